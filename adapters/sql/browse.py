"""The console's reads on both SQL stores (ADR 0020): the runs list by filter with keyset
pagination, capped counts, and the finished history of a window.

The list walks ``ix_runs_created_at`` (admission time, id) from the cursor, so a page costs
its rows whatever the table holds; a count stops at its cap (PostgreSQL then asks its planner
for an estimate). Finished history is read through ``ix_runs_finished`` (last change, id) from
the window's start."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Select,
    and_,
    cast,
    func,
    literal,
    or_,
    select,
)

from ql3.adapters.sql import rows
from ql3.adapters.sql.schema import run_attempts, run_events, runs
from ql3.adapters.sql.statements import Spelling
from ql3.application.console import (
    Count,
    FinishedBucket,
    RunCursor,
    RunFilter,
    RunOrder,
    RunPage,
)
from ql3.domain.model import TERMINAL_RUN_STATUSES, JsonValue, RunOwner, RunStatus

Millis = Callable[[ColumnElement[Any]], ColumnElement[int]]
Contains = Callable[[Mapping[str, JsonValue]], Sequence[ColumnElement[bool]]]
# The event's data holds this text under this key.
DataIs = Callable[[str, str], ColumnElement[bool]]
AGAIN_LIMIT = 20


def where_clauses(
    where: RunFilter, spelling: Spelling, contains: Contains
) -> list[ColumnElement[bool]]:
    r = runs.c
    # The predicate of ``ix_runs_status_created`` (true of every Run): it lets the planner
    # take that index for these statements only.
    clauses: list[ColumnElement[bool]] = [r.created_at.is_not(None)]
    if where.statuses:
        clauses.append(spelling.one_of(r.status, where.statuses))
    if where.task is not None:
        clauses.append(r.task == where.task)
    if where.unique_key is not None:
        clauses.append(r.unique_key == where.unique_key)
    if where.run_id is not None:
        clauses.append(r.id == where.run_id)
    if where.created_from_ms is not None:
        clauses.append(r.created_at >= where.created_from_ms)
    if where.created_to_ms is not None:
        clauses.append(r.created_at <= where.created_to_ms)
    if where.input_contains:
        clauses.extend(contains(where.input_contains))
    if where.workflows:
        # Inline on PostgreSQL, so that ``ix_runs_workflows``'s predicate matches a generic plan.
        clauses.append(spelling.is_(r.owner, RunOwner.WORKFLOW))
    return clauses


def browse_statement(
    where: RunFilter,
    order: RunOrder,
    after: RunCursor | None,
    limit: int,
    spelling: Spelling,
    contains: Contains,
) -> Select:
    r = runs.c
    clauses = where_clauses(where, spelling, contains)
    run_id = spelling.by_id(r.id)
    if after is not None:
        at, key = after.created_at_ms, after.run_id
        if order is RunOrder.NEWEST:
            clauses.append(or_(r.created_at < at, and_(r.created_at == at, run_id < key)))
        else:
            clauses.append(or_(r.created_at > at, and_(r.created_at == at, run_id > key)))
    ordering = (
        (r.created_at.desc(), run_id.desc()) if order is RunOrder.NEWEST else (r.created_at, run_id)
    )
    return select(runs).where(*clauses).order_by(*ordering).limit(limit + 1)


def capped_count_statement(
    where: RunFilter, cap: int, spelling: Spelling, contains: Contains
) -> Select:
    inner = (
        select(literal(1).label("one"))
        .select_from(runs)
        .where(*where_clauses(where, spelling, contains))
        .limit(cap + 1)
    )
    if len(where.statuses) <= 1:
        # In the order of ``ix_runs_status_created`` (``ix_runs_created_at`` without a status):
        # the count walks at most ``cap + 1`` entries of it, even for the commonest status.
        inner = inner.order_by(runs.c.created_at, spelling.by_id(runs.c.id))
    return select(func.count()).select_from(inner.subquery())


def status_counts_statement(cap: int, spelling: Spelling, contains: Contains) -> Select:
    """Every status's capped count in one statement, one scalar subquery a status."""
    columns = [
        capped_count_statement(RunFilter(statuses=(status,)), cap, spelling, contains)
        .scalar_subquery()
        .label(status.value)
        for status in RunStatus
    ]
    return select(*columns)


