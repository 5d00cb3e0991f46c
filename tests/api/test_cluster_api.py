"""The Cluster runtime on PostgreSQL: admission in the caller's transaction (SQLAlchemy
Connection and Session, psycopg connection), the wake-up on commit only, the claim right after,
asyncio submit and wait, start/stop and the mountable ingress."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

import ql3
from ql3 import RunStatus, UnknownTask, UnsupportedTransaction
from ql3.application.identities import RandomIdentities
from ql3.application.worker_commands import WorkerCommands
from ql3.testing import InlineWorker
from tests.api.tasks import TASKS, resize

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def runtime(pg_database_url: str) -> Iterator[ql3.Runtime]:
    rt = ql3.cluster(pg_database_url, tasks=TASKS, cadence_s=0.2, lease_ttl_s=5)
    yield rt
    rt.close()


@pytest.fixture
def clean(runtime: ql3.Runtime) -> ql3.Runtime:
    runtime.store.testing_reset()
    return runtime


@pytest.fixture(scope="module")
def engine(pg_database_url: str) -> Iterator[Any]:
    engine = create_engine(pg_database_url)
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE IF NOT EXISTS orders (id int PRIMARY KEY)"))
    yield engine
    engine.dispose()


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _counts(engine: Any) -> tuple[int, int, int]:
    with engine.connect() as connection:
        return (
            connection.execute(text("SELECT count(*) FROM orders")).scalar_one(),
            connection.execute(text("SELECT count(*) FROM runs")).scalar_one(),
            connection.execute(text("SELECT count(*) FROM run_events")).scalar_one(),
        )


def _worker(runtime: ql3.Runtime) -> InlineWorker:
    commands = WorkerCommands(runtime.store.unit_of_work, RandomIdentities(), lease_ttl_ms=5_000)
    return InlineWorker(commands, lambda: None, TASKS)


def test_a_rolled_back_transaction_leaves_no_run_and_no_event(
    clean: ql3.Runtime, engine: Any
) -> None:
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM orders"))
    with engine.connect() as connection:
        connection.execute(text("INSERT INTO orders VALUES (1)"))
        clean.submit(resize, {"id": 1}, transaction=connection)
        connection.rollback()
    with Session(engine) as session:
        session.execute(text("INSERT INTO orders VALUES (2)"))
        clean.submit_many([("echo", 1), ("echo", 2)], transaction=session)
        session.rollback()
    assert _counts(engine) == (0, 0, 0)


def test_a_committed_one_wakes_the_workers_only_on_commit_and_is_claimed(
    clean: ql3.Runtime, engine: Any, pg_database_url: str
) -> None:
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM orders"))
    with psycopg.connect(_libpq(pg_database_url), autocommit=True) as listener:
        listener.execute("LISTEN ql3_dispatch")
        with Session(engine) as session:
            session.execute(text("INSERT INTO orders VALUES (1)"))
            run_id = clean.submit(resize, {"id": 1}, transaction=session)
            assert list(listener.notifies(timeout=0.2, stop_after=1)) == []  # not yet
            session.commit()
        committed_at = time.monotonic()
        assert [n.channel for n in listener.notifies(timeout=5, stop_after=1)] == ["ql3_dispatch"]
        assert _worker(clean).run_due() == 1
        claimed_after = time.monotonic() - committed_at
    assert _counts(engine)[:2] == (1, 1)
    done = clean.get(run_id)
    assert done.succeeded and done.output == {"id": 1, "attempt": 1}
    assert done.policy == TASKS.definition("resize").policy
    assert claimed_after < 5  # the figure itself is a benchmark's business


def test_a_psycopg_connection_commits_or_rolls_back_with_the_run(
    clean: ql3.Runtime, engine: Any, pg_database_url: str
) -> None:
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM orders"))
    with psycopg.connect(_libpq(pg_database_url)) as connection:
        connection.execute("INSERT INTO orders VALUES (1)")
        kept = clean.submit("echo", {"n": 1}, transaction=connection)
        connection.commit()
        connection.execute("INSERT INTO orders VALUES (2)")
        clean.submit("echo", {"n": 2}, transaction=connection)
        connection.rollback()
    assert _counts(engine) == (1, 1, 1)
    assert clean.get(kept).status is RunStatus.QUEUED
    with (
        psycopg.connect(_libpq(pg_database_url), autocommit=True) as connection,
        pytest.raises(UnsupportedTransaction, match="autocommit"),
    ):
        clean.submit("echo", 1, transaction=connection)
    with pytest.raises(UnsupportedTransaction, match="not str"):
        clean.submit("echo", 1, transaction="BEGIN")


def test_a_refused_submit_leaves_the_callers_transaction_usable(
    clean: ql3.Runtime, engine: Any
) -> None:
    with engine.begin() as connection:
        connection.execute(text("DELETE FROM orders"))
    with Session(engine) as session:
        session.execute(text("INSERT INTO orders VALUES (1)"))
        with pytest.raises(UnknownTask):
            clean.submit("missing", 1, transaction=session)
        session.commit()
    assert _counts(engine) == (1, 0, 0)


def test_asyncio_submit_and_wait(clean: ql3.Runtime) -> None:
    worker = threading.Timer(0.1, _worker(clean).run_due)

    async def scenario() -> Any:
        run_id = await clean.asubmit("double", 5)
        worker.start()
        return await clean.await_run(run_id, timeout=10)

    info = asyncio.run(scenario())
    worker.join()  # it must not run what follows
    assert info.succeeded and info.output == 10
    pending = clean.submit("echo", 1)
    with pytest.raises(ql3.WaitTimeout):
        clean.wait(pending, timeout=0.1)
    clean.cancel(pending)
    assert clean.get(pending).status is RunStatus.CANCELLED


def test_start_stop_and_the_mounted_ingress(clean: ql3.Runtime) -> None:
    app = FastAPI()
    app.mount("/ql3", clean.ingress_app())
    clean.start()
    try:
        with TestClient(app) as client:
            answer = client.post(
                "/ql3/v1/sessions", json={"worker_id": "w1", "capacity": 1, "tasks": ["echo"]}
            )
        assert answer.status_code == 201, answer.text
        assert answer.json()["lease_ttl_ms"] == 5_000
    finally:
        clean.stop()
    clean.stop()  # idempotent


def test_a_commit_that_finishes_runs_notifies_the_waiters(
    clean: ql3.Runtime, pg_database_url: str
) -> None:
    with psycopg.connect(_libpq(pg_database_url), autocommit=True) as listener:
        listener.execute("LISTEN ql3_run_finished")
        first, second = clean.submit_many([("echo", 1), ("echo", 2)])
        assert list(listener.notifies(timeout=0.2, stop_after=1)) == []  # queued: not finished
        clean.cancel(first)
        assert len(list(listener.notifies(timeout=5, stop_after=1))) == 1
        signal = clean._finish_signal()  # the runtime's own listener, as a wait uses it
        deadline = time.monotonic() + 5
        while not clean._finished_listener.connected and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.01)
        mark = signal.mark()
        _worker(clean).run_due()
        signal.wait(mark, 5)
        assert signal.mark() != mark
        assert clean.wait(second, timeout=1).succeeded
