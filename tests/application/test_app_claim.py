"""The claim (ADR 0007) on the memory store, through :class:`WorkerCommands`: completions and the
next claim in one transaction, the worker's ``held`` statement, draining sessions, and the
dispatch gate that the cluster coordinator closes when recovery or lost retry fails."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from attrs import evolve

from ql3.adapters.memory import MemoryStore
from ql3.application.admission import AdmissionRequest
from ql3.application.dispatch import DispatchGateStep
from ql3.application.ports import DispatchGate
from ql3.application.scheduler import ClusterSchedulerCoordinator, SchedulerCoordinator
from ql3.application.worker_commands import (
    BatchOutcome,
    Completion,
    NoGrant,
    Rejection,
    WorkerCommands,
)
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from tests.application.support import (
    LEASE_TTL_MS,
    Services,
    Worker,
    build_services,
    event_types,
    register,
    run_view,
    store_view,
)


@pytest.fixture
def svc() -> Services:
    return build_services()


class CountingFactory:
    """A unit-of-work factory that counts the transactions it opens."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.opened = 0

    def __call__(self) -> Any:
        self.opened += 1
        return self.store.unit_of_work()


def _done(worker: Worker, *attempt_ids: str, succeeded: bool = True) -> tuple[Completion, ...]:
    return tuple(Completion(fence=worker.fences[a], succeeded=succeeded) for a in attempt_ids)


# --- a completion and the next claim in one call ---------------------------------------------


def test_a_completion_and_the_next_claim_are_one_transaction(svc: Services) -> None:
    first, second = svc.admission.submit_many([AdmissionRequest(task="t")] * 2)
    counting = CountingFactory(svc.store)
    workers = WorkerCommands(counting, svc.identities, lease_ttl_ms=LEASE_TTL_MS)
    grant = workers.register("w1", 1, ["t"])
    (a,) = workers.claim(grant.session_id, grant.secret, limit=1).grants
    assert a.run_id == first
    full = workers.claim(grant.session_id, grant.secret, limit=1)
    assert full.no_grant is NoGrant.NO_CAPACITY
    counting.opened = 0
    answer = workers.claim(
        grant.session_id, grant.secret, limit=1,
        completions=[Completion(fence=a.fence, succeeded=True, output=1)],
    )
    assert counting.opened == 1
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    (b,) = answer.grants  # the slot the completion freed, refilled in the same call
    assert b.run_id == second
    assert run_view(svc.store, first).run.status is RunStatus.SUCCEEDED
    assert run_view(svc.store, second).run.status is RunStatus.RUNNING
    assert event_types(svc.store, first) == ["run_admitted", "attempt_started",
                                             "attempt_succeeded"]


def test_a_refused_completion_frees_no_slot(svc: Services) -> None:
    svc.admission.submit_many([AdmissionRequest(task="t")] * 2)
    worker = register(svc, capacity=1)
    (a,) = worker.grants(limit=1)
    stale = Completion(fence=evolve(a.fence, version=2), succeeded=True)
    answer = worker.claim(limit=1, completions=(stale,))
    assert [r.rejection for r in answer.completed] == [Rejection.FENCE]
    assert (answer.grants, answer.no_grant) == ((), NoGrant.NO_CAPACITY)
    assert run_view(svc.store, a.run_id).run.status is RunStatus.RUNNING


def test_a_repeated_completion_in_a_claim_frees_no_second_slot(svc: Services) -> None:
    svc.admission.submit_many([AdmissionRequest(task="t")] * 3)
    worker = register(svc, capacity=1)
    (a,) = worker.grants(limit=1)
    (b,) = worker.claim(limit=1, completions=_done(worker, a.attempt_id)).grants
    again = worker.claim(limit=1, completions=_done(worker, a.attempt_id))
    assert [r.outcome for r in again.completed] == [BatchOutcome.ALREADY_COMPLETED]
    assert (again.grants, again.no_grant) == ((), NoGrant.NO_CAPACITY)
    assert run_view(svc.store, b.run_id).run.status is RunStatus.RUNNING


def test_a_draining_session_completes_but_is_granted_nothing(svc: Services) -> None:
    svc.admission.submit_many([AdmissionRequest(task="t")] * 3)
    worker = register(svc, capacity=2)
    a, b = worker.grants(limit=2)
    svc.workers.drain(worker.session_id, worker.secret)
    answer = worker.claim(limit=2, completions=_done(worker, a.attempt_id), held=[b.attempt_id])
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    assert (answer.grants, answer.released, answer.no_grant) == (
        (), (), NoGrant.SESSION_NOT_ACTIVE
    )
    assert answer.status.value == "draining"
    assert run_view(svc.store, a.run_id).run.status is RunStatus.SUCCEEDED
    assert run_view(svc.store, b.run_id).run.status is RunStatus.RUNNING


