"""The Cluster store: every port of :mod:`ql3.application.ports` on PostgreSQL.

One engine with a small connection pool per store. A :class:`PostgresUnitOfWork` is one
connection in one READ COMMITTED transaction, rolled back unless committed. Locks follow ADR-0002:
the Attempt's transaction-level advisory lock first, then row locks on the Run, the Attempt and the
lease, in that order (a claim's pristine candidates take row locks only: see
:func:`ql3.adapters.postgres.fenced.claim_sql`). Every write is a compare-and-set; a write that
matches no row, and every unique, exclusion, check or foreign-key violation, is raised as
:class:`~ql3.domain.errors.ConcurrencyConflict` (translated here, at the adapter edge). An admission
(``add``, ``add_many``) and an ``apply`` that inserts rows run under a savepoint, so a refused
write leaves nothing behind and the transaction usable, as in the memory store; a refused
``apply_many`` leaves the transaction to be rolled back, as its port says.

Every candidate source is a single statement (see :mod:`ql3.adapters.postgres.queries`, re-exported
here so that tests EXPLAIN exactly what the store runs) that observes the database clock.

A claim's locks (:meth:`PostgresRunRepository.lock_for_claim`) are two statements in one round
trip, and a commit that puts a Run into ``queued`` notifies
:data:`~ql3.adapters.postgres.queries.DISPATCH_CHANNEL` (see :mod:`ql3.adapters.postgres.fenced`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cached_property, lru_cache
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import psycopg
from psycopg import RawCursor
from psycopg.rows import dict_row
from sqlalchemy import Connection, Engine, Select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.sql import Executable

from ql3.adapters.postgres import fenced, queries
from ql3.adapters.postgres.admission_batch import add_many_statement
from ql3.adapters.postgres.engine import connection_ended, pooled_engine
from ql3.adapters.postgres.outage import resume_leases_on_connect
from ql3.adapters.postgres.queries import (
    ADVISORY_LOCK_NAMESPACE,
    DISPATCH_CHANNEL,
    due_retries_query,
    lost_runs_query,
    orphaned_runs_query,
    recovery_candidates_query,
)
from ql3.adapters.postgres.results import fetched_rows
from ql3.adapters.sql import operations, rows, statements
from ql3.adapters.sql.credentials import SqlCredentialRepository
from ql3.adapters.sql.history import SqlHistoryRepository
from ql3.adapters.sql.repositories import (
    SqlEvidenceRepository,
    SqlGateRepository,
    SqlRunRepository,
    SqlSessionRegistry,
)
from ql3.adapters.sql.statements import ATTEMPT_COLUMNS, LEASE_COLUMNS, RUN_COLUMNS
from ql3.adapters.sql.transaction import ConnectionTransaction
from ql3.adapters.sql.transaction import conflicts_translated as _conflicts_translated
from ql3.adapters.sql.triggers import SqlTriggerRepository
from ql3.adapters.sql.workflows import SqlWorkflowRepository
from ql3.application.budgets import check_page_limit
from ql3.application.ports import (
    ClaimLock,
    CredentialRepository,
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
)
from ql3.domain.dispatch import TaskLimit
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.model import (
    AttemptStatus,
    DispatchLease,
    StopReport,
    WorkerSession,
)
from ql3.domain.transitions import Change

if TYPE_CHECKING:
    from ql3.application.ports import SchedulerStore, SchedulerUnitOfWork

__all__ = [
    "ADVISORY_LOCK_NAMESPACE",
    "DISPATCH_CHANNEL",
    "PostgresStore",
    "PostgresUnitOfWork",
    "check_page_limit",
    "due_retries_query",
    "lost_runs_query",
    "orphaned_runs_query",
    "recovery_candidates_query",
]

T = TypeVar("T")

DRIVER = "postgresql+psycopg"
# How often lock_run re-reads the Run's latest Attempt when it changed while the locks were taken.
LOCK_RUN_ATTEMPTS = 3


def _with_generic_plans(url: str) -> str:
    """The server options of ``url`` (``?options=...``) plus ``plan_cache_mode``: options given
    to the driver replace those of the URL, so both travel together."""
    given = make_url(url).query.get("options")
    if isinstance(given, tuple):
        given = " ".join(given)
    ours = "-c plan_cache_mode=force_generic_plan"
    return f"{given} {ours}" if given else ours


def _driver_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername=DRIVER)
    return parsed.render_as_string(hide_password=False)


# --- plain SQL ----------------------------------------------------------------------------------
#
# The hot statements are written with ``%(name)s`` parameters. The driver parses such a text
# again on every execution when it is longer than it caches (4,096 characters, which a claim's
# and a batch's statements are), so each text is turned into ``$n`` placeholders once, here, and
# executed by a cursor that passes it as it is.

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")
_POSITIONAL: dict[str, tuple[str, tuple[str, ...]]] = {}
_POSITIONAL_LIMIT = 512


def _to_positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` with ``$n`` placeholders, and the parameter name of each ``n``."""
    names: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    return _PLACEHOLDER.sub(placeholder, sql), tuple(names)


