"""Every SQL statement of the SQLite store, as SQLAlchemy Core constructs on the shared tables.

The store's clock is read in Python by the store and bound into each statement as ``now`` (epoch
milliseconds), so a page compares with exactly the ``observed_at_ms`` it reports. There are no
row locks or advisory locks here: a SQLite write transaction (``BEGIN IMMEDIATE``) holds the
whole database, which serialises every writer.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Delete,
    Insert,
    Select,
    Update,
    and_,
    delete,
    exists,
    false,
    func,
    insert,
    literal,
    not_,
    or_,
    select,
    update,
)
from sqlalchemy.sql.base import ReadOnlyColumnCollection

from adapters.sql import rows
from adapters.sql.schema import (
    attempt_stop_reports,
    metadata,
    run_attempts,
    run_dispatch_leases,
    run_events,
    runs,
    triggers,
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
from domain.triggers import TriggerStatus

RUN_COLUMNS = "r_"
ATTEMPT_COLUMNS = "a_"
LEASE_COLUMNS = "l_"

ACTIVE_ATTEMPT_STATUSES = (AttemptStatus.CLAIMED, AttemptStatus.STARTING, AttemptStatus.RUNNING)
RECOVERABLE_RUN_STATUSES = (RunStatus.DISPATCHING, RunStatus.RUNNING, RunStatus.LOST)
OPEN_SESSION_STATUSES = (SessionStatus.ACTIVE, SessionStatus.DRAINING)
GONE_SESSION_STATUSES = (SessionStatus.CLOSED, SessionStatus.REPLACED)


def _is(column: ColumnElement[str], status: enum.Enum) -> ColumnElement[bool]:
    return column == str(status.value)


def _one_of(column: ColumnElement[str], statuses: Iterable[enum.Enum]) -> ColumnElement[bool]:
    return column.in_([str(s.value) for s in statuses])


def _labelled(
    table_columns: Iterable[ColumnElement[object]], prefix: str
) -> list[ColumnElement[object]]:
    return [column.label(f"{prefix}{column.key}") for column in table_columns]


def _without(values: rows.Values, *keys: str) -> rows.Values:
    return {name: value for name, value in values.items() if name not in keys}


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


# --- reads inside a unit of work ---------------------------------------------------------------


def attempt_with_run(attempt_id: str) -> Select:
    """Run and Attempt side by side, columns prefixed ``r_`` and ``a_``."""
    return (
        select(*_labelled(runs.c, RUN_COLUMNS), *_labelled(run_attempts.c, ATTEMPT_COLUMNS))
        .select_from(runs.join(run_attempts, run_attempts.c.run_id == runs.c.id))
        .where(run_attempts.c.id == attempt_id)
    )


def latest_attempt_of(run_id: str) -> Select:
    """The Run's id (so that a missing Run is told apart) and its highest-number Attempt id."""
    return select(runs.c.id, _latest_attempt_id().label("attempt_id")).where(runs.c.id == run_id)


def lease_of(run_id: str, generation: int | None) -> Select:
    """The lease of that generation, or the Run's highest-generation lease."""
    l = run_dispatch_leases.c  # noqa: E741
    statement = select(run_dispatch_leases).where(l.run_id == run_id)
    if generation is not None:
        return statement.where(l.generation == generation)
    return statement.order_by(l.generation.desc()).limit(1)


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
        statement = statement.where(_is(runs.c.status, status))
    return statement.order_by(runs.c.created_at, runs.c.id).limit(limit)


def get_session(session_id: str) -> Select:
    return select(worker_sessions).where(worker_sessions.c.id == session_id)


def open_sessions_of(worker_id: str) -> Select:
    s = worker_sessions.c
    return (
        select(worker_sessions)
        .where(s.worker_id == worker_id, _one_of(s.status, OPEN_SESSION_STATUSES))
        .order_by(s.id)
    )


def offers_of(session_id: str) -> Select:
    a = run_attempts.c
    l = run_dispatch_leases.c  # noqa: E741
    return (
        select(*_labelled(run_attempts.c, ATTEMPT_COLUMNS), *_labelled(l, LEASE_COLUMNS))
        .select_from(run_dispatch_leases.join(run_attempts, a.id == l.attempt_id))
        .where(
            _is(l.status, LeaseStatus.LEASED),
            l.holder_session_id == session_id,
            l.token_hash.is_(None),
            _is(a.status, AttemptStatus.CLAIMED),
        )
        .order_by(l.granted_at, a.id)
    )


def reports_for(attempt_id: str) -> Select:
    r = attempt_stop_reports.c
    return (
        select(attempt_stop_reports).where(r.attempt_id == attempt_id).order_by(r.reported_at, r.id)
    )


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


def renew_lease(before: DispatchLease, after: DispatchLease, now_ms: int) -> Update:
    """Moves only ``expires_at``, while the presented lease is still leased, unchanged and
    unexpired by the store's clock."""
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
            l.expires_at > now_ms,
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


# --- candidate sources: one statement each -----------------------------------------------------
#
# Every page query reads ``limit + 1`` rows to learn ``has_more``.


