"""The repository methods every SQL store runs the same way: key lookups, the inserts of an
admission, the session registry and the stop-report evidence, on the statements of
:mod:`ql3.adapters.sql.statements`.

A store's repositories derive from these, name their ``queries`` module (for the statements the
store spells its own way) and add or override what is their own: the PostgreSQL store its locks,
its one-statement writes, what its last lock statement read and its dispatch wake-ups; the SQLite
store its wake-ups; the worker ingress what its role may not do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from sqlalchemy import Insert, Select

from ql3.adapters.sql import rows, statements
from ql3.adapters.sql.transaction import SqlReader, SqlTransaction
from ql3.application.ports import DispatchGate, StoredEvent
from ql3.domain.dispatch import TaskLimit
from ql3.domain.model import Attempt, DispatchLease, Run, RunStatus, StopReport, WorkerSession
from ql3.domain.transitions import Change

R = TypeVar("R", bound=SqlReader)
W = TypeVar("W", bound=SqlTransaction)


class DialectQueries(Protocol):
    """The statements a store spells its own way: its ``queries`` module."""

    def list_runs(self, status: RunStatus | None, limit: int) -> Select: ...

    def unfinished_with_keys(self, keys: Sequence[str]) -> Select: ...

    def open_sessions_of(self, worker_id: str) -> Select: ...

    def held_by(self, session_id: str) -> Select: ...

    def upsert_task_limit(self, limit: TaskLimit) -> Insert: ...


class SqlRunReads(Generic[R]):
    """The reads of :class:`ql3.application.ports.RunRepository`."""

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

    def unfinished_with_keys(self, keys: Sequence[str]) -> Mapping[str, str]:
        if not keys:
            return {}
        result = self._uow.execute(self.queries.unfinished_with_keys(keys))
        return {str(key): str(run_id) for key, run_id in result}


class SqlRunRepository(SqlRunReads[W]):
    """The reads, and admission: Runs with their Attempts, leases and events, all or nothing."""

    def add(self, change: Change) -> None:
        self.add_many([change])

    def add_many(self, changes: Sequence[Change]) -> None:
        """Insert newly admitted Runs, each with its Attempts, lease and event, in order: all of
        them or none (under a savepoint: a refused batch leaves nothing of itself behind and the
        transaction usable). A duplicate or otherwise refused row is a
        ``ConcurrencyConflict``."""
        if not changes:
            return

        def insert_all() -> None:
            for change in changes:
                self._insert(change)

        self._uow.atomically(insert_all)

    def task_limits(self) -> Sequence[TaskLimit]:
        result = self._uow.execute(statements.list_task_limits()).mappings()
        return tuple(statements.task_limit_from_row(row) for row in result)

    def set_task_limit(self, limit: TaskLimit) -> None:
        self._uow.write(self.queries.upsert_task_limit(limit), f"limit of task {limit.task}")

    def clear_task_limit(self, task: str) -> bool:
        return self._uow.write(statements.delete_task_limit(task), f"limit of task {task}") > 0

    def _insert(self, change: Change) -> None:
        for name, values in rows.admitted_rows(change):
            what = f"{name} of run {change.run.id}"
            self._uow.write(statements.insert_row(rows.ADMITTED_TABLES[name], values), what)


class SqlSessionReads(Generic[R]):
    """The reads of :class:`ql3.application.ports.WorkerSessionRegistry`."""

    queries: DialectQueries

    def __init__(self, uow: R) -> None:
        self._uow = uow

    def get(self, session_id: str) -> WorkerSession | None:
        row = self._uow.execute(statements.get_session(session_id)).mappings().first()
        return rows.session_from_row(row) if row is not None else None

    def open_sessions_of(self, worker_id: str) -> Sequence[WorkerSession]:
        result = self._uow.execute(self.queries.open_sessions_of(worker_id)).mappings()
        return tuple(rows.session_from_row(row) for row in result)

    def held_by(self, session_id: str) -> Sequence[str]:
        result = self._uow.execute(self.queries.held_by(session_id)).scalars()
        return tuple(str(attempt_id) for attempt_id in result)


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
    """:class:`ql3.application.ports.EvidenceRepository`: stop reports, oldest first."""

    def __init__(self, uow: W) -> None:
        self._uow = uow

    def record(self, report: StopReport) -> None:
        self._uow.write(statements.insert_report(report), f"stop report of {report.attempt_id}")

    def reports_for(self, attempt_id: str) -> Sequence[StopReport]:
        result = self._uow.execute(statements.reports_for(attempt_id)).mappings()
        return tuple(rows.report_from_row(row) for row in result)


class SqlGateRepository(Generic[W]):
    """:class:`ql3.application.ports.DispatchGateRepository`: the one row. A close replaces it
    (a failure is reported whatever the gate said); an opening is a compare-and-set on its
    state and ``changed_at``, so it never overwrites a close committed since the cycle
    began. A missing row is written anew."""

    def __init__(self, uow: W) -> None:
        self._uow = uow

    def set(self, gate: DispatchGate) -> None:
        if self._uow.write(statements.update_gate(gate), "the dispatch gate") == 0:
            self._insert(gate)

    def open(self, closed_before_ms: int | None, now_ms: int) -> bool:
        statement = statements.open_gate(closed_before_ms, now_ms)
        if self._uow.write(statement, "the dispatch gate") == 1:
            return True
        if self._uow.execute(statements.get_gate()).first() is not None:
            return False  # open already, or closed since the cycle began
        self._insert(DispatchGate(open=True, changed_at_ms=now_ms))
        return True

    def _insert(self, gate: DispatchGate) -> None:
        statement = statements.insert_gate(gate)
        self._uow.atomically(lambda: self._uow.write(statement, "the dispatch gate"))

    def get(self) -> DispatchGate:
        row = self._uow.execute(statements.get_gate()).mappings().first()
        return statements.gate_from_row(row)
