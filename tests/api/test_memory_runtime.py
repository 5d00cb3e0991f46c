"""The in-memory runtime an application tests its jobs on: submit, run due work inline, move
the clock, see recovery and lost retry follow each run's policy."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from ql3 import (
    InvalidInput,
    InvalidTransition,
    RetryPolicy,
    RunStatus,
    Safety,
    Submission,
    UnknownRun,
    UnknownTask,
    WaitTimeout,
)
from ql3.testing import InMemoryRuntime, in_memory
from tests.api.tasks import TASKS, charge, echo, resize

pytest_plugins = ["ql3.pytest_plugin"]


@pytest.fixture
def ql3_tasks():  # type: ignore[no-untyped-def]
    return TASKS


@pytest.fixture
def rt() -> Iterator[InMemoryRuntime]:
    runtime = in_memory(TASKS)
    yield runtime
    runtime.close()


def test_the_plugin_fixture_gives_a_fresh_runtime(ql3_runtime: InMemoryRuntime) -> None:
    run_id = ql3_runtime.submit("echo", [1, 2])
    assert ql3_runtime.get(run_id).status is RunStatus.QUEUED
    assert ql3_runtime.run_due() == 1
    assert ql3_runtime.get(run_id).output == [1, 2]


def test_submit_run_due_and_read(rt: InMemoryRuntime) -> None:
    ok = rt.submit(echo, {"a": 1})
    bad = rt.submit("explode", 7)
    doubled = rt.submit("double", 21)
    assert rt.run_due() == 3
    assert rt.get(ok).succeeded and rt.get(ok).output == {"a": 1}
    failed = rt.get(bad)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None
    assert failed.error.splitlines()[0] == "ValueError: bad payload 7"
    assert "Traceback (most recent call last)" in failed.error
    assert rt.get(doubled).output == 42  # an async def task, run to its end inline
    assert rt.events(ok) == ["run_admitted", "attempt_started", "attempt_succeeded"]


def test_submit_many_and_the_snapshot_of_the_template(rt: InMemoryRuntime) -> None:
    override = RetryPolicy(max_attempts=2, safety=Safety.UNSAFE)
    ids = rt.submit_many([("resize", {"id": 1}), Submission(resize, {"id": 2}, override)])
    assert rt.get(ids[0]).policy == TASKS.definition("resize").policy
    assert rt.get(ids[1]).policy == override


def test_a_refused_submit_writes_nothing(rt: InMemoryRuntime) -> None:
    rt.submit("echo", 1)
    with pytest.raises(UnknownTask):
        rt.submit_many([("echo", 2), ("missing", 3)])
    with pytest.raises(InvalidInput, match="not JSON"):
        rt.submit("echo", {1j})
    assert [run.input for run in rt.runs()] == [1]


def test_retried_on_lost_as_the_policy_says(rt: InMemoryRuntime) -> None:
    safe = rt.submit(resize, {"id": 7})
    unsafe = rt.submit(charge, None)
    started = rt.run_due(vanish=lambda attempt: attempt.attempt_number == 1)
    assert started == 2
    assert rt.get(safe).status is RunStatus.RUNNING
    rt.advance(seconds=rt.lease_ttl_s + 1)  # the vanished worker's leases expire
    rt.run_due()
    assert rt.get(unsafe).status is RunStatus.FAILED  # unsafe: never run twice
    assert rt.get(safe).status is RunStatus.RETRY_WAIT
    rt.advance(seconds=1)  # the declared backoff
    rt.run_due()
    done = rt.get(safe)
    assert done.succeeded and done.attempts == 2
    assert done.output == {"id": 7, "attempt": 2}


def test_wait_and_cancel(rt: InMemoryRuntime) -> None:
    run_id = rt.submit("echo", "x")
    assert rt.wait(run_id).output == "x"
    queued = rt.submit("echo", "y")
    rt.cancel(queued, "no longer needed")
    assert rt.get(queued).status is RunStatus.CANCELLED
    assert rt.run_due() == 0  # a cancelled run never starts
    with pytest.raises(InvalidTransition, match="is succeeded: cannot be cancelled"):
        rt.cancel(run_id)
    started = rt.submit(resize, {"id": 1})
    rt.run_due(vanish=lambda attempt: True)
    with pytest.raises(WaitTimeout, match="still running"):
        rt.wait(started, timeout=0.01)
    assert rt.cancel(started) is RunStatus.RUNNING  # a running run is cancelled at once
    assert rt.wait(started).status is RunStatus.CANCELLED
    with pytest.raises(UnknownRun):
        rt.get("nope")


def test_asyncio_submit_and_wait(rt: InMemoryRuntime) -> None:
    async def scenario() -> object:
        run_id = await rt.asubmit("double", 4)
        ids = await rt.asubmit_many([("echo", 1)])
        assert (await rt.aget(ids[0])).status is RunStatus.QUEUED
        return (await rt.await_run(run_id)).output

    assert asyncio.run(scenario()) == 8


def test_admission_follows_the_applications_transaction(rt: InMemoryRuntime) -> None:
    engine = create_engine("sqlite://")
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE orders (id INTEGER PRIMARY KEY)"))
    with Session(engine) as session:
        session.execute(text("INSERT INTO orders VALUES (1)"))
        kept = rt.submit("echo", 1, transaction=session)
        assert rt.runs() == []  # not before the commit
        session.commit()
        session.execute(text("INSERT INTO orders VALUES (2)"))
        dropped = rt.submit("echo", 2, transaction=session)
        session.rollback()
    assert [run.id for run in rt.runs()] == [kept]
    with pytest.raises(UnknownRun):
        rt.get(dropped)
    with engine.connect() as connection:
        connection.execute(text("INSERT INTO orders VALUES (3)"))
        rt.submit("echo", 3, transaction=connection)
        connection.commit()
    assert sorted(run.input for run in rt.runs()) == [1, 3]  # one clock tick: no order
