"""Opening the dispatch gate is a compare-and-set on every store (ADR 0007): step 5 of a cycle
opens the gate only if it did not close after that cycle's recovery step began, so a replica
never reopens a gate another replica closed meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ql3.application.admission import AdmissionRequest
from ql3.application.ports import DispatchGate
from ql3.application.scheduler import ClusterSchedulerCoordinator, SchedulerCoordinator
from ql3.application.worker_commands import NoGrant
from tests.contract.builders import committed
from tests.scheduling_support import Runtime, WorkerDriver, runtime

REASON = "runtime_recovery failed: RuntimeError: the store is unavailable"


def closed_at(store: Any) -> int:
    with committed(store) as uow:
        now = int(uow.now_ms())
        uow.gate.set(DispatchGate(open=False, reason=REASON, changed_at_ms=now))
    return now


def test_the_gate_opens_only_if_it_closed_before_the_cycle_began(
    store: Any, advance: Callable[[int], None]
) -> None:
    closed = closed_at(store)
    with store.unit_of_work() as uow:  # a cycle that began when the gate closed, or before
        assert uow.gate.open(closed, uow.now_ms()) is False
        assert uow.gate.open(closed - 1, uow.now_ms()) is False
    assert store.dispatch_gate() == DispatchGate(open=False, reason=REASON, changed_at_ms=closed)

    advance(1)
    with committed(store) as uow:  # a cycle that began after the close
        now = int(uow.now_ms())
        assert uow.gate.open(closed + 1, now) is True
    assert store.dispatch_gate() == DispatchGate(open=True, changed_at_ms=now)
    with store.unit_of_work() as uow:
        assert uow.gate.open(now + 1, uow.now_ms()) is False  # open already


def test_without_a_recovery_step_a_closed_gate_opens(store: Any) -> None:
    closed = closed_at(store)
    with committed(store) as uow:
        assert uow.gate.open(None, closed) is True
    assert store.dispatch_gate().open


@dataclass
class FailingStep:
    def run_once(self) -> Any:
        raise RuntimeError("the store is unavailable")


def replica(rt: Runtime, workflow_frontier: Any) -> ClusterSchedulerCoordinator:
    """The container's coordinator with its workflow frontier step replaced."""
    core = rt.container.core
    return ClusterSchedulerCoordinator(
        runtime_recovery=rt.container.runtime_recovery(),
        lost_retry=rt.container.lost_retry(),
        inner=SchedulerCoordinator(
            trigger_schedule=core.trigger_schedule(),
            workflow_frontier=workflow_frontier,
            task_attempt_admission=core.dispatch_gate(),
        ),
        gate=core.dispatch_gate(),
    )


def failing_replica(rt: Runtime) -> ClusterSchedulerCoordinator:
    core = rt.container.core
    return ClusterSchedulerCoordinator(
        runtime_recovery=FailingStep(),
        lost_retry=rt.container.lost_retry(),
        inner=core.scheduler(),
        gate=core.dispatch_gate(),
    )


class Report:
    def counts(self) -> dict[str, int]:
        return {}


@dataclass
class CloseDuringStep:
    """Replica A's workflow frontier step, during which replica B's recovery fails and closes
    the gate: after A's recovery step began and before A's step 5."""

    other: ClusterSchedulerCoordinator
    advance: Callable[[int], None]

    def run_once(self) -> Report:
        self.advance(1)
        assert self.other.run_cycle().aborted_at == "runtime_recovery"
        return Report()


def test_a_close_after_the_cycle_began_keeps_the_gate_closed_until_the_next_cycle(
    store: Any, advance: Callable[[int], None]
) -> None:
    a, b = runtime(store, advance), runtime(store, advance)
    (queued,) = a.container.core.admission().submit_many([AdmissionRequest(task="t")])
    worker = WorkerDriver.register(a.workers, "w1", ["t"], capacity=1)
    racing = replica(a, CloseDuringStep(failing_replica(b), advance))

    summary = racing.run_cycle()

    assert summary.ok
    assert summary.step("task_attempt_admission").counts == {"gate_opened": 0}
    gate = store.dispatch_gate()
    assert (gate.open, gate.reason) == (False, REASON)  # B's close, not overwritten
    answer = worker.claim()
    assert (answer.grants, answer.no_grant) == ((), NoGrant.GATE_CLOSED)

    advance(1)
    summary = a.cycle()  # began after B's close

    assert summary.step("task_attempt_admission").counts == {"gate_opened": 1}
    assert store.dispatch_gate().open and store.dispatch_gate().reason is None
    assert [g.run_id for g in worker.claim_all()] == [queued]
