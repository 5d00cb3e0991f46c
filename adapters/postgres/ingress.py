"""The worker ingress's store: the ports :class:`application.worker_commands.WorkerCommands`
needs, on PostgreSQL, through the ingress's own least-privilege role.

That role (see :mod:`adapters.postgres.grants`) may read ``runs``, ``run_attempts``,
``run_dispatch_leases`` and ``worker_sessions`` and execute the four ``SECURITY DEFINER``
functions of migration ``0002_ingress``; it can INSERT, UPDATE or DELETE nothing. The Python domain
still decides every transition, exactly as over :class:`~adapters.postgres.store.PostgresStore`;
this store only persists the decisions differently:

- Reads are plain ``SELECT`` statements. :meth:`IngressRunRepository.lock_attempt` takes the
  Attempt's advisory lock like the runtime's store, but reads the Run, Attempt and lease rows
  **without** ``FOR UPDATE`` (which needs the UPDATE privilege); ``open_sessions_of`` likewise.
  Each function re-reads and locks the rows itself and re-checks what was read, so a row that
  changed in between is a :class:`~domain.errors.ConcurrencyConflict`, as a failed
  compare-and-set is in the runtime's store.
- Every write is one call of a function with one item: the columns the change alters (a diff of
  the rows before and after), the compare-and-set values read, the acting session's id and
  secret hash, and the event. The function checks that it is a transition a worker may make and
  applies it with its event, all or nothing; an item it refuses leaves the transaction usable, so
  the batch commands of ``WorkerCommands`` go on with their other items.
- The acting session is the one this unit of work read with ``sessions.get`` (which is how
  ``WorkerCommands`` authenticates a caller): a change of an Attempt is sent on behalf of the
  session that holds its lease, and only if that session was read here.
- A stop report (``evidence.record``) is held until the ``apply`` of its audit event and sent
  with it; the replacement of a worker's older sessions (``sessions.update`` to ``replaced``)
  is held until ``sessions.add`` of the new session and sent with it. Both are single function
  calls, so neither can be written without the other.

What the ingress role may not do raises :class:`IngressNotPermitted`: admission, creating
Attempts or leases, operator attestations, reading events or stop reports, and every candidate
source of recovery, lost retry, startup and dispatch (they run on the runtime's own store).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Integer,
    Select,
    Text,
    TextClause,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import make_url
from sqlalchemy.sql.elements import BindParameter

from adapters.batches import OneAtATime
from adapters.postgres import queries
from adapters.postgres.engine import pooled_engine
from adapters.postgres.queries import ADVISORY_LOCK_NAMESPACE
from adapters.sql import rows, statements
from adapters.sql.repositories import SqlRunReads, SqlSessionReads
from adapters.sql.schema import (
    EpochMillis,
    millis_to_datetime,
    run_attempts,
    run_dispatch_leases,
    runs,
    worker_sessions,
)
from adapters.sql.statements import (
    ATTEMPT_COLUMNS,
    LEASE_COLUMNS,
    OPEN_SESSION_STATUSES,
    RUN_COLUMNS,
)
from application.ports import (
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
    DispatchLease,
    EvidenceKind,
    SessionStatus,
    StopReport,
    WorkerSession,
)
from domain.transitions import Change

if TYPE_CHECKING:
    from sqlalchemy import Table

    from application.ports import RuntimeStore, UnitOfWork

__all__ = ["IngressNotPermitted", "PostgresIngressStore", "PostgresIngressUnitOfWork"]

DRIVER = "postgresql+psycopg"

REGISTER_SESSIONS = "ql3_ingress_register_sessions"
UPDATE_SESSIONS = "ql3_ingress_update_sessions"
APPLY = "ql3_ingress_apply"
RENEW = "ql3_ingress_renew"


class IngressNotPermitted(RuntimeError):
    """The worker ingress's role may not do this: it is not a worker command, or the function
    refused the change as not a transition a worker may make."""


def _not_permitted(what: str) -> NoReturn:
    raise IngressNotPermitted(f"the worker ingress's database role cannot {what}")


def _driver_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername=DRIVER)
    return parsed.render_as_string(hide_password=False)


@cache
def _call_statement(function: str) -> TextClause:
    """``SELECT item, outcome, detail FROM <function>(:items)``, built once per function."""
    if function not in (REGISTER_SESSIONS, UPDATE_SESSIONS, APPLY, RENEW):
        raise ValueError(f"not an ingress function: {function}")
    return text(f"SELECT item, outcome, detail FROM {function}(:items) ORDER BY item").bindparams(
        bindparam("items", type_=JSONB)
    )


# --- what a function is sent ------------------------------------------------------------------


def _json_value(column: Column[Any], value: Any) -> Any:
    """A column value as the functions read it: times as ISO-8601 text (exact milliseconds)."""
    if value is not None and isinstance(column.type, EpochMillis):
        return millis_to_datetime(int(value)).isoformat()
    return value


def _row(table: Table, values: Mapping[str, Any]) -> dict[str, Any]:
    return {c.name: _json_value(c, values[c.name]) for c in table.columns if c.name in values}


def _changed(table: Table, before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """The columns whose value differs between two versions of one row, with the new values."""
    return {
        c.name: _json_value(c, after[c.name])
        for c in table.columns
        if c.name in after and after[c.name] != before.get(c.name)
    }


@cache
def _read_attempt(try_lock: bool) -> Select:
    """Run, Attempt and the Attempt's lease (its generation's, or the Run's latest when the
    Attempt has none), in one statement and without row locks. With ``try_lock`` it also tries
    the Attempt's advisory lock (column ``locked``). Built once; ``attempt_id`` is bound at
    execution."""
    a = run_attempts.c
    l = run_dispatch_leases.c  # noqa: E741
    lease = (
        select(run_dispatch_leases)
        .where(
            l.run_id == a.run_id,
            or_(a.lease_generation.is_(None), l.generation == a.lease_generation),
        )
        .order_by(l.generation.desc())
        .limit(1)
        .lateral("lease")
    )
    key: BindParameter[str] = bindparam("attempt_id", type_=Text())
    locked = func.pg_try_advisory_xact_lock(
        literal_column(str(ADVISORY_LOCK_NAMESPACE), Integer()), func.hashtext(key)
    )
    return (
        select(
            *([locked.label("locked")] if try_lock else []),
            *statements.run_columns(),
            *statements.attempt_columns(),
            *[column.label(f"{LEASE_COLUMNS}{column.key}") for column in lease.c],
        )
        .select_from(run_attempts.join(runs, runs.c.id == a.run_id).outerjoin(lease, true()))
        .where(a.id == key)
    )


@cache
def _advisory_lock() -> Select:
    """The runtime store's advisory lock of an Attempt (``lock_key`` bound at execution)."""
    return queries.advisory_lock("")


