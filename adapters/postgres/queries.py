"""Every SQL statement of the PostgreSQL store, as SQLAlchemy Core constructs.

The store executes these and nothing else, and the tests EXPLAIN the very same statements.

Time is the database's: :func:`store_now` is ``statement_timestamp()`` plus the store's clock
offset (zero in production, moved only by the test hook), truncated to whole milliseconds, so the
value a query compares with is exactly the ``observed_at_ms`` it reports.

Status constants are rendered as SQL literals, not bound parameters, so that the planner can
match the partial indexes of :mod:`adapters.sql.schema` even with a generic (prepared) plan.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Double,
    Insert,
    Integer,
    Interval,
    Select,
    Text,
    Update,
    and_,
    any_,
    bindparam,
    exists,
    false,
    func,
    insert,
    literal_column,
    not_,
    or_,
    select,
    text,
    true,
    type_coerce,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.base import ReadOnlyColumnCollection
from sqlalchemy.sql.elements import BindParameter

from adapters.sql import rows
from adapters.sql.schema import (
    ALL_TABLES,
    EpochMillis,
    attempt_stop_reports,
    run_attempts,
    run_dispatch_leases,
    run_events,
    runs,
    worker_sessions,
)
from domain.events import RunEvent
from domain.model import (
    Attempt,
    AttemptStatus,
    DispatchLease,
    LeaseStatus,
    Run,
    RunOwner,
    RunStatus,
    SessionStatus,
    StopReport,
    WorkerSession,
)

# The first key of every two-key advisory lock the store takes: "QL3" in ASCII, an int4.
ADVISORY_LOCK_NAMESPACE = 0x514C33

RUN_COLUMNS = "r_"
ATTEMPT_COLUMNS = "a_"
LEASE_COLUMNS = "l_"
SESSION_COLUMNS = "s_"

ACTIVE_ATTEMPT_STATUSES = (AttemptStatus.CLAIMED, AttemptStatus.STARTING, AttemptStatus.RUNNING)
RECOVERABLE_RUN_STATUSES = (RunStatus.DISPATCHING, RunStatus.RUNNING, RunStatus.LOST)
OPEN_SESSION_STATUSES = (SessionStatus.ACTIVE, SessionStatus.DRAINING)
GONE_SESSION_STATUSES = (SessionStatus.CLOSED, SessionStatus.REPLACED)


def const(value: str) -> ColumnElement[str]:
    """A constant from a domain enum, rendered inline as a SQL string literal."""
    if "'" in value:
        raise ValueError(f"not a plain constant: {value!r}")
    return literal_column(f"'{value}'", Text())


def _is(column: ColumnElement[str], status: enum.Enum) -> ColumnElement[bool]:
    return column == const(str(status.value))


def _one_of(column: ColumnElement[str], statuses: Iterable[enum.Enum]) -> ColumnElement[bool]:
    return column.in_([const(str(s.value)) for s in statuses])


# --- the store's clock -------------------------------------------------------------------------


def _offset_interval(clock_offset_ms: int) -> ColumnElement[object]:
    offset: BindParameter[float] = bindparam(
        "clock_offset_s", clock_offset_ms / 1000.0, type_=Double()
    )
    return type_coerce(
        text("make_interval(secs => :clock_offset_s)").bindparams(offset), Interval()
    )


def store_timestamp(clock_offset_ms: int) -> ColumnElement[object]:
    """``statement_timestamp()`` plus the clock offset, truncated to milliseconds (timestamptz)."""
    shifted = func.statement_timestamp() + _offset_interval(clock_offset_ms)
    return func.date_trunc(literal_column("'milliseconds'"), shifted)


def store_now(clock_offset_ms: int) -> ColumnElement[int]:
    """The store's clock as epoch milliseconds: what every time predicate compares with."""
    return type_coerce(store_timestamp(clock_offset_ms), EpochMillis())


def now_statement(clock_offset_ms: int) -> Select:
    return select(store_now(clock_offset_ms).label("now_ms"))


# --- column lists ------------------------------------------------------------------------------


