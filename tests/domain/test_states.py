"""The state diagrams of domain/states.py: well formed, and what the transitions obey."""

from __future__ import annotations

import pytest
from attrs import evolve

from ql3.domain.errors import InvalidTransition
from ql3.domain.model import (
    TERMINAL_ATTEMPT_STATUSES,
    TERMINAL_RUN_STATUSES,
    AttemptStatus,
    ReleaseReason,
    RunStatus,
)
from ql3.domain.states import (
    ADMITTED_RUN_STATUSES,
    ATTEMPT_EDGES,
    CLAIMABLE_RUN_STATUSES,
    NON_TERMINAL_ATTEMPT_STATUSES,
    RELEASABLE_ATTEMPT_STATUSES,
    RUN_EDGES,
    STARTED_ATTEMPT_STATUSES,
    require_admitted,
    require_attempt_edge,
    require_run_edge,
    values,
)
from ql3.domain.transitions import admit, cancel, complete, mark_lost, release
from tests.domain.builders import NOW, legacy_offered, legacy_started, queued, running


def _reachable(edges, start):  # type: ignore[no-untyped-def]
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize(
    ("edges", "statuses", "terminal"),
    [
        (RUN_EDGES, RunStatus, TERMINAL_RUN_STATUSES),
        (ATTEMPT_EDGES, AttemptStatus, TERMINAL_ATTEMPT_STATUSES),
    ],
)
def test_every_status_is_in_the_diagram_terminals_absorb_and_every_status_can_end(
    edges, statuses, terminal  # type: ignore[no-untyped-def]
) -> None:
    assert set(edges) == set(statuses)
    for status, targets in edges.items():
        assert targets <= set(statuses)
        if status in terminal:
            assert targets == frozenset(), status
        else:
            assert _reachable(edges, status) & terminal, status


def test_nothing_enters_the_states_of_the_offer_protocol_any_more() -> None:
    assert all(RunStatus.DISPATCHING not in t for t in RUN_EDGES.values())
    assert all(AttemptStatus.STARTING not in t for t in ATTEMPT_EDGES.values())


def test_derived_sets() -> None:
    assert {
        AttemptStatus.CLAIMED, AttemptStatus.STARTING, AttemptStatus.RUNNING
    } == NON_TERMINAL_ATTEMPT_STATUSES
    assert {s for s in AttemptStatus if s.is_started} == STARTED_ATTEMPT_STATUSES
    assert RELEASABLE_ATTEMPT_STATUSES == NON_TERMINAL_ATTEMPT_STATUSES
    assert {RunStatus.QUEUED} == CLAIMABLE_RUN_STATUSES
    assert values(CLAIMABLE_RUN_STATUSES) == ("queued",)


def test_require_edge_refuses_what_the_diagram_does_not_draw() -> None:
    run, _ = queued()
    require_run_edge(run, RunStatus.RUNNING, "x")
    with pytest.raises(InvalidTransition):
        require_run_edge(run, RunStatus.SUCCEEDED, "x")
    require_attempt_edge("a", AttemptStatus.RUNNING, AttemptStatus.CLAIMED, "x")
    with pytest.raises(InvalidTransition):
        require_attempt_edge("a", AttemptStatus.LOST, AttemptStatus.CLAIMED, "x")


@pytest.mark.parametrize("build", [running, legacy_offered, legacy_started])
def test_every_change_of_a_held_attempt_moves_along_the_diagram(build) -> None:  # type: ignore[no-untyped-def]
    run, attempt, lease, fence = build()
    changes = [
        release(run=run, attempt=attempt, lease=lease, session_id="s1", cause="c", now_ms=NOW),
        cancel(run=run, attempt=attempt, lease=lease, reason="r", now_ms=NOW),
    ]
    if not attempt.status.is_started:
        changes.append(
            mark_lost(run=run, attempt=attempt, lease=lease, evidence=None,
                      release_reason=ReleaseReason.LEASE_EXPIRED,
                      now_ms=NOW, cause="c")
        )
    else:
        changes.append(
            complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=True,
                     output=None, error=None, now_ms=NOW + 1)
        )
    for change in changes:
        assert change.run.status in RUN_EDGES[run.status]
        for after in change.attempts:
            assert after.status in ATTEMPT_EDGES[attempt.status]


def _adr_0007_run_diagram() -> set[tuple[str, str]]:
    """The edges of the Run diagram of ADR 0007 (its first mermaid block), ``[*]`` the start."""
    from pathlib import Path

    text = (
        Path(__file__).resolve().parents[2] / "docs" / "adr" / "0007-claim-protocol.md"
    ).read_text()
    block = text.split("## State diagrams", 1)[1].split("```mermaid", 1)[1].split("```", 1)[0]
    edges = set()
    for line in block.splitlines():
        parts = line.split(":", 1)[0].split("-->")
        if len(parts) == 2:
            edges.add((parts[0].strip(), parts[1].strip()))
    return edges


def test_the_run_diagram_of_adr_0007_draws_exactly_the_domains_edges_and_admissions() -> None:
    drawn = _adr_0007_run_diagram()
    expected = {(f.value, t.value) for f, targets in RUN_EDGES.items() for t in targets}
    expected |= {("[*]", s.value) for s in ADMITTED_RUN_STATUSES}
    assert drawn == expected


def test_admission_puts_a_run_only_where_the_diagram_starts() -> None:
    assert {RunStatus.CREATED, RunStatus.QUEUED, RunStatus.RETRY_WAIT} == ADMITTED_RUN_STATUSES
    # every admitted status can end, and none is terminal
    for status in ADMITTED_RUN_STATUSES:
        assert not status.is_terminal
        assert _reachable(RUN_EDGES, status) & TERMINAL_RUN_STATUSES
    made = {
        admit(run_id="r", attempt_id=attempt, task="t", input=None, policy=None, now_ms=NOW,
              run_after_ms=due).run.status
        for attempt in ("a", None)
        for due in (None, NOW, NOW + 1)
    }
    assert made == ADMITTED_RUN_STATUSES


def test_require_admitted_refuses_any_other_status() -> None:
    run, _ = queued()
    require_admitted(run)
    for status in set(RunStatus) - ADMITTED_RUN_STATUSES:
        with pytest.raises(InvalidTransition):
            require_admitted(evolve(run, status=status))
