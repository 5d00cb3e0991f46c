"""Quarantine and the operations view on every store (ADR 0010): a quarantined Run is no
candidate of recovery or lost retry, the flag survives the store, is audited, and the view that
``ql3 status``, ``ql3 doctor`` and the metrics read agrees between the stores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ql3.application.admission import UnknownRun
from ql3.application.diagnosis import FailingCandidate
from ql3.application.dispatch import DispatchGateStep
from ql3.application.operations import NODE_SILENT_AFTER_MS, Quarantines, diagnose
from ql3.application.ports import HARD_PAGE_CAP, NodeCycle
from ql3.application.scheduler import CycleSummary, NodeHeartbeat
from ql3.domain.errors import InvalidAdmission, InvalidTransition
from ql3.domain.events import EventType
from ql3.domain.model import EvidenceKind, RunStatus
from tests.contract.builders import (
    OTHER_TASK,
    RETRY_DELAY_MS,
    TASK,
    TTL_MS,
    attempt_id_of,
    committed,
    given_lost,
    given_queued,
    given_retry_wait,
    given_session,
    given_started,
    report_stop,
)

Advance = Callable[[int], None]


def _quarantines(store: Any) -> Quarantines:
    return Quarantines(store.unit_of_work)


def _event_types(store: Any, run_id: str) -> list[EventType]:
    with store.unit_of_work() as uow:
        return [stored.event.type for stored in uow.runs.events_of(run_id)]


def test_a_quarantined_lost_run_is_no_lost_retry_candidate_until_lifted(store: Any) -> None:
    given_session(store, "s1")
    given_lost(store, "r1", "s1")
    given_lost(store, "r2", "s1")
    run = _quarantines(store).quarantine("r1", "  trigger raises on this run ")
    assert run.quarantine is not None and run.quarantine.reason == "trigger raises on this run"
    assert [c.run_id for c in store.lost_runs(16).items] == ["r2"]
    with store.unit_of_work() as uow:
        stored = uow.runs.get_run("r1")
        assert stored is not None and stored.status is RunStatus.LOST
        assert stored.quarantine == run.quarantine
    assert _event_types(store, "r1")[-1] is EventType.RUN_QUARANTINED

    lifted = _quarantines(store).unquarantine("r1", "fixed")
    assert lifted.quarantine is None
    assert [c.run_id for c in store.lost_runs(16).items] == ["r1", "r2"]
    with store.unit_of_work() as uow:
        last = uow.runs.events_of("r1")[-1].event
    assert last.type is EventType.RUN_UNQUARANTINED and last.data["reason"] == "fixed"
    assert last.data["quarantined_since_ms"] == run.quarantine.since_ms


def test_a_quarantined_expired_attempt_is_no_recovery_candidate(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    attempt = given_started(store, "r1", "s1")
    with committed(store) as uow:
        report_stop(uow, attempt, EvidenceKind.OPERATOR_ATTESTED)
    advance(TTL_MS + 1)
    assert [c.attempt_id for c in store.recovery_candidates(16).items] == [attempt]
    _quarantines(store).quarantine("r1", "recovery raises")
    assert store.recovery_candidates(16).items == ()
    _quarantines(store).unquarantine("r1")
    assert [c.attempt_id for c in store.recovery_candidates(16).items] == [attempt]


def test_a_quarantined_due_retry_is_not_started(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    given_retry_wait(store, "r1", "s1")
    advance(RETRY_DELAY_MS + 1)
    assert [c.run_id for c in store.due_retries(16).items] == ["r1"]
    _quarantines(store).quarantine("r1", "hold")
    assert store.due_retries(16).items == ()


def test_quarantine_is_refused_where_recovery_and_retry_never_look(store: Any) -> None:
    given_queued(store, "queued")
    with pytest.raises(InvalidTransition):
        _quarantines(store).quarantine("queued", "no")
    with pytest.raises(UnknownRun):
        _quarantines(store).quarantine("missing", "no")
    given_session(store, "s1")
    given_lost(store, "lost", "s1")
    with pytest.raises(InvalidAdmission):
        _quarantines(store).quarantine("lost", "   ")
    _quarantines(store).quarantine("lost", "once")
    with pytest.raises(InvalidTransition):
        _quarantines(store).quarantine("lost", "twice")
    with pytest.raises(InvalidTransition):
        _quarantines(store).unquarantine("queued")
    # Nothing was written by the refusals: one quarantine event, no more.
    assert _event_types(store, "lost").count(EventType.RUN_QUARANTINED) == 1
    assert EventType.RUN_QUARANTINED not in _event_types(store, "queued")


def test_the_operations_view(store: Any, advance: Advance) -> None:
    s1 = given_session(store, "s1")
    given_session(store, "s2")
    given_queued(store, "q1", task=TASK)
    advance(1_000)
    given_queued(store, "q2", task=TASK)
    given_queued(store, "q3", task=OTHER_TASK)
    started = given_started(store, "waiting", "s1")  # expires without evidence: it waits
    given_started(store, "live", "s2", ttl_ms=10 * TTL_MS)
    given_lost(store, "lost", "s2")
    _quarantines(store).quarantine("lost", "broken")
    advance(TTL_MS + 1)

    view = store.operations_view(HARD_PAGE_CAP)

    assert view.gate.open and view.gate.failure is None
    assert [(q.task, q.queued) for q in view.queues] == [(TASK, 2), (OTHER_TASK, 1)] or [
        (q.task, q.queued) for q in view.queues
    ] == sorted([(TASK, 2), (OTHER_TASK, 1)])
    by_task = {q.task: q for q in view.queues}
    assert by_task[TASK].oldest_ms < by_task[OTHER_TASK].oldest_ms
    assert view.evidence.count == 1
    with store.unit_of_work() as uow:
        leases = uow.runs.leases_of("waiting")
    assert view.evidence.oldest_ms == leases[0].expires_at_ms
    assert {(c.session.id, c.in_flight) for c in view.sessions} == {("s1", 1), ("s2", 1)}
    assert [c.session.worker_id for c in view.sessions] == sorted([s1.worker_id, "ws2"])
    assert view.quarantined_count == 1
    assert [r.id for r in view.quarantined] == ["lost"]
    assert started == attempt_id_of("waiting")
    findings = diagnose(view)
    assert [f.problem for f in findings] == [False, False]


def test_a_gate_closed_on_one_candidate_keeps_its_streak(store: Any, advance: Advance) -> None:
    gate = DispatchGateStep(store.unit_of_work, store)
    broken = FailingCandidate(step="lost_retry", run_id="r1", attempt_id="a1", error="E: one")
    gate.close("lost_retry failed: E: one", broken)
    first_at = store.dispatch_gate().changed_at_ms
    advance(1_000)
    again = FailingCandidate(step="lost_retry", run_id="r1", attempt_id="a1", error="E: two")
    gate.close("lost_retry failed: E: two", again)
    failure = store.dispatch_gate().failure
    assert failure is not None
    assert (failure.run_id, failure.cycles, failure.error) == ("r1", 2, "E: two")
    assert failure.since_ms == first_at and store.dispatch_gate().changed_at_ms != first_at
    other = FailingCandidate(step="lost_retry", run_id="r2", attempt_id="a2", error="E: x")
    gate.close("lost_retry failed: E: x", other)
    failure = store.dispatch_gate().failure
    assert failure is not None and (failure.run_id, failure.cycles) == ("r2", 1)
    assert first_at is not None and failure.since_ms > first_at
    (finding, *_) = diagnose(store.operations_view(HARD_PAGE_CAP))
    assert finding.problem and "r2" in finding.what and "quarantine r2" in finding.advice
    gate.run_once()  # a good cycle's step 5 opens it and forgets the failure
    assert store.dispatch_gate().open and store.dispatch_gate().failure is None
    gate.close("runtime_recovery failed: database gone")  # no candidate: no streak
    closed = store.dispatch_gate()
    assert not closed.open and closed.failure is None


def test_nodes_record_their_last_cycle(store: Any, advance: Advance) -> None:
    store.record_node_cycle(NodeCycle(node_id="n1", ok=True, aborted_at=None, cycles=1))
    (first,) = store.operations_view(HARD_PAGE_CAP).nodes
    assert first.started_at_ms is not None and first.started_at_ms == first.last_cycle_at_ms
    advance(5_000)
    store.record_node_cycle(NodeCycle(node_id="n1", ok=False, aborted_at="lost_retry", cycles=7))
    advance(5_000)
    store.record_node_cycle(NodeCycle(node_id="n2", ok=True, aborted_at=None, cycles=1))
    view = store.operations_view(HARD_PAGE_CAP)
    assert [n.node_id for n in view.nodes] == ["n2", "n1"]
    n1 = view.nodes[1]
    assert (n1.ok, n1.aborted_at, n1.cycles) == (False, "lost_retry", 7)
    assert n1.started_at_ms == first.started_at_ms
    assert n1.last_cycle_at_ms is not None and n1.last_cycle_at_ms > first.started_at_ms
    assert not [f for f in diagnose(view) if f.problem]
    advance(NODE_SILENT_AFTER_MS + 1_000)
    (silent, *_) = diagnose(store.operations_view(HARD_PAGE_CAP))
    assert silent.problem and "no node has run a scheduler cycle" in silent.what


def test_a_node_heartbeat_writes_on_change_and_now_and_then(store: Any) -> None:
    written: list[NodeCycle] = []

    class Registry:
        def record_node_cycle(self, cycle: NodeCycle) -> None:
            written.append(cycle)
            store.record_node_cycle(cycle)

    heartbeat = NodeHeartbeat(Registry(), "n1", every_s=3600)
    good = CycleSummary(steps=())
    bad = CycleSummary(steps=(), aborted_at="lost_retry")
    for summary in (good, good, good, bad, bad, good):
        heartbeat(summary)
    assert [(c.ok, c.cycles) for c in written] == [(True, 1), (False, 4), (True, 6)]
    (node,) = store.operations_view(HARD_PAGE_CAP).nodes
    assert (node.node_id, node.cycles, node.ok) == ("n1", 6, True)
    assert not node.anonymous_workers


def test_a_node_that_allows_anonymous_workers_says_so(store: Any) -> None:
    NodeHeartbeat(store, "open-node", anonymous_workers=True)(CycleSummary(steps=()))
    NodeHeartbeat(store, "closed-node")(CycleSummary(steps=()))
    nodes = {n.node_id: n.anonymous_workers for n in store.operations_view(HARD_PAGE_CAP).nodes}
    assert nodes == {"open-node": True, "closed-node": False}
