"""Fenced compare-and-set writes, lock order and atomicity of the PostgreSQL store, on a real
server: what the memory store can only simulate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from attrs import evolve
from sqlalchemy.exc import DBAPIError, OperationalError

from ql3.adapters.postgres.store import ADVISORY_LOCK_NAMESPACE, PostgresStore
from ql3.application.ports import Snapshot
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import (
    Attempt,
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunStatus,
    SessionStatus,
    StopReport,
)
from ql3.domain.policy import RetryPolicy, Safety
from ql3.domain.recovery import find_not_running_evidence, resolve_recovery
from ql3.domain.sessions import close
from ql3.domain.transitions import Change, admit, renew
from tests.postgres.pg_helpers import (
    admit_run,
    claim_attempt,
    close_session,
    dispatched,
    open_session,
    recover,
    settle,
)

WAIT_S = 10.0


def _plain_url(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


@pytest.fixture
def observer(pg_database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A separate autocommit connection that looks at pg_locks and holds raw locks."""
    with psycopg.connect(_plain_url(pg_database_url), autocommit=True) as connection:
        yield connection


def _eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _locks_of(
    observer: psycopg.Connection[tuple[object, ...]], pid: int
) -> list[tuple[object, ...]]:
    return observer.execute(
        "SELECT l.locktype, l.granted, coalesce(c.relname, ''), l.classid::bigint,"
        " l.objid::bigint, l.objsubid FROM pg_locks l"
        " LEFT JOIN pg_class c ON c.oid = l.relation WHERE l.pid = %s",
        (pid,),
    ).fetchall()


def _advisory_key(observer: psycopg.Connection[tuple[object, ...]], key: str) -> tuple[int, int]:
    row = observer.execute("SELECT hashtext(%s)::bigint & 4294967295", (key,)).fetchone()
    assert row is not None
    return ADVISORY_LOCK_NAMESPACE, int(str(row[0]))


def _backend_pid(uow: object) -> int:
    from sqlalchemy import text

    connection = uow.connection  # type: ignore[attr-defined]
    return int(connection.execute(text("SELECT pg_backend_pid()")).scalar_one())


class Contender(threading.Thread):
    """``lock_attempt`` in another transaction, on another connection, in a thread."""

    def __init__(self, store: PostgresStore, attempt_id: str) -> None:
        super().__init__(daemon=True)
        self.store = store
        self.attempt_id = attempt_id
        self.pid: int | None = None
        self.snapshot: Snapshot | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()

    def run(self) -> None:
        try:
            with self.store.unit_of_work() as uow:
                self.pid = _backend_pid(uow)
                self.ready.set()
                self.snapshot = uow.runs.lock_attempt(self.attempt_id)
        except BaseException as error:  # reported to the test thread
            self.error = error
            self.ready.set()


def _expired_attempt_of_a_closed_session(store: PostgresStore) -> None:
    """Attempt a1 of Run r1, started, its lease expired and its session closed: recovery loses
    it on the evidence of the closed session."""
    session = open_session(store, "s1", "w1")
    dispatched(store, "r1", "a1", session, ttl_ms=1_000)
    close_session(store, "s1")
    store.testing_advance_clock(5_000)


# --- lock order --------------------------------------------------------------------------------


