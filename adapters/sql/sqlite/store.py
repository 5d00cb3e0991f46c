"""The Standalone and Edge store: every port of :mod:`ql3.application.ports` on an embedded SQLite
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
    :class:`~ql3.domain.errors.ConcurrencyConflict`. A multi-row write runs under a savepoint, so a
    refused write leaves nothing behind and the transaction usable.
Time
    The store's clock is this host's clock, read by the store (never by the domain), never going
    backwards within one store; all processes sharing the database file share the host's clock.
Wake-ups
    A commit that admits a Run, puts one into ``queued`` (a hand-back, the next Attempt of a
    retry, a first Attempt) or changes a trigger pokes the database's wake channel
    (:mod:`ql3.adapters.sql.sqlite.wake`), so an idle executing process starts at once without
    polling.
Schema
    ``PRAGMA user_version`` is :data:`SCHEMA_VERSION`: a new database gets the declared schema
    of :mod:`ql3.adapters.sql.schema`; a database of the baseline, version 5 (ADR 0022), gets
    the operator console's indexes (ADR 0020) when it is opened and becomes version 6; a
    database of any other version is refused with :class:`SchemaMismatch` (a database made
    before the baseline is recreated).

``SqliteStore(None)`` (or ``":memory:"``) is a private in-memory database on one connection,
whose transactions are serialised by a lock: for tests and throw-away containers.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import cached_property, lru_cache
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Engine,
    bindparam,
    create_engine,
    event,
    literal,
)
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql import Executable

from ql3.adapters.sql import operations, rows, statements
from ql3.adapters.sql.history import SqlHistoryRepository
from ql3.adapters.sql.repositories import (
    SqlEvidenceRepository,
    SqlGateRepository,
    SqlRunRepository,
    SqlSessionRegistry,
)
from ql3.adapters.sql.schema import metadata, runs, worker_sessions
from ql3.adapters.sql.sqlite import fenced, queries
from ql3.adapters.sql.sqlite.connection import (
    SCHEMA_VERSION,
    UPGRADABLE_VERSIONS,
    connection_pragmas,
    host_now_ms,
)
from ql3.adapters.sql.sqlite.wake import poke, wake_path_for
from ql3.adapters.sql.statements import ATTEMPT_COLUMNS, LEASE_COLUMNS, RUN_COLUMNS
from ql3.adapters.sql.transaction import ConnectionTransaction, conflicts_translated
from ql3.adapters.sql.triggers import SqlTriggerRepository, due_triggers_query
from ql3.adapters.sql.workflows import SqlWorkflowRepository, workflow_candidates_query
from ql3.application.budgets import check_page_limit
from ql3.application.ports import (
    OPEN_GATE,
    ClaimLock,
    DispatchGate,
    DispatchGateRepository,
    DueTrigger,
    EvidenceRepository,
    HistoryRepository,
    NodeCycle,
    OperationsView,
    Page,
    RecoveryCandidate,
    RunCandidate,
    RunRepository,
    SessionCapacity,
    Snapshot,
    TriggerRepository,
    WorkerSessionRegistry,
    WorkflowRepository,
    no_connection_hold,
)
from ql3.domain.dispatch import TaskLimit
from ql3.domain.errors import ConcurrencyConflict, Error
from ql3.domain.model import (
    AttemptStatus,
    DispatchLease,
    WorkerSession,
)
from ql3.domain.transitions import Change
from ql3.domain.triggers import Trigger

if TYPE_CHECKING:
    from ql3.application.ports import SchedulerStore, SchedulerUnitOfWork

__all__ = ["SCHEMA_VERSION", "SchemaMismatch", "SqliteStore", "SqliteUnitOfWork"]

MEMORY = ":memory:"
BEGIN_OPTION = "ql3_sqlite_begin"


class SchemaMismatch(Error, RuntimeError):
    """The database file was made by another schema version (or is not a QL3 database)."""


def _install_hooks(engine: Engine, *, busy_timeout_ms: int, synchronous: str, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        # The driver must not open transactions by itself: the "begin" hook below does.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            pragmas = connection_pragmas(
                busy_timeout_ms=busy_timeout_ms, synchronous=synchronous, wal=wal
            )
            for pragma in pragmas:
                cursor.execute(pragma)
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def on_begin(connection: Connection) -> None:
        mode = connection.get_execution_options().get(BEGIN_OPTION, "IMMEDIATE")
        # Straight on the driver (every unit of work begins here), its errors wrapped as the
        # Core path wraps them.
        driver = connection.connection.driver_connection
        assert driver is not None
        try:
            driver.execute(f"BEGIN {mode}")
        except sqlite3.Error as error:
            raise DBAPIError.instance(
                f"BEGIN {mode}",
                None,
                error,
                sqlite3.Error,
                hide_parameters=True,
                dialect=connection.dialect,
            ) from error


# --- unit of work ------------------------------------------------------------------------------


class SqliteUnitOfWork(ConnectionTransaction):
    """One connection, one ``BEGIN IMMEDIATE`` transaction. Rolls back unless committed."""

    def __init__(self, store: SqliteStore) -> None:
        self._store = store
        self._connection: Connection | None = None
        self._driver: sqlite3.Connection | None = None
        self._release: Callable[[], None] | None = None
        self._admitted = False
        self.runs: RunRepository = SqliteRunRepository(self)
        self.sessions: WorkerSessionRegistry = SqliteSessionRegistry(self)
        self.evidence: EvidenceRepository = SqlEvidenceRepository(self)
        self.triggers: TriggerRepository = SqliteTriggerRepository(self)
        self.workflows: WorkflowRepository = SqlWorkflowRepository(self)
        self.gate: DispatchGateRepository = SqlGateRepository(self)
        self.history: HistoryRepository = SqlHistoryRepository(
            self, queries.SQLITE, skip_locked=False
        )

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
        self._driver = connection.connection.driver_connection
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
        self._driver = None
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

    def execute_sql(
        self, sql: str, params: Sequence[Any] | dict[str, Any], label: str
    ) -> list[fenced.Row]:
        """Plain SQL straight on the driver's connection, in this transaction (the hot paths of
        :mod:`ql3.adapters.sql.sqlite.fenced`); the rows as dictionaries by column label. Driver
        errors are raised in SQLAlchemy's exception classes, as on the Core path."""
        driver = self._require_driver()
        try:
            cursor = driver.execute(sql, params)
            found = cursor.fetchall()
        except sqlite3.Error as error:
            raise self._wrapped(error, label) from error
        if not found:
            return []
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in found]

    def execute_many(self, sql: str, params: Sequence[dict[str, Any]], label: str) -> int:
        """One write statement for each set of parameters; the rows they touched in all."""
        driver = self._require_driver()
        try:
            return int(driver.executemany(sql, params).rowcount)
        except sqlite3.Error as error:
            raise self._wrapped(error, label) from error

    def driver_atomically(self, body: Callable[[], None]) -> None:
        """``atomically`` for writes made with :meth:`execute_sql` and :meth:`execute_many`: a
        savepoint of the driver's, without the Core path's bookkeeping of nested
        transactions. A failing ``body`` leaves nothing behind and the transaction usable."""
        driver = self._require_driver()
        self.execute_sql("SAVEPOINT ql3_apply", (), "savepoint")
        try:
            body()
        except BaseException:
            if driver.in_transaction:
                driver.execute("ROLLBACK TO ql3_apply")
                driver.execute("RELEASE ql3_apply")
            raise
        self.execute_sql("RELEASE ql3_apply", (), "savepoint")

    def _require_driver(self) -> sqlite3.Connection:
        if self._driver is None:
            raise RuntimeError("use the unit of work inside its `with` block")
        return self._driver

    def _wrapped(self, error: sqlite3.Error, label: str) -> StatementError:
        return DBAPIError.instance(
            f"<{label}>",
            None,
            error,
            sqlite3.Error,
            hide_parameters=True,
            dialect=self.connection.dialect,
        )

    def note_admission(self) -> None:
        """This transaction gives the executing process work (a Run put into ``queued``) or
        changes when work becomes due (a trigger): its commit wakes that process."""
        self._admitted = True


