"""The Cluster store: every port of :mod:`application.ports` on PostgreSQL.

One engine with a small connection pool per store. A :class:`PostgresUnitOfWork` is one
connection in one READ COMMITTED transaction, rolled back unless committed. Locks follow ADR-0002:
the Attempt's transaction-level advisory lock first, then row locks on the Run, the Attempt and the
lease, in that order. Every write is a compare-and-set; a write that matches no row, and every
unique, exclusion, check or foreign-key violation, is raised as
:class:`~domain.errors.ConcurrencyConflict` (translated here, at the adapter edge). A multi-row
write (``add``, ``apply``) runs under a savepoint, so a refused write leaves nothing behind and
the transaction usable, as in the memory store.

Every candidate source is a single statement (see :mod:`adapters.postgres.queries`, re-exported
here so that tests EXPLAIN exactly what the store runs) that observes the database clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import QueuePool
from sqlalchemy.sql import Executable

from adapters.postgres import queries
from adapters.postgres.queries import (
    ADVISORY_LOCK_NAMESPACE,
    ATTEMPT_COLUMNS,
    LEASE_COLUMNS,
    RUN_COLUMNS,
    available_sessions_query,
    due_retries_query,
    lost_runs_query,
    orphaned_runs_query,
    queued_attempts_query,
    recovery_candidates_query,
)
from adapters.sql import rows
from application.ports import (
    HARD_PAGE_CAP,
    EvidenceRepository,
    Page,
    QueuedAttempt,
    RecoveryCandidate,
    RunCandidate,
    RunRepository,
    SessionCapacity,
    Snapshot,
    StoredEvent,
    WorkerSessionRegistry,
)
from domain.errors import ConcurrencyConflict
from domain.model import (
    Attempt,
    AttemptStatus,
    DispatchLease,
    Run,
    RunStatus,
    StopReport,
    WorkerSession,
)
from domain.transitions import Change

if TYPE_CHECKING:
    from application.ports import RuntimeStore, UnitOfWork

__all__ = [
    "ADVISORY_LOCK_NAMESPACE",
    "PostgresStore",
    "PostgresUnitOfWork",
    "available_sessions_query",
    "check_page_limit",
    "due_retries_query",
    "lost_runs_query",
    "orphaned_runs_query",
    "queued_attempts_query",
    "recovery_candidates_query",
]

DRIVER = "postgresql+psycopg"
# How often lock_run re-reads the Run's latest Attempt when it changed while the locks were taken.
LOCK_RUN_ATTEMPTS = 3

T = TypeVar("T")


def check_page_limit(limit: int, name: str = "limit") -> None:
    """Page sizes are 1..HARD_PAGE_CAP; anything else is a caller's bug."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= HARD_PAGE_CAP:
        raise ValueError(f"{name} must be an integer within 1..{HARD_PAGE_CAP}, got {limit!r}")


def _driver_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername=DRIVER)
    return parsed.render_as_string(hide_password=False)


@contextmanager
def _conflicts_translated(what: str) -> Iterator[None]:
    """Unique, exclusion, check and foreign-key violations are concurrency conflicts."""
    try:
        yield
    except IntegrityError as error:
        raise ConcurrencyConflict(f"{what}: {error.orig}") from error


# --- unit of work ------------------------------------------------------------------------------


class PostgresUnitOfWork:
    """One connection, one READ COMMITTED transaction. Rolls back unless committed."""

    def __init__(self, store: PostgresStore) -> None:
        self._store = store
        self._connection: Connection | None = None
        self.runs: RunRepository = PostgresRunRepository(self)
        self.sessions: WorkerSessionRegistry = PostgresSessionRegistry(self)
        self.evidence: EvidenceRepository = PostgresEvidenceRepository(self)

    def __enter__(self) -> PostgresUnitOfWork:
        if self._connection is not None:
            raise RuntimeError("this unit of work is already in use")
        connection = self._store.engine.connect()
        connection.begin()
        self._connection = connection
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        try:
            connection.rollback()
        finally:
            connection.close()

    @property
    def connection(self) -> Connection:
        if self._connection is None:
            raise RuntimeError("use the unit of work inside its `with` block")
        return self._connection

    @property
    def clock_offset_ms(self) -> int:
        return self._store.clock_offset_ms

    def now_ms(self) -> int:
        value = self.connection.execute(queries.now_statement(self.clock_offset_ms)).scalar_one()
        return int(value)

    def commit(self) -> None:
        self.connection.commit()

    def execute(self, statement: Executable) -> Any:
        return self.connection.execute(statement)

    def write(self, statement: Executable, what: str) -> int:
        """Execute a write and return how many rows it touched; violations are conflicts."""
        with _conflicts_translated(what):
            result = self.connection.execute(statement)
        return int(getattr(result, "rowcount", 0))

    def compare_and_set(self, statement: Executable, what: str) -> None:
        if self.write(statement, what) != 1:
            raise ConcurrencyConflict(f"{what} changed since it was read")

    def atomically(self, body: Callable[[], T]) -> T:
        """Run a multi-statement write under a savepoint: all of it or none of it."""
        savepoint = self.connection.begin_nested()
        try:
            result = body()
        except BaseException:
            if savepoint.is_active:
                savepoint.rollback()
            raise
        savepoint.commit()
        return result


