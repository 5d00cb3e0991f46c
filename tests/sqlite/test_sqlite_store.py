"""What the SQLite store adds to the port contract (which tests/contract runs on it): its
database settings, its single-writer transactions across processes, its schema guard, its clock
and its wake channel."""

from __future__ import annotations

import select
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from adapters.sql.sqlite import SchemaMismatch, SqliteStore
from adapters.sql.sqlite.wake import WakeListener, poke
from application.admission import Admission
from application.identities import RandomIdentities


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    opened = SqliteStore(tmp_path / "ql3.sqlite")
    yield opened
    opened.close()


def _pragma(store: SqliteStore, name: str) -> object:
    with store.unit_of_work() as uow:
        return uow.connection.exec_driver_sql(f"PRAGMA {name}").scalar()


def test_the_database_uses_the_write_ahead_log_and_enforces_foreign_keys(
    store: SqliteStore,
) -> None:
    assert _pragma(store, "journal_mode") == "wal"
    assert _pragma(store, "foreign_keys") == 1
    assert _pragma(store, "busy_timeout") == 30_000


def test_every_at_most_one_rule_is_a_partial_unique_index(store: SqliteStore) -> None:
    with store.unit_of_work() as uow:
        found = dict(
            uow.connection.exec_driver_sql(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            ).all()
        )
    for name in (
        "uq_run_attempts_one_active_per_run",
        "uq_run_dispatch_leases_one_leased_per_run",
        "uq_worker_sessions_one_open_per_worker",
    ):
        assert "UNIQUE" in found[name] and "WHERE" in found[name], found[name]


def test_a_writer_waits_for_another_process_s_write_transaction(tmp_path: Path) -> None:
    path = tmp_path / "ql3.sqlite"
    SqliteStore(path).close()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    store = SqliteStore(path, busy_timeout_s=10)  # opening an existing database only reads
    admitted: list[str] = []

    def admit() -> None:
        admitted.append(Admission(store.unit_of_work, RandomIdentities()).submit("t"))

    writer = threading.Thread(target=admit)
    writer.start()
    time.sleep(0.3)
    assert admitted == []  # BEGIN IMMEDIATE waits for the lock instead of failing
    other.execute("ROLLBACK")
    writer.join(timeout=10)
    assert len(admitted) == 1
    other.close()
    store.close()


def test_another_schema_or_another_application_s_database_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.sqlite"
    connection = sqlite3.connect(foreign)
    connection.execute("CREATE TABLE notes (body TEXT)")
    connection.commit()
    connection.close()
    with pytest.raises(SchemaMismatch, match="not a QL3"):
        SqliteStore(foreign)

    newer = tmp_path / "newer.sqlite"
    SqliteStore(newer).close()
    connection = sqlite3.connect(newer)
    connection.execute("PRAGMA user_version = 99")
    connection.close()
    with pytest.raises(SchemaMismatch, match="schema version 99"):
        SqliteStore(newer)


def test_the_clock_is_the_host_s_plus_the_test_offset_and_never_goes_back(
    store: SqliteStore,
) -> None:
    before = store.now_ms()
    assert abs(before - time.time() * 1000) < 5_000
    store.testing_advance_clock(60_000)
    assert store.now_ms() >= before + 60_000
    readings = [store.now_ms() for _ in range(1_000)]
    assert readings == sorted(readings)


def test_a_committed_admission_pokes_the_wake_channel_and_a_rolled_back_one_does_not(
    store: SqliteStore,
) -> None:
    assert store.wake_path is not None
    assert poke(store.wake_path) is False  # nobody listens yet: nothing happens
    listener = WakeListener(store.wake_path)
    try:
        identities = RandomIdentities()
        with store.unit_of_work() as uow:
            from domain.transitions import admit

            uow.runs.add(
                admit(
                    run_id=identities.new_id(),
                    attempt_id=identities.new_id(),
                    task="t",
                    input=None,
                    policy=None,
                    now_ms=uow.now_ms(),
                )
            )
            # leaving without commit: rolled back, no poke
        assert select.select([listener], [], [], 0.1)[0] == []

        Admission(store.unit_of_work, identities).submit("t")
        assert select.select([listener], [], [], 1.0)[0] == [listener]
        assert listener.drain() == 1
        assert select.select([listener], [], [], 0.1)[0] == []  # no end-of-file spin
    finally:
        listener.close()


def test_skip_locked_never_skips_since_the_transaction_holds_the_whole_database(
    store: SqliteStore,
) -> None:
    Admission(store.unit_of_work, RandomIdentities()).submit("t")
    with store.unit_of_work() as uow:
        (run,) = uow.runs.list_runs(None, 10)
        (attempt,) = uow.runs.attempts_of(run.id)
        snapshot = uow.runs.lock_attempt(attempt.id, skip_locked=True)
    assert snapshot is not None and snapshot.attempt == attempt


def test_an_in_memory_store_refuses_a_nested_unit_of_work_in_one_thread() -> None:
    memory = SqliteStore(None)
    try:
        assert memory.wake_path is None
        with memory.unit_of_work(), pytest.raises(RuntimeError, match="already open"):
            memory.unit_of_work().__enter__()
        with memory.unit_of_work() as uow:  # and the lock was released
            assert uow.now_ms() > 0
    finally:
        memory.close()
