"""Workflows on every store: a DAG of steps admitted by the frontier once their predecessors
succeeded, failure and cancellation of what has not started, the aggregate Run kept out of
recovery and lost retry, and the operator's view of a workflow."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ql3.application.queries import RunQueries
from ql3.domain.errors import InvalidWorkflow
from ql3.domain.events import EventType
from ql3.domain.model import RunOwner, RunStatus
from ql3.domain.workflows import StepStatus
from tests.scheduling_support import Runtime, WorkerDriver, runtime

TTL_S = 30.0

DIAMOND = {
    "name": "nightly",
    "steps": [
        {"id": "extract", "task": "t", "input": {"n": 1}},
        {"id": "left", "task": "t", "after": ["extract"]},
        {"id": "right", "task": "t", "after": ["extract"]},
        {"id": "load", "task": "t", "after": ["left", "right"]},
    ],
}


def _steps(rt: Runtime, workflow_id: str) -> dict[str, Any]:
    return {view.step.step_id: view for view in rt.workflows.steps(workflow_id)}


def _run_ids(rt: Runtime, workflow_id: str) -> dict[str, str]:
    return {
        step_id: view.step.run_id
        for step_id, view in _steps(rt, workflow_id).items()
        if view.step.run_id is not None
    }


def _step_of(rt: Runtime, workflow_id: str, run_id: str) -> str:
    return next(s for s, r in _run_ids(rt, workflow_id).items() if r == run_id)


def _all_runs(rt: Runtime) -> list[Any]:
    with rt.store.unit_of_work() as uow:
        return list(uow.runs.list_runs(None, 10_000))


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"name": "w", "steps": [{"id": "a", "task": "t"}, {"id": "a", "task": "t"}]},
         "duplicate step id"),
        ({"name": "w", "steps": [{"id": "a", "task": "t", "after": ["zz"]}]}, "unknown step"),
        ({"name": "w", "steps": [{"id": "a", "task": "t", "after": ["b"]},
                                 {"id": "b", "task": "t", "after": ["a"]}]}, "cycle"),
        ({"name": "w", "steps": [{"id": "a", "task": "t", "after": ["a"]}]}, "cycle"),
        ({"name": "w", "steps": []}, "1..256 steps"),
        ({"name": "w", "steps": [{"id": "a", "task": "t", "retries": 3}]}, "unknown keys"),
        ({"name": "w", "steps": [{"id": "a", "task": "t", "policy": {"safety": "maybe"}}]},
         "safety"),
        ({"steps": [{"id": "a", "task": "t"}]}, "workflow name"),
    ],
    ids=["duplicate", "unknown", "cycle", "self", "empty", "bad-key", "bad-policy", "no-name"],
)
def test_a_refused_dag_writes_nothing(
    store: Any, advance: Callable[[int], None], document: dict[str, Any], message: str
) -> None:
    rt = runtime(store, advance)
    with pytest.raises(InvalidWorkflow, match=message):
        rt.workflows.submit(document)
    assert _all_runs(rt) == []


def test_a_diamond_runs_each_step_once_after_its_predecessors(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    workflow_id = rt.workflows.submit(DIAMOND)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=4)
    aggregate = rt.run(workflow_id)
    assert (aggregate.owner, aggregate.status, aggregate.attempt_count) == (
        RunOwner.WORKFLOW, RunStatus.CREATED, 0)
    assert {s: v.step.status for s, v in _steps(rt, workflow_id).items()} == dict.fromkeys(
        ("extract", "left", "right", "load"), StepStatus.PENDING
    )

    for expected in (["extract"], ["left", "right"], ["load"]):
        summary = rt.cycle()
        assert summary.ok
        taken = worker.claim_all()
        assert sorted(_step_of(rt, workflow_id, g.run_id) for g in taken) == expected
        for grant in taken:
            step = _step_of(rt, workflow_id, grant.run_id)
            worker.finish(grant.run_id, output={"step": step})
    assert rt.cycle().step("workflow_frontier").counts["succeeded"] == 1

    aggregate = rt.run(workflow_id)
    assert aggregate.status is RunStatus.SUCCEEDED
    assert aggregate.output == {s: {"step": s} for s in ("extract", "left", "right", "load")}
    with store.unit_of_work() as uow:
        assert uow.runs.attempts_of(workflow_id) == ()
        kinds = [e.event.type for e in uow.runs.events_of(workflow_id)]
    assert kinds == [EventType.RUN_ADMITTED, EventType.WORKFLOW_STARTED,
                     EventType.WORKFLOW_SUCCEEDED]
    for step_id, view in _steps(rt, workflow_id).items():
        assert view.step.status is StepStatus.SUCCEEDED
        assert (view.run.owner, view.run.parent_run_id, view.run.attempt_count) == (
            RunOwner.RUNTIME, workflow_id, 1)
        with store.unit_of_work() as uow:
            admitted = uow.runs.events_of(view.run.id)[0].event
        assert admitted.data["workflow_run_id"] == workflow_id
        assert admitted.data["step"] == step_id
    assert _steps(rt, workflow_id)["extract"].run.input == {"n": 1}
    assert len(_all_runs(rt)) == 5
    assert store.workflow_candidates(16).items == ()


def test_a_failed_step_fails_the_workflow_and_cancels_the_steps_not_started(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    workflow_id = rt.workflows.submit(
        {
            "name": "w",
            "steps": [
                {"id": "a", "task": "t"},
                {"id": "b", "task": "t", "after": ["a"]},
                {"id": "c", "task": "unserved", "after": ["a"]},
                {"id": "d", "task": "t", "after": ["b", "c"]},
            ],
        }
    )
    worker = WorkerDriver.register(rt.workers, "w1", ["t"])
    rt.cycle()
    (a,) = worker.claim_all()
    worker.finish(a.run_id)
    rt.cycle()  # b and c admitted; only b has a worker
    (b,) = worker.claim_all()
    worker.finish(b.run_id, succeeded=False, error="disk full")

    summary = rt.cycle()

    assert summary.step("workflow_frontier").counts["failed"] == 1
    aggregate = rt.run(workflow_id)
    assert aggregate.status is RunStatus.FAILED
    assert aggregate.error == "step b failed: disk full"
    steps = _steps(rt, workflow_id)
    assert {s: v.step.status for s, v in steps.items()} == {
        "a": StepStatus.SUCCEEDED,
        "b": StepStatus.FAILED,
        "c": StepStatus.CANCELLED,
        "d": StepStatus.CANCELLED,
    }
    assert steps["c"].run.status is RunStatus.CANCELLED  # admitted, never started
    assert steps["d"].run is None  # never admitted
    assert store.workflow_candidates(16).items == ()
    assert rt.cycle().step("workflow_frontier").counts["workflows"] == 0


def test_a_running_step_finishes_after_its_workflow_failed(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    workflow_id = rt.workflows.submit(
        {"name": "w", "steps": [{"id": "a", "task": "t"}, {"id": "b", "task": "t"},
                                {"id": "c", "task": "t", "after": ["a", "b"]}]}
    )
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=2)
    rt.cycle()
    taken = {_step_of(rt, workflow_id, g.run_id): g for g in worker.claim_all()}
    assert sorted(taken) == ["a", "b"]
    worker.finish(taken["a"].run_id, succeeded=False, error="boom")

    rt.cycle()

    steps = _steps(rt, workflow_id)
    assert rt.run(workflow_id).status is RunStatus.FAILED
    assert steps["b"].step.status is StepStatus.ADMITTED  # started: not cancelled
    assert steps["b"].run.status is RunStatus.RUNNING
    assert steps["c"].step.status is StepStatus.CANCELLED
    worker.finish(taken["b"].run_id, output=1)
    assert rt.cycle().step("workflow_frontier").counts["steps_settled"] == 1
    assert _steps(rt, workflow_id)["b"].step.status is StepStatus.SUCCEEDED
    assert rt.run(workflow_id).status is RunStatus.FAILED
    assert store.workflow_candidates(16).items == ()


def test_cancelling_a_workflow_cancels_its_steps_not_started(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    workflow_id = rt.workflows.submit(DIAMOND)
    rt.cycle()  # extract admitted, no worker
    rt.container.core.admission().cancel(workflow_id, "not tonight")

    report = rt.container.core.workflow_frontier().run_once()

    assert report.steps_cancelled == 4
    steps = _steps(rt, workflow_id)
    assert {v.step.status for v in steps.values()} == {StepStatus.CANCELLED}
    assert steps["extract"].run.status is RunStatus.CANCELLED
    assert rt.run(workflow_id).status is RunStatus.CANCELLED
    assert store.workflow_candidates(16).items == ()


def test_the_aggregate_is_never_recovered_or_retried_and_a_lost_step_is_retried_alone(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    safe = {"retry_on_lost": True, "max_attempts": 2, "safety": "idempotent",
            "backoff": {"initial_ms": 0}}
    workflow_id = rt.workflows.submit(
        {"name": "w", "steps": [{"id": "a", "task": "t", "policy": safe},
                                {"id": "b", "task": "t", "after": ["a"]}]}
    )
    first = WorkerDriver.register(rt.workers, "w1", ["t"])
    rt.cycle()
    (lost,) = first.claim_all()
    rt.workers.close(first.session_id, first.secret)  # the worker is gone: evidence
    advance(round(TTL_S * 1000) + 1_000)

    summary = rt.cycle()  # recovery: lost; lost retry: attempt 2 at once (no backoff)

    assert summary.step("runtime_recovery").counts["recovered"] == 1
    assert summary.step("lost_retry").counts["attempts_created"] == 1
    for page in (store.recovery_candidates(64), store.lost_runs(64), store.due_retries(64),
                 store.orphaned_runs(64)):
        assert workflow_id not in {c.run_id for c in page.items}
    assert rt.run(workflow_id).status is RunStatus.RUNNING
    second = WorkerDriver.register(rt.workers, "w2", ["t"])
    rt.cycle()
    (retried,) = second.claim_all()
    assert retried.run_id == lost.run_id and retried.attempt_number == 2
    second.finish(retried.run_id)
    rt.cycle()
    (b,) = second.claim_all()
    second.finish(b.run_id)
    rt.cycle()
    assert rt.run(workflow_id).status is RunStatus.SUCCEEDED
    assert rt.run(lost.run_id).attempt_count == 2


def test_the_operator_view_of_a_workflow_lists_its_steps_and_their_runs(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    workflow_id = rt.workflows.submit(DIAMOND)
    rt.cycle()
    view = RunQueries(store.unit_of_work).show(workflow_id)
    assert view is not None
    document = view.as_dict()
    assert document["owner"] == "workflow"
    assert [s["id"] for s in document["steps"]] == ["extract", "left", "right", "load"]
    extract = document["steps"][0]
    assert (extract["status"], extract["run_status"], extract["attempts"]) == (
        "admitted", "queued", 1)
    assert document["steps"][3] == {
        "id": "load", "task": "t", "after": ["left", "right"], "status": "pending",
        "run_id": None, "run_status": None, "attempts": 0,
    }
    step_view = RunQueries(store.unit_of_work).show(str(extract["run_id"]))
    assert step_view is not None
    assert step_view.as_dict()["parent_run_id"] == workflow_id
    assert step_view.steps == ()