def _labelled(
    table_columns: Iterable[ColumnElement[object]], prefix: str
) -> list[ColumnElement[object]]:
    return [column.label(f"{prefix}{column.key}") for column in table_columns]


def run_columns() -> list[ColumnElement[object]]:
    return _labelled(runs.c, RUN_COLUMNS)


def attempt_columns() -> list[ColumnElement[object]]:
    return _labelled(run_attempts.c, ATTEMPT_COLUMNS)


def lease_columns() -> list[ColumnElement[object]]:
    return _labelled(run_dispatch_leases.c, LEASE_COLUMNS)


def _pristine(a: ReadOnlyColumnCollection[str, ColumnElement[Any]]) -> ColumnElement[bool]:
    """Mirror of :attr:`domain.model.Attempt.is_pristine` on columns of ``run_attempts``."""
    return and_(
        _is(a.status, AttemptStatus.CLAIMED),
        a.session_id.is_(None),
        a.worker_id.is_(None),
        a.lease_generation.is_(None),
        a.offered_at.is_(None),
        a.accepted_at.is_(None),
        a.started_at.is_(None),
    )


def _latest_attempt_id() -> ColumnElement[str]:
    """The id of the Run's highest-number Attempt (correlated to ``runs``)."""
    a = run_attempts.c
    return (
        select(a.id)
        .where(a.run_id == runs.c.id)
        .order_by(a.number.desc())
        .limit(1)
        .correlate(runs)
        .scalar_subquery()
    )


# --- locks -------------------------------------------------------------------------------------


def advisory_lock(key: str) -> Select:
    """``pg_advisory_xact_lock(<QL3 namespace>, hashtext(key))``: released at transaction end."""
    namespace = literal_column(str(ADVISORY_LOCK_NAMESPACE), Integer())
    return select(func.pg_advisory_xact_lock(namespace, func.hashtext(bindparam("lock_key", key))))


def try_advisory_lock(key: str) -> Select:
    """``pg_try_advisory_xact_lock``: the same lock, or false at once when someone holds it."""
    namespace = literal_column(str(ADVISORY_LOCK_NAMESPACE), Integer())
    return select(
        func.pg_try_advisory_xact_lock(namespace, func.hashtext(bindparam("try_lock_key", key)))
    )


def lock_attempt_rows(attempt_id: str, run_id: str | None = None) -> Select:
    """Run and Attempt rows, locked in the order runs, run_attempts, by one statement."""
    statement = (
        select(*run_columns(), *attempt_columns())
        .select_from(runs.join(run_attempts, run_attempts.c.run_id == runs.c.id))
        .where(run_attempts.c.id == attempt_id)
        .with_for_update(of=[runs, run_attempts])
    )
    if run_id is not None:
        statement = statement.where(runs.c.id == run_id)
    return statement


def lock_run_row(run_id: str) -> Select:
    return select(*run_columns()).where(runs.c.id == run_id).with_for_update(of=runs)


def latest_attempt_of(run_id: str) -> Select:
    """The Run's id (so that a missing Run is told apart) and its highest-number Attempt id."""
    return select(runs.c.id, _latest_attempt_id().label("attempt_id")).where(runs.c.id == run_id)


def lock_lease(run_id: str, generation: int | None) -> Select:
    """The lease of that generation, or the Run's highest-generation lease, locked."""
    l = run_dispatch_leases.c  # noqa: E741
    statement = select(*lease_columns()).where(l.run_id == run_id)
    if generation is not None:
        statement = statement.where(l.generation == generation)
    else:
        statement = statement.order_by(l.generation.desc()).limit(1)
    return statement.with_for_update(of=run_dispatch_leases)


# --- writes: inserts ---------------------------------------------------------------------------


def insert_run(run: Run) -> Insert:
    return insert(runs).values(rows.run_values(run))


def insert_attempt(attempt: Attempt) -> Insert:
    return insert(run_attempts).values(rows.attempt_values(attempt))


def insert_lease(lease: DispatchLease) -> Insert:
    return insert(run_dispatch_leases).values(rows.lease_values(lease))


def insert_event(event: RunEvent) -> Insert:
    return insert(run_events).values(rows.event_values(event))


def insert_session(session: WorkerSession) -> Insert:
    return insert(worker_sessions).values(rows.session_values(session))


