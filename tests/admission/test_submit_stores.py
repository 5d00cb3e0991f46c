"""The submit-only stores of ``ql3 submit`` (ADR 0009) write what the stores write.

They run the stores' admission statements as generated text on the bare driver; these tests
check the text against the statements the schema gives today, and the rows each one writes
against the rows the store writes for the same admissions, on SQLite and on PostgreSQL."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from ql3.adapters.postgres.store import PostgresStore
from ql3.adapters.postgres.submit import PostgresSubmitStore, libpq_url
from ql3.adapters.sql import submit_sql
from ql3.adapters.sql.sqlite import SCHEMA_VERSION, SqliteStore
from ql3.adapters.sql.sqlite.submit import SqliteSubmitStore
from ql3.adapters.sql.sqlite.wake import WakeListener
from ql3.adapters.sql.submit_sql_source import render
from ql3.application.admission import AdmissionRequest, admit_requests
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.model import RunOwner
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from ql3.domain.transitions import Change, admit
from tests.application.support import CountingIdentities

NOW_MS = 1_790_000_000_123
POLICY = RetryPolicy(
    retry_on_lost=True,
    retry_on_error=True,
    max_attempts=4,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=250, cap_ms=9_000, multiplier=3.0, jitter=0.25),
)
TABLES = ("runs", "run_attempts", "run_dispatch_leases", "run_events")


def test_the_generated_sql_is_what_the_stores_build_from_the_schema() -> None:
    """Run ``python -m ql3.adapters.sql.submit_sql_source`` after changing the schema."""
    assert Path(submit_sql.__file__).read_text() == render()


def _changes(prefix: str) -> list[Change]:
    """Admissions of every shape a submit makes: plain, with a policy, a timeout, a priority
    and a unique key, delayed (no Attempt), and inputs of every JSON kind."""
    shapes: list[dict[str, Any]] = [
        {"input": None},
        {"input": {"text": "naïve ☃ \"quoted\"", "n": [1, 2.5, None, True]}, "policy": POLICY},
        {"input": [1, "two"], "timeout_ms": 1_500, "priority": 7, "unique_key": f"{prefix}k"},
        {"input": "just text", "run_after_ms": NOW_MS + 60_000},
        {"input": 0, "priority": -3},
    ]
    changes = []
    for index, shape in enumerate(shapes):
        changes.append(
            admit(
                run_id=f"{prefix}run{index}",
                attempt_id=f"{prefix}attempt{index}",
                task="shop.charge",
                input=shape["input"],
                policy=shape.get("policy"),
                owner=RunOwner.RUNTIME,
                priority=shape.get("priority", 0),
                unique_key=shape.get("unique_key"),
                timeout_ms=shape.get("timeout_ms"),
                run_after_ms=shape.get("run_after_ms"),
                now_ms=NOW_MS,
            )
        )
    assert any(not change.attempts for change in changes)  # the delayed one
    return changes


def _without_ids(row: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A row with the test's id prefix taken out of its text and the event sequence dropped."""
    return {
        key: value.replace(prefix, "") if isinstance(value, str) else value
        for key, value in row.items()
        if key != "id" or not isinstance(value, int)
    }


# --- SQLite ------------------------------------------------------------------------------------


def _sqlite_rows(path: Path, prefix: str) -> dict[str, list[dict[str, Any]]]:
    connection = sqlite3.connect(path)
    connection.row_factory = sqlite3.Row
    try:
        found: dict[str, list[dict[str, Any]]] = {}
        for table in TABLES:
            key = "id" if table == "runs" else "run_id"
            query = f"SELECT * FROM {table} WHERE {key} LIKE ? ORDER BY {key}, rowid"
            rows = connection.execute(query, (f"{prefix}%",)).fetchall()
            # Raw values with their SQLite storage classes: text, integer, real, null.
            found[table] = [
                {
                    name: (value, type(row[name]).__name__)
                    for name, value in _without_ids(dict(row), prefix).items()
                }
                for row in rows
            ]
        return found
    finally:
        connection.close()


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "submit.db"
    SqliteStore(path).close()  # creates the schema
    yield path


def test_on_sqlite_it_writes_the_rows_the_store_writes(sqlite_path: Path) -> None:
    store = SqliteStore(sqlite_path)
    try:
        with store.unit_of_work() as uow:
            uow.runs.add_many(_changes("store-"))
            uow.commit()
    finally:
        store.close()
    submit = SqliteSubmitStore.open(str(sqlite_path))
    assert submit is not None
    try:
        with submit.unit_of_work() as submit_uow:
            submit_uow.runs.add_many(_changes("submit-"))
            submit_uow.commit()
    finally:
        submit.close()
    by_store = _sqlite_rows(sqlite_path, "store-")
    assert len(by_store["runs"]) == 5 and len(by_store["run_events"]) == 5
    assert _sqlite_rows(sqlite_path, "submit-") == by_store
    # And the store reads them back as it reads its own.
    reader = SqliteStore(sqlite_path)
    try:
        with reader.unit_of_work() as uow:
            for own, other in zip(_changes("store-"), _changes("submit-"), strict=True):
                assert uow.runs.get_run(other.run.id) is not None
                assert uow.runs.get_run(own.run.id) == own.run
                assert uow.runs.get_run(other.run.id) == other.run
    finally:
        reader.close()