def recovery_candidates_query(limit: int, now_ms: int) -> Select:
    """Runtime-owned, non-pristine claimed|starting|running Attempts of dispatching|running|lost
    Runs whose own lease is missing, released or expired; resolvable ones first."""
    a = run_attempts.c
    r = runs.c
    l = run_dispatch_leases.c  # noqa: E741
    stop_reported = exists().where(attempt_stop_reports.c.attempt_id == a.id)
    session_gone = exists().where(
        worker_sessions.c.id == a.session_id,
        _one_of(worker_sessions.c.status, GONE_SESSION_STATUSES),
    )
    resolvable = or_(_is(a.status, AttemptStatus.CLAIMED), stop_reported, session_gone)
    own_lease = and_(l.run_id == a.run_id, l.generation == a.lease_generation, l.attempt_id == a.id)
    return (
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
            or_(l.run_id.is_(None), _is(l.status, LeaseStatus.RELEASED), l.expires_at <= now_ms),
        )
        .order_by(resolvable.desc(), l.expires_at.asc().nulls_first(), a.id)
        .limit(limit + 1)
    )


def _run_page(
    *, where: Sequence[ColumnElement[bool]], since: ColumnElement[int], limit: int, latest: bool
) -> Select:
    attempt_id: ColumnElement[Any] = _latest_attempt_id() if latest else literal(None)
    return (
        select(runs.c.id.label("run_id"), attempt_id.label("attempt_id"), since.label("since"))
        .where(_is(runs.c.owner, RunOwner.RUNTIME), *where)
        .order_by(since, runs.c.id)
        .limit(limit + 1)
    )


def lost_runs_query(limit: int) -> Select:
    """Runtime-owned ``lost`` Runs, by (updated_at, id)."""
    return _run_page(
        where=[_is(runs.c.status, RunStatus.LOST)],
        since=runs.c.updated_at,
        limit=limit,
        latest=True,
    )


def due_retries_query(limit: int, now_ms: int) -> Select:
    """Runtime-owned ``retry_wait`` Runs whose next_attempt_at the store's clock reached."""
    return _run_page(
        where=[_is(runs.c.status, RunStatus.RETRY_WAIT), runs.c.next_attempt_at <= now_ms],
        since=runs.c.next_attempt_at,
        limit=limit,
        latest=True,
    )


def orphaned_runs_query(limit: int) -> Select:
    """Runtime-owned ``created`` Runs without an Attempt, by (created_at, id)."""
    return _run_page(
        where=[_is(runs.c.status, RunStatus.CREATED), runs.c.attempt_count == 0],
        since=runs.c.created_at,
        limit=limit,
        latest=False,
    )


def queued_attempts_query(limit_per_task: int, tasks: Sequence[str]) -> Select:
    """Pristine latest Attempts of ``queued`` Runs of the named tasks, at most
    ``limit_per_task + 1`` per task (the extra row tells ``has_more``), by (queued_at, run id)."""
    a = run_attempts.c
    r = runs.c
    ranked = (
        select(
            r.id.label("run_id"),
            a.id.label("attempt_id"),
            r.task.label("task"),
            a.created_at.label("queued_at"),
            func.row_number()
            .over(partition_by=r.task, order_by=(a.created_at, r.id))
            .label("task_rank"),
        )
        .select_from(runs.join(run_attempts, a.id == _latest_attempt_id()))
        .where(_is(r.status, RunStatus.QUEUED), r.task.in_(list(tasks)), _pristine(a))
        .subquery("ranked")
    )
    return (
        select(*ranked.c)
        .where(ranked.c.task_rank <= limit_per_task + 1)
        .order_by(ranked.c.queued_at, ranked.c.run_id)
    )


def available_sessions_query(max_silence_ms: int, now_ms: int) -> Select:
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
    return (
        select(worker_sessions, in_flight.label("in_flight"))
        .where(_is(s.status, SessionStatus.ACTIVE), s.last_heartbeat_at > now_ms - max_silence_ms)
        .order_by(s.id)
    )


# --- due times (what an idle Edge process sleeps until) ---------------------------------------


def next_retry_at_query() -> Select:
    """The earliest ``next_attempt_at`` of runtime-owned ``retry_wait`` Runs (NULL if none)."""
    return select(func.min(runs.c.next_attempt_at)).where(
        _is(runs.c.owner, RunOwner.RUNTIME), _is(runs.c.status, RunStatus.RETRY_WAIT)
    )


def next_trigger_at_query() -> Select:
    """The earliest ``next_fire_at`` of active triggers (NULL if none)."""
    active = str(TriggerStatus.ACTIVE.value)
    return select(func.min(triggers.c.next_fire_at)).where(triggers.c.status == active)


def last_foreign_lease_expiry_query(session_id: str) -> Select:
    """The latest ``expires_at`` of leased leases held by any session but ``session_id``."""
    l = run_dispatch_leases.c  # noqa: E741
    return select(func.max(l.expires_at)).where(
        _is(l.status, LeaseStatus.LEASED), l.holder_session_id != session_id
    )


# --- maintenance -------------------------------------------------------------------------------


def delete_all() -> list[Delete]:
    """DELETE every row, children before parents (test hook)."""
    return [delete(table) for table in reversed(metadata.sorted_tables)]