# --- repositories ------------------------------------------------------------------------------


class SqliteRunRepository(SqlRunRepository[SqliteUnitOfWork]):
    queries = queries

    def add_many(self, changes: Sequence[Change]) -> None:
        super().add_many(changes)
        if changes:
            # Any admission, queued or not: a workflow's aggregate is admitted ``created`` and
            # the executing process's frontier starts it.
            self._uow.note_admission()

    def set_task_limit(self, limit: TaskLimit) -> None:
        super().set_task_limit(limit)
        self._uow.note_admission()  # a raised limit may make queued Runs claimable

    def clear_task_limit(self, task: str) -> bool:
        cleared = super().clear_task_limit(task)
        if cleared:
            self._uow.note_admission()
        return cleared

    def lock_for_claim(
        self, session_id: str, tasks: Sequence[str], limit_per_task: int
    ) -> ClaimLock:
        """Read under the transaction's database lock, which no other writer shares: the
        session, the leases it holds, the gate and, while it is open, each task's oldest
        claimable Attempts with their Runs' latest leases (the first of those never changed and
        of those handed back, merged; see :func:`ql3.adapters.sql.sqlite.fenced.claimable_sql`), and
        the limits of their tasks."""
        uow = self._uow
        now_ms = uow.now_ms()
        found = uow.execute_sql(fenced.claim_session_sql(), {"session_id": session_id}, "claim")
        capacity = None
        if found:
            row = _session_row(found[0])
            capacity = SessionCapacity(
                session=rows.session_from_row(row), in_flight=int(row["ql3_held"])
            )
        gate = _gate(uow)
        candidates: list[Snapshot] = []
        in_flight: dict[str, int] = {}
        limits: dict[str, int] = {}
        if gate.open and capacity is not None:
            for task in sorted(set(tasks)):
                params = {"task": task, "limit": limit_per_task}
                found_rows = uow.execute_sql(fenced.claimable_sql(), params, "claim")
                picked = [_snapshot(row) for row in found_rows]
                picked.sort(key=_claim_order)
                candidates.extend(picked[:limit_per_task])
            claimed_tasks = json.dumps(sorted({snapshot.run.task for snapshot in candidates}))
            if candidates:
                params = {"tasks": claimed_tasks}
                counts = uow.execute_sql(fenced.in_flight_by_task_sql(), params, "claim")
                in_flight = {str(row["task"]): int(row["in_flight"]) for row in counts}
                found_limits = uow.execute_sql(fenced.limits_of_sql(), params, "claim")
                limits = {str(row["task"]): int(row["max_running"]) for row in found_limits}
        return ClaimLock(
            capacity=capacity,
            gate=gate,
            candidates=tuple(candidates),
            in_flight_by_task=in_flight,
            observed_at_ms=now_ms,
            limits=limits,
        )

    def lock_attempts(self, attempt_ids: Sequence[str]) -> list[Snapshot | None]:
        # The transaction already holds the database's write lock: nothing else to take.
        if not attempt_ids:
            return []
        found = self._uow.execute_sql(
            fenced.lock_attempts_sql(), {"ids": json.dumps(list(attempt_ids))}, "lock attempts"
        )
        by_id = {row[f"{ATTEMPT_COLUMNS}id"]: row for row in found}
        return [
            _snapshot(by_id[attempt_id]) if attempt_id in by_id else None
            for attempt_id in attempt_ids
        ]

    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None:
        # Nobody else can hold this candidate, so ``skip_locked`` never skips.
        return self.lock_attempts([attempt_id])[0]

    def lock_run(self, run_id: str) -> Snapshot | None:
        found = self._uow.execute(statements.latest_attempt_of(run_id)).first()
        if found is None:
            return None
        attempt_id = found[1]
        if attempt_id is None:
            run = self.get_run(run_id)
            if run is None:
                return None
            leases = self._uow.execute_sql(fenced.latest_lease_sql(), {"run_id": run_id}, "lease")
            lease = rows.lease_from_row(leases[0], LEASE_COLUMNS) if leases else None
            return Snapshot(run=run, attempt=None, lease=lease)
        return self.lock_attempt(str(attempt_id))

    def apply(self, before: Snapshot, change: Change) -> None:
        self.apply_many([(before, change)])

    def apply_many(self, writes: Sequence[tuple[Snapshot, Change]]) -> None:
        """Every Change of the batch, all or nothing, under a savepoint: a few statements of one
        shape each (:class:`ql3.adapters.sql.sqlite.fenced.ApplyMany`), every update a
        compare-and-set that must touch each of its rows."""
        if not writes:
            return
        batch = fenced.ApplyMany(writes)
        uow = self._uow
        uow.driver_atomically(lambda: _write(uow, batch))
        if batch.queues:
            uow.note_admission()

    def renew_lease(self, before: DispatchLease, after: DispatchLease) -> None:
        if (after.run_id, after.generation) != (before.run_id, before.generation):
            raise ValueError("a renewal must name the same lease before and after")
        statement = queries.renew_lease(before, after, self._uow.now_ms())
        what = f"lease {before.run_id}/{before.generation}"
        if self._uow.write(statement, what) != 1:
            raise ConcurrencyConflict(f"{what} is no longer the live lease presented")