def test_on_sqlite_a_refused_batch_leaves_nothing_and_the_transaction_usable(
    sqlite_path: Path,
) -> None:
    submit = SqliteSubmitStore.open(str(sqlite_path))
    assert submit is not None
    first, second, *_ = _changes("dup-")
    try:
        with submit.unit_of_work() as uow:
            uow.runs.add_many([first])
            with pytest.raises(ConcurrencyConflict):
                uow.runs.add_many([second, first])  # run0 again: the primary key refuses it
            uow.runs.add_many([second])
            uow.commit()
    finally:
        submit.close()
    runs = [row["id"][0] for row in _sqlite_rows(sqlite_path, "dup-")["runs"]]
    assert runs == ["run0", "run1"]


def test_on_sqlite_its_unique_keys_and_its_commit_are_the_stores(sqlite_path: Path) -> None:
    submit = SqliteSubmitStore.open(str(sqlite_path))
    assert submit is not None
    listener = WakeListener(str(sqlite_path) + ".wake")
    try:
        request = AdmissionRequest(task="t", unique_key="order-1")
        identities = CountingIdentities("sqlite-submit")
        (first,) = admit_requests(submit.unit_of_work, identities, [request])
        assert listener.drain() == 1  # the commit woke the executing process
        (again,) = admit_requests(submit.unit_of_work, identities, [request])
        assert (again.run_id, again.existing, first.existing) == (first.run_id, True, False)
        assert listener.drain() == 0  # nothing was written, nobody is woken
    finally:
        listener.close()
        submit.close()
    store = SqliteStore(sqlite_path)
    try:
        with store.unit_of_work() as uow:
            assert uow.runs.unfinished_with_keys(["order-1"]) == {"order-1": first.run_id}
    finally:
        store.close()


def test_on_sqlite_it_leaves_a_missing_or_other_version_database_to_the_store(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "missing.db"
    assert SqliteSubmitStore.open(str(missing)) is None
    assert not missing.exists()
    older = tmp_path / "older.db"
    connection = sqlite3.connect(older)
    connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    connection.close()
    assert SqliteSubmitStore.open(str(older)) is None
    connection = sqlite3.connect(older)
    assert connection.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION - 1,)
    connection.close()


# --- PostgreSQL --------------------------------------------------------------------------------


def _pg_rows(url: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
    with psycopg.connect(libpq_url(url), row_factory=dict_row) as connection:
        found: dict[str, list[dict[str, Any]]] = {}
        for table in TABLES:
            key = "id" if table == "runs" else "run_id"
            order = "id" if table == "run_events" else key
            query = f"SELECT * FROM {table} WHERE {key} LIKE %s ORDER BY {key}, {order}"
            rows = connection.execute(query, (f"{prefix}%",)).fetchall()
            found[table] = [_without_ids(dict(row), prefix) for row in rows]
        return found


def test_on_postgres_it_writes_the_rows_the_store_writes(pg_database_url: str) -> None:
    store = PostgresStore.from_url(pg_database_url, pool_size=1)
    try:
        with store.unit_of_work() as uow:
            uow.runs.add_many(_changes("pg-store-"))
            uow.commit()
    finally:
        store.close()
    submit = PostgresSubmitStore(pg_database_url)
    with submit.unit_of_work() as submit_uow:
        submit_uow.runs.add_many(_changes("pg-submit-"))
        submit_uow.commit()
    by_store = _pg_rows(pg_database_url, "pg-store-")
    assert len(by_store["runs"]) == 5 and len(by_store["run_attempts"]) == 4
    assert _pg_rows(pg_database_url, "pg-submit-") == by_store


def test_on_postgres_a_refused_batch_leaves_nothing_and_the_transaction_usable(
    pg_database_url: str,
) -> None:
    first, second, *_ = _changes("pg-dup-")
    submit = PostgresSubmitStore(pg_database_url)
    with submit.unit_of_work() as uow:
        uow.runs.add_many([first])
        with pytest.raises(ConcurrencyConflict):
            uow.runs.add_many([second, first])
        uow.runs.add_many([second])
        uow.commit()
    runs = [row["id"] for row in _pg_rows(pg_database_url, "pg-dup-")["runs"]]
    assert runs == ["run0", "run1"]


def test_on_postgres_its_admission_notifies_at_commit_and_answers_held_keys(
    pg_database_url: str,
) -> None:
    submit = PostgresSubmitStore(pg_database_url)
    identities = CountingIdentities("pg-notify")
    request = AdmissionRequest(task="t", unique_key="pg-order-1")
    with psycopg.connect(libpq_url(pg_database_url), autocommit=True) as listener:
        listener.execute("LISTEN ql3_dispatch")
        (first,) = admit_requests(submit.unit_of_work, identities, [request])
        assert [n.channel for n in listener.notifies(timeout=2.0, stop_after=1)] == [
            "ql3_dispatch"
        ]
        (again,) = admit_requests(submit.unit_of_work, identities, [request])
        assert (again.run_id, again.existing) == (first.run_id, True)
        assert list(listener.notifies(timeout=0.3)) == []
    store = PostgresStore.from_url(pg_database_url, pool_size=1)
    try:
        with store.unit_of_work() as uow:
            assert uow.runs.unfinished_with_keys(["pg-order-1"]) == {"pg-order-1": first.run_id}
    finally:
        store.close()