def test_lock_attempt_waits_on_the_advisory_lock_before_touching_any_row(
    store: PostgresStore, observer: psycopg.Connection[tuple[object, ...]]
) -> None:
    _expired_attempt_of_a_closed_session(store)
    namespace, key = _advisory_key(observer, "a1")
    with store.unit_of_work() as holder:
        assert holder.runs.lock_attempt("a1") is not None
        contender = Contender(store, "a1")
        contender.start()
        assert contender.ready.wait(WAIT_S) and contender.pid is not None
        pid = contender.pid

        def waits_on_advisory() -> bool:
            return ("advisory", False, "", namespace, key, 2) in _locks_of(observer, pid)

        _eventually(waits_on_advisory, "the contender to wait on the advisory lock")
        locks = _locks_of(observer, pid)
        # No row lock yet: locking a row assigns a transaction id, and none is assigned.
        assert not [lock for lock in locks if lock[0] in ("transactionid", "tuple")]
        # The lock statement's plan holds only the weak relation locks every reader takes,
        # which block no row writer.
        modes = observer.execute(
            "SELECT DISTINCT l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
            " WHERE l.pid = %s AND c.relname IN ('runs', 'run_attempts', 'run_dispatch_leases')",
            (pid,),
        ).fetchall()
        assert {str(row[0]) for row in modes} <= {"AccessShareLock", "RowShareLock"}
    contender.join(WAIT_S)
    assert contender.error is None
    assert contender.snapshot is not None and contender.snapshot.attempt is not None
    assert contender.snapshot.attempt.id == "a1"


def test_lock_attempt_holds_the_advisory_lock_while_it_waits_for_the_row_locks(
    store: PostgresStore, observer: psycopg.Connection[tuple[object, ...]]
) -> None:
    _expired_attempt_of_a_closed_session(store)
    namespace, key = _advisory_key(observer, "a1")
    observer.execute("BEGIN")
    try:
        observer.execute("SELECT 1 FROM runs WHERE id = 'r1' FOR UPDATE")
        contender = Contender(store, "a1")
        contender.start()
        assert contender.ready.wait(WAIT_S) and contender.pid is not None
        pid = contender.pid

        def waits_on_row() -> bool:
            locks = _locks_of(observer, pid)
            return ("advisory", True, "", namespace, key, 2) in locks and any(
                lock[0] == "transactionid" and lock[1] is False for lock in locks
            )

        _eventually(waits_on_row, "the contender to hold the advisory lock and wait on a row")
    finally:
        observer.execute("ROLLBACK")
    contender.join(WAIT_S)
    assert contender.error is None and contender.snapshot is not None


def test_a_lock_timeout_on_the_advisory_lock_changes_nothing(
    store: PostgresStore, pg_database_url: str
) -> None:
    _expired_attempt_of_a_closed_session(store)
    impatient = PostgresStore.from_url(
        pg_database_url + "?options=-c%20lock_timeout%3D100", pool_size=1
    )
    try:
        with store.unit_of_work() as holder:
            assert holder.runs.lock_attempt("a1") is not None
            with pytest.raises(OperationalError), impatient.unit_of_work() as uow:
                uow.runs.lock_attempt("a1")
    finally:
        impatient.close()
    with store.unit_of_work() as uow:
        attempt = uow.runs.get_attempt("a1")
        assert attempt is not None and attempt.status is AttemptStatus.RUNNING


def test_server_options_of_the_url_and_generic_plans_both_apply(pg_database_url: str) -> None:
    from sqlalchemy import text

    tuned = PostgresStore.from_url(
        pg_database_url + "?options=-c%20lock_timeout%3D100", pool_size=1
    )
    try:
        with tuned.unit_of_work() as uow:
            shown = {
                name: uow.connection.execute(text(f"SHOW {name}")).scalar_one()
                for name in ("lock_timeout", "plan_cache_mode")
            }
    finally:
        tuned.close()
    assert shown == {"lock_timeout": "100ms", "plan_cache_mode": "force_generic_plan"}


def test_lock_run_locks_through_the_latest_attempt(store: PostgresStore) -> None:
    session = open_session(store, "s1", "w1")
    dispatched(store, "r1", "a1", session, ttl_ms=1_000)
    admit_run(store, "r2")
    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_run("r1")
        assert snapshot is not None and snapshot.attempt is not None
        assert snapshot.attempt.id == "a1"
        assert snapshot.lease is not None and snapshot.lease.generation == 1
        orphan = uow.runs.lock_run("r2")
        assert orphan is not None and orphan.attempt is None and orphan.lease is None
        assert uow.runs.lock_run("nope") is None
        assert uow.runs.lock_attempt("nope") is None


