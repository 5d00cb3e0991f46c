"""The repository methods every SQL store runs the same way: key lookups, the inserts of an
admission, the session registry and the stop-report evidence, on the statements of
:mod:`adapters.sql.statements`.

A store's repositories derive from these, name their ``queries`` module (for the statements the
store spells its own way) and add or override what is their own: the PostgreSQL store its locks,
its one-statement writes and what its last lock statement read; the SQLite store its wake-ups;
the worker ingress what its role may not do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from sqlalchemy import Select

from adapters.sql import rows, statements
from adapters.sql.transaction import SqlReader, SqlTransaction
from application.ports import HARD_PAGE_CAP, StoredEvent
from domain.model import Attempt, DispatchLease, Run, RunStatus, StopReport, WorkerSession
from domain.transitions import Change

R = TypeVar("R", bound=SqlReader)
W = TypeVar("W", bound=SqlTransaction)


def check_page_limit(limit: int, name: str = "limit") -> None:
    """Page sizes are 1..HARD_PAGE_CAP; anything else is a caller's bug."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= HARD_PAGE_CAP:
        raise ValueError(f"{name} must be an integer within 1..{HARD_PAGE_CAP}, got {limit!r}")


class DialectQueries(Protocol):
    """The statements a store spells its own way: its ``queries`` module."""

    def list_runs(self, status: RunStatus | None, limit: int) -> Select: ...

    def open_sessions_of(self, worker_id: str) -> Select: ...

    def offers_of(self, session_id: str) -> Select: ...


class SqlRunReads(Generic[R]):
    """The reads of :class:`application.ports.RunRepository`."""

    queries: DialectQueries

    def __init__(self, uow: R) -> None:
        self._uow = uow

    def get_run(self, run_id: str) -> Run | None:
        row = self._uow.execute(statements.get_run(run_id)).mappings().first()
        return rows.run_from_row(row) if row is not None else None

    def get_attempt(self, attempt_id: str) -> Attempt | None:
        row = self._uow.execute(statements.get_attempt(attempt_id)).mappings().first()
        return rows.attempt_from_row(row) if row is not None else None

    def attempts_of(self, run_id: str) -> Sequence[Attempt]:
        result = self._uow.execute(statements.attempts_of(run_id)).mappings()
        return tuple(rows.attempt_from_row(row) for row in result)

    def leases_of(self, run_id: str) -> Sequence[DispatchLease]:
        result = self._uow.execute(statements.leases_of(run_id)).mappings()
        return tuple(rows.lease_from_row(row) for row in result)

    def events_of(self, run_id: str) -> Sequence[StoredEvent]:
        result = self._uow.execute(statements.events_of(run_id)).mappings()
        return tuple(
            StoredEvent(sequence=int(row["id"]), event=rows.event_from_row(row)) for row in result
        )

    def list_runs(self, status: RunStatus | None, limit: int) -> Sequence[Run]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        result = self._uow.execute(self.queries.list_runs(status, limit)).mappings()
        return tuple(rows.run_from_row(row) for row in result)


class SqlRunRepository(SqlRunReads[W]):
    """The reads, and admission: a Run with its Attempts, lease and event, all or nothing."""

    def add(self, change: Change) -> None:
        def insert_all() -> None:
            self._uow.write(statements.insert_run(change.run), f"run {change.run.id}")
            for attempt in change.attempts:
                self._uow.write(statements.insert_attempt(attempt), f"attempt {attempt.id}")
            if change.lease is not None:
                lease = change.lease
                self._uow.write(
                    statements.insert_lease(lease), f"lease {lease.run_id}/{lease.generation}"
                )
            self._uow.write(statements.insert_event(change.event), f"event of run {change.run.id}")

        self._uow.atomically(insert_all)


class SqlSessionReads(Generic[R]):
    """The reads of :class:`application.ports.WorkerSessionRegistry`."""

    queries: DialectQueries

    def __init__(self, uow: R) -> None:
        self._uow = uow

    def get(self, session_id: str) -> WorkerSession | None:
        row = self._uow.execute(statements.get_session(session_id)).mappings().first()
        return rows.session_from_row(row) if row is not None else None

    def open_sessions_of(self, worker_id: str) -> Sequence[WorkerSession]:
        result = self._uow.execute(self.queries.open_sessions_of(worker_id)).mappings()
        return tuple(rows.session_from_row(row) for row in result)

    def offers_of(self, session_id: str) -> Sequence[tuple[Run, Attempt, DispatchLease]]:
        result = self._uow.execute(self.queries.offers_of(session_id)).mappings()
        return tuple(
            (
                rows.run_from_row(row, statements.RUN_COLUMNS),
                rows.attempt_from_row(row, statements.ATTEMPT_COLUMNS),
                rows.lease_from_row(row, statements.LEASE_COLUMNS),
            )
            for row in result
        )


class SqlSessionRegistry(SqlSessionReads[W]):
    """The reads, and compare-and-set writes of sessions."""

    def add(self, session: WorkerSession) -> None:
        statement = statements.insert_session(session)
        self._uow.atomically(lambda: self._uow.write(statement, f"session {session.id}"))

    def update(self, before: WorkerSession, after: WorkerSession) -> None:
        if after.id != before.id:
            raise ValueError("a session update must name the same session before and after")
        statement = statements.update_session(before, after)
        self._uow.atomically(lambda: self._uow.compare_and_set(statement, f"session {before.id}"))


class SqlEvidenceRepository(Generic[W]):
    """:class:`application.ports.EvidenceRepository`: stop reports, oldest first."""

    def __init__(self, uow: W) -> None:
        self._uow = uow

    def record(self, report: StopReport) -> None:
        self._uow.write(statements.insert_report(report), f"stop report of {report.attempt_id}")

    def reports_for(self, attempt_id: str) -> Sequence[StopReport]:
        result = self._uow.execute(statements.reports_for(attempt_id)).mappings()
        return tuple(rows.report_from_row(row) for row in result)