def _open_sessions_of(worker_id: str) -> Select:
    s = worker_sessions.c
    return (
        select(worker_sessions)
        .where(s.worker_id == worker_id, s.status.in_([x.value for x in OPEN_SESSION_STATUSES]))
        .order_by(s.id.collate("C"))
    )


# --- unit of work ------------------------------------------------------------------------------


class PostgresIngressUnitOfWork:
    """One connection as the ingress role, one READ COMMITTED transaction; rolled back unless
    committed."""

    def __init__(self, store: PostgresIngressStore) -> None:
        self._store = store
        self._connection: Connection | None = None
        self._sessions: dict[str, WorkerSession] = {}
        self._reports: dict[str, StopReport] = {}
        self._replaced: list[tuple[WorkerSession, WorkerSession]] = []
        self.runs: RunRepository = IngressRunRepository(self)
        self.sessions: WorkerSessionRegistry = IngressSessionRegistry(self)
        self.evidence: EvidenceRepository = IngressEvidenceRepository(self)

    def __enter__(self) -> PostgresIngressUnitOfWork:
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
        self._sessions.clear()
        self._reports.clear()
        self._replaced.clear()
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

    def now_ms(self) -> int:
        return int(self.connection.execute(queries.now_statement(0)).scalar_one())

    def commit(self) -> None:
        if self._reports or self._replaced:
            raise RuntimeError(
                "a stop report or a session replacement was held but never written with its "
                "change; nothing is committed"
            )
        self.connection.commit()

    def execute(self, statement: Any, parameters: Mapping[str, Any] | None = None) -> Any:
        return self.connection.execute(statement, parameters)

    # the acting sessions

    def saw_session(self, session: WorkerSession) -> None:
        self._sessions[session.id] = session

    def acting_session(self, session_id: str) -> WorkerSession:
        session = self._sessions.get(session_id)
        if session is None:
            _not_permitted(
                f"change work held by session {session_id} without that session's credentials"
            )
        return session

    # held writes

    def hold_report(self, report: StopReport) -> None:
        self._reports[report.attempt_id] = report

    def take_report(self, attempt_id: str) -> StopReport | None:
        return self._reports.pop(attempt_id, None)

    def hold_replacement(self, before: WorkerSession, after: WorkerSession) -> None:
        self._replaced.append((before, after))

    def take_replacements(self) -> list[tuple[WorkerSession, WorkerSession]]:
        taken, self._replaced = self._replaced, []
        return taken

    # function calls

    def call(self, function: str, item: Mapping[str, Any], what: str) -> None:
        """One item through one function. ``conflict`` is a ConcurrencyConflict; ``refused``
        means the function does not take this as a worker's transition."""
        result = self.connection.execute(_call_statement(function), {"items": [dict(item)]}).one()
        if result.outcome == "ok":
            return
        if result.outcome == "conflict":
            raise ConcurrencyConflict(f"{what}: {result.detail}")
        raise IngressNotPermitted(f"{what}: {result.detail}")


