"""The Python API's delayed and unique submissions (ADR 0015): ``delay=`` / ``run_after=`` on
submit, ``unique_key=`` and :meth:`Runtime.submit_unique`, in memory and on PostgreSQL (in the
caller's transaction too)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

import ql3
from ql3 import InvalidAdmission, RunStatus, Submission, Submitted
from ql3.testing import InMemoryRuntime, in_memory
from tests.api.tasks import TASKS, echo


@pytest.fixture
def rt() -> Iterator[InMemoryRuntime]:
    runtime = in_memory(TASKS)
    yield runtime
    runtime.close()


def test_a_delayed_run_runs_only_once_the_clock_reached_its_time(rt: InMemoryRuntime) -> None:
    run_id = rt.submit(echo, {"n": 1}, delay=30)
    assert rt.get(run_id).status is RunStatus.RETRY_WAIT and rt.get(run_id).attempts == 0
    assert rt.run_due() == 0
    rt.advance(29)
    assert rt.run_due() == 0 and rt.get(run_id).status is RunStatus.RETRY_WAIT
    rt.advance(1)
    assert rt.run_due() == 1
    info = rt.get(run_id)
    assert info.succeeded and info.output == {"n": 1} and info.attempts == 1
    assert rt.events(run_id) == [
        "run_admitted", "attempt_created", "attempt_started", "attempt_succeeded",
    ]


def test_delay_takes_a_timedelta_and_run_after_a_datetime_naive_as_utc(
    rt: InMemoryRuntime,
) -> None:
    now = dt.datetime.fromtimestamp(rt.clock.now_ms() / 1000, dt.UTC)
    by_delta = rt.submit("echo", 1, delay=dt.timedelta(minutes=2))
    aware = rt.submit("echo", 2, run_after=now + dt.timedelta(minutes=3))
    naive = rt.submit("echo", 3, run_after=(now + dt.timedelta(minutes=3)).replace(tzinfo=None))
    rt.advance(120)
    assert rt.run_due() == 1 and rt.get(by_delta).succeeded
    rt.advance(60)
    assert rt.run_due() == 2 and rt.get(aware).succeeded and rt.get(naive).succeeded


def test_a_due_time_in_the_past_queues_the_run_at_once(rt: InMemoryRuntime) -> None:
    run_id = rt.submit("echo", 1, run_after=dt.datetime(2001, 1, 1, tzinfo=dt.UTC))
    assert rt.get(run_id).status is RunStatus.QUEUED


@pytest.mark.parametrize(
    "timing",
    [
        {"delay": 5, "run_after": dt.datetime(2031, 1, 1, tzinfo=dt.UTC)},
        {"delay": -1},
        {"delay": float("nan")},
        {"delay": "5"},
        {"run_after": "2031-01-01"},
    ],
)
def test_bad_timing_is_refused_and_nothing_is_written(
    rt: InMemoryRuntime, timing: dict[str, object]
) -> None:
    with pytest.raises(InvalidAdmission):
        rt.submit("echo", 1, **timing)  # type: ignore[arg-type]
    assert rt.runs() == []


def test_a_delayed_run_is_cancelled_before_it_runs(rt: InMemoryRuntime) -> None:
    run_id = rt.submit("echo", 1, delay=10)
    rt.cancel(run_id)
    rt.advance(10)
    assert rt.run_due() == 0
    assert rt.get(run_id).status is RunStatus.CANCELLED


def test_submit_unique_tells_new_from_existing_and_the_key_frees_when_the_run_finished(
    rt: InMemoryRuntime,
) -> None:
    first = rt.submit_unique("echo", 1, unique_key="order-1")
    assert first == Submitted(run_id=first.run_id, existing=False)
    again = rt.submit_unique("echo", 2, unique_key="order-1")
    assert again == Submitted(run_id=first.run_id, existing=True)
    assert rt.submit("echo", 3, unique_key="order-1") == first.run_id
    assert [r.id for r in rt.runs()] == [first.run_id]
    assert rt.events(first.run_id) == ["run_admitted"]

    assert rt.run_due() == 1 and rt.get(first.run_id).output == 1
    later = rt.submit_unique("echo", 4, unique_key="order-1")
    assert not later.existing and later.run_id != first.run_id


def test_submit_many_maps_one_key_to_one_run(rt: InMemoryRuntime) -> None:
    ids = rt.submit_many(
        [
            Submission("echo", 1, unique_key="a"),
            Submission("echo", 2, unique_key="a"),
            Submission("echo", 3, delay=5),
            ("echo", 4),
        ]
    )
    assert ids[0] == ids[1] and len(set(ids)) == 3
    assert rt.get(ids[2]).status is RunStatus.RETRY_WAIT
    assert rt.get(ids[0]).input == 1


def test_asyncio_forms(rt: InMemoryRuntime) -> None:
    async def both() -> tuple[str, Submitted]:
        delayed = await rt.asubmit("echo", 1, delay=5)
        unique = await rt.asubmit_unique("echo", 2, unique_key="k")
        return delayed, unique

    delayed, unique = asyncio.run(both())
    assert rt.get(delayed).status is RunStatus.RETRY_WAIT
    assert not unique.existing


def test_a_unique_submit_in_the_callers_transaction_sees_its_earlier_runs(
    rt: InMemoryRuntime,
) -> None:
    engine = create_engine("sqlite://")
    with Session(engine) as session:
        session.connection()
        first = rt.submit_unique("echo", 1, unique_key="k", transaction=session)
        second = rt.submit_unique("echo", 2, unique_key="k", transaction=session)
        assert second == Submitted(run_id=first.run_id, existing=True)
        session.commit()
    assert [r.id for r in rt.runs()] == [first.run_id]
    engine.dispose()


@pytest.mark.postgres
def test_on_postgres_in_the_callers_transaction(pg_database_url: str) -> None:
    runtime = ql3.cluster(pg_database_url, tasks=TASKS)
    engine = create_engine(pg_database_url)
    try:
        held = runtime.submit_unique("echo", 1, unique_key="k")
        delayed = runtime.submit("echo", 2, delay=60)
        with Session(engine) as session:
            again = runtime.submit_unique("echo", 3, unique_key="k", transaction=session)
            fresh = runtime.submit_unique("echo", 4, unique_key="j", transaction=session)
            session.commit()
        assert again == Submitted(run_id=held.run_id, existing=True)
        assert not fresh.existing and runtime.get(fresh.run_id).status is RunStatus.QUEUED
        info = runtime.get(delayed)
        assert info.status is RunStatus.RETRY_WAIT and info.attempts == 0
    finally:
        engine.dispose()
        runtime.close()
