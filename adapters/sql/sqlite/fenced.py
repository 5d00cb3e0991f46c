"""Plain SQL for the SQLite store's hot paths: locking Attempts, a claim's reads and applying a
batch of Changes, as ADR 0006 does for PostgreSQL (decisions 3 and 4).

Every worker command, every claim and every startup-recovery candidate goes through these. Built
as SQLAlchemy Core statements they cost several times the CPU SQLite spends on them (statement
construction, compilation cache keys, row mapping), so each is one SQL text, generated once per
shape from the same table metadata (:mod:`ql3.adapters.sql.schema`) and run on the unit of work's
driver connection (:meth:`ql3.adapters.sql.sqlite.store.SqliteUnitOfWork.execute_sql`):

- :func:`lock_attempts_sql` reads Attempts with their Runs and their leases (the Attempt's own
  generation, or the Run's latest lease while the Attempt has none), the ids given as one JSON
  array: one statement of one shape for any number of them.
- :func:`claimable_sql` is a task's claim candidates with their Runs' latest leases;
  :func:`claim_session_sql` the claiming session with the leases it holds.
- :class:`ApplyMany` writes a batch of Changes as a few ``executemany`` calls, one per table and
  shape of row (the columns an update writes): every update is a compare-and-set on its key and
  fence, so a batch whose total of touched rows falls short of its items lost a race.

Time columns are integer epoch milliseconds in SQLite already (as
:class:`ql3.adapters.sql.schema.EpochMillis` stores them); JSON columns travel as JSON text, as the
Core path's ``JSON`` type writes and reads them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from typing import Any

from sqlalchemy import JSON, Table

from ql3.adapters.sql import guards, rows
from ql3.adapters.sql.merge import merge_by_run
from ql3.adapters.sql.schema import (
    DISPATCH_GATE_ID,
    dispatch_gate,
    in_declared_order,
    run_attempts,
    run_dispatch_leases,
    run_events,
    runs,
    worker_sessions,
)
from ql3.adapters.sql.statements import ATTEMPT_COLUMNS, LEASE_COLUMNS, RUN_COLUMNS
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.guards import (
    CHANGED_SINCE_MADE,
    CLAIMABLE_RUN,
    PRISTINE_ATTEMPT,
    UNCHANGED_SINCE_MADE,
)
from ql3.domain.model import LeaseStatus
from ql3.domain.states import CLAIMABLE_RUN_STATUSES

Row = dict[str, Any]


def _literal(status: Any) -> str:
    value = str(status.value)
    if "'" in value:
        raise ValueError(f"not a plain constant: {value!r}")
    return f"'{value}'"


def _one_of(column: str, statuses: Iterable[Any]) -> str:
    return f"{column} IN ({', '.join(_literal(s) for s in in_declared_order(statuses))})"


def _select_list(table: Table, alias: str, prefix: str) -> str:
    return ", ".join(f"{alias}.{c.name} AS {prefix}{c.name}" for c in table.columns)


@cache
def _json_columns(table: Table) -> frozenset[str]:
    return frozenset(c.name for c in table.columns if isinstance(c.type, JSON))


def decode(found: list[Row], *tables: tuple[Table, str]) -> list[Row]:
    """The JSON columns of ``found`` (labelled ``<prefix><column>``) as Python values. A
    column declared ``JSON`` has numeric affinity in SQLite, which keeps a JSON number as a
    number: only text is parsed (as SQLAlchemy's SQLite ``JSON`` type reads it)."""
    labels = [prefix + name for table, prefix in tables for name in _json_columns(table)]
    for row in found:
        for label in labels:
            value = row[label]
            if isinstance(value, str):
                row[label] = json.loads(value)
    return found


def _encoded(table: Table, values: Mapping[str, Any]) -> dict[str, Any]:
    """Column values as the driver takes them: JSON columns as JSON text (None is NULL)."""
    encoded = dict(values)
    for name in _json_columns(table):
        if name in encoded and encoded[name] is not None:
            encoded[name] = json.dumps(encoded[name])
    return encoded


# --- reads --------------------------------------------------------------------------------------

_LATEST_LEASE = "(SELECT max(m.generation) FROM run_dispatch_leases m WHERE m.run_id = {run})"


@cache
def lock_attempts_sql() -> str:
    """Attempts named in the JSON array ``:ids``, each with its Run and its lease: the one of the
    Attempt's generation, or the Run's highest-generation lease while the Attempt has none (as
    :meth:`~ql3.adapters.sql.sqlite.store.SqliteRunRepository.lock_attempt` reads them). The
    transaction holds the database's write lock: there is nothing else to lock."""
    latest = _LATEST_LEASE.format(run="a.run_id")
    return (
        f"SELECT {_select_list(runs, 'r', RUN_COLUMNS)},"
        f" {_select_list(run_attempts, 'a', ATTEMPT_COLUMNS)},"
        f" {_select_list(run_dispatch_leases, 'l', LEASE_COLUMNS)}"
        " FROM run_attempts a JOIN runs r ON r.id = a.run_id"
        " LEFT JOIN run_dispatch_leases l ON l.run_id = a.run_id"
        f" AND l.generation = coalesce(a.lease_generation, {latest})"
        " WHERE a.id IN (SELECT value FROM json_each(:ids))"
    )


@cache
def latest_lease_sql() -> str:
    """The Run's highest-generation lease (a Run without an Attempt)."""
    return (
        f"SELECT {_select_list(run_dispatch_leases, 'l', LEASE_COLUMNS)}"
        " FROM run_dispatch_leases l WHERE l.run_id = :run_id"
        " ORDER BY l.generation DESC LIMIT 1"
    )


def _pristine(a: str) -> str:
    """:data:`ql3.domain.guards.PRISTINE_ATTEMPT` on the Attempt aliased ``a``."""
    return guards.text(PRISTINE_ATTEMPT, {"attempt": a})


def _claimable_part(handed_back: bool) -> str:
    """One of the two parts of a task's claimable Attempts (see :func:`claimable_sql`)."""
    if handed_back:
        # The Attempts drive (the left table of a CROSS JOIN is SQLite's outer loop): few are
        # handed back, while the Runs' index would list the whole queue of the task.
        source = (
            "run_attempts a CROSS JOIN runs r ON r.id = a.run_id AND r.attempt_count = a.number"
        )
        part = guards.text(CHANGED_SINCE_MADE, {"attempt": "a"})
        order = "r.priority DESC, a.created_at, a.run_id"
    else:
        source = "runs r JOIN run_attempts a ON a.run_id = r.id AND a.number = r.attempt_count"
        part = guards.text(UNCHANGED_SINCE_MADE, {"attempt": "a"})
        order = "r.priority DESC, r.updated_at, r.id"
    return (
        f"SELECT * FROM (SELECT {_select_list(runs, 'r', RUN_COLUMNS)},"
        f" {_select_list(run_attempts, 'a', ATTEMPT_COLUMNS)}"
        f" FROM {source}"
        f" WHERE r.task = :task AND {guards.text(CLAIMABLE_RUN, {'run': 'r'})}"
        f" AND {_pristine('a')} AND {part}"
        f" ORDER BY {order} LIMIT :limit)"
    )


@cache
def claimable_sql() -> str:
    """Up to ``:limit`` claimable Runs of ``:task`` with their pristine latest Attempt (the one
    numbered ``attempt_count``: every Attempt is created with the next number and counted in
    the same change) and the Run's latest lease, Run, Attempt and lease side by side, from
    each of two parts that together are all of them:

    - Attempts never changed since they were created, read from ``ix_runs_claimable`` in its
      order (such an Attempt was created with its Run's move into ``queued``, so the Run's
      ``updated_at`` is the Attempt's age);
    - Attempts handed back since, from ``ix_run_attempts_handed_back`` (few at any time: they
      are sorted).

    Each part is in claim order: the Run's highest priority first, then the oldest Attempt (its
    ``created_at``, then the Run's id). The first ``:limit`` of the task are the first
    ``:limit`` of both parts merged, which the caller does."""
    latest = _LATEST_LEASE.format(run=f"c.{RUN_COLUMNS}id")
    return (
        f"SELECT c.*, {_select_list(run_dispatch_leases, 'l', LEASE_COLUMNS)}"
        f" FROM ({_claimable_part(False)} UNION ALL {_claimable_part(True)}) c"
        f" LEFT JOIN run_dispatch_leases l ON l.run_id = c.{RUN_COLUMNS}id"
        f" AND l.generation = {latest}"
    )


@cache
def claim_session_sql() -> str:
    """The claiming session and how many ``leased`` leases it holds
    (``ix_run_dispatch_leases_held``)."""
    return (
        f"SELECT {_select_list(worker_sessions, 's', '')},"
        " (SELECT count(*) FROM run_dispatch_leases h WHERE h.holder_session_id = s.id"
        f" AND h.status = {_literal(LeaseStatus.LEASED)}) AS ql3_held"
        " FROM worker_sessions s WHERE s.id = :session_id"
    )


@cache
def get_session_sql() -> str:
    return f"SELECT {_select_list(worker_sessions, 's', '')} FROM worker_sessions s WHERE s.id = ?"


@cache
def held_by_sql() -> str:
    """The Attempt ids of the session's ``leased`` leases, by id."""
    return (
        "SELECT attempt_id FROM run_dispatch_leases WHERE holder_session_id = ?"
        f" AND status = {_literal(LeaseStatus.LEASED)} ORDER BY attempt_id"
    )


@cache
def get_gate_sql() -> str:
    return (
        f"SELECT {_select_list(dispatch_gate, 'g', '')} FROM dispatch_gate g"
        f" WHERE g.id = {DISPATCH_GATE_ID}"
    )


@cache
def in_flight_by_task_sql() -> str:
    """``leased`` leases per task (of the JSON array ``:tasks``) of their Run."""
    return (
        "SELECT r.task, count(*) AS in_flight"
        " FROM run_dispatch_leases l JOIN runs r ON r.id = l.run_id"
        f" WHERE l.status = {_literal(LeaseStatus.LEASED)}"
        " AND r.task IN (SELECT value FROM json_each(:tasks)) GROUP BY r.task"
    )


@cache
def limits_of_sql() -> str:
    """The limits of the tasks of the JSON array ``:tasks`` that have one."""
    return (
        "SELECT task, max_running FROM task_limits"
        " WHERE task IN (SELECT value FROM json_each(:tasks))"
    )


# --- apply many ---------------------------------------------------------------------------------
#
# The compare-and-set of each kind of row, written once: the key, then the fence the
# transaction read. ``IS`` compares the nullable fence columns (NULL matches NULL).

_KEYS: dict[str, tuple[str, ...]] = {
    "runs": ("id",),
    "run_attempts": ("id",),
    "run_dispatch_leases": ("run_id", "generation"),
}
_TABLES = {table.name: table for table in (runs, run_attempts, run_dispatch_leases, run_events)}
_FENCES: dict[str, tuple[tuple[str, str], ...]] = {
    table: tuple(
        (column, "IS" if _TABLES[table].c[column].nullable else "=")
        for column in guards.fence_columns(table)
    )
    for table in _KEYS
}
"""The domain's fences (:data:`ql3.domain.guards.FENCES`), a nullable column compared with
``IS``."""


@cache
def _fence_parameters(table: str) -> tuple[tuple[str, str], ...]:
    """The ``w_<column>`` parameters of an update of ``table`` (:func:`update_sql`) and the
    columns whose value as read each one takes."""
    columns = (*_KEYS[table], *(column for column, _ in _FENCES[table]))
    return tuple((f"w_{column}", column) for column in columns)


@cache
def update_sql(table: str, written: tuple[str, ...]) -> str:
    """The compare-and-set update of one row of ``table`` writing the columns ``written``
    (parameters ``:<column>``), keyed and fenced on ``:w_<column>`` parameters. Without
    columns to write it only counts the row if it is still as read."""
    where = " AND ".join(
        [f"{key} = :w_{key}" for key in _KEYS[table]]
        + [f"{column} {op} :w_{column}" for column, op in _FENCES[table]]
    )
    if not written:
        return f"SELECT count(*) FROM {table} WHERE {where}"
    values = ", ".join(f"{column} = :{column}" for column in written)
    return f"UPDATE {table} SET {values} WHERE {where}"


@cache
def insert_sql(table: str, written: tuple[str, ...]) -> str:
    columns = ", ".join(written)
    return f"INSERT INTO {table} ({columns}) VALUES ({', '.join(':' + c for c in written)})"


class ApplyMany:
    """A batch of Changes as groups of rows of one statement each, in the order they are
    written: updates of Runs, of Attempts, inserts of Attempts, updates of leases, inserts of
    leases (a Run's lease is released before its next one is granted; an Attempt exists before
    a lease names it), then the events in the order of the batch.

    Changes of one Run are merged: the first write's ``before`` is the fence, the last one's
    result is written, every event appended in order. A later change of a Run must start from
    the earlier one's result."""

    _ORDER = (
        ("update", "runs"),
        ("update", "run_attempts"),
        ("insert", "run_attempts"),
        ("update", "run_dispatch_leases"),
        ("insert", "run_dispatch_leases"),
        ("insert", "run_events"),
    )

    def __init__(self, writes: Sequence[tuple[Any, Any]]) -> None:
        # (kind, table) -> written columns -> [(parameters, what)]
        self.groups: dict[tuple[str, str], dict[tuple[str, ...], list[tuple[Row, str]]]] = {
            key: {} for key in self._ORDER
        }
        self.queues = False
        self._merge(writes)

    def statements(self) -> list[tuple[str, str, list[Row], list[str]]]:
        """``(kind, sql, parameters, what)`` per statement, in the order they run; ``kind`` is
        ``update`` (each item must touch its one row), ``check`` (each item's row must still be
        as read: a count, one item at a time) or ``insert``."""
        out = []
        for (kind, table), shapes in self.groups.items():
            for written, items in shapes.items():
                if kind == "insert":
                    step, sql = kind, insert_sql(table, written)
                else:
                    step, sql = ("update" if written else "check"), update_sql(table, written)
                out.append((step, sql, [p for p, _ in items], [w for _, w in items]))
        return out

    def _add(self, kind: str, table: str, written: tuple[str, ...], params: Row, what: str) -> None:
        self.groups[(kind, table)].setdefault(written, []).append((params, what))

    def _update(
        self, table: str, first: Mapping[str, Any], last: Mapping[str, Any], what: str
    ) -> None:
        written = tuple(c for c in last if first[c] != last[c] and c not in _KEYS[table])
        params = {c: last[c] for c in written}
        for name in _json_columns(_TABLES[table]).intersection(written):
            if params[name] is not None:
                params[name] = json.dumps(params[name])
        for parameter, column in _fence_parameters(table):
            params[parameter] = first[column]
        self._add("update", table, written, params, what)

    def _insert(self, table: str, values: Mapping[str, Any], what: str) -> None:
        self._add("insert", table, tuple(values), _encoded(_TABLES[table], values), what)

    def _merge(self, writes: Sequence[tuple[Any, Any]]) -> None:
        merged = merge_by_run(writes, out_of_order=ConcurrencyConflict)
        for run_id, group in merged.runs.items():
            first_run, last_run = group.before, group.run
            if last_run.status in CLAIMABLE_RUN_STATUSES:
                self.queues = True
            if last_run != first_run:
                self._update(
                    "runs", rows.run_values(first_run), rows.run_values(last_run), f"run {run_id}"
                )
            for attempt in group.attempts.values():
                last = attempt.last
                what = f"attempt {last.id}"
                if attempt.first is None:
                    self._insert("run_attempts", rows.attempt_values(last), what)
                else:
                    self._update(
                        "run_attempts",
                        rows.attempt_values(attempt.first),
                        rows.attempt_values(last),
                        what,
                    )
            for lease in group.leases.values():
                what = f"lease {lease.last.run_id}/{lease.last.generation}"
                if lease.first is None:
                    self._insert("run_dispatch_leases", rows.lease_values(lease.last), what)
                elif lease.last != lease.first:
                    self._update(
                        "run_dispatch_leases",
                        rows.lease_values(lease.first),
                        rows.lease_values(lease.last),
                        what,
                    )
        for event in merged.events:
            self._insert("run_events", rows.event_values(event), f"event of run {event.run_id}")
