"""Data between steps, cancellation, unique keys and listing of workflows, on every store (ADR
0021): a step is admitted with its parents' outputs fixed in its input snapshot; a fan-in gets
all of them; parents' outputs over the limit fail the workflow with a clear error; a cancelled
workflow cancels every unfinished step, running ones included."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ql3.domain import step_input
from ql3.domain.errors import InvalidTransition, InvalidWorkflow
from ql3.domain.model import ReleaseReason, RunStatus
from ql3.domain.workflows import StepStatus
from tests.scheduling_support import Runtime, WorkerDriver, runtime

TTL_S = 30.0

DIAMOND = {
    "name": "diamond",
    "steps": [
        {"id": "a", "task": "t", "input": {"n": 1}},
        {"id": "b", "task": "t", "input": {"side": "b"}, "after": ["a"]},
        {"id": "c", "task": "t", "input": {"side": "c"}, "after": ["a"]},
        {"id": "d", "task": "t", "after": ["b", "c"]},
    ],
}


def _steps(rt: Runtime, workflow_id: str) -> dict[str, Any]:
    return {view.step.step_id: view for view in rt.workflows.steps(workflow_id)}


def _step_of(rt: Runtime, workflow_id: str, run_id: str) -> str:
    return next(s for s, v in _steps(rt, workflow_id).items() if v.step.run_id == run_id)


def _drive(rt: Runtime, worker: WorkerDriver, workflow_id: str, output: Callable[..., Any]) -> dict[
    str, Any
]:
    """Cycle and finish every granted step with ``output(step_id, grant)`` until the
    workflow ends; the grants by step id."""
    seen: dict[str, Any] = {}
    for _ in range(20):
        rt.cycle()
        if rt.run(workflow_id).status.is_terminal:
            return seen
        for grant in worker.claim_all():
            step = _step_of(rt, workflow_id, grant.run_id)
            seen[step] = grant
            worker.finish(grant.run_id, output=output(step, grant))
    raise AssertionError("the workflow did not finish")


def test_a_diamond_fan_in_gets_both_parents_outputs_fixed_at_admission(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    workflow_id = rt.workflows.submit(DIAMOND)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=4)

    grants = _drive(rt, worker, workflow_id, lambda step, grant: {"from": step})

    assert rt.run(workflow_id).status is RunStatus.SUCCEEDED
    assert grants["a"].input == {"n": 1}  # a root step's input is its own
    own, envelope = step_input.split(grants["b"].input)
    assert own == {"side": "b"}
    assert envelope is not None and envelope["parents"] == {"a": {"from": "a"}}
    own, envelope = step_input.split(grants["d"].input)
    assert own is None
    assert envelope == {
        "workflow_run_id": workflow_id,
        "step": "d",
        "parents": {"b": {"from": "b"}, "c": {"from": "c"}},
        "input": None,
    }
    # The snapshot is the Run's input: every Attempt of it reads the same values.
    assert _steps(rt, workflow_id)["d"].run.input == grants["d"].input


def test_a_fan_out_of_fifty_steps_and_its_fan_in(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    leaves = [f"leaf-{i:02d}" for i in range(50)]
    workflow_id = rt.workflows.submit(
        {
            "name": "fan",
            "steps": [
                {"id": "root", "task": "t", "input": 7},
                *({"id": leaf, "task": "t", "input": i, "after": ["root"]}
                  for i, leaf in enumerate(leaves)),
                {"id": "sum", "task": "t", "after": leaves},
            ],
        }
    )
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=64)

    def output(step: str, grant: Any) -> Any:
        own, envelope = step_input.split(grant.input)
        if step == "root":
            return own
        if step == "sum":
            assert envelope is not None
            return sum(envelope["parents"].values())
        assert envelope is not None and envelope["parents"] == {"root": 7}
        return own * envelope["parents"]["root"]

    grants = _drive(rt, worker, workflow_id, output)

    assert len(grants) == 52
    _, envelope = step_input.split(grants["sum"].input)
    assert envelope is not None and sorted(envelope["parents"]) == leaves
    aggregate = rt.run(workflow_id)
    assert aggregate.status is RunStatus.SUCCEEDED
    assert aggregate.output["sum"] == 7 * sum(range(50))  # type: ignore[index,call-overload]


def test_parents_outputs_over_the_limit_fail_the_workflow_and_the_step_never_runs(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    workflow_id = rt.workflows.submit(
        {"name": "big", "steps": [{"id": "a", "task": "t"}, {"id": "b", "task": "t"},
                                  {"id": "c", "task": "t", "after": ["a", "b"]}]}
    )
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=4)
    half = "x" * (step_input.MAX_PARENT_OUTPUTS_BYTES // 2)

    grants = _drive(rt, worker, workflow_id, lambda step, grant: half)

    assert sorted(grants) == ["a", "b"]
    aggregate = rt.run(workflow_id)
    assert aggregate.status is RunStatus.FAILED
    assert aggregate.error is not None
    assert aggregate.error.startswith("step c cancelled: the outputs of its parents (a, b) are")
    assert f"more than the {step_input.MAX_PARENT_OUTPUTS_BYTES} a step receives" in (
        aggregate.error)
    steps = _steps(rt, workflow_id)
    assert steps["c"].step.status is StepStatus.CANCELLED and steps["c"].run is None
    with store.unit_of_work() as uow:
        failed = uow.runs.events_of(workflow_id)[-1].event
    assert failed.data == {"reason": "step_input_too_large", "step": "c"}


def test_cancelling_a_workflow_cancels_its_running_and_waiting_steps_at_once(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    workflow_id = rt.workflows.submit(DIAMOND)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)
    rt.cycle()
    (a,) = worker.claim_all()
    worker.finish(a.run_id, output=1)
    rt.cycle()  # b and c admitted; the worker takes one of them
    (running,) = worker.claim_all()
    running_step = _step_of(rt, workflow_id, running.run_id)

    was = rt.workflows.cancel(workflow_id, "not today")

    assert was is RunStatus.RUNNING
    aggregate = rt.run(workflow_id)
    assert (aggregate.status, aggregate.error) == (RunStatus.CANCELLED, "not today")
    steps = _steps(rt, workflow_id)
    assert {s: v.step.status for s, v in steps.items()} == {
        "a": StepStatus.SUCCEEDED,
        "b": StepStatus.CANCELLED,
        "c": StepStatus.CANCELLED,
        "d": StepStatus.CANCELLED,
    }
    for step in ("b", "c"):
        assert steps[step].run.status is RunStatus.CANCELLED
        assert steps[step].run.error == f"workflow {workflow_id} cancelled: not today"
    assert steps["d"].run is None
    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_run(steps[running_step].run.id)
    assert snapshot is not None and snapshot.lease is not None
    assert snapshot.lease.release_reason is ReleaseReason.CANCELLED
    # The running step's worker is refused at its next call; nothing is left for the frontier.
    renewed = rt.workers.renew_many(worker.session_id, worker.secret, [running.fence])
    assert [(r.outcome, r.reason) for r in renewed.results] == [(None, "cancelled")]
    assert store.workflow_candidates(16).items == ()
    with pytest.raises(InvalidTransition):
        rt.workflows.cancel(workflow_id)
    assert rt.run(workflow_id).status is RunStatus.CANCELLED


def test_a_unique_key_admits_one_unfinished_workflow(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    first = rt.workflows.admit(DIAMOND, unique_key="nightly-2031-01-01")
    again = rt.workflows.admit(DIAMOND, unique_key="nightly-2031-01-01")
    assert (first.existing, again.existing, again.run_id) == (False, True, first.run_id)
    assert [run.id for run in rt.workflows.list_workflows()] == [first.run_id]
    rt.workflows.cancel(first.run_id)
    third = rt.workflows.admit(DIAMOND, unique_key="nightly-2031-01-01")
    assert not third.existing and third.run_id != first.run_id
    listed = rt.workflows.list_workflows()
    assert [run.id for run in listed] == [third.run_id, first.run_id]
    assert [r.id for r in rt.workflows.list_workflows(RunStatus.CANCELLED)] == [first.run_id]


def test_a_workflow_files_step_timeout_is_its_runs(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    workflow_id = rt.workflows.submit(
        {"name": "timed", "steps": [{"id": "a", "task": "t", "timeout": 1.5},
                                    {"id": "b", "task": "t", "after": ["a"]}]}
    )
    assert rt.run(workflow_id).input == {"steps": ["a", "b"], "timeouts": {"a": 1500}}
    worker = WorkerDriver.register(rt.workers, "w1", ["t"])
    grants = _drive(rt, worker, workflow_id, lambda step, grant: step)
    assert (grants["a"].timeout_ms, grants["b"].timeout_ms) == (1500, None)
    with pytest.raises(InvalidWorkflow, match="timeout is a positive number"):
        rt.workflows.submit({"name": "w", "steps": [{"id": "a", "task": "t", "timeout": "1"}]})


def test_cancelling_a_failed_workflow_stops_the_steps_still_running(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    workflow_id = rt.workflows.submit(
        {"name": "w", "steps": [{"id": "a", "task": "t"}, {"id": "b", "task": "t"}]}
    )
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=2)
    rt.cycle()
    grants = {_step_of(rt, workflow_id, g.run_id): g for g in worker.claim_all()}
    worker.finish(grants["a"].run_id, succeeded=False, error="boom")
    rt.cycle()
    assert rt.run(workflow_id).status is RunStatus.FAILED
    assert rt.run(grants["b"].run_id).status is RunStatus.RUNNING  # a failure lets it finish

    assert rt.workflows.cancel(workflow_id, "stop b too") is RunStatus.FAILED

    assert rt.run(workflow_id).status is RunStatus.FAILED  # its outcome stays
    assert rt.run(grants["b"].run_id).status is RunStatus.CANCELLED
    assert _steps(rt, workflow_id)["b"].step.status is StepStatus.CANCELLED
    with pytest.raises(InvalidTransition):
        rt.workflows.cancel(workflow_id)
