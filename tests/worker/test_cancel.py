"""A cancelled Run's task is stopped by its worker (ADR 0017): the ledger stops the slot when the
node refuses a renewal as ``cancelled`` and reports the stop instead of a completion; against a
real node in this process, the slot's child process is gone and the Run stays cancelled."""

from __future__ import annotations

import logging
import os
import time

import pytest

from ql3.adapters.worker.client import BatchResult, ItemAnswer
from ql3.adapters.worker.ledger import Ledger, Phase
from ql3.adapters.worker.slot import JobOutcome
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from tests.worker.conftest import LEASE_TTL_S, LocalNode, WorkerThread, worker_settings
from tests.worker.conftest import Ledger as SideEffects
from tests.worker.test_claims import _answer, _grant, _Slot

CANCELLED = ItemAnswer("a1", 409, None, None, "fence_rejected", "cancelled")


def _running(ledger: Ledger, slot: _Slot) -> None:
    ledger.add_slots([slot])
    with ledger.lock:
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None
    ledger.end_claim(plan, _answer([_grant("a1")]))
    assert slot.jobs == ["a1"]


def test_a_renewal_refused_as_cancelled_kills_the_slot_and_reports_the_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ledger, slot = Ledger(capacity=1), _Slot(0)
    _running(ledger, slot)
    held = ledger.renewable()
    with caplog.at_level(logging.WARNING, logger="ql3.worker"):
        kills = ledger.settle_renewals(held, BatchResult(now_ms=1_000, items={"a1": CANCELLED}))
    assert kills == [(slot, "a1")]
    entry = ledger.get("a1")
    assert entry is not None
    assert (entry.phase, entry.cause, entry.detail) == (
        Phase.STOPPING,
        "cancelled",
        "its run was cancelled",
    )
    assert "its run was cancelled; stopping the task" in caplog.text
    # The slot's child is killed: the stop is reported by an abandon, not a completion.
    ledger.on_outcome(slot, "a1", JobOutcome(False, killed=True), reusable=False)
    (stopped,) = ledger.take(Phase.STOPPED, time.monotonic())
    assert stopped.abandonment().detail == "its run was cancelled"
    taken = ItemAnswer("a1", 200, "cancelled", None, None, None)
    ledger.settle_abandons([stopped], BatchResult(now_ms=1_000, items={"a1": taken}))
    assert ledger.empty()
    assert (ledger.cancelled, ledger.abandoned) == (1, 0)


def test_a_job_cancelled_before_it_reached_the_child_is_handed_back_as_cancelled() -> None:
    ledger, slot = Ledger(capacity=1), _Slot(0)
    _running(ledger, slot)
    ledger.settle_renewals(ledger.renewable(), BatchResult(now_ms=1_000, items={"a1": CANCELLED}))
    ledger.on_outcome(slot, "a1", JobOutcome(False, killed=True, started=False), reusable=True)
    (unstarted,) = ledger.take(Phase.UNSTARTED, time.monotonic())
    taken = ItemAnswer("a1", 200, "cancelled", None, None, None)
    ledger.settle_releases([unstarted], BatchResult(now_ms=1_000, items={"a1": taken}))
    assert ledger.empty()
    assert (ledger.cancelled, ledger.released) == (1, 0)


def test_a_completion_refused_as_cancelled_is_discarded(caplog: pytest.LogCaptureFixture) -> None:
    ledger, slot = Ledger(capacity=1), _Slot(0)
    _running(ledger, slot)
    ledger.on_outcome(slot, "a1", JobOutcome(True, output=1), reusable=True)
    with ledger.lock:
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None and [h.attempt_id for h in plan.completions] == ["a1"]
    with caplog.at_level(logging.WARNING, logger="ql3.worker"):
        ledger.end_claim(plan, _answer([], {"a1": CANCELLED}))
    assert ledger.empty() and ledger.cancelled == 1
    assert "finished after its run was cancelled: result discarded" in caplog.text
    assert slot.kills == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_cancelled_running_task_is_stopped_by_the_worker(
    node: LocalNode, ledger: SideEffects
) -> None:
    run_id = node.admission.submit("e2e.sleep", {"seconds": 60})
    worker = WorkerThread(worker_settings(node)).start()
    node.wait_for(lambda: len(ledger.entries("start")) == 1)
    (started,) = ledger.entries("start")
    assert node.admission.cancel(run_id, "not wanted") is RunStatus.RUNNING
    # The worker learns it at its next renewal (a third of the TTL) and kills the slot.
    node.wait_for(lambda: not _alive(started["pid"]), timeout=2 * LEASE_TTL_S)
    node.wait_for(lambda: worker.worker.ledger.empty(), timeout=2 * LEASE_TTL_S)
    assert worker.worker.ledger.cancelled == 1
    assert ledger.entries("end") == []
    # The slot works again: the next task runs in a fresh child.
    nxt = node.admission.submit("e2e.double", {"n": 4})
    node.wait_for(lambda: node.run(nxt).status is RunStatus.SUCCEEDED)
    worker.worker.request_drain()
    assert worker.join() == 0
    run = node.run(run_id)
    assert (run.status, run.error) == (RunStatus.CANCELLED, "not wanted")
    (attempt,) = node.attempts(run_id)
    assert attempt.status is AttemptStatus.CANCELLED
    (lease,) = node.leases(run_id)
    assert (lease.status, lease.release_reason) == (LeaseStatus.RELEASED, ReleaseReason.CANCELLED)
    assert node.events(run_id)[-1] == "run_cancelled"