class SqliteSessionRegistry(SqlSessionRegistry[SqliteUnitOfWork]):
    queries = queries

    def get(self, session_id: str) -> WorkerSession | None:
        found = self._uow.execute_sql(fenced.get_session_sql(), (session_id,), "session")
        return rows.session_from_row(_session_row(found[0])) if found else None

    def held_by(self, session_id: str) -> Sequence[str]:
        found = self._uow.execute_sql(fenced.held_by_sql(), (session_id,), "held by")
        return tuple(str(row["attempt_id"]) for row in found)


def _session_row(row: fenced.Row) -> fenced.Row:
    return fenced.decode([row], (worker_sessions, ""))[0]


def _gate(uow: SqliteUnitOfWork) -> DispatchGate:
    found = uow.execute_sql(fenced.get_gate_sql(), (), "the dispatch gate")
    return statements.gate_from_row(found[0] if found else None)


def _snapshot(row: fenced.Row) -> Snapshot:
    """A Run, its Attempt and its lease read side by side (prefixed ``r_``, ``a_``, ``l_``)."""
    fenced.decode([row], (runs, RUN_COLUMNS))
    run = rows.run_from_row(row, RUN_COLUMNS)
    attempt = rows.attempt_from_row(row, ATTEMPT_COLUMNS)
    has_lease = row[f"{LEASE_COLUMNS}run_id"] is not None
    lease = rows.lease_from_row(row, LEASE_COLUMNS) if has_lease else None
    return Snapshot(run=run, attempt=attempt, lease=lease)


