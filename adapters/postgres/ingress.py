"""The worker ingress's store: the ports :class:`ql3.application.worker_commands.WorkerCommands`
needs, on PostgreSQL, through the ingress's own least-privilege role (ADR 0004, ADR 0007).

That role (see :mod:`ql3.adapters.postgres.grants`) may read ``runs``, ``run_attempts``,
``run_dispatch_leases``, ``worker_sessions`` and ``dispatch_gate`` and execute the entry points
of migrations ``0002_ingress`` and ``0005_ingress_claim``; it can INSERT, UPDATE or DELETE
nothing and take no row lock. The Python domain still decides every transition, exactly as over
:class:`~ql3.adapters.postgres.store.PostgresStore`; this store only persists the decisions
differently, in few round trips:

- :meth:`IngressSessionRegistry.get` reads the session together with the Attempts its
  ``leased`` leases name and the clock, in one statement: ``held_by`` and ``now_ms`` then need
  none of their own.
- :meth:`IngressRunRepository.lock_attempts` is one call of ``ql3_ingress_lock_attempts`` for
  the whole batch: each Attempt's advisory lock (the runtime's own), then the Runs, Attempts and
  leases read by one statement once every lock is held, so the read sees every commit made
  before each lock was granted. No row lock (it needs the UPDATE privilege): each write function
  re-locks and re-checks the rows, so a row that changed in between is a
  :class:`~ql3.domain.errors.ConcurrencyConflict`, as a failed compare-and-set is in the runtime's
  store.
- :meth:`IngressRunRepository.lock_for_claim` is one call of ``ql3_ingress_claim_lock``
  (``SECURITY DEFINER``): the session row locked, its lease count, the dispatch gate and, while
  it is open, the candidates locked ``SKIP LOCKED``, their tasks' in-flight counts and the clock.
- :meth:`IngressRunRepository.apply_many` sends every write of a command (claims, completions,
  hand-backs, abandonments) as the items of one ``ql3_ingress_apply`` call (256 items a call):
  the columns each change alters (a diff of the rows before and after), the compare-and-set
  values read, the acting session's id and secret hash, and the event. The function checks that
  each is a transition a worker may make and applies it with its event. A batch is all or
  nothing: when any item is refused after others were written, the unit of work refuses to
  commit. Renewals are held and sent the same way, as one ``ql3_ingress_renew`` call, with the
  batch's writes or at commit.
- The acting session is the one this unit of work read with ``sessions.get`` (which is how
  ``WorkerCommands`` authenticates a caller): a change is sent on behalf of the session that
  holds the lease (or, for a claim, is granted it), and only if that session was read here.
- A stop report (``evidence.record``) is held until the ``apply`` of its audit event and sent
  with it; the replacement of a worker's older sessions (``sessions.update`` to ``replaced``)
  is held until ``sessions.add`` of the new session and sent with it.

A claim with completions thus costs four statements and the commit: the session (with what it
holds and the clock), the completions' locks, the claim's locks, every write of the call; a claim
without completions or hand-backs three statements and the commit. (psycopg sends its ``BEGIN``
on its own before the first statement: one more round trip per transaction, on every store.)

Input PostgreSQL cannot store (a NUL character, a lone surrogate) is refused as
:class:`~ql3.domain.errors.InvalidAdmission` before or when it reaches the database, never raised as
a store error. What the ingress role may not do raises :class:`IngressNotPermitted`: admission,
operator attestations, reading events or stop reports, and every candidate source of recovery,
lost retry and startup (they run on the runtime's own store).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import cache
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn

import psycopg
from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Double,
    Engine,
    Integer,
    Select,
    Text,
    TextClause,
    bindparam,
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSON, JSONB, aggregate_order_by
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql.selectable import TextualSelect

from ql3.adapters.postgres import queries
from ql3.adapters.postgres.engine import pooled_engine, set_role_on_connect
from ql3.adapters.sql import rows, statements
from ql3.adapters.sql.repositories import SqlRunReads, SqlSessionReads
from ql3.adapters.sql.schema import (
    EpochMillis,
    datetime_to_millis,
    millis_to_datetime,
    run_attempts,
    run_dispatch_leases,
    runs,
    worker_sessions,
)
from ql3.application.ports import (
    ClaimLock,
    DispatchGate,
    EvidenceRepository,
    Page,
    RecoveryCandidate,
    RunCandidate,
    RunRepository,
    SessionCapacity,
    Snapshot,
    StoredEvent,
    WorkerSessionRegistry,
)
from ql3.domain.dispatch import TaskLimit
from ql3.domain.errors import ConcurrencyConflict, InvalidAdmission
from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import (
    DispatchLease,
    EvidenceKind,
    LeaseStatus,
    SessionStatus,
    StopReport,
    WorkerSession,
)
from ql3.domain.states import OPEN_SESSION_STATUSES
from ql3.domain.transitions import Change

if TYPE_CHECKING:
    from sqlalchemy import Table

    from ql3.application.ports import RuntimeStore, UnitOfWork

__all__ = ["IngressNotPermitted", "PostgresIngressStore", "PostgresIngressUnitOfWork"]

DRIVER = "postgresql+psycopg"

REGISTER_SESSIONS = "ql3_ingress_register_sessions"
UPDATE_SESSIONS = "ql3_ingress_update_sessions"
APPLY = "ql3_ingress_apply"
RENEW = "ql3_ingress_renew"
CLAIM_LOCK = "ql3_ingress_claim_lock"
LOCK_ATTEMPTS = "ql3_ingress_lock_attempts"
# What one call of a function takes (its check_batch; the lock functions likewise).
MAX_CALL_ITEMS = 256


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


def _chunks(items: Sequence[Any]) -> Iterator[tuple[int, Sequence[Any]]]:
    for start in range(0, len(items), MAX_CALL_ITEMS):
        yield start, items[start : start + MAX_CALL_ITEMS]


# --- input PostgreSQL cannot store -------------------------------------------------------------


def _unstorable(error: BaseException) -> str | None:
    """Why PostgreSQL (or the driver, before sending) refused a value as bad input, or None
    when the error is something else. Never the error's own text: it can quote the parameters
    (secret and token hashes)."""
    if isinstance(error, UnicodeEncodeError):
        return "a string is not valid Unicode (a lone surrogate)"
    if not isinstance(error, psycopg.DataError):
        return None
    state = error.sqlstate
    first_line = str(error).split("\n", 1)[0]
    if state is None and "NUL" in first_line:
        return "a string holds a NUL character, which PostgreSQL cannot store"
    if state == "22P05":  # untranslatable_character: \u0000 in JSON
        return "a string holds a NUL character, which PostgreSQL cannot store"
    if state == "22021":  # character_not_in_repertoire: an invalid byte sequence
        return "a string is not valid in the database's encoding"
    if state == "22P02" and "type json" in first_line:  # a lone surrogate escaped in JSON
        return "a string is not valid Unicode (a lone surrogate)"
    return None


# --- statements ----------------------------------------------------------------------------------


@cache
def _call_statement(function: str) -> TextClause:
    """``SELECT item, outcome, detail FROM <function>(:items)``, built once per function."""
    if function not in (REGISTER_SESSIONS, UPDATE_SESSIONS, APPLY, RENEW):
        raise ValueError(f"not an ingress function: {function}")
    return text(f"SELECT item, outcome, detail FROM {function}(:items) ORDER BY item").bindparams(
        bindparam("items", type_=JSONB)
    )


@cache
def _lock_attempts_statement() -> TextualSelect:
    return (
        text(f"SELECT {LOCK_ATTEMPTS}(:attempt_ids, :skip_locked) AS found")
        .bindparams(
            bindparam("attempt_ids", type_=ARRAY(Text())),
            bindparam("skip_locked", type_=Boolean()),
        )
        .columns(found=JSON)
    )


@cache
def _claim_lock_statement() -> TextualSelect:
    return (
        text(f"SELECT {CLAIM_LOCK}(:session_id, :secret_hash, :tasks, :limit) AS found")
        .bindparams(
            bindparam("session_id", type_=Text()),
            bindparam("secret_hash", type_=Text()),
            bindparam("tasks", type_=ARRAY(Text())),
            bindparam("limit", type_=Integer()),
        )
        .columns(found=JSON)
    )


def _leased_by_session() -> Any:
    l = run_dispatch_leases.c  # noqa: E741
    return (
        l.holder_session_id == worker_sessions.c.id,
        queries.POSTGRES.is_(l.status, LeaseStatus.LEASED),
    )


@cache
def _session_statement() -> Select:
    """The session, the Attempts its ``leased`` leases name (sorted) and the clock, in one
    statement (``ix_run_dispatch_leases_held``); ``session_id`` bound at execution."""
    l = run_dispatch_leases.c  # noqa: E741
    held = (
        select(func.array_agg(aggregate_order_by(l.attempt_id, l.attempt_id)))
        .where(*_leased_by_session())
        .scalar_subquery()
    )
    return select(
        worker_sessions,
        held.label("held"),
        queries.store_now(0).label("observed_at"),
    ).where(worker_sessions.c.id == bindparam("session_id", type_=Text()))


@cache
def _held_statement() -> Select:
    l = run_dispatch_leases.c  # noqa: E741
    return (
        select(l.attempt_id)
        .where(
            l.holder_session_id == bindparam("session_id", type_=Text()),
            queries.POSTGRES.is_(l.status, LeaseStatus.LEASED),
        )
        .order_by(l.attempt_id)
    )


def _open_sessions_of(worker_id: str) -> Select:
    s = worker_sessions.c
    open_statuses = sorted(status.value for status in OPEN_SESSION_STATUSES)
    return (
        select(worker_sessions)
        .where(s.worker_id == worker_id, s.status.in_(open_statuses))
        .order_by(s.id.collate("C"))
    )


# --- what a function is sent and answers -------------------------------------------------------


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


def _from_json(table: Table, found: Mapping[str, Any]) -> dict[str, Any]:
    """A row as ``to_jsonb`` gives it, with the values :mod:`ql3.adapters.sql.rows` reads: times as
    epoch milliseconds, doubles as floats."""
    values: dict[str, Any] = {}
    for column in table.columns:
        value = found.get(column.name)
        if value is not None:
            if isinstance(column.type, EpochMillis):
                value = datetime_to_millis(dt.datetime.fromisoformat(value))
            elif isinstance(column.type, Double):
                value = float(value)
        values[column.name] = value
    return values


def _snapshot(found: Mapping[str, Any]) -> Snapshot:
    lease = found.get("lease")
    return Snapshot(
        run=rows.run_from_row(_from_json(runs, found["run"])),
        attempt=rows.attempt_from_row(_from_json(run_attempts, found["attempt"])),
        lease=rows.lease_from_row(_from_json(run_dispatch_leases, lease)) if lease else None,
    )


def _gate(found: Mapping[str, Any]) -> DispatchGate:
    changed_at = found.get("changed_at")
    return DispatchGate(
        open=bool(found["open"]),
        reason=found.get("reason"),
        changed_at_ms=(
            datetime_to_millis(dt.datetime.fromisoformat(changed_at)) if changed_at else None
        ),
    )


def _event(event: RunEvent) -> dict[str, Any]:
    return {
        "type": event.type.value,
        "attempt_id": event.attempt_id,
        "at": millis_to_datetime(event.at_ms).isoformat(),
        "data": dict(event.data),
    }


# --- unit of work ------------------------------------------------------------------------------


class PostgresIngressUnitOfWork:
    """One connection as the ingress role, one READ COMMITTED transaction; rolled back unless
    committed."""

    def __init__(self, store: PostgresIngressStore) -> None:
        self._store = store
        self._connection: Connection | None = None
        self._sessions: dict[str, WorkerSession] = {}
        self._held: dict[str, tuple[str, ...]] = {}
        self._now_ms: int | None = None
        self._reports: dict[str, StopReport] = {}
        self._replaced: list[tuple[WorkerSession, WorkerSession]] = []
        self._renewals: list[tuple[dict[str, Any], str]] = []
        self._broken: str | None = None
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
        self._held.clear()
        self._now_ms = None
        self._reports.clear()
        self._replaced.clear()
        self._renewals.clear()
        self._broken = None
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
        """The clock the last read of this transaction observed (each lock and the session read
        observe it), else read now; after a write it is read again."""
        if self._now_ms is None:
            self._now_ms = int(self.execute(queries.now_statement(0)).scalar_one())
        return self._now_ms

    def observed(self, now_ms: Any) -> None:
        self._now_ms = int(now_ms)

    def commit(self) -> None:
        if self._broken is None:
            self.flush_renewals()
        if self._broken is not None:
            raise ConcurrencyConflict(f"not committed: {self._broken}")
        if self._reports or self._replaced:
            raise RuntimeError(
                "a stop report or a session replacement was held but never written with its "
                "change; nothing is committed"
            )
        self.connection.commit()

    def execute(self, statement: Any, parameters: Mapping[str, Any] | None = None) -> Any:
        """Run a statement in this transaction. Input PostgreSQL cannot store is an
        :class:`~ql3.domain.errors.InvalidAdmission` (the transaction is then unusable)."""
        try:
            return self.connection.execute(statement, parameters)
        except UnicodeEncodeError as error:
            raise InvalidAdmission(_unstorable(error) or "bad input") from None
        except DBAPIError as error:
            reason = _unstorable(error.orig) if error.orig is not None else None
            if reason is None:
                raise
            raise InvalidAdmission(reason) from None

    # what the reads of this transaction saw

    def saw_session(self, session: WorkerSession, held: Sequence[str] | None = None) -> None:
        self._sessions[session.id] = session
        if held is not None:
            self._held[session.id] = tuple(held)

    def held_of(self, session_id: str) -> tuple[str, ...] | None:
        return self._held.get(session_id)

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

    def hold_renewal(self, item: dict[str, Any], what: str) -> None:
        self._renewals.append((item, what))

    def flush_renewals(self) -> None:
        if self._renewals:
            renewals, self._renewals = self._renewals, []
            self.call(RENEW, [item for item, _ in renewals], lambda i: renewals[i][1])

    # function calls

    def call(
        self, function: str, items: Sequence[Mapping[str, Any]], what: Callable[[int], str]
    ) -> None:
        """Items through one function, in calls of at most :data:`MAX_CALL_ITEMS`. ``conflict``
        is a ConcurrencyConflict; ``refused`` means the function does not take the item as a
        worker's transition. An item the function does not take changes nothing; when others
        were written before it, the unit of work refuses to commit (all or nothing)."""
        written = False
        for start, chunk in _chunks(items):
            self._now_ms = None
            self._held.clear()
            results = self.execute(_call_statement(function), {"items": [dict(i) for i in chunk]})
            failed = None
            for result in results.all():
                if result.outcome == "ok":
                    written = True
                elif failed is None:
                    failed = result
            if failed is None:
                continue
            message = f"{what(start + int(failed.item) - 1)}: {failed.detail}"
            if written:
                self._broken = message
            if failed.outcome == "conflict":
                raise ConcurrencyConflict(message)
            raise IngressNotPermitted(message)


# --- repositories ------------------------------------------------------------------------------


class IngressRunRepository(SqlRunReads[PostgresIngressUnitOfWork]):
    queries = queries

    def add(self, change: Change) -> None:
        _not_permitted("admit runs")

    def add_many(self, changes: Sequence[Change]) -> None:
        _not_permitted("admit runs")

    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None:
        """The Attempt's advisory lock (as the runtime's store takes it), then its rows read
        after it: the functions lock and re-check the rows before they write."""
        return self._lock([attempt_id], skip_locked=skip_locked)[0]

    def lock_attempts(self, attempt_ids: Sequence[str]) -> list[Snapshot | None]:
        """:meth:`lock_attempt` for each id in the order given, in one call."""
        return self._lock(list(attempt_ids), skip_locked=False)

    def _lock(self, attempt_ids: Sequence[str], *, skip_locked: bool) -> list[Snapshot | None]:
        found: list[Snapshot | None] = []
        for _, chunk in _chunks(attempt_ids):
            parameters = {"attempt_ids": list(chunk), "skip_locked": skip_locked}
            answer = self._uow.execute(_lock_attempts_statement(), parameters).scalar_one()
            self._uow.observed(answer["observed_at"])
            found.extend(
                _snapshot(item) if item and "run" in item else None for item in answer["snapshots"]
            )
        return found

    def lock_for_claim(
        self, session_id: str, tasks: Sequence[str], limit_per_task: int
    ) -> ClaimLock:
        """One call of the claim's lock function, on behalf of the session read (and its secret
        checked) in this unit of work."""
        if isinstance(limit_per_task, bool) or not 1 <= limit_per_task <= MAX_CALL_ITEMS:
            raise ValueError(f"limit_per_task must be within 1..{MAX_CALL_ITEMS}")
        uow = self._uow
        session = uow.acting_session(session_id)
        parameters = {
            "session_id": session.id,
            "secret_hash": session.secret_hash,
            "tasks": list(tasks),
            "limit": limit_per_task,
        }
        answer = uow.execute(_claim_lock_statement(), parameters).scalar_one()
        uow.observed(answer["observed_at"])
        capacity = None
        if answer["session"] is not None:
            locked = rows.session_from_row(_from_json(worker_sessions, answer["session"]))
            uow.saw_session(locked)
            capacity = SessionCapacity(session=locked, in_flight=int(answer["in_flight"]))
        return ClaimLock(
            capacity=capacity,
            gate=_gate(answer["gate"]),
            candidates=tuple(_snapshot(found) for found in answer["candidates"]),
            in_flight_by_task={
                str(task): int(count) for task, count in answer["in_flight_by_task"].items()
            },
            observed_at_ms=int(answer["observed_at"]),
            limits={
                str(task): int(limit)
                for task, limit in (answer.get("task_limits") or {}).items()
            },
        )

    def lock_run(self, run_id: str) -> Snapshot | None:
        _not_permitted("lock runs (recovery and lost retry run on the runtime's own store)")

    def task_limits(self) -> Sequence[TaskLimit]:
        _not_permitted("read task limits (a claim's locks read those it needs)")

    def set_task_limit(self, limit: TaskLimit) -> None:
        _not_permitted("set task limits")

    def clear_task_limit(self, task: str) -> bool:
        _not_permitted("clear task limits")

    def apply(self, before: Snapshot, change: Change) -> None:
        self.apply_many([(before, change)])

    def apply_many(self, writes: Sequence[tuple[Snapshot, Change]]) -> None:
        """Every write as an item of one call (the held renewals first, as a call of their
        own); all or nothing."""
        uow = self._uow
        uow.flush_renewals()
        if not writes:
            return
        items = [self._item(before, change) for before, change in writes]
        uow.call(APPLY, items, lambda i: f"attempt {items[i]['attempt_id']}")

    def _item(self, before: Snapshot, change: Change) -> dict[str, Any]:
        if change.run.id != before.run.id:
            raise ValueError(f"change of run {change.run.id} applied to run {before.run.id}")
        if change.event.type is EventType.ATTEMPT_STARTED:
            return self._claim_item(before, change)
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
            _not_permitted("grant leases but by a claim")
        session = self._uow.acting_session(lease.holder_session_id)
        after_attempt = change.attempts[0] if change.attempts else attempt
        after_lease = change.lease if change.lease is not None else lease
        item: dict[str, Any] = {
            "session_id": session.id,
            "secret_hash": session.secret_hash,
            "run_id": before.run.id,
            "attempt_id": attempt.id,
            "run": {
                "status": before.run.status.value,
                "attempt_count": before.run.attempt_count,
                "to": _changed(runs, rows.run_values(before.run), rows.run_values(change.run)),
            },
            "attempt": {
                "status": attempt.status.value,
                "lease_version": attempt.lease_version,
                "to": _changed(
                    run_attempts, rows.attempt_values(attempt), rows.attempt_values(after_attempt)
                ),
            },
            "lease": {
                "generation": lease.generation,
                "version": lease.version,
                "status": lease.status.value,
                "token_hash": lease.token_hash,
                "to": _changed(
                    run_dispatch_leases, rows.lease_values(lease), rows.lease_values(after_lease)
                ),
            },
            "event": _event(change.event),
        }
        if report is not None:
            item["report"] = {
                "attempt_id": report.attempt_id,
                "kind": report.kind.value,
                "reported_at": millis_to_datetime(report.reported_at_ms).isoformat(),
                "detail": report.detail,
            }
        return item

    def _claim_item(self, before: Snapshot, change: Change) -> dict[str, Any]:
        """A claim: the pristine Attempt started under a new lease of the claiming session."""
        attempt, lease = before.attempt, change.lease
        if attempt is None or lease is None or [a.id for a in change.attempts] != [attempt.id]:
            _not_permitted("create attempts")
        if before.lease is not None and before.lease.generation >= lease.generation:
            _not_permitted("grant a lease of a generation already granted")
        session = self._uow.acting_session(lease.holder_session_id)
        return {
            "session_id": session.id,
            "secret_hash": session.secret_hash,
            "run_id": before.run.id,
            "attempt_id": attempt.id,
            "run": {
                "status": before.run.status.value,
                "attempt_count": before.run.attempt_count,
                "to": _changed(runs, rows.run_values(before.run), rows.run_values(change.run)),
            },
            "attempt": {
                "status": attempt.status.value,
                "lease_version": attempt.lease_version,
                "to": _changed(
                    run_attempts,
                    rows.attempt_values(attempt),
                    rows.attempt_values(change.attempts[0]),
                ),
            },
            "new_lease": _row(run_dispatch_leases, rows.lease_values(lease)),
            "event": _event(change.event),
        }

    def renew_lease(self, before: DispatchLease, after: DispatchLease) -> None:
        """Held, and sent with the other renewals of the batch in one call (at the batch's
        ``apply_many`` or at commit)."""
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
        self._uow.hold_renewal(item, f"lease {before.run_id}/{before.generation}")

    def events_of(self, run_id: str) -> Sequence[StoredEvent]:
        _not_permitted("read run events")


class IngressSessionRegistry(SqlSessionReads[PostgresIngressUnitOfWork]):
    queries = queries

    def get(self, session_id: str) -> WorkerSession | None:
        """The session, with the Attempts it holds and the clock, in one statement; remembered
        as a session this unit of work may act for once the caller has checked its secret."""
        found = self._uow.execute(_session_statement(), {"session_id": session_id})
        row = found.mappings().first()
        if row is None:
            return None
        session = rows.session_from_row(row)
        self._uow.saw_session(session, held=sorted(row["held"] or ()))
        self._uow.observed(row["observed_at"])
        return session

    def held_by(self, session_id: str) -> Sequence[str]:
        """As read with the session, when it was read in this transaction and nothing was
        written since."""
        held = self._uow.held_of(session_id)
        if held is not None:
            return held
        found = self._uow.execute(_held_statement(), {"session_id": session_id}).scalars()
        return tuple(sorted(str(attempt_id) for attempt_id in found))

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
        self._uow.call(REGISTER_SESSIONS, [item], lambda _: f"session {session.id}")

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
        self._uow.call(UPDATE_SESSIONS, [item], lambda _: f"session {before.id}")
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
    the ingress role, and the dispatch gate. The scheduler's candidate sources are not
    available."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @classmethod
    def from_url(
        cls, url: str, *, pool_size: int = 5, role: str | None = None
    ) -> PostgresIngressStore:
        """A store on ``url``, which names the ingress role (``ql3 db grant-ingress``), or, with
        ``role``, a role whose member ``url`` names, taken on every connection (``SET ROLE``;
        the default role of ``ql3 db upgrade``, ADR 0024); a bare ``postgresql://`` gets the
        psycopg driver. The schema must be migrated (``ql3 db upgrade``, run as the schema's
        owner)."""
        # Parameters are hidden from errors: the functions' parameters carry secret and
        # token hashes.
        engine = pooled_engine(_driver_url(url), pool_size=pool_size)
        if role is not None:
            set_role_on_connect(engine, role)
        return cls(engine)

    def acting_role(self) -> str:
        """The role this store's connections act as (``current_user``); opening the first
        connection here fails at once when that role cannot be taken."""
        with self.engine.connect() as connection:
            return str(connection.exec_driver_sql("SELECT current_user").scalar_one())

    def unit_of_work(self) -> PostgresIngressUnitOfWork:
        return PostgresIngressUnitOfWork(self)

    def close(self) -> None:
        self.engine.dispose()

    def dispatch_gate(self) -> DispatchGate:
        """The gate as committed: one read, outside any transaction."""
        with self.engine.connect() as connection:
            reader = connection.execution_options(isolation_level="AUTOCOMMIT")
            row = reader.execute(statements.get_gate()).mappings().first()
        return statements.gate_from_row(row)

    # The scheduler's candidate sources run on the runtime's own store.

    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        _not_permitted("look for recovery candidates")

    def lost_runs(self, limit: int) -> Page[RunCandidate]:
        _not_permitted("look for lost runs")

    def due_retries(self, limit: int) -> Page[RunCandidate]:
        _not_permitted("look for due retries")

    def orphaned_runs(self, limit: int) -> Page[RunCandidate]:
        _not_permitted("look for orphaned runs")


if TYPE_CHECKING:

    def _conforms(
        store: PostgresIngressStore, uow: PostgresIngressUnitOfWork
    ) -> tuple[RuntimeStore, UnitOfWork]:
        """Lets mypy check that the store implements the ports structurally."""
        return store, uow
