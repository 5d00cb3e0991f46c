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
from sqlalchemy.exc import IntegrityError

from ql3.adapters.sql.sqlite import SchemaMismatch, SqliteStore
from ql3.adapters.sql.sqlite.wake import WakeListener, poke
from ql3.application.admission import Admission
from ql3.application.dispatch import DispatchGateStep
from ql3.application.identities import RandomIdentities
from ql3.application.ports import DispatchGate
from ql3.application.worker_commands import NoGrant, Release, WorkerCommands


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


def test_a_write_lock_not_had_in_time_is_sqlalchemy_s_operational_error(tmp_path: Path) -> None:
    """The driver's error at BEGIN is wrapped as on the Core path, and the connection is good
    for the next unit of work."""
    from sqlalchemy.exc import OperationalError

    path = tmp_path / "ql3.sqlite"
    SqliteStore(path).close()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    store = SqliteStore(path, busy_timeout_s=0.05)
    with pytest.raises(OperationalError, match="database is locked"), store.unit_of_work():
        pass
    other.execute("ROLLBACK")
    other.close()
    Admission(store.unit_of_work, RandomIdentities()).submit("t")
    store.close()


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
            from ql3.domain.transitions import admit

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


# --- the claim protocol (ADR 0007) -------------------------------------------------------------


def _commands(store: SqliteStore) -> WorkerCommands:
    return WorkerCommands(store.unit_of_work, RandomIdentities(), 60_000)


def test_a_commit_that_queues_a_run_again_pokes_and_a_claim_does_not(store: SqliteStore) -> None:
    assert store.wake_path is not None
    listener = WakeListener(store.wake_path)
    try:
        commands = _commands(store)
        Admission(store.unit_of_work, RandomIdentities()).submit("t")
        assert listener.drain() == 1
        session = commands.register("w1", 2, ["t"])
        (grant,) = commands.claim(session.session_id, session.secret, limit=2).grants
        assert select.select([listener], [], [], 0.1)[0] == []  # queued -> running: no work
        answer = commands.release_many(
            session.session_id, session.secret, [Release(fence=grant.fence, cause="draining")]
        )
        assert answer.results[0].ok
        assert select.select([listener], [], [], 1.0)[0] == [listener]
        assert listener.drain() == 1
        # A claim that hands back what the worker no longer holds queues it again, too.
        (again,) = commands.claim(session.session_id, session.secret, limit=1).grants
        assert again.run_id == grant.run_id and listener.drain() == 0
        answer2 = commands.claim(session.session_id, session.secret, limit=0, held=[])
        assert answer2.released == (again.attempt_id,)
        assert listener.drain() == 1
        # Any admission wakes, a Run admitted ``created`` (a workflow's aggregate) too.
        from ql3.domain.transitions import admit

        with store.unit_of_work() as uow:
            created = admit(
                run_id="c1", attempt_id=None, task="t", input=None, policy=None,
                now_ms=uow.now_ms(),
            )
            uow.runs.add(created)
            uow.commit()
        assert listener.drain() == 1
    finally:
        listener.close()


def test_claims_take_the_oldest_queued_first_and_respect_the_gate(store: SqliteStore) -> None:
    commands = _commands(store)
    admission = Admission(store.unit_of_work, RandomIdentities())
    first = admission.submit("t")
    store.testing_advance_clock(10)
    second = admission.submit("t")
    session = commands.register("w1", 1, ["t"])
    with store.unit_of_work() as uow:
        closed = DispatchGate(open=False, reason="lost_retry failed: boom", changed_at_ms=7)
        uow.gate.set(closed)
        uow.commit()
    assert store.dispatch_gate() == closed
    answer = commands.claim(session.session_id, session.secret, limit=1)
    assert (answer.grants, answer.no_grant, answer.detail) == (
        (),
        NoGrant.GATE_CLOSED,
        "lost_retry failed: boom",
    )
    assert DispatchGateStep(store.unit_of_work, store).run_once().opened == 1
    (grant,) = commands.claim(session.session_id, session.secret, limit=1).grants
    assert grant.run_id == first
    answer = commands.claim(session.session_id, session.secret, limit=1)
    assert answer.no_grant is NoGrant.NO_CAPACITY
    with store.unit_of_work() as uow:
        assert list(uow.sessions.held_by(session.session_id)) == [grant.attempt_id]
        lock = uow.runs.lock_for_claim(session.session_id, ["t"], 4)
    assert [c.run.id for c in lock.candidates] == [second]
    assert lock.in_flight_by_task == {"t": 1}
    assert lock.capacity is not None and lock.capacity.in_flight == 1


