"""Quarantine as a domain flag: which Runs take it, what it changes, what reads it."""

from __future__ import annotations

import pytest
from attrs import evolve

from ql3.domain.errors import InvalidAdmission, InvalidTransition
from ql3.domain.events import EventType
from ql3.domain.model import RunOwner, RunStatus
from ql3.domain.quarantine import MAX_REASON_LENGTH, quarantine, unquarantine
from ql3.domain.recovery import is_recovery_candidate
from ql3.domain.retry import is_due_retry, is_lost_retry_candidate, start_next_attempt
from ql3.domain.states import QUARANTINABLE_RUN_STATUSES
from tests.domain.builders import NOW, TTL, queued, running


def test_quarantinable_statuses_are_where_recovery_and_retry_look() -> None:
    assert {s.value for s in QUARANTINABLE_RUN_STATUSES} == {
        "dispatching",
        "running",
        "lost",
        "retry_wait",
    }


@pytest.mark.parametrize("status", sorted(QUARANTINABLE_RUN_STATUSES, key=lambda s: s.value))
def test_quarantine_flags_the_run_and_changes_nothing_else(status: RunStatus) -> None:
    run, _ = queued()
    run = evolve(run, status=status)
    change = quarantine(run=run, reason=" stuck ", now_ms=NOW)
    assert change.run.quarantine is not None
    assert (change.run.quarantine.reason, change.run.quarantine.since_ms) == ("stuck", NOW)
    assert evolve(change.run, quarantine=None) == run
    assert change.attempts == () and change.lease is None
    assert change.event.type is EventType.RUN_QUARANTINED
    assert dict(change.event.data) == {"reason": "stuck", "status": status.value}
    lifted = unquarantine(run=change.run, reason="", now_ms=NOW + 5)
    assert lifted.run == run
    assert lifted.event.type is EventType.RUN_UNQUARANTINED
    assert lifted.event.data["quarantined_since_ms"] == NOW


@pytest.mark.parametrize(
    "status",
    [s for s in RunStatus if s not in QUARANTINABLE_RUN_STATUSES],
)
def test_quarantine_is_refused_elsewhere(status: RunStatus) -> None:
    run, _ = queued()
    with pytest.raises(InvalidTransition):
        quarantine(run=evolve(run, status=status), reason="x", now_ms=NOW)


def test_refusals() -> None:
    run, _ = queued()
    lost = evolve(run, status=RunStatus.LOST)
    with pytest.raises(InvalidTransition):
        quarantine(run=evolve(lost, owner=RunOwner.WORKFLOW), reason="x", now_ms=NOW)
    for reason in ("", "   ", "x" * (MAX_REASON_LENGTH + 1), "nul\x00"):
        with pytest.raises(InvalidAdmission):
            quarantine(run=lost, reason=reason, now_ms=NOW)
    flagged = quarantine(run=lost, reason="x", now_ms=NOW).run
    with pytest.raises(InvalidTransition):
        quarantine(run=flagged, reason="again", now_ms=NOW)
    with pytest.raises(InvalidTransition):
        unquarantine(run=lost, reason="", now_ms=NOW)


def test_the_candidate_predicates_pass_over_a_quarantined_run() -> None:
    run, attempt, lease, _fence = running()
    later = NOW + TTL + 1
    assert is_recovery_candidate(run, attempt, lease, later)
    flagged = quarantine(run=run, reason="x", now_ms=NOW).run
    assert not is_recovery_candidate(flagged, attempt, lease, later)

    lost = evolve(run, status=RunStatus.LOST)
    assert is_lost_retry_candidate(lost)
    assert not is_lost_retry_candidate(quarantine(run=lost, reason="x", now_ms=NOW).run)

    waiting = evolve(run, status=RunStatus.RETRY_WAIT, next_attempt_at_ms=NOW)
    assert is_due_retry(waiting, NOW) and not is_due_retry(waiting, NOW - 1)
    held = quarantine(run=waiting, reason="x", now_ms=NOW).run
    assert not is_due_retry(held, NOW)
    with pytest.raises(InvalidTransition):
        start_next_attempt(run=held, attempt_id="a2", now_ms=NOW)