def insert_report(report: StopReport) -> Insert:
    return insert(attempt_stop_reports).values(rows.report_values(report))


# --- writes: compare-and-set updates -----------------------------------------------------------


def _without(values: rows.Values, *keys: str) -> rows.Values:
    return {name: value for name, value in values.items() if name not in keys}


def update_run(before: Run, after: Run) -> Update:
    """Fenced on the status and attempt count the transaction read."""
    return (
        update(runs)
        .where(
            runs.c.id == before.id,
            runs.c.status == before.status.value,
            runs.c.attempt_count == before.attempt_count,
        )
        .values(_without(rows.run_values(after), "id"))
    )


def update_attempt(before: Attempt, after: Attempt) -> Update:
    """Fenced on the status and lease version the transaction read."""
    a = run_attempts.c
    return (
        update(run_attempts)
        .where(
            a.id == before.id,
            a.status == before.status.value,
            a.lease_version.is_not_distinct_from(before.lease_version),
        )
        .values(_without(rows.attempt_values(after), "id"))
    )


def update_lease(before: DispatchLease, after: DispatchLease) -> Update:
    """Fenced on version, status and token hash of the lease the transaction read."""
    l = run_dispatch_leases.c  # noqa: E741
    return (
        update(run_dispatch_leases)
        .where(
            l.run_id == before.run_id,
            l.generation == before.generation,
            l.version == before.version,
            l.status == before.status.value,
            l.token_hash.is_not_distinct_from(before.token_hash),
        )
        .values(_without(rows.lease_values(after), "run_id", "generation"))
    )


def renew_lease(before: DispatchLease, after: DispatchLease, clock_offset_ms: int) -> Update:
    """Moves only ``expires_at`` (no indexed column: a HOT update), while the presented lease is
    still leased, unchanged and unexpired by the store's clock."""
    l = run_dispatch_leases.c  # noqa: E741
    token_matches = l.token_hash == before.token_hash if before.token_hash is not None else false()
    return (
        update(run_dispatch_leases)
        .where(
            l.run_id == before.run_id,
            l.generation == before.generation,
            l.version == before.version,
            _is(l.status, LeaseStatus.LEASED),
            l.status == before.status.value,
            token_matches,
            l.expires_at > store_now(clock_offset_ms),
        )
        .values(expires_at=after.expires_at_ms)
    )


def update_session(before: WorkerSession, after: WorkerSession) -> Update:
    """Fenced on the status the transaction read."""
    s = worker_sessions.c
    return (
        update(worker_sessions)
        .where(s.id == before.id, s.status == before.status.value)
        .values(_without(rows.session_values(after), "id"))
    )


# --- reads -------------------------------------------------------------------------------------


def get_run(run_id: str) -> Select:
    return select(runs).where(runs.c.id == run_id)


def get_attempt(attempt_id: str) -> Select:
    return select(run_attempts).where(run_attempts.c.id == attempt_id)


def attempts_of(run_id: str) -> Select:
    a = run_attempts.c
    return select(run_attempts).where(a.run_id == run_id).order_by(a.number)


def leases_of(run_id: str) -> Select:
    l = run_dispatch_leases.c  # noqa: E741
    return select(run_dispatch_leases).where(l.run_id == run_id).order_by(l.generation)


def events_of(run_id: str) -> Select:
    e = run_events.c
    return select(run_events).where(e.run_id == run_id).order_by(e.id)


def list_runs(status: RunStatus | None, limit: int) -> Select:
    statement = select(runs)
    if status is not None:
        statement = statement.where(runs.c.status == status.value)
    return statement.order_by(runs.c.created_at, runs.c.id.collate("C")).limit(limit)


def get_session(session_id: str) -> Select:
    return select(worker_sessions).where(worker_sessions.c.id == session_id)


def open_sessions_of(worker_id: str) -> Select:
    s = worker_sessions.c
    return (
        select(worker_sessions)
        .where(s.worker_id == worker_id, _one_of(s.status, OPEN_SESSION_STATUSES))
        .order_by(s.id.collate("C"))
        .with_for_update()
    )