def test_a_claim_reads_each_part_of_its_candidates_from_its_own_index(
    store: SqliteStore,
) -> None:
    """However deep the queue, a claim reads the never-changed Attempts from
    ``ix_runs_claimable`` and the handed-back ones from ``ix_run_attempts_handed_back``: no
    part walks the whole queue of its task."""
    from ql3.adapters.sql.sqlite import fenced

    commands = _commands(store)
    admission = Admission(store.unit_of_work, RandomIdentities())
    oldest = admission.submit("t")
    for _ in range(30):
        admission.submit("t")
    session = commands.register("w1", 1, ["t"])
    (grant,) = commands.claim(session.session_id, session.secret, limit=1).grants
    assert grant.run_id == oldest
    commands.release_many(session.session_id, session.secret, [Release(fence=grant.fence)])
    with store.unit_of_work() as uow:
        plan = [
            str(row[3])
            for row in uow.connection.exec_driver_sql(
                "EXPLAIN QUERY PLAN " + fenced.claimable_sql(), {"task": "t", "limit": 1}
            )
        ]
        lock = uow.runs.lock_for_claim(session.session_id, ["t"], 1)
    assert any("USING INDEX ix_runs_claimable" in line for line in plan), plan
    assert any("USING INDEX ix_run_attempts_handed_back" in line for line in plan), plan
    assert not any(line.startswith("SCAN r") for line in plan), plan
    # The handed-back Attempt is the oldest: it comes first, with its released lease.
    (candidate,) = lock.candidates
    assert candidate.run.id == oldest and candidate.attempt is not None
    assert candidate.attempt.is_pristine
    assert candidate.lease is not None and candidate.lease.generation == 1
    (again,) = commands.claim(session.session_id, session.secret, limit=1).grants
    assert (again.run_id, again.generation) == (oldest, 2)


def test_a_refused_batch_leaves_nothing_and_the_transaction_usable(store: SqliteStore) -> None:
    """A batch one of whose items lost its race (its Attempt was claimed since it was read)
    is refused as a whole, by count of the rows its compare-and-set touched; the transaction
    goes on and commits what it writes next."""
    from ql3.domain.errors import ConcurrencyConflict
    from tests.contract.builders import (
        claim_attempt,
        given_queued,
        given_session,
        locked_attempt,
    )
    from tests.contract.test_run_repository import _claim_change

    given_session(store, "s1")
    given_session(store, "s2")
    first, second = given_queued(store, "r1"), given_queued(store, "r2")
    with store.unit_of_work() as uow:
        stale = locked_attempt(uow, second)
    with store.unit_of_work() as uow:
        claim_attempt(uow, second, "s2")
        uow.commit()
    with store.unit_of_work() as uow:
        fresh = locked_attempt(uow, first)
        writes = [
            (fresh, _claim_change(uow, fresh, "s1", "tokenr1")),
            (stale, _claim_change(uow, stale, "s1", "tokenr2")),
        ]
        with pytest.raises(ConcurrencyConflict, match="changed since it was read"):
            uow.runs.apply_many(writes)
        assert uow.runs.leases_of("r1") == ()  # the first item's writes were undone
        uow.runs.apply_many(writes[:1])
        uow.commit()
    with store.unit_of_work() as uow:
        assert [x.holder_session_id for x in uow.runs.leases_of("r1")] == ["s1"]
        assert [x.holder_session_id for x in uow.runs.leases_of("r2")] == ["s2"]


def test_a_missing_gate_row_reads_closed_and_is_written_anew(store: SqliteStore) -> None:
    with store.unit_of_work() as uow:
        uow.connection.exec_driver_sql("DELETE FROM dispatch_gate")
        uow.commit()
    assert not store.dispatch_gate().open
    assert DispatchGateStep(store.unit_of_work, store).run_once().opened == 1
    assert store.dispatch_gate().open


def test_a_database_of_a_version_before_the_baseline_is_refused_and_left_alone(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.sqlite"
    SqliteStore(path).close()
    for version in range(1, 5):  # the versions before the baseline
        connection = sqlite3.connect(path)
        connection.execute(f"PRAGMA user_version = {version}")
        connection.close()
        with pytest.raises(SchemaMismatch, match=f"schema version {version}, this store needs"):
            SqliteStore(path)
        connection = sqlite3.connect(path)
        assert connection.execute("PRAGMA user_version").fetchone() == (version,)
        connection.close()


SET_STATUS = "UPDATE runs SET status = ? WHERE id = ?"


def test_one_of_checks_are_equalities_on_sqlite_and_refuse_other_values(
    store: SqliteStore,
) -> None:
    with store.unit_of_work() as uow:
        ddl = uow.connection.exec_driver_sql(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'runs'"
        ).scalar_one()
    assert "status = 'queued' OR status = 'dispatching'" in ddl
    assert " IN (" not in ddl
    run_id = Admission(store.unit_of_work, RandomIdentities()).submit("t")
    with store.unit_of_work() as uow, pytest.raises(IntegrityError):
        uow.connection.exec_driver_sql(SET_STATUS, ("nonsense", run_id))
    with store.unit_of_work() as uow:  # a declared status passes
        uow.connection.exec_driver_sql(SET_STATUS, ("failed", run_id))
