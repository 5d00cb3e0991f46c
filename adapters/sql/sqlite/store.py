"""The Standalone and Edge store: every port of :mod:`application.ports` on an embedded SQLite
database, on the same SQLAlchemy Core tables as the PostgreSQL store.

Transactions
    A :class:`SqliteUnitOfWork` is one connection in one ``BEGIN IMMEDIATE`` transaction: it takes
    the database's single write lock when it begins, so writers are serial (the strongest
    isolation there is) and a transaction's reads are never stale. Other processes wait for the
    lock up to ``busy_timeout_s``. Candidate pages are read in a deferred (read-only) transaction,
    which the write-ahead log lets run beside a writer.
Locks
    ``lock_attempt`` and ``lock_run`` read under the transaction's database lock; there are no
    row or advisory locks to take. ``skip_locked`` has no meaning here and is ignored: no other
    transaction can hold a candidate while this one runs.
Writes
    Every write is a compare-and-set; a write that matches no row, and every unique, check or
    foreign-key violation (foreign keys are enforced), is raised as
    :class:`~domain.errors.ConcurrencyConflict`. A multi-row write runs under a savepoint, so a
    refused write leaves nothing behind and the transaction usable.
Time
    The store's clock is this host's clock, read by the store (never by the domain), never going
    backwards within one store; all processes sharing the database file share the host's clock.
Wake-ups
    A committed admission pokes the database's wake channel (:mod:`adapters.sql.sqlite.wake`), so
    an idle executing process starts at once without polling.

``SqliteStore(None)`` (or ``":memory:"``) is a private in-memory database on one connection,
whose transactions are serialised by a lock: for tests and throw-away containers.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy import BigInteger, ColumnElement, Connection, Engine, create_engine, event, literal
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql import Executable

from adapters.batches import OneAtATime
from adapters.sql import rows, statements
from adapters.sql.capacity import SqlCapacityLocks, in_flight_by_task
from adapters.sql.repositories import (
    SqlEvidenceRepository,
    SqlRunRepository,
    SqlSessionRegistry,
    check_page_limit,
)
from adapters.sql.schema import metadata
from adapters.sql.sqlite import queries
from adapters.sql.sqlite.wake import poke, wake_path_for
from adapters.sql.statements import ATTEMPT_COLUMNS, RUN_COLUMNS
from adapters.sql.transaction import ConnectionTransaction
from adapters.sql.triggers import SqlTriggerRepository, due_triggers_query
from adapters.sql.workflows import SqlWorkflowRepository, workflow_candidates_query
from application.ports import (
    DueTrigger,
    EvidenceRepository,
    Page,
    QueuedAttempt,
    RecoveryCandidate,
    RunCandidate,
    RunRepository,
    SessionCapacity,
    SessionCapacityLocks,
    Snapshot,
    TriggerRepository,
    WorkerSessionRegistry,
    WorkflowRepository,
)
from domain.errors import ConcurrencyConflict
from domain.model import (
    Attempt,
    AttemptStatus,
    DispatchLease,
)
from domain.transitions import Change
from domain.triggers import Trigger

if TYPE_CHECKING:
    from application.ports import SchedulerStore, SchedulerUnitOfWork

__all__ = ["SCHEMA_VERSION", "SchemaMismatch", "SqliteStore", "SqliteUnitOfWork"]

# PRAGMA user_version of a database this store created; another value is refused.
SCHEMA_VERSION = 1
MEMORY = ":memory:"
BEGIN_OPTION = "ql3_sqlite_begin"


class SchemaMismatch(RuntimeError):
    """The database file was made by another schema version (or is not a QL3 database)."""


def _install_hooks(engine: Engine, *, busy_timeout_ms: int, synchronous: str, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # The driver must not open transactions by itself: the "begin" hook below does.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if wal:
                cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute(f"PRAGMA synchronous = {synchronous}")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def on_begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get(BEGIN_OPTION, "IMMEDIATE")
        connection.exec_driver_sql(f"BEGIN {mode}")


# --- unit of work ------------------------------------------------------------------------------


class SqliteUnitOfWork(ConnectionTransaction):
    """One connection, one ``BEGIN IMMEDIATE`` transaction. Rolls back unless committed."""

    def __init__(self, store: SqliteStore) -> None:
        self._store = store
        self._connection: Connection | None = None
        self._release: Callable[[], None] | None = None
        self._admitted = False
        self.runs: RunRepository = SqliteRunRepository(self)
        self.sessions: WorkerSessionRegistry = SqliteSessionRegistry(self)
        self.evidence: EvidenceRepository = SqlEvidenceRepository(self)
        self.triggers: TriggerRepository = SqliteTriggerRepository(self)
        self.workflows: WorkflowRepository = SqlWorkflowRepository(self)
        # Under the transaction's database lock, as every read here.
        self.capacity: SessionCapacityLocks = SqlCapacityLocks(self)

    def __enter__(self) -> SqliteUnitOfWork:
        if self._connection is not None:
            raise RuntimeError("this unit of work is already in use")
        connection, release = self._store._open_connection()
        try:
            connection.begin()
        except BaseException:
            connection.close()
            release()
            raise
        self._connection, self._release = connection, release
        self._admitted = False
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        connection, self._connection = self._connection, None
        release, self._release = self._release, None
        if connection is None:
            return
        try:
            connection.rollback()
        finally:
            connection.close()
            if release is not None:
                release()

    def now_ms(self) -> int:
        if self._connection is None:
            raise RuntimeError("use the unit of work inside its `with` block")
        return self._store.now_ms()

    def commit(self) -> None:
        self.connection.commit()
        if self._admitted:
            self._admitted = False
            self._store.announce_work()

    def note_admission(self) -> None:
        """This transaction admitted work (or changed when work becomes due): its commit wakes
        the executing process."""
        self._admitted = True


# --- repositories ------------------------------------------------------------------------------


class SqliteRunRepository(OneAtATime, SqlRunRepository[SqliteUnitOfWork]):
    queries = queries

    def add(self, change: Change) -> None:
        super().add(change)
        self._uow.note_admission()

    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None:
        # The transaction already holds the database's write lock: nothing else to take, and
        # nobody else can hold this candidate, so ``skip_locked`` never skips.
        row = self._uow.execute(queries.attempt_with_run(attempt_id)).mappings().first()
        if row is None:
            return None
        run = rows.run_from_row(row, RUN_COLUMNS)
        attempt = rows.attempt_from_row(row, ATTEMPT_COLUMNS)
        return Snapshot(run=run, attempt=attempt, lease=self._lease(run.id, attempt))

    def lock_run(self, run_id: str) -> Snapshot | None:
        found = self._uow.execute(statements.latest_attempt_of(run_id)).first()
        if found is None:
            return None
        attempt_id = found[1]
        if attempt_id is None:
            run = self.get_run(run_id)
            if run is None:
                return None
            return Snapshot(run=run, attempt=None, lease=self._lease(run_id, None))
        return self.lock_attempt(str(attempt_id))

    def _lease(self, run_id: str, attempt: Attempt | None) -> DispatchLease | None:
        generation = attempt.lease_generation if attempt is not None else None
        row = self._uow.execute(queries.lease_of(run_id, generation)).mappings().first()
        return rows.lease_from_row(row) if row is not None else None

    def apply(self, before: Snapshot, change: Change) -> None:
        if change.run.id != before.run.id:
            raise ValueError(f"change of run {change.run.id} applied to run {before.run.id}")
        self._uow.atomically(lambda: self._apply(before, change))

    def _apply(self, before: Snapshot, change: Change) -> None:
        uow = self._uow
        if change.run != before.run:
            uow.compare_and_set(
                statements.update_run(before.run, change.run), f"run {before.run.id}"
            )
        for attempt in change.attempts:
            what = f"attempt {attempt.id}"
            if before.attempt is not None and attempt.id == before.attempt.id:
                uow.compare_and_set(statements.update_attempt(before.attempt, attempt), what)
            else:
                uow.write(statements.insert_attempt(attempt), what)
        lease = change.lease
        if lease is not None:
            what = f"lease {lease.run_id}/{lease.generation}"
            old = before.lease
            if old is not None and (old.run_id, old.generation) == (lease.run_id, lease.generation):
                if lease != old:
                    uow.compare_and_set(statements.update_lease(old, lease), what)
            else:
                uow.write(statements.insert_lease(lease), what)
        uow.write(statements.insert_event(change.event), f"event of run {change.run.id}")

    def renew_lease(self, before: DispatchLease, after: DispatchLease) -> None:
        if (after.run_id, after.generation) != (before.run_id, before.generation):
            raise ValueError("a renewal must name the same lease before and after")
        statement = queries.renew_lease(before, after, self._uow.now_ms())
        what = f"lease {before.run_id}/{before.generation}"
        if self._uow.write(statement, what) != 1:
            raise ConcurrencyConflict(f"{what} is no longer the live lease presented")


class SqliteSessionRegistry(SqlSessionRegistry[SqliteUnitOfWork]):
    queries = queries


class SqliteTriggerRepository(SqlTriggerRepository):
    """The shared trigger repository; adding or changing a trigger wakes the executing process,
    which may have to sleep until a different time now."""

    def __init__(self, uow: SqliteUnitOfWork) -> None:
        super().__init__(uow)
        self._uow = uow

    def add(self, trigger: Trigger) -> None:
        super().add(trigger)
        self._uow.note_admission()

    def update(self, before: Trigger, after: Trigger) -> None:
        super().update(before, after)
        self._uow.note_admission()


# --- the store ---------------------------------------------------------------------------------


class SqliteStore:
    """Every port of the runtime on one SQLite database file (or a private in-memory one).

    ``path``: the database file, created with its schema when missing. ``busy_timeout_s``: how
    long a transaction waits for another process's write lock. ``synchronous``: SQLite's
    ``PRAGMA synchronous`` (``FULL`` keeps every commit through a power loss; ``NORMAL`` is
    faster and still survives a crash of the process). ``wake``: poke the database's wake
    channel when a commit admitted work."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        busy_timeout_s: float = 30.0,
        synchronous: str = "FULL",
        wake: bool = True,
    ) -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"unknown synchronous mode {synchronous!r}")
        location = MEMORY if path is None else os.fspath(path)
        self._in_memory = location == MEMORY
        self.path: str | None = None if self._in_memory else os.path.abspath(location)
        self._wake_path = wake_path_for(self.path) if wake and self.path is not None else None
        self._clock_lock = threading.Lock()
        self._clock_offset_ms = 0
        self._last_now_ms = 0
        # One in-memory connection carries one transaction at a time.
        self._memory_lock = threading.Lock()
        self._memory_owner: int | None = None
        busy_ms = max(0, round(busy_timeout_s * 1000))
        if self._in_memory:
            self.engine = create_engine(
                "sqlite://",
                poolclass=StaticPool,
                connect_args={"check_same_thread": False},
                hide_parameters=True,
            )
        else:
            assert self.path is not None
            self.engine = create_engine(
                f"sqlite:///{self.path}",
                connect_args={"check_same_thread": False, "timeout": busy_timeout_s},
                hide_parameters=True,  # errors reach logs: no tokens in them
            )
        _install_hooks(
            self.engine,
            busy_timeout_ms=busy_ms,
            synchronous=synchronous.upper(),
            wal=not self._in_memory,
        )
        try:
            self._prepare_schema()
        except BaseException:
            self.engine.dispose()
            raise

    @property
    def wake_path(self) -> str | None:
        """The wake channel this store pokes after admissions (None for in-memory stores)."""
        return self._wake_path

    def _prepare_schema(self) -> None:
        """Create the tables when the database is new; refuse another schema's database."""
        with self._transaction(read_only=True) as connection:
            version = int(connection.exec_driver_sql("PRAGMA user_version").scalar_one())
        if version == SCHEMA_VERSION:
            return
        # Take the write lock, then look again: another process may be creating it right now.
        with self._transaction() as connection:
            version = int(connection.exec_driver_sql("PRAGMA user_version").scalar_one())
            if version not in (0, SCHEMA_VERSION):
                raise SchemaMismatch(
                    f"{self.path or MEMORY} has schema version {version}, this store needs "
                    f"{SCHEMA_VERSION}"
                )
            if version == 0:
                existing = connection.exec_driver_sql(
                    "SELECT count(*) FROM sqlite_master WHERE type = 'table'"
                ).scalar_one()
                if existing:
                    raise SchemaMismatch(f"{self.path} is not a QL3 runtime database")
                metadata.create_all(connection)
                connection.exec_driver_sql(f"PRAGMA user_version = {SCHEMA_VERSION}")
            connection.commit()

    # connections

    def _open_connection(self) -> tuple[Connection, Callable[[], None]]:
        """A pooled connection and what to call once it is closed."""
        if not self._in_memory:
            return self.engine.connect(), _nothing
        me = threading.get_ident()
        if self._memory_owner == me:
            raise RuntimeError("a unit of work is already open on this store in this thread")
        self._memory_lock.acquire()
        self._memory_owner = me

        def release() -> None:
            self._memory_owner = None
            self._memory_lock.release()

        try:
            return self.engine.connect(), release
        except BaseException:
            release()
            raise

    @contextmanager
    def _transaction(self, *, read_only: bool = False) -> Iterator[Connection]:
        connection, release = self._open_connection()
        try:
            if read_only:
                connection = connection.execution_options(**{BEGIN_OPTION: "DEFERRED"})
            connection.begin()
            try:
                yield connection
            finally:
                connection.rollback()
        finally:
            connection.close()
            release()

    # transactions and the clock

    def unit_of_work(self) -> SqliteUnitOfWork:
        return SqliteUnitOfWork(self)

    def close(self) -> None:
        self.engine.dispose()

    def now_ms(self) -> int:
        """The store's clock: this host's time plus the test offset, never going backwards."""
        with self._clock_lock:
            now = time.time_ns() // 1_000_000 + self._clock_offset_ms
            self._last_now_ms = max(self._last_now_ms, now)
            return self._last_now_ms

    def announce_work(self) -> None:
        """Wake the process that executes work on this database, if one listens."""
        if self._wake_path is not None:
            poke(self._wake_path)

    # test hooks

    def testing_advance_clock(self, ms: int) -> int:
        """Move this store's clock forward by ``ms``; returns the total offset."""
        if ms < 0:
            raise ValueError("a clock only advances")
        with self._clock_lock:
            self._clock_offset_ms += ms
            return self._clock_offset_ms

    def testing_reset(self) -> None:
        """Delete every row and put the clock back to the host's time."""
        with self._transaction() as connection:
            for statement in queries.delete_all():
                connection.execute(statement)
            connection.commit()
        with self._clock_lock:
            self._clock_offset_ms = 0
            self._last_now_ms = 0

    # candidate sources: one statement each, in its own read transaction

    def _page_rows(self, statement_for: Callable[[int], Executable]) -> tuple[int, list[Any]]:
        with self._transaction(read_only=True) as connection:
            now = self.now_ms()
            found = list(connection.execute(statement_for(now)).mappings().all())
        return now, found

    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        check_page_limit(limit)
        now, found = self._page_rows(lambda now: queries.recovery_candidates_query(limit, now))
        items = tuple(
            RecoveryCandidate(
                run_id=row["run_id"],
                attempt_id=row["attempt_id"],
                attempt_status=AttemptStatus(row["attempt_status"]),
                lease_expires_at_ms=(
                    None if row["lease_expires_at"] is None else int(row["lease_expires_at"])
                ),
                resolvable=bool(row["resolvable"]),
            )
            for row in found
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    def _run_page(
        self, statement_for: Callable[[int], Executable], limit: int
    ) -> Page[RunCandidate]:
        now, found = self._page_rows(statement_for)
        items = tuple(
            RunCandidate(
                run_id=row["run_id"],
                attempt_id=None if row["attempt_id"] is None else str(row["attempt_id"]),
                since_ms=int(row["since"]),
            )
            for row in found
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    def lost_runs(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(lambda _now: queries.lost_runs_query(limit), limit)

    def due_retries(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(lambda now: queries.due_retries_query(limit, now), limit)

    def orphaned_runs(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(lambda _now: queries.orphaned_runs_query(limit), limit)

    def queued_attempts(self, limit_per_task: int, tasks: Sequence[str]) -> Page[QueuedAttempt]:
        check_page_limit(limit_per_task, "limit_per_task")
        wanted = list(tasks)
        now, found = self._page_rows(
            lambda _now: queries.queued_attempts_query(limit_per_task, wanted)
        )
        items = tuple(
            QueuedAttempt(
                run_id=row["run_id"],
                attempt_id=row["attempt_id"],
                task=row["task"],
                queued_at_ms=int(row["queued_at"]),
            )
            for row in found
            if row["task_rank"] <= limit_per_task
        )
        has_more = any(row["task_rank"] > limit_per_task for row in found)
        return Page(items=items, has_more=has_more, observed_at_ms=now)

    def available_sessions(self, max_silence_ms: int) -> Sequence[SessionCapacity]:
        _, found = self._page_rows(
            lambda now: queries.available_sessions_query(max_silence_ms, now)
        )
        return tuple(
            SessionCapacity(session=rows.session_from_row(row), in_flight=int(row["in_flight"]))
            for row in found
        )

    def in_flight_by_task(self, tasks: Sequence[str]) -> dict[str, int]:
        with self._transaction(read_only=True) as connection:
            return in_flight_by_task(connection, tasks)

    def due_triggers(self, limit: int) -> Page[DueTrigger]:
        check_page_limit(limit)
        now, found = self._page_rows(lambda now: due_triggers_query(limit, _clock(now)))
        items = tuple(
            DueTrigger(trigger_id=row["trigger_id"], next_fire_at_ms=int(row["next_fire_at"]))
            for row in found
            if row["trigger_id"] is not None
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    def workflow_candidates(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        now, found = self._page_rows(lambda now: workflow_candidates_query(limit, _clock(now)))
        items = tuple(
            RunCandidate(run_id=row["run_id"], attempt_id=None, since_ms=int(row["since"]))
            for row in found
            if row["run_id"] is not None
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    # due times: what an idle executing process may sleep until

    def next_due_at_ms(self) -> int | None:
        """The earliest time a ``retry_wait`` Run or an active trigger becomes due, if any."""
        with self._transaction(read_only=True) as connection:
            found = [
                connection.execute(statement).scalar()
                for statement in (queries.next_retry_at_query(), queries.next_trigger_at_query())
            ]
        times = [int(value) for value in found if value is not None]
        return min(times) if times else None

    def last_foreign_lease_expiry_ms(self, session_id: str) -> int | None:
        """The latest expiry of leased leases that a session other than ``session_id`` holds."""
        with self._transaction(read_only=True) as connection:
            value = connection.execute(queries.last_foreign_lease_expiry_query(session_id)).scalar()
        return None if value is None else int(value)


def _nothing() -> None:
    return None


def _clock(now_ms: int) -> ColumnElement[int]:
    """The store's clock as a column expression for the shared SQL statements."""
    return literal(now_ms, BigInteger())


if TYPE_CHECKING:

    def _conforms(
        store: SqliteStore, uow: SqliteUnitOfWork
    ) -> tuple[SchedulerStore, SchedulerUnitOfWork]:
        """Lets mypy check that the store implements the ports structurally."""
        return store, uow