# --- atomicity ---------------------------------------------------------------------------------


def test_a_failure_after_the_lease_update_leaves_nothing_committed(
    store: PostgresStore, observer: psycopg.Connection[tuple[object, ...]]
) -> None:
    _expired_attempt_of_a_closed_session(store)
    with store.unit_of_work() as uow:
        before = uow.runs.lock_attempt("a1")
        events_before = uow.runs.events_of("r1")
    assert before is not None and before.lease is not None
    observer.execute(
        "CREATE FUNCTION ql3_test_fail() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN RAISE EXCEPTION 'injected failure'; END $$"
    )
    observer.execute(
        "CREATE TRIGGER ql3_test_fail BEFORE INSERT ON run_events"
        " FOR EACH ROW EXECUTE FUNCTION ql3_test_fail()"
    )
    try:
        with pytest.raises(DBAPIError, match="injected failure"), store.unit_of_work() as uow:
            snapshot = uow.runs.lock_attempt("a1")
            assert snapshot is not None
            change = _lost_change(uow, snapshot)
            assert change.lease is not None
            uow.runs.apply(snapshot, change)
            uow.commit()
    finally:
        observer.execute("DROP TRIGGER ql3_test_fail ON run_events")
        observer.execute("DROP FUNCTION ql3_test_fail()")
    with store.unit_of_work() as uow:
        after = uow.runs.lock_attempt("a1")
        assert after == before
        assert uow.runs.events_of("r1") == events_before
    # And without the failure the same resolution commits all of it together.
    assert recover(store, "a1")
    with store.unit_of_work() as uow:
        lost = uow.runs.lock_attempt("a1")
    assert lost is not None and lost.attempt is not None and lost.lease is not None
    assert lost.run.status is RunStatus.LOST
    assert lost.attempt.status is AttemptStatus.LOST
    assert lost.lease.status is LeaseStatus.RELEASED
    assert lost.lease.release_reason is ReleaseReason.LEASE_EXPIRED
    assert lost.lease.version == before.lease.version + 1
    assert lost.attempt.lease_version == lost.lease.version


# --- compare-and-set ---------------------------------------------------------------------------


def _snapshot(store: PostgresStore, attempt_id: str) -> Snapshot:
    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_attempt(attempt_id)
    assert snapshot is not None
    return snapshot


def _state(store: PostgresStore, run_id: str) -> tuple[object, ...]:
    with store.unit_of_work() as uow:
        return (
            uow.runs.get_run(run_id),
            uow.runs.attempts_of(run_id),
            uow.runs.leases_of(run_id),
            uow.runs.events_of(run_id),
        )


def _lost_change(uow: Any, snapshot: Snapshot) -> Change:
    """What recovery decides for ``snapshot`` on the evidence its closed session gives."""
    attempt = snapshot.attempt
    assert attempt is not None and attempt.session_id is not None
    session = uow.sessions.get(attempt.session_id)
    evidence = find_not_running_evidence(attempt, session, uow.evidence.reports_for(attempt.id))
    resolution = resolve_recovery(
        run=snapshot.run,
        attempt=attempt,
        lease=snapshot.lease,
        evidence=evidence,
        now_ms=uow.now_ms(),
    )
    assert resolution.change is not None
    return resolution.change


@pytest.mark.parametrize("stale", ["run", "attempt", "lease"])
def test_a_stale_before_matches_no_row_and_writes_nothing(store: PostgresStore, stale: str) -> None:
    _expired_attempt_of_a_closed_session(store)
    snapshot = _snapshot(store, "a1")
    assert snapshot.attempt is not None and snapshot.lease is not None
    if stale == "run":
        before = Snapshot(
            run=evolve(snapshot.run, status=RunStatus.QUEUED),
            attempt=snapshot.attempt,
            lease=snapshot.lease,
        )
    elif stale == "attempt":
        before = Snapshot(
            run=snapshot.run,
            attempt=evolve(snapshot.attempt, lease_version=7),
            lease=snapshot.lease,
        )
    else:
        before = Snapshot(
            run=snapshot.run,
            attempt=snapshot.attempt,
            lease=evolve(snapshot.lease, version=7),
        )
    state = _state(store, "r1")
    with store.unit_of_work() as uow:
        change = _lost_change(uow, snapshot)
        with pytest.raises(ConcurrencyConflict):
            uow.runs.apply(before, change)
        # The refused write left the transaction usable and wrote nothing of itself.
        assert uow.runs.get_run("r1") == snapshot.run
        uow.commit()
    assert _state(store, "r1") == state