def _claim_order(snapshot: Snapshot) -> tuple[int, int, str]:
    """Highest priority first, then the oldest Attempt, then the Run's id."""
    assert snapshot.attempt is not None
    return (-snapshot.run.priority, snapshot.attempt.created_at_ms, snapshot.run.id)


def _write(uow: SqliteUnitOfWork, batch: fenced.ApplyMany) -> None:
    for kind, sql, params, what in batch.statements():
        if kind == "check":
            for one, name in zip(params, what, strict=True):
                (row,) = uow.execute_sql(sql, one, name)
                if next(iter(row.values())) != 1:
                    raise ConcurrencyConflict(f"{name} changed since it was read")
            continue
        label = what[0] if len(what) == 1 else f"{what[0]} and {len(what) - 1} more"
        with conflicts_translated(label):
            touched = uow.execute_many(sql, params, label)
        if kind == "update" and touched != len(params):
            # Each item's key names one row: a short total means an item's row was not as read.
            raise ConcurrencyConflict(
                f"{label} changed since it was read ({touched} of {len(params)} as read)"
            )


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
            if version == SCHEMA_VERSION:
                return
            if version not in (0, *UPGRADABLE_VERSIONS):
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
                connection.execute(statements.insert_gate(OPEN_GATE))
            else:
                upgrade_from_version_5(connection)
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

    def holding_connection(self) -> AbstractContextManager[None]:
        """The :class:`~ql3.application.ports.ConnectionHold`: nothing to hold here."""
        return no_connection_hold()

    def close(self) -> None:
        self.engine.dispose()

    def now_ms(self) -> int:
        """The store's clock: this host's time plus the test offset, never going backwards."""
        with self._clock_lock:
            now = host_now_ms() + self._clock_offset_ms
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

    def _page_rows(self, statement: Executable) -> tuple[int, list[Any]]:
        with self._transaction(read_only=True) as connection:
            now = self.now_ms()
            found = list(connection.execute(statement, {NOW: now}).mappings().all())
        return now, found

    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        check_page_limit(limit)
        now, found = self._page_rows(_page("recovery", limit))
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

    def _run_page(self, statement: Executable, limit: int) -> Page[RunCandidate]:
        now, found = self._page_rows(statement)
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
        return self._run_page(_page("lost", limit), limit)

    def due_retries(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(_page("due_retries", limit), limit)

    def orphaned_runs(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(_page("orphaned", limit), limit)

    def dispatch_gate(self) -> DispatchGate:
        with self._transaction(read_only=True) as connection:
            row = connection.execute(statements.get_gate()).mappings().first()
        return statements.gate_from_row(row)

    def due_triggers(self, limit: int) -> Page[DueTrigger]:
        check_page_limit(limit)
        now, found = self._page_rows(_page("due_triggers", limit))
        items = tuple(
            DueTrigger(trigger_id=row["trigger_id"], next_fire_at_ms=int(row["next_fire_at"]))
            for row in found
            if row["trigger_id"] is not None
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    def workflow_candidates(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        now, found = self._page_rows(_page("workflows", limit))
        items = tuple(
            RunCandidate(run_id=row["run_id"], attempt_id=None, since_ms=int(row["since"]))
            for row in found
            if row["run_id"] is not None
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    def record_node_cycle(self, cycle: NodeCycle) -> None:
        with self._transaction() as connection:
            now = self.now_ms()
            if connection.execute(operations.update_node(cycle, now)).rowcount == 0:
                connection.execute(operations.insert_node(cycle, now))
            connection.commit()

    def operations_view(self, limit: int) -> OperationsView:
        """Read in one read transaction, on demand (never on the cadence)."""
        check_page_limit(limit)
        with self._transaction(read_only=True) as connection:
            now = self.now_ms()
            return operations.operations_view(
                lambda statement: connection.execute(statement).mappings().all(),
                now=_clock(now),
                observed_at_ms=now,
                limit=limit,
                spelling=queries.SQLITE,
            )

    # RunBrowser: the console's reads (ADR 0020), each in a read transaction

    @cached_property
    def _browser(self) -> Any:
        from ql3.adapters.sql.browse import SqlRunBrowser
        from ql3.adapters.sql.sqlite import browse

        return SqlRunBrowser(
            self._console_read,
            queries.SQLITE,
            millis=browse.millis,
            contains=browse.contains,
            data_is=browse.data_is,
        )

    @contextmanager
    def _console_read(self) -> Iterator[tuple[Connection, int]]:
        with self._transaction(read_only=True) as connection:
            yield connection, self.now_ms()

    def browse_runs(self, where: Any, order: Any, after: Any, limit: int) -> Any:
        return self._browser.browse_runs(where, order, after, limit)

    def count_runs(self, where: Any, cap: int) -> Any:
        return self._browser.count_runs(where, cap)

    def finished_between(self, since_ms: int, bucket_ms: int) -> Any:
        return self._browser.finished_between(since_ms, bucket_ms)

    def finished_counts(self, since_ms: int) -> Any:
        return self._browser.finished_counts(since_ms)

    def task_durations(self, since_ms: int, limit: int) -> Any:
        return self._browser.task_durations(since_ms, limit)

    def last_event_sequence(self) -> int:
        return int(self._browser.last_event_sequence())

    def status_counts(self, cap: int) -> Any:
        return self._browser.status_counts(cap)

    def runs_again_of(self, run_id: str, after_sequence: int) -> Any:
        return self._browser.runs_again_of(run_id, after_sequence)

    # due times: what an idle executing process may sleep until

    def next_due_at_ms(self) -> int | None:
        """The earliest time a ``retry_wait`` Run or an active trigger becomes due, if any."""
        with self._transaction(read_only=True) as connection:
            found = [connection.execute(statement).scalar() for statement in _due_times()]
        times = [int(value) for value in found if value is not None]
        return min(times) if times else None

    def last_foreign_lease_expiry_ms(self, session_id: str) -> int | None:
        """The latest expiry of leased leases that a session other than ``session_id`` holds."""
        with self._transaction(read_only=True) as connection:
            value = connection.execute(queries.last_foreign_lease_expiry_query(session_id)).scalar()
        return None if value is None else int(value)


def _nothing() -> None:
    return None


def upgrade_from_version_5(connection: Connection) -> None:
    """Version 5 (the baseline) to 6, inside the caller's write transaction: the indexes of the
    operator console (ADR 0020), rows untouched."""
    for table in metadata.sorted_tables:
        for index in table.indexes:
            index.create(connection, checkfirst=True)


NOW = "ql3_now"
_NOW = bindparam(NOW, type_=BigInteger())


@lru_cache(maxsize=64)
def _page(kind: str, limit: int) -> Executable:
    """A candidate page's statement, built once per kind and page size, the store's clock bound
    as the parameter :data:`NOW` when it is run: building one of these costs several times
    what running it does, and the cadence runs them several times a second while work flows."""
    builders: dict[str, Callable[[], Executable]] = {
        "recovery": lambda: queries.recovery_candidates_query(limit, _NOW),
        "lost": lambda: queries.lost_runs_query(limit),
        "due_retries": lambda: queries.due_retries_query(limit, _NOW),
        "orphaned": lambda: queries.orphaned_runs_query(limit),
        "due_triggers": lambda: due_triggers_query(limit, _NOW),
        "workflows": lambda: workflow_candidates_query(limit, _NOW),
    }
    return builders[kind]()


@lru_cache(maxsize=1)
def _due_times() -> tuple[Executable, Executable]:
    """What an idle process may sleep until, built once (the loop asks after every cycle)."""
    return queries.next_retry_at_query(), queries.next_trigger_at_query()


def _clock(now_ms: int) -> ColumnElement[int]:
    """The store's clock as a column expression for the shared SQL statements."""
    return literal(now_ms, BigInteger())


if TYPE_CHECKING:

    def _conforms(
        store: SqliteStore, uow: SqliteUnitOfWork
    ) -> tuple[SchedulerStore, SchedulerUnitOfWork]:
        """Lets mypy check that the store implements the ports structurally."""
        return store, uow