def _positional(sql: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
    converted = _POSITIONAL.get(sql)
    if converted is None:
        if len(_POSITIONAL) >= _POSITIONAL_LIMIT:
            _POSITIONAL.clear()
        converted = _POSITIONAL[sql] = _to_positional(sql)
    text_, names = converted
    return text_, [params[name] for name in names]


_SAVEPOINT = "ql3_statement"


# --- unit of work ------------------------------------------------------------------------------


class PostgresGateRepository(SqlGateRepository["PostgresUnitOfWork"]):
    """The dispatch gate; its opening wakes the claims parked while it was closed (they wait
    for work, ADR 0007), so that work flows again within milliseconds of the cycle that opens
    it rather than at the end of each claim's wait."""

    def open(self, closed_before_ms: int | None, now_ms: int) -> bool:
        opened = super().open(closed_before_ms, now_ms)
        if opened:
            self._uow.wake_claims()
        return opened


class PostgresUnitOfWork(ConnectionTransaction):
    """One connection, one READ COMMITTED transaction. Rolls back unless committed."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        # The pooled connection, checked out for the ``with`` block; the SQLAlchemy connection
        # around it is made only when a Core statement needs it (see :attr:`connection`).
        self._pooled: PoolProxiedConnection | None = None
        self._connection: Connection | None = None
        self.runs: RunRepository = PostgresRunRepository(self)
        self.sessions: WorkerSessionRegistry = PostgresSessionRegistry(self)
        self.evidence: EvidenceRepository = PostgresEvidenceRepository(self)
        self.triggers: TriggerRepository = SqlTriggerRepository(self)
        self.workflows: WorkflowRepository = SqlWorkflowRepository(self)
        self.gate: DispatchGateRepository = PostgresGateRepository(self)
        self.credentials: CredentialRepository = SqlCredentialRepository(self)
        self.history: HistoryRepository = SqlHistoryRepository(
            self, queries.POSTGRES, skip_locked=True
        )
        # What the last lock statement read besides the locked rows (the holder's session, the
        # Attempt's stop reports, the clock), served to the next reads until anything is written.
        self._seen_sessions: dict[str, WorkerSession | None] = {}
        self._seen_reports: dict[str, tuple[StopReport, ...]] = {}
        self._seen_held: dict[str, tuple[str, ...]] = {}  # a session's leased Attempts
        self._seen_now_ms: int | None = None
        self._seen_at_offset_ms = 0  # the clock offset that reading was taken at
        # Set when a write was refused after part of it may have been applied: the transaction
        # can then only be rolled back.
        self._broken: str | None = None

    def __enter__(self) -> PostgresUnitOfWork:
        if self._pooled is not None or self._connection is not None:
            raise RuntimeError("this unit of work is already in use")
        self._pooled = self._store.check_out()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        connection, self._connection = self._connection, None
        pooled, self._pooled = self._pooled, None
        if connection is not None:
            try:
                connection.rollback()
            finally:
                connection.close()
        elif pooled is not None:
            try:
                # An invalidated connection (lost) has nothing left to roll back.
                if pooled.is_valid:
                    self._on_driver(pooled, lambda driver: driver.rollback(), "roll back")
            finally:
                self._store.check_in(pooled)

    @property
    def connection(self) -> Connection:
        """The SQLAlchemy connection on this unit of work's pooled connection, in its
        transaction, made on first use: the hot paths (:mod:`hot`) run on the driver alone and
        a unit of work that only runs them never makes one."""
        if self._connection is None:
            if self._pooled is None:
                raise RuntimeError("use the unit of work inside its `with` block")
            self._connection = Connection(self._store.engine, connection=self._pooled)
            self._connection.begin()
        return self._connection

    def _driver_connection(self) -> psycopg.Connection[Any]:
        """The psycopg connection under this unit of work."""
        pooled = self._connection.connection if self._connection is not None else self._pooled
        driver = None if pooled is None else pooled.driver_connection
        if driver is None:
            raise RuntimeError("the unit of work has no open connection")
        return cast("psycopg.Connection[Any]", driver)

    def _on_driver(self, pooled: PoolProxiedConnection, call: Callable[[Any], T], label: str) -> T:
        """``call`` on the driver's connection under ``pooled``, its errors raised as
        SQLAlchemy's would be (see :meth:`_driver_error`)."""
        driver = pooled.driver_connection
        if driver is None:
            raise RuntimeError(f"cannot {label}: the connection was lost and invalidated")
        try:
            return call(driver)
        except psycopg.Error as error:
            raise self._driver_error(error, driver, label, pooled) from error

    def _driver_error(
        self,
        error: psycopg.Error,
        driver: Any,
        label: str,
        pooled: PoolProxiedConnection | None = None,
    ) -> Exception:
        """The same error as through SQLAlchemy: wrapped in its exception classes, and a lost
        connection is invalidated so that the pool does not hand it out again."""
        dialect = self._store.engine.dialect
        lost = dialect.is_disconnect(cast(Any, error), driver, None)
        if lost:
            if self._connection is not None:
                self._connection.invalidate(error)
            elif (target := pooled if pooled is not None else self._pooled) is not None:
                target.invalidate(error)
        return DBAPIError.instance(
            f"<{label}>",
            None,
            error,
            psycopg.Error,
            hide_parameters=True,
            connection_invalidated=lost,
            dialect=dialect,
        )

    @property
    def clock_offset_ms(self) -> int:
        return self._store.clock_offset_ms

    def now_ms(self) -> int:
        if self._seen_now_ms is not None and self._seen_at_offset_ms == self.clock_offset_ms:
            return self._seen_now_ms
        params = {"clock_offset_ms": self.clock_offset_ms}
        (row,) = self.execute_sql(fenced.now_sql(), params, "read the clock")
        return int(row["now_ms"])

    def commit(self) -> None:
        if self._broken is not None:
            raise ConcurrencyConflict(f"not committed: {self._broken}")
        if self._connection is not None:
            self._connection.commit()
        elif self._pooled is not None:
            self._on_driver(self._pooled, lambda driver: driver.commit(), "commit")
        else:
            raise RuntimeError("use the unit of work inside its `with` block")

    def wake_claims(self) -> None:
        """Parked claims are woken when this transaction commits, as by an admission: it may
        have made queued Runs claimable without queueing one (a limit changed, the gate
        opened)."""
        self.execute_sql(
            f"SELECT pg_notify('{DISPATCH_CHANNEL}', '') AS notified", {}, "wake claims"
        )

    def execute_sql(self, sql: str, params: dict[str, Any], label: str) -> list[dict[str, Any]]:
        """Plain SQL straight on the driver's connection (``%(name)s`` parameters), in this
        transaction; the rows as dictionaries. Used by the hot paths of :mod:`hot`."""
        return self.execute_pipelined([(sql, params)], label)[-1]

    def execute_pipelined(
        self, statements: Sequence[tuple[str, dict[str, Any]]], label: str
    ) -> list[list[dict[str, Any]]]:
        """Several plain SQL statements sent together in one round trip (a pipeline), run by
        the server one after the other, each with its own snapshot; the rows of each. A failing
        statement fails the call and the server skips the ones after it."""
        driver = self._driver_connection()
        self._seen_held = {}
        try:
            if len(statements) == 1:
                sql, params = statements[0]
                with RawCursor(driver, row_factory=dict_row) as cursor:
                    cursor.execute(*_positional(sql, params))
                    return [fetched_rows(cursor)]
            cursors = [RawCursor(driver, row_factory=dict_row) for _ in statements]
            try:
                with driver.pipeline():
                    for cursor, (sql, params) in zip(cursors, statements, strict=True):
                        # A command without parameters (a savepoint's) is never prepared: one
                        # prepared after a statement that fails in the same pipeline would be
                        # skipped, and the driver would take it for prepared all the same.
                        prepare = None if params else False
                        cursor.execute(*_positional(sql, params), prepare=prepare)
                return [fetched_rows(cursor) for cursor in cursors]
            finally:
                for cursor in cursors:
                    cursor.close()
        except psycopg.Error as error:
            raise self._driver_error(error, driver, label) from error

    def execute_savepointed(
        self, sql: str, params: dict[str, Any], label: str
    ) -> list[dict[str, Any]]:
        """One plain statement under a savepoint, all of it or none, the transaction usable
        after a refusal: the savepoint, the statement and the savepoint's release travel in one
        round trip (a refused statement skips the release, and the savepoint is rolled back
        after it)."""
        statements = [
            (f"SAVEPOINT {_SAVEPOINT}", {}),
            (sql, params),
            (f"RELEASE SAVEPOINT {_SAVEPOINT}", {}),
        ]
        try:
            return self.execute_pipelined(statements, label)[1]
        except DBAPIError:
            undo: list[tuple[str, dict[str, Any]]] = [
                (f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}", {}),
                (f"RELEASE SAVEPOINT {_SAVEPOINT}", {}),
            ]
            try:
                self.execute_pipelined(undo, f"undo {label}")
            except DBAPIError:
                self.break_transaction(f"{label}: its savepoint could not be rolled back")
            raise

    def remember(
        self,
        sessions: dict[str, WorkerSession | None],
        reports: dict[str, tuple[StopReport, ...]],
        now_ms: int,
    ) -> None:
        self._seen_sessions = sessions
        self._seen_reports = reports
        self.remember_clock(now_ms)

    def remember_clock(self, now_ms: int) -> None:
        """The store's clock as the last statement read it, served by :meth:`now_ms` until
        anything is written (or the test clock moves)."""
        self._seen_now_ms = now_ms
        self._seen_at_offset_ms = self.clock_offset_ms

    def forget(self) -> None:
        self._seen_sessions = {}
        self._seen_reports = {}
        self._seen_held = {}
        self._seen_now_ms = None

    def execute(self, statement: Executable) -> Any:
        self._seen_held = {}
        return super().execute(statement)

    def remember_held(self, session_id: str, attempt_ids: tuple[str, ...]) -> None:
        """The Attempts a session's ``leased`` leases name, as the statement just run read
        them; served by :meth:`seen_held` until the next statement."""
        self._seen_held = {session_id: attempt_ids}

    def seen_held(self, session_id: str) -> tuple[str, ...] | None:
        return self._seen_held.get(session_id)

    def seen_session(self, session_id: str) -> tuple[bool, WorkerSession | None]:
        if session_id in self._seen_sessions:
            return True, self._seen_sessions[session_id]
        return False, None

    def seen_reports(self, attempt_id: str) -> tuple[StopReport, ...] | None:
        return self._seen_reports.get(attempt_id)

    def break_transaction(self, reason: str) -> None:
        self._broken = reason

    def write(self, statement: Executable, what: str) -> int:
        """Execute a write and return how many rows it touched; violations are conflicts."""
        self.forget()
        return super().write(statement, what)


# --- repositories ------------------------------------------------------------------------------


class PostgresRunRepository(SqlRunRepository[PostgresUnitOfWork]):
    queries = queries

    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None:
        """One statement: the advisory lock (or the try-lock), then the row locks, plus what a
        decision about the Attempt reads next (its session, its stop reports, the clock)."""
        uow = self._uow
        uow.forget()
        params = fenced.lock_attempt_params(attempt_id, uow.clock_offset_ms)
        found_rows = uow.execute_sql(fenced.lock_attempt_sql(skip_locked), params, "lock attempt")
        snapshots = self._remember_locked(found_rows)
        return snapshots.get(attempt_id)

    def lock_attempts(self, attempt_ids: Sequence[str]) -> list[Snapshot | None]:
        """:meth:`lock_attempt` for each id in the order given, in one statement."""
        if not attempt_ids:
            return []
        uow = self._uow
        uow.forget()
        params = {"attempt_ids": list(attempt_ids), "clock_offset_ms": uow.clock_offset_ms}
        found_rows = uow.execute_sql(fenced.lock_attempts_sql(), params, "lock attempts")
        snapshots = self._remember_locked(found_rows)
        return [snapshots.get(attempt_id) for attempt_id in attempt_ids]

    def _remember_locked(self, found_rows: Sequence[dict[str, Any]]) -> dict[str, Snapshot]:
        snapshots: dict[str, Snapshot] = {}
        sessions: dict[str, WorkerSession | None] = {}
        reports: dict[str, tuple[StopReport, ...]] = {}
        now_ms: int | None = None
        for row in found_rows:
            run = rows.run_from_row(row, fenced.RUN_PREFIX)
            attempt = rows.attempt_from_row(row, fenced.ATTEMPT_PREFIX)
            lease = None
            if row[f"{fenced.LEASE_PREFIX}run_id"] is not None:
                lease = rows.lease_from_row(row, fenced.LEASE_PREFIX)
            if attempt.session_id is not None:
                found = row[f"{fenced.SESSION_PREFIX}id"] is not None
                sessions[attempt.session_id] = (
                    rows.session_from_row(row, fenced.SESSION_PREFIX) if found else None
                )
            reports[attempt.id] = tuple(rows.report_from_row(item) for item in row["reports"] or ())
            now_ms = int(row["observed_at"])
            snapshots[attempt.id] = Snapshot(run=run, attempt=attempt, lease=lease)
        if now_ms is not None:
            self._uow.remember(sessions, reports, now_ms)
        return snapshots

    def lock_run(self, run_id: str) -> Snapshot | None:
        for _ in range(LOCK_RUN_ATTEMPTS):
            latest = self._latest_attempt_id(run_id)
            if latest is None:
                return None
            _, attempt_id = latest
            self._uow.execute(queries.advisory_lock(attempt_id or run_id))
            if attempt_id is None:
                row = self._uow.execute(queries.lock_run_row(run_id)).mappings().first()
            else:
                statement = queries.lock_attempt_rows(attempt_id, run_id=run_id)
                row = self._uow.execute(statement).mappings().first()
            if row is None:
                return None
            # A new Attempt commits together with an update of its Run; the Run row is now
            # locked, so a fresh read tells whether the Attempt locked is still the latest.
            again = self._latest_attempt_id(run_id)
            if again is not None and again[1] == attempt_id:
                return self._snapshot(row, with_attempt=attempt_id is not None)
        raise ConcurrencyConflict(f"run {run_id} kept gaining attempts while being locked")

    def _latest_attempt_id(self, run_id: str) -> tuple[str, str | None] | None:
        row = self._uow.execute(statements.latest_attempt_of(run_id)).first()
        if row is None:
            return None
        return str(row[0]), (None if row[1] is None else str(row[1]))

    def _snapshot(self, row: rows.Row, *, with_attempt: bool = True) -> Snapshot:
        run = rows.run_from_row(row, RUN_COLUMNS)
        attempt = rows.attempt_from_row(row, ATTEMPT_COLUMNS) if with_attempt else None
        generation = attempt.lease_generation if attempt is not None else None
        lease_row = self._uow.execute(queries.lock_lease(run.id, generation)).mappings().first()
        lease = rows.lease_from_row(lease_row, LEASE_COLUMNS) if lease_row is not None else None
        return Snapshot(run=run, attempt=attempt, lease=lease)

    def apply(self, before: Snapshot, change: Change) -> None:
        if change.run.id != before.run.id:
            raise ValueError(f"change of run {change.run.id} applied to run {before.run.id}")
        uow = self._uow
        uow.forget()
        statement = fenced.apply_statement(
            before.run,
            change.run,
            before.attempt,
            change.attempts,
            before.lease,
            change.lease,
            change.event,
        )
        what = f"run {before.run.id}"
        # Inserted Attempts and leases can meet a unique index; a savepoint then keeps the
        # transaction usable. Updates are fenced by the `ok` gate and need none.
        inserts = any(name.startswith(("i_att", "i_lease")) for name in statement.names)

        def write() -> Any:
            with _conflicts_translated(what):
                return uow.execute_sql(statement.sql(), statement.params, "apply change")[0]

        result = uow.atomically(write) if inserts else write()
        if not result["ok"]:
            raise ConcurrencyConflict(f"{what} changed since it was read")
        if any(int(result[name]) != 1 for name in statement.names):
            # Only a row changed by a writer that did not hold the locks can get here.
            uow.break_transaction(f"{what} changed while being written")
            raise ConcurrencyConflict(f"{what} changed while being written")

    def apply_many(self, writes: Sequence[tuple[Snapshot, Change]]) -> None:
        """Every ``(before, change)`` in one statement, all or nothing; see the port."""
        if not writes:
            return
        uow = self._uow
        uow.forget()
        batch = fenced.apply_many_statement(writes)
        what = f"{len(writes)} changes"
        # No savepoint, although the statement inserts leases and Attempts that can meet a unique
        # index: whatever refuses it, the transaction is then broken and only rolls back (the
        # port's promise), so a savepoint would buy nothing for its two round trips.
        try:
            with _conflicts_translated(what):
                result = uow.execute_pipelined(
                    [(fenced.INDEX_PLANS_SQL, {}), (fenced.apply_many_sql(), batch.params)],
                    "apply changes",
                )[-1][0]
        except ConcurrencyConflict:
            uow.break_transaction(f"{what} refused")
            raise
        if not result["ok"]:
            uow.break_transaction(f"{what}: a row changed since it was read")
            raise ConcurrencyConflict(f"{what}: a row changed since it was read")
        if any(int(result[name]) != count for name, count in batch.expected.items()):
            uow.break_transaction(f"{what} changed while being written")
            raise ConcurrencyConflict(f"{what} changed while being written")

    def add_many(self, changes: Sequence[Change]) -> None:
        """Every newly admitted Run of the batch, with its Attempts, lease and event, in one
        statement under a savepoint: all or none, and a refused batch leaves the transaction
        usable. It notifies the dispatch channel when a Run is admitted ``queued``."""
        if not changes:
            return
        uow = self._uow
        uow.forget()
        batch = add_many_statement(changes)
        what = f"{len(changes)} admitted runs"

        with _conflicts_translated(what):
            result = uow.execute_savepointed(fenced.add_many_sql(), batch.params, "add runs")[0]
        if not batch.all_written(result):
            uow.break_transaction(f"{what} were not all written")
            raise ConcurrencyConflict(f"{what} were not all written")

    def lock_for_claim(
        self, session_id: str, tasks: Sequence[str], limit_per_task: int
    ) -> ClaimLock:
        """The session's row lock and the limits of its limited tasks, then (in the same round
        trip, with a snapshot taken once those locks are held) the count of its leases, the
        gate, the candidates, locked, and the limits; see :func:`fenced.lock_session_sql` and
        :func:`fenced.claim_sql`."""
        uow = self._uow
        uow.forget()
        wanted = sorted(set(tasks))
        params = fenced.claim_params(session_id, wanted, limit_per_task, uow.clock_offset_ms)
        _, found = uow.execute_pipelined(
            [(fenced.lock_session_sql(), params), (fenced.claim_sql(), params)], "lock for claim"
        )
        head = found[0]
        now_ms = int(head["observed_at"])
        capacity = None
        if head[f"{fenced.SESSION_PREFIX}id"] is not None:
            capacity = SessionCapacity(
                session=rows.session_from_row(head, fenced.SESSION_PREFIX),
                in_flight=int(head["held"]),
            )
        gate_found = head[f"{fenced.GATE_PREFIX}open"] is not None
        gate = statements.gate_from_row(head if gate_found else None, fenced.GATE_PREFIX)
        candidates: list[Snapshot] = []
        for row in found:
            if row[f"{fenced.RUN_PREFIX}id"] is None:
                continue
            attempt = rows.attempt_from_row(row, fenced.ATTEMPT_PREFIX)
            if not attempt.is_pristine:
                continue  # no transition queues a Run so; see fenced.claim_sql
            lease = None
            if row[f"{fenced.LEASE_PREFIX}run_id"] is not None:
                lease = rows.lease_from_row(row, fenced.LEASE_PREFIX)
            candidates.append(
                Snapshot(
                    run=rows.run_from_row(row, fenced.RUN_PREFIX), attempt=attempt, lease=lease
                )
            )
        by_task = head["in_flight_by_task"] or {}
        in_flight = {str(task): int(count) for task, count in by_task.items()}
        limits = {str(task): int(limit) for task, limit in (head["task_limits"] or {}).items()}
        uow.remember_clock(now_ms)
        return ClaimLock(
            capacity=capacity,
            gate=gate,
            candidates=tuple(candidates),
            in_flight_by_task=in_flight,
            observed_at_ms=now_ms,
            limits=limits,
        )

    def set_task_limit(self, limit: TaskLimit) -> None:
        super().set_task_limit(limit)
        self._wake_claims()

    def clear_task_limit(self, task: str) -> bool:
        cleared = super().clear_task_limit(task)
        if cleared:
            self._wake_claims()
        return cleared

    def _wake_claims(self) -> None:
        """A changed limit may make queued Runs claimable."""
        self._uow.wake_claims()

    def renew_lease(self, before: DispatchLease, after: DispatchLease) -> None:
        if (after.run_id, after.generation) != (before.run_id, before.generation):
            raise ValueError("a renewal must name the same lease before and after")
        statement = queries.renew_lease(before, after, self._uow.clock_offset_ms)
        what = f"lease {before.run_id}/{before.generation}"
        if self._uow.write(statement, what) != 1:
            raise ConcurrencyConflict(f"{what} is no longer the live lease presented")


class PostgresSessionRegistry(SqlSessionRegistry[PostgresUnitOfWork]):
    queries = queries

    def get(self, session_id: str) -> WorkerSession | None:
        """The session, with the store's clock in the same statement: the command that
        authenticates by it reads the time next, and needs no statement for it."""
        uow = self._uow
        seen, session = uow.seen_session(session_id)
        if seen:
            return session
        params = {"session_id": session_id, "clock_offset_ms": uow.clock_offset_ms}
        (row,) = uow.execute_sql(fenced.get_session_sql(), params, "get session")
        uow.remember_clock(int(row["observed_at"]))
        if row[f"{fenced.SESSION_PREFIX}id"] is None:
            return None
        uow.remember_held(session_id, tuple(row["held"]))
        return rows.session_from_row(row, fenced.SESSION_PREFIX)

    def held_by(self, session_id: str) -> Sequence[str]:
        """As read with the session by :meth:`get` when no statement ran since (a claim asks
        right after authenticating), else read now."""
        seen = self._uow.seen_held(session_id)
        return seen if seen is not None else super().held_by(session_id)


class PostgresEvidenceRepository(SqlEvidenceRepository[PostgresUnitOfWork]):
    def reports_for(self, attempt_id: str) -> Sequence[StopReport]:
        seen = self._uow.seen_reports(attempt_id)
        if seen is not None:
            return seen
        return super().reports_for(attempt_id)


# --- the store ---------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _page_statement(build: Callable[[int, int], Select], limit: int, offset_ms: int) -> Select:
    """A candidate source's statement for ``limit`` and the clock offset, built once rather
    than on every cycle: a Core statement does not change once built, and each source runs
    with the same page size and (outside tests) the same offset every cycle."""
    return build(limit, offset_ms)


class PostgresStore:
    """Every port of the runtime on PostgreSQL, through one engine and its small pool."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._clock_offset_ms = 0
        # Per thread, inside holding_connection: whether it holds, and the connection it holds
        # between two units of work (None while one uses it).
        self._held = threading.local()

    @classmethod
    def from_url(
        cls, url: str, *, create_schema: bool = False, pool_size: int = 5
    ) -> PostgresStore:
        """A store on ``url`` (``postgresql+psycopg://...``; a bare ``postgresql://`` gets the
        psycopg driver). ``create_schema`` runs the Alembic migrations up to head first."""
        driver_url = _driver_url(url)
        if create_schema:
            from ql3.adapters.postgres.migrate import upgrade

            upgrade(driver_url)
        # Parameters are hidden: errors reach cycle summaries and logs, and no token may.
        engine = pooled_engine(
            driver_url,
            pool_size=pool_size,
            # Every statement of the store looks rows up by key or walks a partial index whose
            # predicate is a constant: one generic plan per prepared statement serves all
            # parameter values, and skips planning on each execution.
            connect_args={"options": _with_generic_plans(driver_url)},
        )
        resume_leases_on_connect(engine)
        return cls(engine)

    @property
    def clock_offset_ms(self) -> int:
        return self._clock_offset_ms

    def unit_of_work(self) -> PostgresUnitOfWork:
        return PostgresUnitOfWork(self)

    @contextmanager
    def holding_connection(self) -> Iterator[None]:
        """The units of work this thread opens inside, one after the other, run on one pooled
        connection, each in its own transaction (:class:`ql3.application.ports.ConnectionHold`);
        the connection goes back to the pool at the end. A connection the server has ended
        meanwhile, or one that was lost, is given up for a fresh one, as at a checkout."""
        held = self._held
        if getattr(held, "holding", False):
            yield  # already held further out
            return
        held.holding, held.connection = True, None
        try:
            yield
        finally:
            pooled, held.connection, held.holding = held.connection, None, False
            if pooled is not None:
                pooled.close()

    def check_out(self) -> PoolProxiedConnection:
        """A unit of work's connection: the one this thread holds, else one from the pool."""
        held = self._held
        pooled = getattr(held, "connection", None)
        if pooled is not None:
            held.connection = None
            driver = pooled.driver_connection
            if pooled.is_valid and driver is not None:
                if not connection_ended(driver):
                    return pooled
                pooled.invalidate()
            pooled.close()
        return self.engine.raw_connection()

    def check_in(self, pooled: PoolProxiedConnection) -> None:
        """Kept for this thread's next unit of work while it holds one, else back to the
        pool."""
        held = self._held
        if getattr(held, "holding", False) and held.connection is None and pooled.is_valid:
            held.connection = pooled
        else:
            pooled.close()

    def close(self) -> None:
        self.engine.dispose()

    # test hooks

    def testing_advance_clock(self, ms: int) -> int:
        """Move this store's view of the database clock forward by ``ms``; returns the total
        offset. Every time the store observes (now_ms, source pages, renewals) includes it."""
        if ms < 0:
            raise ValueError("a clock only advances")
        self._clock_offset_ms += ms
        return self._clock_offset_ms

    def testing_reset(self) -> None:
        """Empty every table and put the clock offset back to zero."""
        with self.engine.begin() as connection:
            held = connection.execute(queries.rows_up_to(queries.DELETE_AT_MOST_ROWS)).scalar_one()
            if held > queries.DELETE_AT_MOST_ROWS:
                connection.execute(text(queries.truncate_all()))
            else:
                for statement in queries.delete_all():
                    connection.execute(statement)
        self._clock_offset_ms = 0

    # candidate sources: one statement each, in its own short transaction

    def _page_rows(
        self, statement: Executable, key: str = "run_id"
    ) -> tuple[int, list[rows.Row]]:
        """A page statement's clock and its rows (those whose ``key`` is set: an empty page is
        one row of NULLs beside the clock)."""
        with self.engine.connect() as connection:
            result = connection.execute(statement).mappings().all()
            connection.rollback()
        observed_at = int(result[0]["observed_at"])
        return observed_at, [row for row in result if row[key] is not None]

    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        check_page_limit(limit)
        now, found = self._page_rows(
            _page_statement(recovery_candidates_query, limit, self._clock_offset_ms)
        )
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
                run_id=row["run_id"], attempt_id=row["attempt_id"], since_ms=int(row["since"])
            )
            for row in found
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    def lost_runs(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(_page_statement(lost_runs_query, limit, self._clock_offset_ms), limit)

    def due_retries(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(
            _page_statement(due_retries_query, limit, self._clock_offset_ms), limit
        )

    def orphaned_runs(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(
            _page_statement(orphaned_runs_query, limit, self._clock_offset_ms), limit
        )

    def dispatch_gate(self) -> DispatchGate:
        with self.engine.connect() as connection:
            row = connection.execute(statements.get_gate()).mappings().first()
            connection.rollback()
        return statements.gate_from_row(row)

    def due_triggers(self, limit: int) -> Page[DueTrigger]:
        """Active triggers whose next firing the database clock reached (``ix_triggers_due``)."""
        check_page_limit(limit)
        statement = queries.due_triggers_statement(limit, self._clock_offset_ms)
        now, found = self._page_rows(statement, key="trigger_id")
        items = tuple(
            DueTrigger(trigger_id=row["trigger_id"], next_fire_at_ms=int(row["next_fire_at"]))
            for row in found
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    def record_node_cycle(self, cycle: NodeCycle) -> None:
        now = queries.store_now(self._clock_offset_ms)
        with self.engine.begin() as connection:
            if connection.execute(operations.update_node(cycle, now)).rowcount == 0:
                connection.execute(operations.insert_node(cycle, now))

    def operations_view(self, limit: int) -> OperationsView:
        """Read in one read-only snapshot, on demand (never on the cadence)."""
        check_page_limit(limit)
        offset = self._clock_offset_ms
        with self.engine.connect() as connection:
            connection.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            now = int(connection.execute(queries.now_statement(offset)).scalar_one())
            view = operations.operations_view(
                lambda statement: connection.execute(statement).mappings().all(),
                now=queries.store_now(offset),
                observed_at_ms=now,
                limit=limit,
                spelling=queries.POSTGRES,
            )
            connection.rollback()
        return view

    def workflow_candidates(self, limit: int) -> Page[RunCandidate]:
        """Workflow aggregates whose frontier may move (the frontier's candidate page)."""
        check_page_limit(limit)
        statement = queries.workflow_candidates_statement(limit, self._clock_offset_ms)
        now, found = self._page_rows(statement)
        items = tuple(
            RunCandidate(run_id=row["run_id"], attempt_id=None, since_ms=int(row["since"]))
            for row in found
        )
        return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    # RunBrowser: the console's reads (ADR 0020), each in a read-only snapshot

    @cached_property
    def _browser(self) -> Any:
        from ql3.adapters.postgres import browse
        from ql3.adapters.sql.browse import SqlRunBrowser

        return SqlRunBrowser(
            self._console_read,
            queries.POSTGRES,
            millis=browse.millis,
            contains=browse.contains,
            data_is=browse.data_is,
            estimate=browse.estimate,
        )

    @contextmanager
    def _console_read(self) -> Iterator[tuple[Connection, int]]:
        with self.engine.connect() as connection:
            # The console's statements bound a range of time (a window, a cursor): planned for
            # their values, not generically as the store's other statements are (a generic plan
            # guesses that a third of the table is in range, and reads it all). LOCAL: the
            # setting ends with this transaction, and the pooled connection keeps its own.
            connection.exec_driver_sql("SET LOCAL plan_cache_mode = force_custom_plan")
            now = int(connection.execute(queries.now_statement(self._clock_offset_ms)).scalar_one())
            try:
                yield connection, now
            finally:
                connection.rollback()

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


if TYPE_CHECKING:

    def _conforms(
        store: PostgresStore, uow: PostgresUnitOfWork
    ) -> tuple[SchedulerStore, SchedulerUnitOfWork]:
        """Lets mypy check that the store implements the ports structurally."""
        return store, uow