def test_a_second_writer_with_the_same_before_loses(store: PostgresStore) -> None:
    _expired_attempt_of_a_closed_session(store)
    snapshot = _snapshot(store, "a1")
    with store.unit_of_work() as uow:
        uow.runs.apply(snapshot, _lost_change(uow, snapshot))
        uow.commit()
    state = _state(store, "r1")
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.runs.apply(snapshot, _lost_change(uow, snapshot))
    assert _state(store, "r1") == state


def test_lost_retry_goes_through_retry_wait_to_a_fresh_attempt(store: PostgresStore) -> None:
    from ql3.domain.retry import start_next_attempt

    policy = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)
    session = open_session(store, "s1", "w1")
    admit_run(store, "r1", "a1", policy=policy)
    claim_attempt(store, "a1", session, 1_000)
    close_session(store, "s1")
    store.testing_advance_clock(5_000)
    assert recover(store, "a1")
    assert [c.run_id for c in store.lost_runs(16).items] == ["r1"]
    settle(store, "r1")
    with store.unit_of_work() as uow:
        run = uow.runs.get_run("r1")
    assert run is not None and run.status is RunStatus.RETRY_WAIT
    assert run.next_attempt_at_ms is not None
    store.testing_advance_clock(10_000)
    due = store.due_retries(16)
    assert [(c.run_id, c.attempt_id) for c in due.items] == [("r1", "a1")]
    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_run("r1")
        assert snapshot is not None
        change = start_next_attempt(run=snapshot.run, attempt_id="a1-2", now_ms=uow.now_ms())
        uow.runs.apply(snapshot, change)
        uow.commit()
    with store.unit_of_work() as uow:
        attempts = uow.runs.attempts_of("r1")
        snapshot = uow.runs.lock_run("r1")
    assert [(a.id, a.number, a.status) for a in attempts] == [
        ("a1", 1, AttemptStatus.LOST),
        ("a1-2", 2, AttemptStatus.CLAIMED),
    ]
    assert attempts[1].is_pristine
    assert snapshot is not None and snapshot.attempt == attempts[1]
    assert snapshot.lease is not None and snapshot.lease.generation == 1  # latest, released
    open_session(store, "s2", "w2")
    with store.unit_of_work() as uow:
        lock = uow.runs.lock_for_claim("s2", ["mail"], 4)
    assert [(c.run.id, c.attempt.id if c.attempt else None) for c in lock.candidates] == [
        ("r1", "a1-2")
    ]
    assert [c.lease for c in lock.candidates] == [snapshot.lease]


# --- constraint violations are conflicts -------------------------------------------------------


def test_a_duplicate_run_is_a_conflict(store: PostgresStore) -> None:
    admit_run(store, "r1", "a1")
    with store.unit_of_work() as uow:
        change = admit(run_id="r1", attempt_id="a9", task="mail", input=None, policy=None, now_ms=1)
        with pytest.raises(ConcurrencyConflict):
            uow.runs.add(change)
        # The savepoint kept the transaction usable; nothing of the refused add remains.
        assert uow.runs.get_attempt("a9") is None


