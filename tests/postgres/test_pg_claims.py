"""The claim protocol (ADR 0007) on a real PostgreSQL server: concurrent claims, the dispatch
gate, the dispatch wake-ups, and what a claim costs in statements."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.sql
import pytest
from sqlalchemy import event

from ql3.adapters.postgres.store import DISPATCH_CHANNEL, PostgresStore, PostgresUnitOfWork
from ql3.application.admission import Admission
from ql3.application.dispatch import DispatchGateStep
from ql3.application.identities import RandomIdentities
from ql3.application.ports import DispatchGate
from ql3.application.worker_commands import (
    ClaimAnswer,
    Completion,
    Grant,
    NoGrant,
    Release,
    SessionGrant,
    WorkerCommands,
)
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from ql3.domain.transitions import admit, create_first_attempt

TTL_MS = 60_000
TASK = "t"
WAIT_S = 30.0


def _plain_url(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


@pytest.fixture
def commands(store: PostgresStore) -> WorkerCommands:
    return WorkerCommands(store.unit_of_work, RandomIdentities(), TTL_MS)


def _admit(store: PostgresStore, count: int, task: str = TASK) -> list[str]:
    return Admission(store.unit_of_work, RandomIdentities()).submit_many(
        [_request(task) for _ in range(count)]
    )


def _request(task: str) -> Any:
    from ql3.application.admission import AdmissionRequest

    return AdmissionRequest(task=task, input={"task": task})


def _completions(grants: tuple[Grant, ...]) -> list[Completion]:
    return [Completion(fence=g.fence, succeeded=True, output={"ok": g.run_id}) for g in grants]


def _leased_of(store: PostgresStore, session_id: str) -> list[str]:
    with store.unit_of_work() as uow:
        return list(uow.sessions.held_by(session_id))


# --- concurrency -------------------------------------------------------------------------------


class Claimer(threading.Thread):
    """One worker's loop: claim up to its capacity, complete everything in its next claim, until
    a claim finds nothing queued."""

    def __init__(self, commands: WorkerCommands, session: SessionGrant, capacity: int) -> None:
        super().__init__(daemon=True)
        self.commands = commands
        self.session = session
        self.capacity = capacity
        self.granted: list[str] = []
        self.answers: list[ClaimAnswer] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            held: tuple[Grant, ...] = ()
            while True:
                answer = self.commands.claim(
                    self.session.session_id,
                    self.session.secret,
                    limit=self.capacity,
                    completions=_completions(held),
                )
                self.answers.append(answer)
                assert all(result.ok for result in answer.completed), answer.completed
                self.granted.extend(g.attempt_id for g in answer.grants)
                held = answer.grants
                if not held and answer.no_grant is NoGrant.NOTHING_QUEUED:
                    return
        except BaseException as error:  # reported to the test thread
            self.error = error


def test_concurrent_claims_of_two_sessions_never_share_an_attempt_or_exceed_capacity(
    store: PostgresStore, commands: WorkerCommands
) -> None:
    run_ids = _admit(store, 60)
    capacity = 4
    claimers = [
        Claimer(commands, commands.register(f"w{n}", capacity, [TASK]), capacity) for n in (1, 2)
    ]
    for claimer in claimers:
        claimer.start()
    for claimer in claimers:
        claimer.join(WAIT_S)
        assert not claimer.is_alive() and claimer.error is None, claimer.error
    first, second = (set(c.granted) for c in claimers)
    assert len(first) == len(claimers[0].granted) and len(second) == len(claimers[1].granted)
    assert not first & second
    assert len(first | second) == len(run_ids)
    for claimer in claimers:
        assert all(len(answer.grants) <= capacity for answer in claimer.answers)
    with store.unit_of_work() as uow:
        for run_id in run_ids:
            run = uow.runs.get_run(run_id)
            assert run is not None and run.status is RunStatus.SUCCEEDED
            (lease,) = uow.runs.leases_of(run_id)  # claimed exactly once
            assert lease.release_reason is ReleaseReason.COMPLETED


def test_concurrent_claims_of_one_session_count_its_capacity_one_after_the_other(
    store: PostgresStore, commands: WorkerCommands
) -> None:
    """Each round, two claims of one session start together; the second waits for the first's
    session lock and must then see the leases the first committed."""
    capacity = 3
    _admit(store, 2 * capacity * 12)
    session = commands.register("w1", capacity, [TASK])
    barrier = threading.Barrier(2)
    answers: list[ClaimAnswer] = []
    errors: list[BaseException] = []

    def claim() -> None:
        try:
            barrier.wait(WAIT_S)
            answers.append(commands.claim(session.session_id, session.secret, limit=capacity))
        except BaseException as error:  # reported to the test thread
            errors.append(error)

    for _ in range(12):
        answers.clear()
        threads = [threading.Thread(target=claim, daemon=True) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
        assert not errors, errors
        granted = [g for answer in answers for g in answer.grants]
        assert len(granted) == capacity  # together exactly the capacity, never more
        assert len(_leased_of(store, session.session_id)) == capacity
        assert {a.no_grant for a in answers if not a.grants} <= {NoGrant.NO_CAPACITY}
        done = commands.complete_many(session.session_id, session.secret, _completions(granted))
        assert all(result.ok for result in done.results)


def test_a_claim_skips_attempts_another_transaction_holds(
    store: PostgresStore, commands: WorkerCommands
) -> None:
    first, second = sorted(_admit(store, 2))  # admitted together: queued in id order
    session = commands.register("w1", 4, [TASK])
    other = commands.register("w2", 4, [TASK])
    with store.unit_of_work() as holder:
        lock = holder.runs.lock_for_claim(other.session_id, [TASK], 1)
        assert [c.run.id for c in lock.candidates] == [first]
        answer = commands.claim(session.session_id, session.secret, limit=4)
        assert [g.run_id for g in answer.grants] == [second]
    answer = commands.claim(session.session_id, session.secret, limit=4)
    assert [g.run_id for g in answer.grants] == [first]


# --- the dispatch gate -------------------------------------------------------------------------


def test_a_closed_gate_grants_nothing_locks_nothing_and_says_why(
    store: PostgresStore, commands: WorkerCommands, pg_database_url: str
) -> None:
    (run_id,) = _admit(store, 1)
    session = commands.register("w1", 4, [TASK])
    reason = "runtime_recovery failed: the server went away"
    with store.unit_of_work() as uow:
        closed = DispatchGate(open=False, reason=reason, changed_at_ms=uow.now_ms())
        uow.gate.set(closed)
        uow.commit()
    assert store.dispatch_gate() == closed

    answer = commands.claim(session.session_id, session.secret, limit=4)
    assert (answer.grants, answer.no_grant, answer.detail) == ((), NoGrant.GATE_CLOSED, reason)
    with store.unit_of_work() as uow:
        lock = uow.runs.lock_for_claim(session.session_id, [TASK], 4)
        assert lock.gate == closed and lock.candidates == () and lock.in_flight_by_task == {}
        assert lock.capacity is not None and lock.capacity.in_flight == 0
        # No row of the queued Run was locked: another connection takes its lock at once.
        with psycopg.connect(_plain_url(pg_database_url), autocommit=True) as other:
            other.execute("SET lock_timeout = '1s'")
            with other.transaction():
                other.execute("SELECT 1 FROM runs WHERE id = %s FOR UPDATE NOWAIT", (run_id,))
        run = uow.runs.get_run(run_id)
    assert run is not None and run.status is RunStatus.QUEUED

    report = DispatchGateStep(store.unit_of_work, store).run_once()
    assert report.opened == 1
    assert store.dispatch_gate().open
    assert DispatchGateStep(store.unit_of_work, store).run_once().opened == 0
    answer = commands.claim(session.session_id, session.secret, limit=4)
    assert [g.run_id for g in answer.grants] == [run_id] and answer.no_grant is None


def test_a_missing_gate_row_reads_closed_and_is_written_anew(
    store: PostgresStore, pg_database_url: str
) -> None:
    with psycopg.connect(_plain_url(pg_database_url), autocommit=True) as other:
        other.execute("DELETE FROM dispatch_gate")
    gate = store.dispatch_gate()
    assert not gate.open and gate.reason is not None
    assert DispatchGateStep(store.unit_of_work, store).run_once().opened == 1
    assert store.dispatch_gate().open


# --- wake-ups ----------------------------------------------------------------------------------


@pytest.fixture
def listener(pg_database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(_plain_url(pg_database_url), autocommit=True) as connection:
        connection.execute(f"LISTEN {DISPATCH_CHANNEL}")
        yield connection


def _heard(listener: psycopg.Connection[Any], timeout: float) -> list[str]:
    return [n.channel for n in listener.notifies(timeout=timeout, stop_after=1)]


def test_commits_that_queue_a_run_notify_the_dispatch_channel(
    store: PostgresStore, commands: WorkerCommands, listener: psycopg.Connection[Any]
) -> None:
    with store.unit_of_work() as uow:
        uow.runs.add(
            admit(run_id="r0", attempt_id="a0", task=TASK, input=None, policy=None, now_ms=1)
        )
        # rolled back: nothing is delivered
    assert _heard(listener, 0.5) == []

    (run_id,) = _admit(store, 1)
    assert _heard(listener, 5.0) == [DISPATCH_CHANNEL]

    session = commands.register("w1", 4, [TASK])
    (grant,) = commands.claim(session.session_id, session.secret, limit=1).grants
    assert grant.run_id == run_id
    assert _heard(listener, 0.5) == []  # queued -> running gives claims nothing new

    released = commands.release_many(
        session.session_id, session.secret, [Release(fence=grant.fence, cause="draining")]
    )
    assert [r.ok for r in released.results] == [True]
    assert _heard(listener, 5.0) == [DISPATCH_CHANNEL]
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        (lease,) = uow.runs.leases_of(run_id)
    assert run is not None and run.status is RunStatus.QUEUED
    assert lease.release_reason is ReleaseReason.HANDED_BACK

    # One Change through `apply` (a first Attempt, as startup recovery makes it) notifies too;
    # a created Run admitted without one does not.
    with store.unit_of_work() as uow:
        uow.runs.add(
            admit(run_id="r9", attempt_id=None, task=TASK, input=None, policy=None, now_ms=1)
        )
        uow.commit()
    assert _heard(listener, 0.5) == []
    with store.unit_of_work() as uow:
        before = uow.runs.lock_run("r9")
        assert before is not None
        uow.runs.apply(before, create_first_attempt(before.run, "a9", uow.now_ms()))
        uow.commit()
    assert _heard(listener, 5.0) == [DISPATCH_CHANNEL]


def test_the_gate_opening_wakes_parked_claims_and_its_closing_does_not(
    store: PostgresStore, listener: psycopg.Connection[Any]
) -> None:
    """Claims park while the gate is closed (they wait for work); the commit of the cycle that
    opens it notifies the dispatch channel, so they claim again at once."""
    with store.unit_of_work() as uow:
        closed = DispatchGate(open=False, reason="lost_retry failed", changed_at_ms=uow.now_ms())
        uow.gate.set(closed)
        uow.commit()
    assert _heard(listener, 0.5) == []
    with store.unit_of_work() as uow:
        assert uow.gate.open(None, uow.now_ms())
        # rolled back: nothing is delivered
    assert _heard(listener, 0.5) == []
    assert DispatchGateStep(store.unit_of_work, store).run_once().opened == 1
    assert _heard(listener, 5.0) == [DISPATCH_CHANNEL]
    assert DispatchGateStep(store.unit_of_work, store).run_once().opened == 0  # open already
    assert _heard(listener, 0.5) == []


def _generic_plan_rows(store: PostgresStore, sql: str, params: dict[str, Any]) -> Any:
    """The executed generic plan of ``sql`` (as the store's connections run a prepared
    statement: ``plan_cache_mode = force_generic_plan``), in a transaction rolled back after."""
    names: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", placeholder, sql)
    with psycopg.connect(_plain_url(store.engine.url.render_as_string(False))) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.execute(psycopg.sql.SQL("PREPARE ql3_plan AS {}").format(psycopg.sql.SQL(prepared)))
        arguments = psycopg.sql.SQL(", ").join(psycopg.sql.Literal(params[n]) for n in names)
        explain = psycopg.sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE ql3_plan({})")
        row = conn.execute(explain.format(arguments)).fetchone()
        conn.rollback()
    assert row is not None
    return row[0][0]["Plan"]


def _rows_read_from(plan: dict[str, Any], index: str) -> int:
    found = 0
    pending = [plan]
    while pending:
        node = pending.pop()
        if node.get("Index Name") == index:
            found += int(node["Actual Rows"]) * int(node["Actual Loops"])
        pending.extend(node.get("Plans", ()))
    return found


def test_a_claim_reads_no_more_of_the_queue_than_it_takes(
    store: PostgresStore, commands: WorkerCommands
) -> None:
    from ql3.adapters.postgres import fenced

    _admit(store, 60)
    session = commands.register("w1", 8, [TASK])
    plan = _generic_plan_rows(
        store, fenced.claim_sql(), fenced.claim_params(session.session_id, [TASK], 8, 0)
    )
    # Eight from the index of claimable Runs for the never-changed part, and none for the
    # handed-back part while no Attempt is handed back: it used to read the whole queue there.
    assert _rows_read_from(plan, "ix_runs_claimable") == 8


# --- what a claim costs ------------------------------------------------------------------------


class StatementLog:
    """Every statement a store's units of work send: SQLAlchemy's, and the hot paths' by label
    (a pipelined call is one round trip)."""

    def __init__(self, store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.core: list[str] = []
        self.hot: list[tuple[str, int]] = []
        pipelined = PostgresUnitOfWork.execute_pipelined

        def logged(uow: PostgresUnitOfWork, statements: Any, label: str) -> Any:
            self.hot.append((label, len(statements)))
            return pipelined(uow, statements, label)

        monkeypatch.setattr(PostgresUnitOfWork, "execute_pipelined", logged)
        event.listen(store.engine, "before_cursor_execute", self._core)
        self._store = store

    def _core(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.core.append(statement)

    def clear(self) -> None:
        self.core.clear()
        self.hot.clear()

    def close(self) -> None:
        event.remove(self._store.engine, "before_cursor_execute", self._core)


@pytest.fixture
def log(store: PostgresStore, monkeypatch: pytest.MonkeyPatch) -> Iterator[StatementLog]:
    statements = StatementLog(store, monkeypatch)
    try:
        yield statements
    finally:
        statements.close()


def test_a_claim_with_completions_and_grants_is_four_round_trips_and_one_write(
    store: PostgresStore, commands: WorkerCommands, log: StatementLog
) -> None:
    _admit(store, 16)
    session = commands.register("w1", 8, [TASK])
    first = commands.claim(session.session_id, session.secret, limit=8)
    assert len(first.grants) == 8
    log.clear()
    answer = commands.claim(
        session.session_id,
        session.secret,
        limit=8,
        completions=_completions(first.grants),
        held=[g.attempt_id for g in first.grants],
    )
    assert [r.ok for r in answer.completed] == [True] * 8 and len(answer.grants) == 8
    assert answer.released == ()
    # One statement each: the session with the clock and its leased Attempts (authentication,
    # and what the ``held`` statement is checked against), the completed Attempts' locks, the
    # claim's locks (two statements in one round trip), and every write together (behind the
    # setting that keeps its plan on the keys' indexes, in the same round trip).
    assert log.core == []
    assert log.hot == [
        ("get session", 1),
        ("lock attempts", 1),
        ("lock for claim", 2),
        ("apply changes", 2),
    ]
    with store.unit_of_work() as uow:
        for grant in first.grants:
            attempt = uow.runs.get_attempt(grant.attempt_id)
            assert attempt is not None and attempt.status is AttemptStatus.SUCCEEDED
        for grant in answer.grants:
            attempt = uow.runs.get_attempt(grant.attempt_id)
            assert attempt is not None and attempt.status is AttemptStatus.RUNNING
            assert attempt.session_id == session.session_id
        assert len(uow.sessions.held_by(session.session_id)) == 8


def test_a_claim_alone_reads_the_clock_with_the_session(
    store: PostgresStore, commands: WorkerCommands, log: StatementLog
) -> None:
    _admit(store, 2)
    session = commands.register("w1", 8, [TASK])
    store.testing_advance_clock(1_000)
    log.clear()
    answer = commands.claim(session.session_id, session.secret, limit=8)
    assert len(answer.grants) == 2
    assert log.core == []
    assert log.hot == [("get session", 1), ("lock for claim", 2), ("apply changes", 2)]
    with store.unit_of_work() as uow:
        now = uow.now_ms()
        (lease,) = uow.runs.leases_of(answer.grants[0].run_id)
    # The answer's clock is the store's, test offset included, read before the grants.
    assert session.registered_at_ms + 1_000 <= answer.now_ms <= lease.granted_at_ms <= now
    assert answer.grants[0].expires_at_ms == lease.granted_at_ms + TTL_MS


def test_an_admitted_batch_is_one_statement(store: PostgresStore, log: StatementLog) -> None:
    with store.unit_of_work() as uow:
        now = uow.now_ms()
        changes = [
            admit(
                run_id=f"r{n}",
                attempt_id=f"a{n}",
                task=TASK,
                input={"n": n},
                policy=None,
                now_ms=now,
            )
            for n in range(10)
        ]
        changes.append(
            admit(
                run_id="r-created", attempt_id=None, task=TASK, input=None, policy=None, now_ms=now
            )
        )
        log.clear()
        uow.runs.add_many(changes)
        # The statement, with the savepoint and its release in the same round trip.
        assert log.hot == [("add runs", 3)]
        uow.commit()
    with store.unit_of_work() as uow:
        for change in changes:
            assert uow.runs.get_run(change.run.id) == change.run
            assert tuple(uow.runs.attempts_of(change.run.id)) == change.attempts
            (stored,) = uow.runs.events_of(change.run.id)
            assert stored.event == change.event
        sequences = [uow.runs.events_of(c.run.id)[0].sequence for c in changes]
    assert sequences == sorted(sequences)  # appended in the order of the batch


def test_a_refused_batch_admits_nothing_and_leaves_the_transaction_usable(
    store: PostgresStore,
) -> None:
    with store.unit_of_work() as uow:
        uow.runs.add(
            admit(run_id="r1", attempt_id="a1", task=TASK, input=None, policy=None, now_ms=1)
        )
        uow.commit()
    with store.unit_of_work() as uow:
        batch = [
            admit(run_id="r2", attempt_id="a2", task=TASK, input=None, policy=None, now_ms=2),
            admit(run_id="r1", attempt_id="a9", task=TASK, input=None, policy=None, now_ms=2),
        ]
        with pytest.raises(ConcurrencyConflict):
            uow.runs.add_many(batch)
        assert uow.runs.get_run("r2") is None and uow.runs.get_attempt("a9") is None
        uow.runs.add_many(batch[:1])
        uow.commit()
    with store.unit_of_work() as uow:
        assert [r.id for r in uow.runs.list_runs(None, 10)] == ["r1", "r2"]


def test_held_by_lists_the_session_s_leased_attempts_in_id_order(
    store: PostgresStore, commands: WorkerCommands
) -> None:
    _admit(store, 3)
    session = commands.register("w1", 4, [TASK])
    other = commands.register("w2", 4, [TASK])
    grants = commands.claim(session.session_id, session.secret, limit=2).grants
    commands.claim(other.session_id, other.secret, limit=1)
    assert _leased_of(store, session.session_id) == sorted(g.attempt_id for g in grants)
    done = commands.complete_many(session.session_id, session.secret, _completions(grants[:1]))
    assert done.results[0].ok
    assert _leased_of(store, session.session_id) == [grants[1].attempt_id]
    assert _leased_of(store, "nobody") == []
    with store.unit_of_work() as uow:
        lock = uow.runs.lock_for_claim("nobody", [TASK], 4)
        (lease,) = [
            lease
            for lease in uow.runs.leases_of(grants[1].run_id)
            if lease.status is LeaseStatus.LEASED
        ]
    assert lock.capacity is None and lock.candidates == () and lock.gate.open
    assert lease.holder_session_id == session.session_id