# --- repositories ------------------------------------------------------------------------------


class IngressRunRepository(OneAtATime, SqlRunReads[PostgresIngressUnitOfWork]):
    queries = queries

    def add(self, change: Change) -> None:
        _not_permitted("admit runs")

    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None:
        """The Attempt's advisory lock (as the runtime's store takes it), then its rows read
        without row locks: the functions lock and re-check them before they write.

        One statement tries the lock and reads. When another transaction holds the lock, that
        read may predate the holder's commit: then (unless ``skip_locked``) the lock is waited
        for and the rows are read again. (A holder that commits between the statement's snapshot
        and its try-lock leaves a stale read behind; the function's re-check refuses the write
        that follows as a conflict.)"""
        uow = self._uow
        parameters = {"attempt_id": attempt_id}
        row = uow.execute(_read_attempt(True), parameters).mappings().first()
        if row is None:
            return None
        if not row["locked"]:
            if skip_locked:
                return None
            uow.execute(_advisory_lock(), {"lock_key": attempt_id})
            row = uow.execute(_read_attempt(False), parameters).mappings().first()
            if row is None:
                return None
        lease = None
        if row[f"{LEASE_COLUMNS}run_id"] is not None:
            lease = rows.lease_from_row(row, LEASE_COLUMNS)
        return Snapshot(
            run=rows.run_from_row(row, RUN_COLUMNS),
            attempt=rows.attempt_from_row(row, ATTEMPT_COLUMNS),
            lease=lease,
        )

    def lock_run(self, run_id: str) -> Snapshot | None:
        _not_permitted("lock runs (recovery and lost retry run on the runtime's own store)")

    def apply(self, before: Snapshot, change: Change) -> None:
        if change.run.id != before.run.id:
            raise ValueError(f"change of run {change.run.id} applied to run {before.run.id}")
        attempt, lease = before.attempt, before.lease
        report = self._uow.take_report(attempt.id) if attempt is not None else None
        if attempt is None or lease is None:
            _not_permitted("change a run that has no leased attempt")
        if any(a.id != attempt.id for a in change.attempts):
            _not_permitted("create attempts")
        if change.lease is not None and (change.lease.run_id, change.lease.generation) != (
            lease.run_id,
            lease.generation,
        ):
            _not_permitted("grant leases")
        session = self._uow.acting_session(lease.holder_session_id)
        after_attempt = change.attempts[0] if change.attempts else attempt
        after_lease = change.lease if change.lease is not None else lease
        run_before = rows.run_values(before.run)
        attempt_before = rows.attempt_values(attempt)
        lease_before = rows.lease_values(lease)
        item: dict[str, Any] = {
            "session_id": session.id,
            "secret_hash": session.secret_hash,
            "run_id": before.run.id,
            "attempt_id": attempt.id,
            "run": {
                "status": before.run.status.value,
                "attempt_count": before.run.attempt_count,
                "to": _changed(runs, run_before, rows.run_values(change.run)),
            },
            "attempt": {
                "status": attempt.status.value,
                "lease_version": attempt.lease_version,
                "to": _changed(run_attempts, attempt_before, rows.attempt_values(after_attempt)),
            },
            "lease": {
                "generation": lease.generation,
                "version": lease.version,
                "status": lease.status.value,
                "token_hash": lease.token_hash,
                "to": _changed(run_dispatch_leases, lease_before, rows.lease_values(after_lease)),
            },
            "event": {
                "type": change.event.type.value,
                "attempt_id": change.event.attempt_id,
                "at": millis_to_datetime(change.event.at_ms).isoformat(),
                "data": dict(change.event.data),
            },
        }
        if report is not None:
            item["report"] = {
                "attempt_id": report.attempt_id,
                "kind": report.kind.value,
                "reported_at": millis_to_datetime(report.reported_at_ms).isoformat(),
                "detail": report.detail,
            }
        self._uow.call(APPLY, item, f"attempt {attempt.id}")

    def renew_lease(self, before: DispatchLease, after: DispatchLease) -> None:
        if (after.run_id, after.generation) != (before.run_id, before.generation):
            raise ValueError("a renewal must name the same lease before and after")
        session = self._uow.acting_session(before.holder_session_id)
        item = {
            "session_id": session.id,
            "secret_hash": session.secret_hash,
            "run_id": before.run_id,
            "attempt_id": before.attempt_id,
            "generation": before.generation,
            "version": before.version,
            "token_hash": before.token_hash,
            "expires_at": millis_to_datetime(after.expires_at_ms).isoformat(),
        }
        self._uow.call(RENEW, item, f"lease {before.run_id}/{before.generation}")

    def events_of(self, run_id: str) -> Sequence[StoredEvent]:
        _not_permitted("read run events")