def test_a_second_non_terminal_attempt_is_a_conflict(store: PostgresStore) -> None:
    admit_run(store, "r1", "a1")
    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_run("r1")
        assert snapshot is not None and snapshot.attempt is not None
        second = evolve(snapshot.attempt, id="a2", number=2)
        change = Change(
            run=evolve(snapshot.run, attempt_count=2),
            attempts=(second,),
            lease=None,
            event=RunEvent(run_id="r1", attempt_id="a2", type=EventType.ATTEMPT_CREATED, at_ms=1),
        )
        with pytest.raises(ConcurrencyConflict):
            uow.runs.apply(Snapshot(run=snapshot.run, attempt=None, lease=None), change)
        run = uow.runs.get_run("r1")
    assert run is not None and run.attempt_count == 1


def test_a_second_leased_lease_is_a_conflict(store: PostgresStore) -> None:
    session = open_session(store, "s1", "w1")
    dispatched(store, "r1", "a1", session)
    snapshot = _snapshot(store, "a1")
    assert snapshot.lease is not None and snapshot.attempt is not None
    second = evolve(snapshot.lease, generation=2)
    change = Change(
        run=snapshot.run,
        attempts=(),
        lease=second,
        event=RunEvent(run_id="r1", attempt_id="a1", type=EventType.ATTEMPT_STARTED, at_ms=1),
    )
    state = _state(store, "r1")
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.runs.apply(snapshot, change)
    assert _state(store, "r1") == state


def test_a_check_violation_is_a_conflict(store: PostgresStore) -> None:
    session = open_session(store, "s1", "w1")
    dispatched(store, "r1", "a1", session)
    snapshot = _snapshot(store, "a1")
    assert snapshot.lease is not None
    # Released without a reason: refused by ck_run_dispatch_leases_release_reason_iff_released.
    released = evolve(snapshot.lease, status=LeaseStatus.RELEASED, version=2)
    change = Change(
        run=snapshot.run,
        attempts=(),
        lease=released,
        event=RunEvent(run_id="r1", attempt_id="a1", type=EventType.ATTEMPT_LOST, at_ms=1),
    )
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.runs.apply(snapshot, change)


def test_a_second_open_session_of_a_worker_is_a_conflict(store: PostgresStore) -> None:
    first = open_session(store, "s1", "w1")
    with store.unit_of_work() as uow:
        with pytest.raises(ConcurrencyConflict):
            uow.sessions.add(evolve(first, id="s2"))
        with pytest.raises(ConcurrencyConflict):
            uow.sessions.add(first)
        assert uow.sessions.get("s2") is None
    # Registering again replaces the open session (the domain's way to a second one).
    second = open_session(store, "s2", "w1")
    with store.unit_of_work() as uow:
        old = uow.sessions.get("s1")
        assert [s.id for s in uow.sessions.open_sessions_of("w1")] == [second.id]
    assert old is not None and old.status is SessionStatus.REPLACED


def test_a_session_update_is_a_compare_and_set_on_status(store: PostgresStore) -> None:
    session = open_session(store, "s1", "w1")
    closed = close(session, session.registered_at_ms + 1)
    with store.unit_of_work() as uow:
        uow.sessions.update(session, closed)
        uow.commit()
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.sessions.update(session, closed)


# --- renewals ----------------------------------------------------------------------------------


def test_a_renewal_moves_only_expiry_as_a_hot_update(store: PostgresStore) -> None:
    from sqlalchemy import text

    from ql3.domain.fence import LeaseFence
    from tests.postgres.pg_helpers import TOKEN

    session = open_session(store, "s1", "w1")
    dispatched(store, "r1", "a1", session, ttl_ms=30_000)
    events = _state(store, "r1")[3]
    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_attempt("a1")
        assert snapshot is not None and snapshot.attempt is not None
        assert snapshot.lease is not None
        fence = LeaseFence(
            attempt_id="a1", generation=1, version=snapshot.lease.version, token=TOKEN
        )
        renewed = renew(
            attempt=snapshot.attempt,
            lease=snapshot.lease,
            fence=fence,
            ttl_ms=90_000,
            now_ms=uow.now_ms(),
        )
        hot_updates = text(
            "SELECT pg_stat_get_xact_tuples_updated('run_dispatch_leases'::regclass),"
            " pg_stat_get_xact_tuples_hot_updated('run_dispatch_leases'::regclass)"
        )
        updated_before, hot_before = uow.connection.execute(hot_updates).one()
        uow.runs.renew_lease(snapshot.lease, renewed)
        updated_after, hot_after = uow.connection.execute(hot_updates).one()
        uow.commit()
    assert (updated_after - updated_before, hot_after - hot_before) == (1, 1)
    with store.unit_of_work() as uow:
        (lease,) = uow.runs.leases_of("r1")
    assert lease == renewed
    assert lease.version == snapshot.lease.version
    assert _state(store, "r1")[3] == events