def offers_of(session_id: str) -> Select:
    a = run_attempts.c
    l = run_dispatch_leases.c  # noqa: E741
    return (
        select(*attempt_columns(), *lease_columns())
        .select_from(run_dispatch_leases.join(run_attempts, a.id == l.attempt_id))
        .where(
            _is(l.status, LeaseStatus.LEASED),
            l.holder_session_id == session_id,
            l.token_hash.is_(None),
            _is(a.status, AttemptStatus.CLAIMED),
        )
        .order_by(l.granted_at, a.id.collate("C"))
    )


def reports_for(attempt_id: str) -> Select:
    r = attempt_stop_reports.c
    return (
        select(attempt_stop_reports).where(r.attempt_id == attempt_id).order_by(r.reported_at, r.id)
    )


# --- candidate sources: one statement each -----------------------------------------------------
#
# Each is ``clock LEFT JOIN (the page) ON true``: exactly one row even for an empty page, so the
# observed time comes with the page in one round trip. Every page query reads ``limit + 1`` rows.


def recovery_candidates_query(limit: int, clock_offset_ms: int = 0) -> Select:
    """Runtime-owned, non-pristine claimed|starting|running Attempts of dispatching|running|lost
    Runs whose own lease is missing, released or expired; resolvable ones first."""
    a = run_attempts.c
    r = runs.c
    l = run_dispatch_leases.c  # noqa: E741
    now = store_now(clock_offset_ms)
    stop_reported = exists().where(attempt_stop_reports.c.attempt_id == a.id)
    session_gone = exists().where(
        worker_sessions.c.id == a.session_id,
        _one_of(worker_sessions.c.status, GONE_SESSION_STATUSES),
    )
    resolvable = or_(_is(a.status, AttemptStatus.CLAIMED), stop_reported, session_gone)
    own_lease = and_(l.run_id == a.run_id, l.generation == a.lease_generation, l.attempt_id == a.id)
    page = (
        select(
            a.run_id.label("run_id"),
            a.id.label("attempt_id"),
            a.status.label("attempt_status"),
            l.expires_at.label("lease_expires_at"),
            resolvable.label("resolvable"),
        )
        .select_from(
            run_attempts.join(runs, r.id == a.run_id).outerjoin(run_dispatch_leases, own_lease)
        )
        .where(
            _one_of(a.status, ACTIVE_ATTEMPT_STATUSES),
            not_(_pristine(a)),
            _is(r.owner, RunOwner.RUNTIME),
            _one_of(r.status, RECOVERABLE_RUN_STATUSES),
            or_(l.run_id.is_(None), _is(l.status, LeaseStatus.RELEASED), l.expires_at <= now),
        )
        .order_by(resolvable.desc(), l.expires_at.asc().nulls_first(), a.id.collate("C"))
        .limit(limit + 1)
        .subquery("candidates")
    )
    clock = select(now.label("observed_at")).subquery("clock")
    return (
        select(clock.c.observed_at, *page.c)
        .select_from(clock.outerjoin(page, true()))
        .order_by(
            page.c.resolvable.desc(),
            page.c.lease_expires_at.asc().nulls_first(),
            page.c.attempt_id.collate("C"),
        )
    )


def _run_page(
    *,
    where: Sequence[ColumnElement[bool]],
    since: ColumnElement[int],
    limit: int,
    clock_offset_ms: int,
    with_attempt: bool,
) -> Select:
    attempt_id: ColumnElement[Any] = (
        _latest_attempt_id() if with_attempt else type_coerce(None, Text())
    )
    page = (
        select(runs.c.id.label("run_id"), attempt_id.label("attempt_id"), since.label("since"))
        .where(_is(runs.c.owner, RunOwner.RUNTIME), *where)
        .order_by(since, runs.c.id.collate("C"))
        .limit(limit + 1)
        .subquery("page")
    )
    clock = select(store_now(clock_offset_ms).label("observed_at")).subquery("clock")
    return (
        select(clock.c.observed_at, *page.c)
        .select_from(clock.outerjoin(page, true()))
        .order_by(page.c.since, page.c.run_id.collate("C"))
    )