# --- repositories ------------------------------------------------------------------------------


class PostgresRunRepository:
    def __init__(self, uow: PostgresUnitOfWork) -> None:
        self._uow = uow

    def add(self, change: Change) -> None:
        def insert_all() -> None:
            self._uow.write(queries.insert_run(change.run), f"run {change.run.id}")
            for attempt in change.attempts:
                self._uow.write(queries.insert_attempt(attempt), f"attempt {attempt.id}")
            if change.lease is not None:
                lease = change.lease
                self._uow.write(
                    queries.insert_lease(lease), f"lease {lease.run_id}/{lease.generation}"
                )
            self._uow.write(queries.insert_event(change.event), f"event of run {change.run.id}")

        self._uow.atomically(insert_all)

    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None:
        if skip_locked:
            if not self._uow.execute(queries.try_advisory_lock(attempt_id)).scalar_one():
                return None
        else:
            self._uow.execute(queries.advisory_lock(attempt_id))
        row = self._uow.execute(queries.lock_attempt_rows(attempt_id)).mappings().first()
        if row is None:
            return None
        return self._snapshot(row)

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
        row = self._uow.execute(queries.latest_attempt_of(run_id)).first()
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
        self._uow.atomically(lambda: self._apply(before, change))

    def _apply(self, before: Snapshot, change: Change) -> None:
        uow = self._uow
        if change.run != before.run:
            uow.compare_and_set(queries.update_run(before.run, change.run), f"run {before.run.id}")
        for attempt in change.attempts:
            what = f"attempt {attempt.id}"
            if before.attempt is not None and attempt.id == before.attempt.id:
                uow.compare_and_set(queries.update_attempt(before.attempt, attempt), what)
            else:
                uow.write(queries.insert_attempt(attempt), what)
        lease = change.lease
        if lease is not None:
            what = f"lease {lease.run_id}/{lease.generation}"
            old = before.lease
            if old is not None and (old.run_id, old.generation) == (lease.run_id, lease.generation):
                if lease != old:
                    uow.compare_and_set(queries.update_lease(old, lease), what)
            else:
                uow.write(queries.insert_lease(lease), what)
        uow.write(queries.insert_event(change.event), f"event of run {change.run.id}")

    def renew_lease(self, before: DispatchLease, after: DispatchLease) -> None:
        if (after.run_id, after.generation) != (before.run_id, before.generation):
            raise ValueError("a renewal must name the same lease before and after")
        statement = queries.renew_lease(before, after, self._uow.clock_offset_ms)
        what = f"lease {before.run_id}/{before.generation}"
        if self._uow.write(statement, what) != 1:
            raise ConcurrencyConflict(f"{what} is no longer the live lease presented")

    def get_run(self, run_id: str) -> Run | None:
        row = self._uow.execute(queries.get_run(run_id)).mappings().first()
        return rows.run_from_row(row) if row is not None else None

    def get_attempt(self, attempt_id: str) -> Attempt | None:
        row = self._uow.execute(queries.get_attempt(attempt_id)).mappings().first()
        return rows.attempt_from_row(row) if row is not None else None

    def attempts_of(self, run_id: str) -> Sequence[Attempt]:
        result = self._uow.execute(queries.attempts_of(run_id)).mappings()
        return tuple(rows.attempt_from_row(row) for row in result)

    def leases_of(self, run_id: str) -> Sequence[DispatchLease]:
        result = self._uow.execute(queries.leases_of(run_id)).mappings()
        return tuple(rows.lease_from_row(row) for row in result)

    def events_of(self, run_id: str) -> Sequence[StoredEvent]:
        result = self._uow.execute(queries.events_of(run_id)).mappings()
        return tuple(
            StoredEvent(sequence=int(row["id"]), event=rows.event_from_row(row)) for row in result
        )

    def list_runs(self, status: RunStatus | None, limit: int) -> Sequence[Run]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        result = self._uow.execute(queries.list_runs(status, limit)).mappings()
        return tuple(rows.run_from_row(row) for row in result)


