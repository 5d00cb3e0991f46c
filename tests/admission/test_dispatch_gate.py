"""The dispatch gate on every store (ADR 0007): a failed runtime-recovery or lost-retry step
closes it for every claim of every replica until step 5 of a later good cycle opens it; a failed
trigger step leaves it as it is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from ql3.application.admission import AdmissionRequest
from ql3.application.scheduler import ClusterSchedulerCoordinator, SchedulerCoordinator
from ql3.application.worker_commands import BatchOutcome, NoGrant
from ql3.domain.model import RunStatus
from tests.scheduling_support import Runtime, WorkerDriver, runtime


@dataclass
class FailingStep:
    message: str

    def run_once(self) -> Any:
        raise RuntimeError(self.message)


def _coordinator(rt: Runtime, failing: str) -> ClusterSchedulerCoordinator:
    """The container's coordinator with one step replaced by a failing one."""
    core = rt.container.core
    steps: dict[str, Any] = {
        "runtime_recovery": rt.container.runtime_recovery(),
        "lost_retry": rt.container.lost_retry(),
        "trigger_schedule": core.trigger_schedule(),
        "workflow_frontier": core.workflow_frontier(),
    }
    steps[failing] = FailingStep(f"{failing} is unavailable")
    inner = SchedulerCoordinator(
        trigger_schedule=steps["trigger_schedule"],
        workflow_frontier=steps["workflow_frontier"],
        task_attempt_admission=core.dispatch_gate(),
    )
    return ClusterSchedulerCoordinator(
        runtime_recovery=steps["runtime_recovery"],
        lost_retry=steps["lost_retry"],
        inner=inner,
        gate=core.dispatch_gate(),
    )


@pytest.mark.parametrize("failing", ["runtime_recovery", "lost_retry"])
def test_a_failed_guard_step_closes_the_gate_for_every_claim_until_a_good_cycle(
    store: Any, advance: Callable[[int], None], failing: str
) -> None:
    rt = runtime(store, advance)
    queued = rt.container.core.admission().submit_many([AdmissionRequest(task="t")] * 2)
    holder = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)
    (running,) = holder.claim_all()
    run_id, other = running.run_id, next(r for r in queued if r != running.run_id)
    assert store.dispatch_gate().open

    summary = _coordinator(rt, failing).run_cycle()

    assert summary.aborted_at == failing
    gate = store.dispatch_gate()
    reason = f"{failing} failed: RuntimeError: {failing} is unavailable"
    assert (gate.open, gate.reason) == (False, reason)
    # No claim of any session grants; a completion in a claim is still recorded.
    answer = holder.claim(completions=(holder.completion(run_id),))
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    assert (answer.grants, answer.no_grant, answer.detail) == ((), NoGrant.GATE_CLOSED, reason)
    newcomer = WorkerDriver.register(rt.workers, "w2", ["t"], capacity=4)
    assert newcomer.claim().no_grant is NoGrant.GATE_CLOSED
    assert rt.run(other).status is RunStatus.QUEUED

    rt.advance(1)  # the next cycle begins after the close
    summary = rt.cycle()  # every step succeeds: step 5 opens the gate

    assert summary.ok
    assert summary.step("task_attempt_admission").counts["gate_opened"] == 1
    assert store.dispatch_gate().open and store.dispatch_gate().reason is None
    assert [g.run_id for g in newcomer.claim_all()] == [other]
    assert rt.cycle().step("task_attempt_admission").counts["gate_opened"] == 0


@pytest.mark.parametrize("failing", ["trigger_schedule", "workflow_frontier"])
def test_a_failed_trigger_or_workflow_step_does_not_close_the_gate(
    store: Any, advance: Callable[[int], None], failing: str
) -> None:
    rt = runtime(store, advance)
    (run_id,) = rt.container.core.admission().submit_many([AdmissionRequest(task="t")])
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)

    summary = _coordinator(rt, failing).run_cycle()

    assert summary.aborted_at == failing
    assert store.dispatch_gate().open
    assert [g.run_id for g in worker.claim_all()] == [run_id]
