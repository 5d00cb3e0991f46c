"""Workflows from Python (ADR 0021): ``ql3.Workflow``, ``submit_workflow`` (in the caller's
transaction too), ``get_workflow``, ``wait_workflow``, ``cancel_workflow`` and their asyncio
forms, with each step receiving its parents' outputs as ``context.parents``; on the in-memory
runtime, on PostgreSQL and on a Standalone runtime that runs the steps itself."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

import ql3
from ql3 import (
    InvalidInput,
    InvalidTransition,
    InvalidWorkflow,
    RunStatus,
    StepStatus,
    UnknownTask,
    UnknownWorkflow,
    UnsupportedTransaction,
    Workflow,
)
from ql3.testing import InMemoryRuntime, in_memory
from tests.api.tasks import TASKS, echo, explode, gather


def diamond(name: str = "diamond") -> Workflow:
    wf = Workflow(name)
    a = wf.step("a", gather, {"n": 1})
    b = wf.step("b", gather, {"side": "b"}, after=[a])
    c = wf.step("c", "gather", {"side": "c"}, after=[a])
    wf.step("d", gather, after=[b, c])
    return wf


def _check_diamond(info: ql3.WorkflowInfo) -> None:
    assert info.succeeded and info.name == "diamond"
    assert [s.id for s in info.steps] == ["a", "b", "c", "d"]
    assert {s.status for s in info.steps} == {StepStatus.SUCCEEDED}
    a, b, c, d = (info.step(s).output for s in "abcd")
    assert a == {"input": {"n": 1}, "parents": {}, "step": None}
    assert b == {"input": {"side": "b"}, "parents": {"a": a}, "step": "b"}
    assert c == {"input": {"side": "c"}, "parents": {"a": a}, "step": "c"}
    assert d == {"input": None, "parents": {"b": b, "c": c}, "step": "d"}
    assert info.output == {"a": a, "b": b, "c": c, "d": d}
    assert info.step("d").after == ("b", "c") and info.step("d").attempts == 1


@pytest.fixture
def rt() -> Iterator[InMemoryRuntime]:
    runtime = in_memory(TASKS)
    yield runtime
    runtime.close()


def test_a_diamond_built_in_python_passes_each_steps_output_to_the_steps_after_it(
    rt: InMemoryRuntime,
) -> None:
    workflow_id = rt.submit_workflow(diamond())
    info = rt.get_workflow(workflow_id)
    assert info.status is RunStatus.CREATED
    assert {s.status for s in info.steps} == {StepStatus.PENDING}
    assert info.step("a").run_id is None and info.step("a").run_status is None

    _check_diamond(rt.wait_workflow(workflow_id))
    assert [r.id for r in rt.list_workflows()] == [workflow_id]


def test_a_failed_step_fails_the_workflow_and_what_comes_after_it_never_runs(
    rt: InMemoryRuntime,
) -> None:
    wf = Workflow("broken")
    wf.step("a", echo, 1)
    wf.step("b", explode, 2, after=["a"])
    wf.step("c", echo, 3, after=["b"])
    info = rt.wait_workflow(rt.submit_workflow(wf))
    assert info.status is RunStatus.FAILED
    assert info.error == "step b failed: ValueError: bad payload 2"
    assert [(s.id, s.status) for s in info.steps] == [
        ("a", StepStatus.SUCCEEDED), ("b", StepStatus.FAILED), ("c", StepStatus.CANCELLED)]
    error = info.step("b").error or ""
    # the step's Run keeps the whole error, its traceback after its first line
    assert error.splitlines()[0] == "ValueError: bad payload 2" and "Traceback" in error
    assert info.step("c").run_id is None


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda wf: (wf.step("a", echo, after=["b"]), wf.step("b", echo, after=["a"])),
         InvalidWorkflow, "cycle"),
        (lambda wf: (wf.step("a", echo), wf.step("a", echo)), InvalidWorkflow, "duplicate"),
        (lambda wf: wf.step("a", echo, after=["nowhere"]), InvalidWorkflow, "unknown step"),
        (lambda wf: wf.step("a", echo, after="b"), InvalidWorkflow, "not a string"),
        (lambda wf: wf.step("a", print), UnknownTask, "not a declared task"),
        (lambda wf: wf.step("a", "nope"), UnknownTask, "no task 'nope'"),
        (lambda wf: wf.step("a", echo, {1, 2}), InvalidInput, "not JSON"),
        (lambda wf: None, InvalidWorkflow, "1..256 steps"),
        (lambda wf: [wf.step(f"s{i}", echo) for i in range(257)], InvalidWorkflow, "1..256"),
    ],
    ids=["cycle", "duplicate", "unknown", "after-str", "undeclared", "unknown-task",
         "not-json", "empty", "too-many"],
)
def test_a_refused_workflow_writes_nothing(
    rt: InMemoryRuntime, build: Any, error: type[Exception], message: str
) -> None:
    wf = Workflow("w")
    with pytest.raises(error, match=message):
        build(wf)
        rt.submit_workflow(wf)
    assert rt.runs() == []


def test_cancel_workflow_cancels_every_unfinished_step(rt: InMemoryRuntime) -> None:
    workflow_id = rt.submit_workflow(diamond())
    rt.run_due(vanish=lambda started: True)  # a starts, its worker vanishes: running
    assert rt.get_workflow(workflow_id).step("a").run_status is RunStatus.RUNNING

    assert rt.cancel_workflow(workflow_id, "changed my mind") is RunStatus.RUNNING

    info = rt.get_workflow(workflow_id)
    assert (info.status, info.error) == (RunStatus.CANCELLED, "changed my mind")
    assert {s.status for s in info.steps} == {StepStatus.CANCELLED}
    assert info.step("a").run_status is RunStatus.CANCELLED
    assert rt.run_due() == 0
    with pytest.raises(InvalidTransition):
        rt.cancel_workflow(workflow_id)
    run_id = rt.submit(echo, 1)
    for call in (rt.get_workflow, rt.cancel_workflow, rt.wait_workflow):
        with pytest.raises(UnknownWorkflow):
            call(run_id)


def test_a_unique_key_and_the_asyncio_forms(rt: InMemoryRuntime) -> None:
    async def scenario() -> ql3.WorkflowInfo:
        first = await rt.asubmit_workflow(diamond(), unique_key="order-7")
        again = await rt.asubmit_workflow(diamond(), unique_key="order-7")
        assert again == first
        return await rt.await_workflow(first)

    info = asyncio.run(scenario())
    _check_diamond(info)
    assert asyncio.run(rt.aget_workflow(info.id)) == info
    assert rt.submit_workflow(diamond(), unique_key="order-7") != info.id  # finished: free


def test_a_workflow_follows_the_applications_transaction_in_memory(
    rt: InMemoryRuntime,
) -> None:
    engine = create_engine("sqlite://")
    with Session(engine) as session:
        session.execute(text("SELECT 1"))
        rt.submit_workflow(diamond(), transaction=session)
        session.rollback()
    assert rt.runs() == []
    with Session(engine) as session, session.begin():
        workflow_id = rt.submit_workflow(diamond(), transaction=session)
        assert rt.runs() == []  # not before the commit
    _check_diamond(rt.wait_workflow(workflow_id))


# --- PostgreSQL ----------------------------------------------------------------


@pytest.fixture
def cluster_rt(pg_database_url: str) -> Iterator[ql3.Runtime]:
    runtime = ql3.cluster(pg_database_url, tasks=TASKS)
    runtime.store.testing_reset()
    yield runtime
    runtime.close()


def _counts(engine: Any) -> tuple[int, int]:
    with engine.connect() as connection:
        return (
            connection.execute(text("SELECT count(*) FROM runs")).scalar_one(),
            connection.execute(text("SELECT count(*) FROM workflow_steps")).scalar_one(),
        )


@pytest.mark.postgres
def test_a_workflow_submitted_in_a_rolled_back_transaction_leaves_nothing(
    cluster_rt: ql3.Runtime, pg_database_url: str
) -> None:
    engine = create_engine(pg_database_url)
    try:
        with engine.connect() as connection:
            cluster_rt.submit_workflow(diamond(), transaction=connection)
            connection.rollback()
        with Session(engine) as session:
            cluster_rt.submit_workflow(diamond(), unique_key="k", transaction=session)
            session.rollback()
        assert _counts(engine) == (0, 0)
        with Session(engine) as session, session.begin():
            kept = cluster_rt.submit_workflow(diamond(), unique_key="k", transaction=session)
            assert cluster_rt.submit_workflow(diamond(), transaction=session) != kept
        assert cluster_rt.submit_workflow(diamond(), unique_key="k") == kept
        assert _counts(engine) == (2, 8)
        assert cluster_rt.get_workflow(kept).status is RunStatus.CREATED
        libpq = pg_database_url.replace("postgresql+psycopg://", "postgresql://", 1)
        with (
            psycopg.connect(libpq) as connection,
            pytest.raises(UnsupportedTransaction, match="bare psycopg"),
        ):
            cluster_rt.submit_workflow(diamond(), transaction=connection)
        assert _counts(engine) == (2, 8)
    finally:
        engine.dispose()


# --- Standalone ----------------------------------------------------------------


def test_a_standalone_runtime_runs_a_diamond_in_its_own_process(tmp_path: Path) -> None:
    with ql3.standalone(str(tmp_path / "wf.sqlite"), tasks=TASKS) as runtime:
        runtime.start()
        _check_diamond(runtime.wait_workflow(runtime.submit_workflow(diamond()), timeout=60))
        with pytest.raises(UnsupportedTransaction):
            runtime.submit_workflow(diamond(), transaction=object())


def test_a_step_runs_with_its_tasks_timeout_or_its_own() -> None:
    tasks = ql3.TaskRegistry()

    @tasks.task(timeout=20)
    def slow(payload: Any) -> Any:
        return payload

    with in_memory(tasks) as runtime:
        wf = Workflow("timed")
        first = wf.step("first", slow, 1)
        wf.step("second", slow, 2, after=[first], timeout=5)
        wf.step("third", "slow", 3, after=[first], timeout=None)
        info = runtime.wait_workflow(runtime.submit_workflow(wf))
        assert info.succeeded
        with runtime.store.unit_of_work() as uow:
            timeouts = {s.id: uow.runs.get_run(s.run_id).timeout_ms for s in info.steps}
        assert timeouts == {"first": 20_000, "second": 5_000, "third": 20_000}
        wf = Workflow("bad")
        wf.step("a", slow, 1, timeout=0)
        with pytest.raises(ql3.InvalidAdmission, match="timeout"):
            runtime.submit_workflow(wf)