def test_a_renewal_with_a_stale_fence_or_after_expiry_is_a_conflict(
    store: PostgresStore,
) -> None:
    session = open_session(store, "s1", "w1")
    dispatched(store, "r1", "a1", session, ttl_ms=1_000)
    lease = _snapshot(store, "a1").lease
    assert lease is not None
    later = evolve(lease, expires_at_ms=lease.expires_at_ms + 60_000)
    with store.unit_of_work() as uow:
        with pytest.raises(ConcurrencyConflict):
            uow.runs.renew_lease(evolve(lease, version=lease.version + 1), later)
        with pytest.raises(ConcurrencyConflict):
            uow.runs.renew_lease(evolve(lease, token_hash="other"), later)
        with pytest.raises(ConcurrencyConflict):
            uow.runs.renew_lease(evolve(lease, token_hash=None), later)
    store.testing_advance_clock(1_000)
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.runs.renew_lease(lease, later)
    assert _snapshot(store, "a1").lease == lease


# --- evidence ----------------------------------------------------------------------------------


def test_a_stop_report_from_before_the_start_is_no_evidence(store: PostgresStore) -> None:
    """Reported before the Attempt's current start (it was pristine, or handed back since):
    neither the page's order nor recovery counts it (ADR 0011)."""
    session = open_session(store, "s1", "w1")
    dispatched(store, "r1", "a1", session, ttl_ms=1_000)
    store.testing_advance_clock(5_000)
    with store.unit_of_work() as uow:
        started = uow.runs.get_attempt("a1")
        assert started is not None and started.started_at_ms is not None
        uow.evidence.record(
            StopReport(attempt_id="a1", kind=EvidenceKind.OPERATOR_ATTESTED,
                       reported_at_ms=started.started_at_ms - 1)
        )
        uow.commit()
    (candidate,) = store.recovery_candidates(16).items
    assert not candidate.resolvable
    assert not recover(store, "a1")


def test_stop_reports_make_a_started_candidate_resolvable(store: PostgresStore) -> None:
    session = open_session(store, "s1", "w1")
    dispatched(store, "r1", "a1", session, ttl_ms=1_000)
    store.testing_advance_clock(5_000)
    (candidate,) = store.recovery_candidates(16).items
    assert candidate.attempt_status is AttemptStatus.RUNNING and not candidate.resolvable
    assert not recover(store, "a1")  # fail closed without evidence
    with store.unit_of_work() as uow:
        started = uow.runs.get_attempt("a1")
        assert started is not None and started.started_at_ms is not None
        report = StopReport(attempt_id="a1", kind=EvidenceKind.OPERATOR_ATTESTED,
                            reported_at_ms=started.started_at_ms + 5_000)
        uow.evidence.record(report)
        uow.commit()
    with store.unit_of_work() as uow:
        assert uow.evidence.reports_for("a1") == (report,)
    (candidate,) = store.recovery_candidates(16).items
    assert candidate.resolvable
    assert recover(store, "a1")
    with store.unit_of_work() as uow:
        attempt: Attempt | None = uow.runs.get_attempt("a1")
    assert attempt is not None and attempt.lost_evidence is EvidenceKind.OPERATOR_ATTESTED
