"""The SQLite store's own SQL statements, as SQLAlchemy Core constructs on the shared tables:
its candidate pages, its due times, and the shared statements of :mod:`ql3.adapters.sql.statements`
in its spelling (:data:`SQLITE`).

The store's clock is read in Python by the store and bound into each statement as ``now`` (epoch
milliseconds), so a page compares with exactly the ``observed_at_ms`` it reports. There are no
row locks or advisory locks here: a SQLite write transaction (``BEGIN IMMEDIATE``) holds the
whole database, which serialises every writer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import ColumnElement, Delete, Insert, Select, Update, delete, func, literal, select
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from ql3.adapters.sql import statements
from ql3.adapters.sql.schema import (
    metadata,
    run_dispatch_leases,
    runs,
    triggers,
)
from ql3.adapters.sql.statements import Spelling
from ql3.application.ports import OPEN_GATE
from ql3.domain.dispatch import TaskLimit
from ql3.domain.model import DispatchLease, LeaseStatus, RunOwner, RunStatus
from ql3.domain.triggers import TriggerStatus

# Status constants bound, text ids in the default (binary) order.
SQLITE = Spelling(inline_constants=False, id_collation=None)
_is = SQLITE.is_


# --- reads inside a unit of work ---------------------------------------------------------------


def list_runs(status: RunStatus | None, limit: int) -> Select:
    return statements.list_runs(status, limit, SQLITE)


def unfinished_with_keys(keys: Sequence[str]) -> Select:
    return statements.unfinished_with_keys(keys, SQLITE)


def open_sessions_of(worker_id: str) -> Select:
    return statements.open_sessions_of(worker_id, SQLITE)


def held_by(session_id: str) -> Select:
    return statements.held_by(session_id, SQLITE)


def renew_lease(before: DispatchLease, after: DispatchLease, now_ms: int) -> Update:
    """Moves only ``expires_at``, while the presented lease is still leased, unchanged and
    unexpired by the store's clock."""
    return statements.renew_lease(before, after, now_ms, SQLITE)


# --- candidate sources: one statement each -----------------------------------------------------
#
# Every page query reads ``limit + 1`` rows to learn ``has_more``.


def recovery_candidates_query(limit: int, now_ms: ColumnElement[int] | int) -> Select:
    """Runtime-owned, non-pristine claimed|starting|running Attempts of dispatching|running|lost
    Runs whose own lease is missing, released or expired; resolvable ones first."""
    return statements.recovery_page(limit, now_ms, SQLITE)


def _run_page(
    *, where: Sequence[ColumnElement[bool]], since: ColumnElement[int], limit: int, latest: bool
) -> Select:
    attempt_id: ColumnElement[Any] = statements.latest_attempt_id() if latest else literal(None)
    return (
        select(runs.c.id.label("run_id"), attempt_id.label("attempt_id"), since.label("since"))
        .where(_is(runs.c.owner, RunOwner.RUNTIME), *where)
        .order_by(since, runs.c.id)
        .limit(limit + 1)
    )


def lost_runs_query(limit: int) -> Select:
    """Runtime-owned ``lost`` Runs, by (updated_at, id)."""
    return _run_page(
        where=[_is(runs.c.status, RunStatus.LOST), statements.not_quarantined()],
        since=runs.c.updated_at,
        limit=limit,
        latest=True,
    )


def due_retries_query(limit: int, now_ms: ColumnElement[int] | int) -> Select:
    """Runtime-owned ``retry_wait`` Runs whose next_attempt_at the store's clock reached."""
    return _run_page(
        where=[
            _is(runs.c.status, RunStatus.RETRY_WAIT),
            runs.c.next_attempt_at <= now_ms,
            statements.not_quarantined(),
        ],
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


# --- due times (what an idle Edge process sleeps until) ---------------------------------------


def next_retry_at_query() -> Select:
    """The earliest ``next_attempt_at`` of runtime-owned ``retry_wait`` Runs (NULL if none)."""
    return select(func.min(runs.c.next_attempt_at)).where(
        _is(runs.c.owner, RunOwner.RUNTIME),
        _is(runs.c.status, RunStatus.RETRY_WAIT),
        statements.not_quarantined(),
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


def delete_all() -> list[Delete | Insert]:
    """DELETE every row, children before parents, then put the dispatch gate's one row back,
    open (test hook)."""
    return [
        *(delete(table) for table in reversed(metadata.sorted_tables)),
        statements.insert_gate(OPEN_GATE),
    ]


def upsert_task_limit(limit: TaskLimit) -> Insert:
    """Record a task's limit, replacing the one it has (ADR 0014)."""
    return cast(Insert, statements.upsert_task_limit(limit, sqlite_insert))