# --- the held statement -------------------------------------------------------------------------


def test_the_held_statement_releases_exactly_the_unheld_leased_attempts(svc: Services) -> None:
    svc.admission.submit_many([AdmissionRequest(task="t")] * 4)
    worker = register(svc, capacity=4)
    held, done_now, done_before, unheld = worker.grants(limit=4)
    assert worker.complete(done_before.fence).ok
    answer = worker.claim(
        limit=0, completions=_done(worker, done_now.attempt_id), held=[held.attempt_id]
    )
    assert answer.released == (unheld.attempt_id,)
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    # The unheld Attempt never began on the worker: queued again, no lost verdict.
    view = run_view(svc.store, unheld.run_id)
    assert view.run.status is RunStatus.QUEUED
    (attempt,) = view.attempts
    assert attempt.status is AttemptStatus.CLAIMED and attempt.is_pristine
    (lease,) = view.leases
    assert (lease.status, lease.release_reason) == (LeaseStatus.RELEASED, ReleaseReason.HANDED_BACK)
    assert [e[1] for e in view.events] == ["run_admitted", "attempt_started", "attempt_released"]
    assert view.events[-1][3]["cause"] == "not_held"
    # What it holds and what it completed are left alone.
    assert run_view(svc.store, held.run_id).run.status is RunStatus.RUNNING
    assert run_view(svc.store, held.run_id).leases[0].status is LeaseStatus.LEASED
    assert run_view(svc.store, done_now.run_id).run.status is RunStatus.SUCCEEDED
    assert run_view(svc.store, done_before.run_id).run.status is RunStatus.SUCCEEDED
    with svc.store.unit_of_work() as uow:
        assert uow.sessions.held_by(worker.session_id) == (held.attempt_id,)
    # Claimable again, under the next generation; the old fence is refused.
    (again,) = worker.grants(limit=4)
    assert (again.attempt_id, again.generation) == (unheld.attempt_id, 2)
    assert worker.complete(unheld.fence).rejection is Rejection.FENCE
    assert worker.complete(again.fence).outcome is BatchOutcome.SUCCEEDED


def test_the_released_slot_counts_in_the_same_claim(svc: Services) -> None:
    svc.admission.submit_many([AdmissionRequest(task="t")] * 2)
    worker = register(svc, capacity=1)
    (lost_answer,) = worker.grants(limit=1)  # the worker never received this answer
    answer = worker.claim(limit=1, held=[])
    assert answer.released == (lost_answer.attempt_id,)
    (grant,) = answer.grants  # the slot the hand-back freed is refilled in the same call
    with svc.store.unit_of_work() as uow:
        assert uow.sessions.held_by(worker.session_id) == (grant.attempt_id,)


def test_held_none_releases_nothing(svc: Services) -> None:
    svc.admission.submit_many([AdmissionRequest(task="t")] * 2)
    worker = register(svc, capacity=2)
    worker.grants(limit=2)
    before = store_view(svc.store, [worker.session_id])
    answer = worker.claim(limit=0, held=None)
    assert answer.released == ()
    assert store_view(svc.store, [worker.session_id]) == before


def test_an_unheld_attempt_whose_lease_expired_is_settled_by_evidence_not_handed_back(
    svc: Services,
) -> None:
    """Once the lease expired the worker may have begun the Attempt and given it up (an abandon
    recorded after the expiry), so its statement is evidence for recovery, never a hand-back:
    a Run without a policy fails closed instead of running twice."""
    svc.admission.submit_many([AdmissionRequest(task="t")] * 2)
    mine = register(svc, "w1", capacity=1)
    theirs = register(svc, "w2", capacity=1)
    (a,) = mine.grants(limit=1)
    (b,) = theirs.grants(limit=1)
    svc.clock.advance(LEASE_TTL_MS + 1)
    answer = mine.claim(limit=0, held=[b.attempt_id])  # naming another's Attempt holds nothing
    assert answer.released == ()
    view = run_view(svc.store, a.run_id)
    assert view.run.status is RunStatus.RUNNING
    assert event_types(svc.store, a.run_id)[-1] == "evidence_recorded"
    assert run_view(svc.store, b.run_id).leases[0].status is LeaseStatus.LEASED
    svc.coordinator.run_cycle()
    settled = run_view(svc.store, a.run_id)
    assert settled.attempts[-1].status is AttemptStatus.LOST
    assert settled.run.status is RunStatus.FAILED
    assert len(settled.attempts) == 1


# --- the dispatch gate --------------------------------------------------------------------------


@dataclass
class FailingStep:
    message: str

    def run_once(self) -> Any:
        raise RuntimeError(self.message)


@dataclass
class EmptyStep:
    def run_once(self) -> Any:
        return self

    def counts(self) -> Mapping[str, int]:
        return {}