def lost_runs_query(limit: int, clock_offset_ms: int = 0) -> Select:
    """Runtime-owned ``lost`` Runs, by (updated_at, id)."""
    return _run_page(
        where=[_is(runs.c.status, RunStatus.LOST)],
        since=runs.c.updated_at,
        limit=limit,
        clock_offset_ms=clock_offset_ms,
        with_attempt=True,
    )


def due_retries_query(limit: int, clock_offset_ms: int = 0) -> Select:
    """Runtime-owned ``retry_wait`` Runs whose next_attempt_at the store's clock reached."""
    return _run_page(
        where=[
            _is(runs.c.status, RunStatus.RETRY_WAIT),
            runs.c.next_attempt_at <= store_now(clock_offset_ms),
        ],
        since=runs.c.next_attempt_at,
        limit=limit,
        clock_offset_ms=clock_offset_ms,
        with_attempt=True,
    )


def orphaned_runs_query(limit: int, clock_offset_ms: int = 0) -> Select:
    """Runtime-owned ``created`` Runs without an Attempt, by (created_at, id)."""
    return _run_page(
        where=[_is(runs.c.status, RunStatus.CREATED), runs.c.attempt_count == 0],
        since=runs.c.created_at,
        limit=limit,
        clock_offset_ms=clock_offset_ms,
        with_attempt=False,
    )


def queued_attempts_query(
    limit_per_task: int, tasks: Sequence[str], clock_offset_ms: int = 0
) -> Select:
    """Pristine latest Attempts of ``queued`` Runs of the named tasks, at most
    ``limit_per_task + 1`` per task (the extra row tells ``has_more``), by (queued_at, run id)."""
    a = run_attempts.c
    r = runs.c
    latest = (
        select(run_attempts)
        .where(a.run_id == r.id)
        .order_by(a.number.desc())
        .limit(1)
        .lateral("latest")
    )
    lc = latest.c
    task_list = bindparam("tasks", list(tasks), type_=postgresql.ARRAY(Text()))
    ranked = (
        select(
            r.id.label("run_id"),
            lc.id.label("attempt_id"),
            r.task.label("task"),
            lc.created_at.label("queued_at"),
            func.row_number()
            .over(partition_by=r.task, order_by=(lc.created_at, r.id.collate("C")))
            .label("task_rank"),
        )
        .select_from(runs.join(latest, true()))
        .where(_is(r.status, RunStatus.QUEUED), r.task == any_(task_list), _pristine(lc))
        .subquery("ranked")
    )
    page = select(*ranked.c).where(ranked.c.task_rank <= limit_per_task + 1).subquery("page")
    clock = select(store_now(clock_offset_ms).label("observed_at")).subquery("clock")
    return (
        select(clock.c.observed_at, *page.c)
        .select_from(clock.outerjoin(page, true()))
        .order_by(page.c.queued_at, page.c.run_id.collate("C"))
    )


def available_sessions_query(max_silence_ms: int, clock_offset_ms: int = 0) -> Select:
    """Active sessions heard from less than ``max_silence_ms`` ago, with the number of leased
    leases each holds, by id."""
    s = worker_sessions.c
    l = run_dispatch_leases.c  # noqa: E741
    in_flight = (
        select(func.count())
        .where(l.holder_session_id == s.id, _is(l.status, LeaseStatus.LEASED))
        .correlate(worker_sessions)
        .scalar_subquery()
    )
    silence = bindparam("max_silence", dt.timedelta(milliseconds=max_silence_ms), type_=Interval())
    oldest_heartbeat = type_coerce(store_timestamp(clock_offset_ms) - silence, EpochMillis())
    return (
        select(worker_sessions, in_flight.label("in_flight"))
        .where(_is(s.status, SessionStatus.ACTIVE), s.last_heartbeat_at > oldest_heartbeat)
        .order_by(s.id.collate("C"))
    )


# --- maintenance -------------------------------------------------------------------------------


def truncate_all() -> str:
    """TRUNCATE every table of the schema (test hook)."""
    names = ", ".join(table.name for table in ALL_TABLES)
    return f"TRUNCATE TABLE {names} RESTART IDENTITY CASCADE"