class IngressSessionRegistry(SqlSessionReads[PostgresIngressUnitOfWork]):
    queries = queries

    def get(self, session_id: str) -> WorkerSession | None:
        """The session, remembered as a session this unit of work may act for once the caller
        has checked its secret."""
        session = super().get(session_id)
        if session is not None:
            self._uow.saw_session(session)
        return session

    def open_sessions_of(self, worker_id: str) -> Sequence[WorkerSession]:
        """Read without row locks; the registration function locks them and re-checks."""
        result = self._uow.execute(_open_sessions_of(worker_id)).mappings()
        return tuple(rows.session_from_row(row) for row in result)

    def add(self, session: WorkerSession) -> None:
        replaced = self._uow.take_replacements()
        if any(after.worker_id != session.worker_id for _, after in replaced):
            _not_permitted("replace the sessions of another worker id")
        item = {
            "session": _row(worker_sessions, rows.session_values(session)),
            "replaced": [
                {
                    "id": before.id,
                    "status": before.status.value,
                    "closed_at": _json_value(worker_sessions.c.closed_at, after.closed_at_ms),
                }
                for before, after in replaced
            ],
        }
        self._uow.call(REGISTER_SESSIONS, item, f"session {session.id}")

    def update(self, before: WorkerSession, after: WorkerSession) -> None:
        if after.id != before.id:
            raise ValueError("a session update must name the same session before and after")
        if after.status is SessionStatus.REPLACED:
            # Written with the registration of the worker id's new session, never alone.
            self._uow.hold_replacement(before, after)
            return
        item = {
            "id": before.id,
            "secret_hash": before.secret_hash,
            "status": before.status.value,
            "to": _changed(
                worker_sessions, rows.session_values(before), rows.session_values(after)
            ),
        }
        self._uow.call(UPDATE_SESSIONS, item, f"session {before.id}")
        self._uow.saw_session(after)


class IngressEvidenceRepository:
    def __init__(self, uow: PostgresIngressUnitOfWork) -> None:
        self._uow = uow

    def record(self, report: StopReport) -> None:
        """Held until the ``apply`` of its audit event, and written with it."""
        if report.kind is not EvidenceKind.WORKER_ABANDONED:
            _not_permitted(f"record {report.kind.value} evidence (an operator's own role can)")
        self._uow.hold_report(report)

    def reports_for(self, attempt_id: str) -> Sequence[StopReport]:
        _not_permitted("read stop reports")


# --- the store ---------------------------------------------------------------------------------


class PostgresIngressStore:
    """The worker ingress's view of the Cluster store: what ``WorkerCommands`` needs, through
    the ingress role. The candidate sources of the scheduler are not available."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_url(cls, url: str, *, pool_size: int = 5) -> PostgresIngressStore:
        """A store on ``url``, which names the ingress role (``ql3 db grant-ingress``); a bare
        ``postgresql://`` gets the psycopg driver. The schema must be at ``0002_ingress`` or
        later (``ql3 db upgrade``, run as the schema's owner)."""
        # Parameters are hidden from errors: the functions' parameters carry secret and
        # token hashes.
        engine = pooled_engine(_driver_url(url), pool_size=pool_size)
        return cls(engine)

    def unit_of_work(self) -> PostgresIngressUnitOfWork:
        return PostgresIngressUnitOfWork(self)

    def close(self) -> None:
        self.engine.dispose()

    # The scheduler's candidate sources run on the runtime's own store.

    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        _not_permitted("look for recovery candidates")

    def lost_runs(self, limit: int) -> Page[RunCandidate]:
        _not_permitted("look for lost runs")

    def due_retries(self, limit: int) -> Page[RunCandidate]:
        _not_permitted("look for due retries")

    def orphaned_runs(self, limit: int) -> Page[RunCandidate]:
        _not_permitted("look for orphaned runs")

    def queued_attempts(self, limit_per_task: int, tasks: Sequence[str]) -> Page[QueuedAttempt]:
        _not_permitted("dispatch queued attempts")

    def available_sessions(self, max_silence_ms: int) -> Sequence[SessionCapacity]:
        _not_permitted("dispatch queued attempts")


if TYPE_CHECKING:

    def _conforms(
        store: PostgresIngressStore, uow: PostgresIngressUnitOfWork
    ) -> tuple[RuntimeStore, UnitOfWork]:
        """Lets mypy check that the store implements the ports structurally."""
        return store, uow