def page_of(found: Sequence[rows.Row], limit: int, observed_at_ms: int) -> RunPage:
    items = tuple(rows.run_from_row(row) for row in found[:limit])
    cursor = None
    if len(found) > limit and items:
        last = items[-1]
        cursor = RunCursor(created_at_ms=last.created_at_ms, run_id=last.id)
    return RunPage(runs=items, next_cursor=cursor, observed_at_ms=observed_at_ms)


def _finished_top_level(since_ms: int, spelling: Spelling) -> list[ColumnElement[bool]]:
    """The predicate of ``ix_runs_finished``, from ``since_ms`` on."""
    r = runs.c
    return [
        spelling.one_of(r.status, TERMINAL_RUN_STATUSES),
        r.parent_run_id.is_(None),
        r.updated_at >= since_ms,
    ]


def finished_buckets_statement(
    since_ms: int, bucket_ms: int, spelling: Spelling, millis: Millis
) -> Select:
    r = runs.c
    size = literal(bucket_ms, BigInteger())
    bucket = cast((millis(r.updated_at) // size) * size, BigInteger()).label("bucket")
    return (
        select(bucket, r.status, func.count().label("n"))
        .where(*_finished_top_level(since_ms, spelling))
        .group_by(bucket, r.status)
    )


def finished_counts_statement(since_ms: int, spelling: Spelling) -> Select:
    r = runs.c
    return (
        select(r.task, r.status, func.count().label("n"))
        .where(*_finished_top_level(since_ms, spelling))
        .group_by(r.task, r.status)
    )


def recent_finished_statement(since_ms: int, limit: int, spelling: Spelling) -> Select:
    """The latest ``limit`` top-level Runs finished since ``since_ms`` (``ix_runs_finished``)."""
    r = runs.c
    return (
        select(r.id, r.task)
        .where(*_finished_top_level(since_ms, spelling))
        .order_by(r.updated_at.desc())
        .limit(limit)
    )


def durations_statement(run_ids: Sequence[str], millis: Millis) -> Select:
    """The finished Attempts of these Runs with their durations, looked up by Run
    (``uq_run_attempts_run_id_number``): two steps, so that no plan joins the history."""
    a = run_attempts.c
    return select(a.run_id, (millis(a.finished_at) - millis(a.started_at)).label("ms")).where(
        a.run_id.in_(list(run_ids)), a.started_at.is_not(None), a.finished_at.is_not(None)
    )


DURATION_CHUNK = 500


def again_statement(run_id: str, after_sequence: int, data_is: DataIs) -> Select:
    """The Runs admitted as ``run_id`` run again: their admission events come after the old
    Run's last event, so the primary key is walked from there."""
    e = run_events.c
    return (
        select(e.run_id)
        .where(e.id > after_sequence, e.type == "run_admitted", data_is("again_of", run_id))
        .order_by(e.id)
        .limit(AGAIN_LIMIT)
    )


def buckets_from(found: Sequence[rows.Row]) -> list[FinishedBucket]:
    by_start: dict[int, dict[str, int]] = {}
    for row in found:
        by_start.setdefault(int(row["bucket"]), {})[str(row["status"])] = int(row["n"])
    return [
        FinishedBucket(
            start_ms=start,
            succeeded=counts.get(RunStatus.SUCCEEDED.value, 0),
            failed=counts.get(RunStatus.FAILED.value, 0),
            cancelled=counts.get(RunStatus.CANCELLED.value, 0),
        )
        for start, counts in sorted(by_start.items())
    ]


class SqlRunBrowser:
    """:class:`ql3.application.console.RunBrowser` over one store's read transactions.
    ``read`` opens one and yields its connection and the store's clock."""

    def __init__(
        self,
        read: Callable[[], AbstractContextManager[tuple[Connection, int]]],
        spelling: Spelling,
        millis: Millis,
        contains: Contains,
        data_is: DataIs,
        estimate: Callable[[Connection, Select], int | None] | None = None,
    ) -> None:
        self._data_is = data_is
        self._read = read
        self._spelling = spelling
        self._millis = millis
        self._contains = contains
        self._estimate = estimate

    def _rows(self, statement: Select) -> Iterator[rows.Row]:
        with self._read() as (connection, _now):
            yield from connection.execute(statement).mappings().all()

    def browse_runs(
        self, where: RunFilter, order: RunOrder, after: RunCursor | None, limit: int
    ) -> RunPage:
        statement = browse_statement(where, order, after, limit, self._spelling, self._contains)
        with self._read() as (connection, now):
            found = connection.execute(statement).mappings().all()
        return page_of(found, limit, now)

    def count_runs(self, where: RunFilter, cap: int) -> Count:
        statement = capped_count_statement(where, cap, self._spelling, self._contains)
        with self._read() as (connection, _now):
            value = int(connection.execute(statement).scalar_one())
            if value <= cap:
                return Count(value=value, exact=True)
            if self._estimate is not None:
                full = select(runs.c.id).where(
                    *where_clauses(where, self._spelling, self._contains)
                )
                estimated = self._estimate(connection, full)
                if estimated is not None and estimated > cap:
                    return Count(value=estimated, exact=False, estimated=True)
        return Count(value=cap, exact=False)

    def finished_between(
        self, since_ms: int, bucket_ms: int
    ) -> tuple[int, Sequence[FinishedBucket]]:
        statement = finished_buckets_statement(since_ms, bucket_ms, self._spelling, self._millis)
        with self._read() as (connection, now):
            found = connection.execute(statement).mappings().all()
        return now, buckets_from(found)

    def finished_counts(self, since_ms: int) -> Mapping[tuple[str, str], int]:
        statement = finished_counts_statement(since_ms, self._spelling)
        return {(str(r["task"]), str(r["status"])): int(r["n"]) for r in self._rows(statement)}

    def task_durations(self, since_ms: int, limit: int) -> Mapping[str, Sequence[int]]:
        found: dict[str, list[int]] = {}
        with self._read() as (connection, _now):
            recent = connection.execute(
                recent_finished_statement(since_ms, limit, self._spelling)
            ).all()
            task_of = {str(run_id): str(task) for run_id, task in recent}
            ids = list(task_of)
            for start in range(0, len(ids), DURATION_CHUNK):
                chunk = ids[start : start + DURATION_CHUNK]
                for run_id, ms in connection.execute(durations_statement(chunk, self._millis)):
                    found.setdefault(task_of[str(run_id)], []).append(max(0, int(ms)))
        return found

    def runs_again_of(self, run_id: str, after_sequence: int) -> Sequence[str]:
        statement = again_statement(run_id, after_sequence, self._data_is)
        return [str(row["run_id"]) for row in self._rows(statement)]

    def last_event_sequence(self) -> int:
        with self._read() as (connection, _now):
            found = connection.execute(select(func.max(run_events.c.id))).scalar()
        return int(found or 0)

    def status_counts(self, cap: int) -> Mapping[RunStatus, Count]:
        statement = status_counts_statement(cap, self._spelling, self._contains)
        with self._read() as (connection, _now):
            row = connection.execute(statement).mappings().one()
            found: dict[RunStatus, Count] = {}
            for status in RunStatus:
                value = int(row[status.value])
                if value <= cap:
                    found[status] = Count(value=value, exact=True)
                    continue
                estimated = None
                if self._estimate is not None:
                    full = select(runs.c.id).where(
                        *where_clauses(
                            RunFilter(statuses=(status,)), self._spelling, self._contains
                        )
                    )
                    estimated = self._estimate(connection, full)
                if estimated is not None and estimated > cap:
                    found[status] = Count(value=estimated, exact=False, estimated=True)
                else:
                    found[status] = Count(value=cap, exact=False)
        return found
