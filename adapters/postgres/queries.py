"""The PostgreSQL store's own SQL statements, as SQLAlchemy Core constructs: its clock, its
locks, its candidate pages, and the shared statements of :mod:`ql3.adapters.sql.statements` in its
spelling (:data:`POSTGRES`). The store executes these and the shared ones and nothing else, and
the tests EXPLAIN the very same statements.

Time is the database's: :func:`store_now` is ``statement_timestamp()`` plus the store's clock
offset (zero in production, moved only by the test hook), truncated to whole milliseconds, so the
value a query compares with is exactly the ``observed_at_ms`` it reports.

Status constants are rendered as SQL literals, not bound parameters, so that the planner can
match the partial indexes of :mod:`ql3.adapters.sql.schema` even with a generic (prepared) plan.

A transaction that puts a Run into ``queued`` sends a notification on :data:`DISPATCH_CHANNEL`
before it commits (folded into its write statement, see :mod:`ql3.adapters.postgres.fenced`):
PostgreSQL delivers it at commit, once per transaction however many were sent, and never for a
transaction that rolls back. A node's one ``LISTEN`` connection wakes its parked claims on it
(ADR 0007).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Double,
    Insert,
    Integer,
    Interval,
    Select,
    Text,
    Update,
    bindparam,
    delete,
    func,
    literal_column,
    select,
    text,
    true,
    type_coerce,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.elements import BindParameter

from ql3.adapters.sql import statements
from ql3.adapters.sql.schema import (
    ALL_TABLES,
    EpochMillis,
    dispatch_gate,
    metadata,
    run_attempts,
    run_dispatch_leases,
    runs,
)
from ql3.adapters.sql.statements import Spelling, attempt_columns, lease_columns, run_columns
from ql3.adapters.sql.triggers import due_triggers_query
from ql3.adapters.sql.workflows import workflow_candidates_query
from ql3.application.ports import OPEN_GATE
from ql3.domain.dispatch import TaskLimit
from ql3.domain.model import DispatchLease, RunOwner, RunStatus

# The first key of every two-key advisory lock the store takes: "QL3" in ASCII, an int4.
ADVISORY_LOCK_NAMESPACE = 0x514C33

# Where a commit that puts a Run into ``queued`` notifies (``LISTEN ql3_dispatch``).
DISPATCH_CHANNEL = "ql3_dispatch"
# A commit that finishes Runs notifies this channel once (trigger runs_finished_notify), for callers
# waiting for a run.
FINISHED_CHANNEL = "ql3_run_finished"

SESSION_COLUMNS = "s_"

# Status constants inline, text ids in byte order.
POSTGRES = Spelling(inline_constants=True, id_collation="C")
_is = POSTGRES.is_


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


def due_triggers_statement(limit: int, clock_offset_ms: int = 0) -> Select:
    """Active triggers whose next firing the store's clock reached (``ix_triggers_due``)."""
    return due_triggers_query(limit, store_now(clock_offset_ms))


def workflow_candidates_statement(limit: int, clock_offset_ms: int = 0) -> Select:
    """Workflow aggregates whose frontier may move, by the store's clock."""
    return workflow_candidates_query(limit, store_now(clock_offset_ms))


def now_statement(clock_offset_ms: int) -> Select:
    return select(store_now(clock_offset_ms).label("now_ms"))


# --- locks -------------------------------------------------------------------------------------


def advisory_lock(key: str) -> Select:
    """``pg_advisory_xact_lock(<QL3 namespace>, hashtext(key))``: released at transaction end."""
    namespace = literal_column(str(ADVISORY_LOCK_NAMESPACE), Integer())
    return select(func.pg_advisory_xact_lock(namespace, func.hashtext(bindparam("lock_key", key))))


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


def lock_lease(run_id: str, generation: int | None) -> Select:
    """The lease of that generation, or the Run's highest-generation lease, locked."""
    l = run_dispatch_leases.c  # noqa: E741
    statement = select(*lease_columns()).where(l.run_id == run_id)
    if generation is not None:
        statement = statement.where(l.generation == generation)
    else:
        statement = statement.order_by(l.generation.desc()).limit(1)
    return statement.with_for_update(of=run_dispatch_leases)


# --- writes and reads in this dialect's spelling ---------------------------------------------


