"""What task attempt admission counts, for every SQL store: a worker session's free capacity,
read under the session's row lock (offers to one session from several replicas serialise on it,
so each counts the leases the others committed and no session is offered more than its
capacity), and the Attempts in flight per task, which admission balances."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Connection, Select, func, literal_column, select

from adapters.sql import rows
from adapters.sql.schema import run_dispatch_leases, runs, worker_sessions
from adapters.sql.transaction import SqlTransaction
from application.ports import SessionCapacity
from domain.model import LeaseStatus


def lock_session(session_id: str) -> Select:
    return (
        select(worker_sessions)
        .where(worker_sessions.c.id == session_id)
        .with_for_update(of=worker_sessions)
    )


_LEASED: ColumnElement[str] = literal_column(f"'{LeaseStatus.LEASED.value}'")


def leases_held(session_id: str) -> Select:
    l = run_dispatch_leases.c  # noqa: E741
    return select(func.count()).where(l.holder_session_id == session_id, l.status == _LEASED)


def in_flight_by_task_query(tasks: Sequence[str]) -> Select:
    """``leased`` leases per task of their Run (the partial index on leased leases: live work
    only)."""
    l = run_dispatch_leases.c  # noqa: E741
    return (
        select(runs.c.task, func.count().label("in_flight"))
        .select_from(run_dispatch_leases.join(runs, runs.c.id == l.run_id))
        .where(l.status == _LEASED, runs.c.task.in_(list(tasks)))
        .group_by(runs.c.task)
    )


def in_flight_by_task(connection: Connection | Any, tasks: Sequence[str]) -> dict[str, int]:
    if not tasks:
        return {}
    result = connection.execute(in_flight_by_task_query(tasks))
    return {str(task): int(count) for task, count in result}


def lock_capacity(tx: SqlTransaction, session_id: str) -> SessionCapacity | None:
    """The session row locked for update, then the leases it holds counted."""
    row = tx.execute(lock_session(session_id)).mappings().first()
    if row is None:
        return None
    in_flight = int(tx.execute(leases_held(session_id)).scalar_one())
    return SessionCapacity(session=rows.session_from_row(row), in_flight=in_flight)


class SqlCapacityLocks:
    """:class:`application.ports.SessionCapacityLocks` on any :class:`SqlTransaction`."""

    def __init__(self, tx: SqlTransaction) -> None:
        self._tx = tx

    def lock(self, session_id: str) -> SessionCapacity | None:
        return lock_capacity(self._tx, session_id)