class PostgresSessionRegistry:
    def __init__(self, uow: PostgresUnitOfWork) -> None:
        self._uow = uow

    def get(self, session_id: str) -> WorkerSession | None:
        row = self._uow.execute(queries.get_session(session_id)).mappings().first()
        return rows.session_from_row(row) if row is not None else None

    def open_sessions_of(self, worker_id: str) -> Sequence[WorkerSession]:
        result = self._uow.execute(queries.open_sessions_of(worker_id)).mappings()
        return tuple(rows.session_from_row(row) for row in result)

    def add(self, session: WorkerSession) -> None:
        statement = queries.insert_session(session)
        self._uow.atomically(lambda: self._uow.write(statement, f"session {session.id}"))

    def update(self, before: WorkerSession, after: WorkerSession) -> None:
        if after.id != before.id:
            raise ValueError("a session update must name the same session before and after")
        statement = queries.update_session(before, after)
        self._uow.atomically(lambda: self._uow.compare_and_set(statement, f"session {before.id}"))

    def offers_of(self, session_id: str) -> Sequence[tuple[Attempt, DispatchLease]]:
        result = self._uow.execute(queries.offers_of(session_id)).mappings()
        return tuple(
            (rows.attempt_from_row(row, ATTEMPT_COLUMNS), rows.lease_from_row(row, LEASE_COLUMNS))
            for row in result
        )


class PostgresEvidenceRepository:
    def __init__(self, uow: PostgresUnitOfWork) -> None:
        self._uow = uow

    def record(self, report: StopReport) -> None:
        self._uow.write(queries.insert_report(report), f"stop report of {report.attempt_id}")

    def reports_for(self, attempt_id: str) -> Sequence[StopReport]:
        result = self._uow.execute(queries.reports_for(attempt_id)).mappings()
        return tuple(rows.report_from_row(row) for row in result)


# --- the store ---------------------------------------------------------------------------------


class PostgresStore:
    """Every port of the runtime on PostgreSQL, through one engine and its small pool."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._clock_offset_ms = 0

    @classmethod
    def from_url(
        cls, url: str, *, create_schema: bool = False, pool_size: int = 5
    ) -> PostgresStore:
        """A store on ``url`` (``postgresql+psycopg://...``; a bare ``postgresql://`` gets the
        psycopg driver). ``create_schema`` runs the Alembic migrations up to head first."""
        driver_url = _driver_url(url)
        if create_schema:
            from adapters.postgres.migrate import upgrade

            upgrade(driver_url)
        engine = create_engine(
            driver_url,
            poolclass=QueuePool,
            pool_size=pool_size,
            max_overflow=0,
            pool_pre_ping=True,
            hide_parameters=True,  # errors reach cycle summaries and logs: no tokens in them
            isolation_level="READ COMMITTED",
        )
        return cls(engine)

    @property
    def clock_offset_ms(self) -> int:
        return self._clock_offset_ms

    def unit_of_work(self) -> PostgresUnitOfWork:
        return PostgresUnitOfWork(self)

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
            connection.execute(text(queries.truncate_all()))
        self._clock_offset_ms = 0

    # candidate sources: one statement each, in its own short transaction

    def _page_rows(self, statement: Executable) -> tuple[int, list[rows.Row]]:
        with self.engine.connect() as connection:
            result = connection.execute(statement).mappings().all()
            connection.rollback()
        observed_at = int(result[0]["observed_at"])
        return observed_at, [row for row in result if row["run_id"] is not None]

    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        check_page_limit(limit)
        now, found = self._page_rows(recovery_candidates_query(limit, self._clock_offset_ms))
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
        return self._run_page(lost_runs_query(limit, self._clock_offset_ms), limit)

    def due_retries(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(due_retries_query(limit, self._clock_offset_ms), limit)

    def orphaned_runs(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        return self._run_page(orphaned_runs_query(limit, self._clock_offset_ms), limit)

    def queued_attempts(self, limit_per_task: int, tasks: Sequence[str]) -> Page[QueuedAttempt]:
        check_page_limit(limit_per_task, "limit_per_task")
        statement = queued_attempts_query(limit_per_task, tasks, self._clock_offset_ms)
        now, found = self._page_rows(statement)
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
        statement = available_sessions_query(max_silence_ms, self._clock_offset_ms)
        with self.engine.connect() as connection:
            result = connection.execute(statement).mappings().all()
            connection.rollback()
        return tuple(
            SessionCapacity(session=rows.session_from_row(row), in_flight=int(row["in_flight"]))
            for row in result
        )


if TYPE_CHECKING:

    def _conforms(store: PostgresStore, uow: PostgresUnitOfWork) -> tuple[RuntimeStore, UnitOfWork]:
        """Lets mypy check that the store implements the ports structurally."""
        return store, uow