def renew_lease(before: DispatchLease, after: DispatchLease, clock_offset_ms: int) -> Update:
    """Moves only ``expires_at`` (no indexed column: a HOT update), while the presented lease is
    still leased, unchanged and unexpired by the store's clock."""
    return statements.renew_lease(before, after, store_now(clock_offset_ms), POSTGRES)


def list_runs(status: RunStatus | None, limit: int) -> Select:
    return statements.list_runs(status, limit, POSTGRES)


def unfinished_with_keys(keys: Sequence[str]) -> Select:
    return statements.unfinished_with_keys(keys, POSTGRES)


def open_sessions_of(worker_id: str) -> Select:
    """Locked, in id order."""
    return statements.open_sessions_of(worker_id, POSTGRES).with_for_update()


def held_by(session_id: str) -> Select:
    return statements.held_by(session_id, POSTGRES)


# --- candidate sources: one statement each -----------------------------------------------------
#
# Each is ``clock LEFT JOIN (the page) ON true``: exactly one row even for an empty page, so the
# observed time comes with the page in one round trip. Every page query reads ``limit + 1`` rows.


def recovery_candidates_query(limit: int, clock_offset_ms: int = 0) -> Select:
    """Runtime-owned, non-pristine claimed|starting|running Attempts of dispatching|running|lost
    Runs whose own lease is missing, released or expired; resolvable ones first."""
    now = store_now(clock_offset_ms)
    page = statements.recovery_page(limit, now, POSTGRES).subquery("candidates")
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
        statements.latest_attempt_id() if with_attempt else type_coerce(None, Text())
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
        where=[_is(runs.c.status, RunStatus.LOST), statements.not_quarantined()],
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
            statements.not_quarantined(),
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


# --- maintenance -------------------------------------------------------------------------------


# A reset deletes the rows when the tables hold at most this many together (what a test
# leaves: a DELETE of a few rows costs a small part of a TRUNCATE, which replaces each table's
# files), and truncates them when they hold more (a loaded history, which deleting row by row
# would take seconds over).
DELETE_AT_MOST_ROWS = 2_000


def rows_up_to(bound: int) -> Select:
    """How many rows the tables hold together, counting at most ``bound`` of each (test hook)."""
    counts = []
    for table in ALL_TABLES:
        some = select(literal_column("1")).select_from(table).limit(bound).subquery()
        counts.append(select(func.count()).select_from(some).scalar_subquery())
    total: ColumnElement[Any] = counts[0]
    for count in counts[1:]:
        total = total + count
    return select(total)


def truncate_all() -> str:
    """TRUNCATE every table of the schema, then put the dispatch gate's one row back, open (test
    hook; two statements, run without parameters)."""
    names = ", ".join(table.name for table in ALL_TABLES)
    return (
        f"TRUNCATE TABLE {names} RESTART IDENTITY CASCADE;"
        f" INSERT INTO {dispatch_gate.name} (id, open) VALUES (1, true)"
    )


def delete_all() -> list[Executable]:
    """What :func:`truncate_all` does, by DELETE: every row, children before parents, the
    sequences the tables own restarted (what ``RESTART IDENTITY`` restarts), the dispatch gate's
    one row put back, open (test hook)."""
    tables = ", ".join(f"'{table.name}'" for table in ALL_TABLES)
    restart = text(
        "DO $$DECLARE owned regclass; BEGIN"
        " FOR owned IN SELECT d.objid::regclass FROM pg_depend d"
        " JOIN pg_class c ON c.oid = d.objid AND c.relkind = 'S'"
        f" WHERE d.refobjid = ANY (ARRAY[{tables}]::regclass[]) AND d.deptype IN ('a', 'i')"
        " LOOP EXECUTE format('ALTER SEQUENCE %s RESTART', owned); END LOOP; END$$"
    )
    return [
        *(delete(table) for table in reversed(metadata.sorted_tables) if table in ALL_TABLES),
        restart,
        statements.insert_gate(OPEN_GATE),
    ]


def upsert_task_limit(limit: TaskLimit) -> Insert:
    """Record a task's limit, replacing the one it has (ADR 0014)."""
    return cast(Insert, statements.upsert_task_limit(limit, pg_insert))