def _coordinator(svc: Services, failing: str) -> ClusterSchedulerCoordinator:
    steps: dict[str, Any] = {
        "runtime_recovery": svc.recovery,
        "lost_retry": svc.lost_retry,
        "trigger_schedule": EmptyStep(),
        "workflow_frontier": EmptyStep(),
    }
    steps[failing] = FailingStep(f"{failing} broke")
    inner = SchedulerCoordinator(
        trigger_schedule=steps["trigger_schedule"],
        workflow_frontier=steps["workflow_frontier"],
        task_attempt_admission=svc.gate,
    )
    return ClusterSchedulerCoordinator(
        runtime_recovery=steps["runtime_recovery"],
        lost_retry=steps["lost_retry"],
        inner=inner,
        gate=svc.gate,
    )


@pytest.mark.parametrize("failing", ["runtime_recovery", "lost_retry"])
def test_a_failed_guard_step_closes_the_gate_until_a_good_cycle_opens_it(
    svc: Services, failing: str
) -> None:
    queued = svc.admission.submit("t")
    worker = register(svc, capacity=2)
    summary = _coordinator(svc, failing).run_cycle()
    assert summary.aborted_at == failing
    gate = svc.store.dispatch_gate()
    reason = f"{failing} failed: RuntimeError: {failing} broke"
    assert gate == DispatchGate(open=False, reason=reason, changed_at_ms=svc.clock.now_ms())
    before = store_view(svc.store, [worker.session_id])
    answer = worker.claim(limit=2)
    assert (answer.grants, answer.no_grant, answer.detail) == ((), NoGrant.GATE_CLOSED, reason)
    assert store_view(svc.store, [worker.session_id]) == before
    # The next good cycle reaches step 5, which opens the gate; claims grant again.
    svc.clock.advance(10)
    summary = svc.coordinator.run_cycle()
    assert summary.ok
    assert summary.step("task_attempt_admission").counts == {"gate_opened": 1}
    assert svc.store.dispatch_gate() == DispatchGate(
        open=True, reason=None, changed_at_ms=svc.clock.now_ms()
    )
    (grant,) = worker.grants()
    assert grant.run_id == queued


def test_a_closed_gate_still_takes_completions_and_hand_backs(svc: Services) -> None:
    svc.admission.submit_many([AdmissionRequest(task="t")] * 3)
    worker = register(svc, capacity=2)
    a, b = worker.grants(limit=2)
    _coordinator(svc, "runtime_recovery").run_cycle()
    answer = worker.claim(limit=2, completions=_done(worker, a.attempt_id), held=[])
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    assert answer.released == (b.attempt_id,)
    assert (answer.grants, answer.no_grant) == ((), NoGrant.GATE_CLOSED)
    assert run_view(svc.store, a.run_id).run.status is RunStatus.SUCCEEDED
    assert run_view(svc.store, b.run_id).run.status is RunStatus.QUEUED


@pytest.mark.parametrize("failing", ["trigger_schedule", "workflow_frontier"])
def test_a_failed_trigger_or_workflow_step_does_not_close_the_gate(
    svc: Services, failing: str
) -> None:
    svc.admission.submit("t")
    worker = register(svc)
    summary = _coordinator(svc, failing).run_cycle()
    assert summary.aborted_at == failing
    assert svc.store.dispatch_gate().open
    assert len(worker.grants()) == 1


def test_a_failed_trigger_step_leaves_a_closed_gate_closed(svc: Services) -> None:
    _coordinator(svc, "runtime_recovery").run_cycle()
    closed = svc.store.dispatch_gate()
    assert not closed.open
    assert _coordinator(svc, "trigger_schedule").run_cycle().aborted_at == "trigger_schedule"
    assert svc.store.dispatch_gate() == closed  # step 5 was not reached


class CountingSource:
    """The gate step's source, counting its reads."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.reads = 0

    def dispatch_gate(self) -> DispatchGate:
        self.reads += 1
        return self.store.dispatch_gate()


def test_the_gate_step_reads_once_and_writes_nothing_when_open(svc: Services) -> None:
    source = CountingSource(svc.store)
    transactions = CountingFactory(svc.store)
    step = DispatchGateStep(transactions, source)
    assert step.run_once().counts() == {"gate_opened": 0}
    assert (source.reads, transactions.opened) == (1, 0)
    assert svc.store.dispatch_gate().open

    step.close("lost_retry failed: boom")
    assert transactions.opened == 1
    source.reads = transactions.opened = 0
    assert step.run_once().counts() == {"gate_opened": 1}
    assert (source.reads, transactions.opened) == (1, 1)
    assert svc.store.dispatch_gate().open


def test_the_gate_reason_is_bounded(svc: Services) -> None:
    svc.gate.close("x" * 10_000)
    reason = svc.store.dispatch_gate().reason
    assert reason is not None and 0 < len(reason) <= 500
