"""The statements both SQL stores share, as SQLAlchemy Core constructs on the shared tables.

Inserts, compare-and-set updates and key lookups are the same on every dialect. Where the two
stores' statements differ only in how they spell a status constant or order text ids, the
builders take a :class:`Spelling`: PostgreSQL renders status constants inline (so that its
partial indexes match generic plans) and orders ids by the ``C`` collation; SQLite binds them
and orders ids by its default (binary) collation. What really differs per dialect (clocks,
locks, page queries of another shape) stays in each store's own ``queries`` module, which
applies its spelling to the builders here that take one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

from attrs import frozen
from sqlalchemy import (
    ColumnElement,
    Delete,
    Insert,
    Select,
    Text,
    Update,
    and_,
    delete,
    exists,
    false,
    insert,
    literal_column,
    not_,
    or_,
    select,
    update,
)
from sqlalchemy.sql.base import ReadOnlyColumnCollection

from ql3.adapters.sql import guards, rows
from ql3.adapters.sql.schema import (
    DISPATCH_GATE_ID,
    attempt_stop_reports,
    dispatch_gate,
    in_declared_order,
    metadata,
    run_attempts,
    run_dispatch_leases,
    run_events,
    runs,
    task_limits,
    worker_sessions,
)
from ql3.application.ports import DispatchGate, StepFailure
from ql3.domain.dispatch import TaskLimit
from ql3.domain.guards import LEASE_EXPIRED, LEASE_LIVE, PRISTINE_ATTEMPT
from ql3.domain.model import (
    AttemptStatus,
    DispatchLease,
    LeaseStatus,
    RunOwner,
    RunStatus,
    StopReport,
    WorkerSession,
)
from ql3.domain.states import (
    GONE_SESSION_STATUSES,
    NON_TERMINAL_ATTEMPT_STATUSES,
    NON_TERMINAL_RUN_STATUSES,
    OPEN_SESSION_STATUSES,
    RECOVERABLE_RUN_STATUSES,
)

RUN_COLUMNS = "r_"
ATTEMPT_COLUMNS = "a_"
LEASE_COLUMNS = "l_"


def const(value: str) -> ColumnElement[str]:
    """A constant from a domain enum, rendered inline as a SQL string literal."""
    if "'" in value:
        raise ValueError(f"not a plain constant: {value!r}")
    return literal_column(f"'{value}'", Text())


@frozen(kw_only=True)
class Spelling:
    """How one store writes what the dialects spell differently.

    ``inline_constants``: status constants as SQL literals (else bound parameters).
    ``id_collation``: the collation text ids are ordered by (None: the column's own)."""

    inline_constants: bool
    id_collation: str | None

    def constant(self, status: enum.Enum) -> ColumnElement[str] | str:
        value = str(status.value)
        return const(value) if self.inline_constants else value

    def is_(self, column: ColumnElement[str], status: enum.Enum) -> ColumnElement[bool]:
        return column == self.constant(status)

    def one_of(
        self, column: ColumnElement[str], statuses: Iterable[enum.Enum]
    ) -> ColumnElement[bool]:
        """``column IN (...)``, the statuses in the order their enum declares them (one SQL
        text for a set, whatever order it iterates in)."""
        ordered = in_declared_order(statuses)
        return column.in_([self.constant(status) for status in ordered])

    def by_id(self, column: ColumnElement[str]) -> ColumnElement[str]:
        """``column`` as text ids are ordered."""
        return column if self.id_collation is None else column.collate(self.id_collation)


# --- column lists ------------------------------------------------------------------------------


def labelled(
    table_columns: Iterable[ColumnElement[object]], prefix: str
) -> list[ColumnElement[object]]:
    return [column.label(f"{prefix}{column.key}") for column in table_columns]


def run_columns() -> list[ColumnElement[object]]:
    return labelled(runs.c, RUN_COLUMNS)


def attempt_columns() -> list[ColumnElement[object]]:
    return labelled(run_attempts.c, ATTEMPT_COLUMNS)


def lease_columns() -> list[ColumnElement[object]]:
    return labelled(run_dispatch_leases.c, LEASE_COLUMNS)


def pristine(
    a: ReadOnlyColumnCollection[str, ColumnElement[Any]], spelling: Spelling
) -> ColumnElement[bool]:
    """:data:`ql3.domain.guards.PRISTINE_ATTEMPT` on columns of ``run_attempts``."""
    return guards.core(PRISTINE_ATTEMPT, {"attempt": a}, spelling=spelling)


def latest_attempt_id() -> ColumnElement[str]:
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


def latest_attempt_of(run_id: str) -> Select:
    """The Run's id (so that a missing Run is told apart) and its highest-number Attempt id."""
    return select(runs.c.id, latest_attempt_id().label("attempt_id")).where(runs.c.id == run_id)


# --- writes: inserts ---------------------------------------------------------------------------


def insert_row(table: str, values: rows.Values) -> Insert:
    """One row into the schema's table named ``table``."""
    return insert(metadata.tables[table]).values(values)


def insert_session(session: WorkerSession) -> Insert:
    return insert(worker_sessions).values(rows.session_values(session))


def insert_report(report: StopReport) -> Insert:
    return insert(attempt_stop_reports).values(rows.report_values(report))


# --- writes: compare-and-set updates -----------------------------------------------------------


def _without(values: rows.Values, *keys: str) -> rows.Values:
    return {name: value for name, value in values.items() if name not in keys}


def renew_lease(
    before: DispatchLease, after: DispatchLease, now: ColumnElement[int] | int, spelling: Spelling
) -> Update:
    """Moves only ``expires_at``, while the presented lease is still leased, unchanged and
    unexpired by the store's clock ``now``."""
    l = run_dispatch_leases.c  # noqa: E741
    token_matches = l.token_hash == before.token_hash if before.token_hash is not None else false()
    return (
        update(run_dispatch_leases)
        .where(
            l.run_id == before.run_id,
            l.generation == before.generation,
            l.version == before.version,
            l.status == before.status.value,
            token_matches,
            guards.core(LEASE_LIVE, {"lease": l}, now=now, spelling=spelling),
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


def list_runs(status: RunStatus | None, limit: int, spelling: Spelling) -> Select:
    """Runs (of one status, if given), oldest first."""
    statement = select(runs)
    if status is not None:
        statement = statement.where(runs.c.status == status.value)
    return statement.order_by(runs.c.created_at, spelling.by_id(runs.c.id)).limit(limit)


def unfinished_with_keys(keys: Sequence[str], spelling: Spelling) -> Select:
    """(unique key, run id) of the unfinished Runs holding any of ``keys``: the predicate of
    the partial unique index ``uq_runs_unique_key`` (ADR 0015), so that the index answers."""
    return select(runs.c.unique_key, runs.c.id).where(
        runs.c.unique_key.in_(list(keys)),
        spelling.one_of(runs.c.status, NON_TERMINAL_RUN_STATUSES),
    )


def get_session(session_id: str) -> Select:
    return select(worker_sessions).where(worker_sessions.c.id == session_id)


def open_sessions_of(worker_id: str, spelling: Spelling) -> Select:
    """The worker id's active and draining sessions, by id (no row locks)."""
    s = worker_sessions.c
    return (
        select(worker_sessions)
        .where(s.worker_id == worker_id, spelling.one_of(s.status, OPEN_SESSION_STATUSES))
        .order_by(spelling.by_id(s.id))
    )


def held_by(session_id: str, spelling: Spelling) -> Select:
    """The Attempt ids of the session's ``leased`` leases, by id
    (``ix_run_dispatch_leases_held``)."""
    l = run_dispatch_leases.c  # noqa: E741
    return (
        select(l.attempt_id)
        .where(l.holder_session_id == session_id, spelling.is_(l.status, LeaseStatus.LEASED))
        .order_by(spelling.by_id(l.attempt_id))
    )


def reports_for(attempt_id: str) -> Select:
    r = attempt_stop_reports.c
    return (
        select(attempt_stop_reports).where(r.attempt_id == attempt_id).order_by(r.reported_at, r.id)
    )


# --- candidate pages: what both dialects select ------------------------------------------------
#
# Every page query reads ``limit + 1`` rows to learn ``has_more``.


def not_quarantined() -> ColumnElement[bool]:
    """Recovery and lost retry pass over quarantined Runs (``ql3.domain.quarantine``)."""
    return runs.c.quarantined_at.is_(None)


@frozen(kw_only=True)
class RecoverySource:
    """What a recovery candidate is, on columns: the joined tables, the predicate, and whether
    the candidate is resolvable (never started, a stop report, or its session gone)."""

    tables: Any
    where: tuple[ColumnElement[bool], ...]
    resolvable: ColumnElement[bool]


def recovery_source(now: ColumnElement[int] | int, spelling: Spelling) -> RecoverySource:
    """Runtime-owned, non-pristine claimed|starting|running Attempts of dispatching|running|lost
    Runs, not quarantined, whose own lease is missing, released or expired by ``now``."""
    a = run_attempts.c
    r = runs.c
    l = run_dispatch_leases.c  # noqa: E741
    # A stop report speaks of the start it follows (ql3.domain.recovery.find_not_running_evidence).
    stop_reported = exists().where(
        attempt_stop_reports.c.attempt_id == a.id,
        or_(a.started_at.is_(None), attempt_stop_reports.c.reported_at >= a.started_at),
    )
    session_gone = exists().where(
        worker_sessions.c.id == a.session_id,
        spelling.one_of(worker_sessions.c.status, GONE_SESSION_STATUSES),
    )
    own_lease = and_(l.run_id == a.run_id, l.generation == a.lease_generation, l.attempt_id == a.id)
    return RecoverySource(
        tables=run_attempts.join(runs, r.id == a.run_id).outerjoin(run_dispatch_leases, own_lease),
        where=(
            spelling.one_of(a.status, NON_TERMINAL_ATTEMPT_STATUSES),
            not_(pristine(a, spelling)),
            spelling.is_(r.owner, RunOwner.RUNTIME),
            spelling.one_of(r.status, RECOVERABLE_RUN_STATUSES),
            not_quarantined(),
            or_(
                l.run_id.is_(None),
                spelling.is_(l.status, LeaseStatus.RELEASED),
                guards.core(LEASE_EXPIRED, {"lease": l}, now=now, spelling=spelling),
            ),
        ),
        resolvable=or_(spelling.is_(a.status, AttemptStatus.CLAIMED), stop_reported, session_gone),
    )


def recovery_page(limit: int, now: ColumnElement[int] | int, spelling: Spelling) -> Select:
    """The candidates of :func:`recovery_source`, resolvable ones first."""
    a = run_attempts.c
    l = run_dispatch_leases.c  # noqa: E741
    source = recovery_source(now, spelling)
    resolvable = source.resolvable
    return (
        select(
            a.run_id.label("run_id"),
            a.id.label("attempt_id"),
            a.status.label("attempt_status"),
            l.expires_at.label("lease_expires_at"),
            resolvable.label("resolvable"),
        )
        .select_from(source.tables)
        .where(*source.where)
        .order_by(resolvable.desc(), l.expires_at.asc().nulls_first(), spelling.by_id(a.id))
        .limit(limit + 1)
    )


# --- task limits (ADR 0014) ---------------------------------------------------------------------


def list_task_limits() -> Select:
    return select(task_limits).order_by(task_limits.c.task)


def task_limit_values(limit: TaskLimit) -> rows.Values:
    return {
        "task": limit.task,
        "max_running": limit.max_running,
        "updated_at": limit.updated_at_ms,
    }


def upsert_task_limit(limit: TaskLimit, insert: Any) -> Any:
    """Record a task's limit, replacing the one it has (ADR 0014), with the dialect's ``insert``
    (both PostgreSQL's and SQLite's take ``ON CONFLICT DO UPDATE``)."""
    values = task_limit_values(limit)
    return (
        insert(task_limits)
        .values(**values)
        .on_conflict_do_update(
            index_elements=[task_limits.c.task],
            set_={"max_running": values["max_running"], "updated_at": values["updated_at"]},
        )
    )


def delete_task_limit(task: str) -> Delete:
    return delete(task_limits).where(task_limits.c.task == task)


def task_limit_from_row(row: rows.Row) -> TaskLimit:
    return TaskLimit(
        task=str(row["task"]),
        max_running=int(row["max_running"]),
        updated_at_ms=int(row["updated_at"]),
    )


# --- the dispatch gate -------------------------------------------------------------------------


def get_gate() -> Select:
    return select(dispatch_gate).where(dispatch_gate.c.id == DISPATCH_GATE_ID)


def _gate_values(gate: DispatchGate) -> rows.Values:
    failure = gate.failure
    return {
        "open": gate.open,
        "reason": gate.reason,
        "changed_at": gate.changed_at_ms,
        "failed_step": failure.step if failure else None,
        "failed_run_id": failure.run_id if failure else None,
        "failed_attempt_id": failure.attempt_id if failure else None,
        "failed_error": failure.error if failure else None,
        "failed_since": failure.since_ms if failure else None,
        "failed_cycles": failure.cycles if failure else None,
    }


def _failure_from_row(row: rows.Row, prefix: str) -> StepFailure | None:
    if row.get(f"{prefix}failed_step") is None:
        return None
    return StepFailure(
        step=row[f"{prefix}failed_step"],
        run_id=row[f"{prefix}failed_run_id"],
        attempt_id=row[f"{prefix}failed_attempt_id"],
        error=row[f"{prefix}failed_error"],
        since_ms=int(row[f"{prefix}failed_since"]),
        cycles=int(row[f"{prefix}failed_cycles"]),
    )


def update_gate(gate: DispatchGate) -> Update:
    return (
        update(dispatch_gate)
        .where(dispatch_gate.c.id == DISPATCH_GATE_ID)
        .values(_gate_values(gate))
    )


def open_gate(closed_before_ms: int | None, now_ms: int) -> Update:
    """:meth:`DispatchGate.may_open` as the compare-and-set's predicate: the gate opens only
    if it is closed and did not change at or after ``closed_before_ms``."""
    g = dispatch_gate.c
    predicate = [g.id == DISPATCH_GATE_ID, g.open.is_(false())]
    if closed_before_ms is not None:
        predicate.append(or_(g.changed_at.is_(None), g.changed_at < closed_before_ms))
    opened = DispatchGate(open=True, changed_at_ms=now_ms)
    return update(dispatch_gate).where(*predicate).values(_gate_values(opened))


def insert_gate(gate: DispatchGate) -> Insert:
    return insert(dispatch_gate).values(id=DISPATCH_GATE_ID, **_gate_values(gate))


def gate_from_row(row: rows.Row | None, prefix: str = "") -> DispatchGate:
    """The gate as stored. A missing row (the schema creates it; nothing deletes it) reads as
    closed: nothing is granted on a gate whose state is unknown."""
    if row is None:
        return DispatchGate(open=False, reason="the dispatch gate row is missing")
    changed_at = row[f"{prefix}changed_at"]
    return DispatchGate(
        open=bool(row[f"{prefix}open"]),
        reason=row[f"{prefix}reason"],
        changed_at_ms=None if changed_at is None else int(changed_at),
        failure=_failure_from_row(row, prefix),
    )
