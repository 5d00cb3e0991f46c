"""Hand-written SQL for the store's hot paths: locking Attempts, and applying Changes.

Recovery, lost retry and every worker command go through these two steps, once per candidate or
command. Built as SQLAlchemy Core statements they cost more CPU than the database spends on them,
so here each is one plain SQL text, generated once per shape from the same table metadata
(:mod:`adapters.sql.schema`) and run through the driver:

- :func:`lock_attempt_sql` takes the Attempt's transaction-level advisory lock (or tries it),
  then locks the Run, Attempt and lease rows, and reads the holder's session, the Attempt's stop
  reports and the store's clock, all in one statement. The lock is taken first: the row locks
  sit in a ``LATERAL`` subquery that depends on its result, so PostgreSQL cannot run them before
  it, and when a try-lock fails the subquery is skipped without touching a row.
- :func:`apply_statement` writes a whole Change as one statement of data-modifying CTEs. Every
  write is gated on one ``ok`` row that re-checks all the compare-and-set predicates together, so
  either all of the Change is written or none of it; the counts it returns tell which.
- :func:`apply_many_sql` writes a batch of Changes (worker command batches, a session's offers)
  as one statement of fixed shape, the rows as parallel arrays, gated the same way. It serves one
  Change too, but at about twice the client CPU of :func:`apply_statement` (every column of every
  table travels as an array), so a single Change keeps its own statement.

Time columns travel as integer epoch milliseconds (``floor(extract(epoch ...) * 1000)`` on the
way out, aware datetimes on the way in), as :class:`adapters.sql.schema.EpochMillis` does for the
Core statements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache, lru_cache
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy import JSON, Column, Table
from sqlalchemy.dialects import postgresql

from adapters.postgres.queries import ADVISORY_LOCK_NAMESPACE
from adapters.sql import rows
from adapters.sql.schema import (
    EpochMillis,
    attempt_stop_reports,
    millis_to_datetime,
    run_attempts,
    run_dispatch_leases,
    run_events,
    runs,
    worker_sessions,
)
from domain.events import RunEvent
from domain.model import Attempt, DispatchLease, Run

RUN_PREFIX = "r_"
ATTEMPT_PREFIX = "a_"
LEASE_PREFIX = "l_"
SESSION_PREFIX = "s_"


def _is_time(column: Column[Any]) -> bool:
    return isinstance(column.type, EpochMillis)


def _is_json(column: Column[Any]) -> bool:
    return isinstance(column.type, JSON)


def _output(column: Column[Any], ref: str) -> str:
    """A column as it leaves the database: times as epoch milliseconds."""
    if _is_time(column):
        return f"floor(extract(epoch FROM {ref}) * 1000)::bigint"
    return ref


def _select_list(table: Table, alias: str, prefix: str, skip: Sequence[str] = ()) -> str:
    parts = []
    for column in table.columns:
        if column.name in skip:
            continue
        parts.append(f"{_output(column, f'{alias}.{column.name}')} AS {prefix}{column.name}")
    return ", ".join(parts)


@cache
def _sql_type(column: Column[Any]) -> str:
    """The column's PostgreSQL type, for an explicit cast of a parameter."""
    compiled = column.type.compile(dialect=postgresql.dialect())
    return compiled.split(" COLLATE ", 1)[0]


def _placeholder(column: Column[Any], name: str) -> str:
    return f"%({name})s::{_sql_type(column)}"


def _identity(value: Any) -> Any:
    return value


@cache
def _converter(column: Column[Any]) -> Any:
    """How a domain value of the column is handed to the driver."""
    if _is_time(column):
        return lambda value: millis_to_datetime(int(value))
    if _is_json(column):
        return Jsonb
    return _identity


def _param(column: Column[Any], value: Any) -> Any:
    if value is None:
        return None
    return _converter(column)(value)


def _params(table: Table, values: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    return {f"{prefix}{name}": _param(table.columns[name], value) for name, value in values.items()}


def store_now_sql(offset_param: str = "clock_offset_ms") -> str:
    """The store's clock (plus the test offset) as epoch milliseconds."""
    return (
        "(floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint"
        f" + %({offset_param})s::bigint)"
    )


# --- lock ---------------------------------------------------------------------------------------


_REPORT_FIELDS = ", ".join(
    f"'{c.name}', " + _output(c, f"p.{c.name}") for c in attempt_stop_reports.columns
)


def _locked_rows_sql(source: str, key: str, order_by: str = "") -> str:
    """The locked rows of each Attempt named by ``key`` in ``source`` (a FROM item whose rows
    are taken one after the other, each one's ``got`` saying whether its advisory lock is held),
    with the holder's session, the stop reports and the store's clock."""
    return f"""
SELECT ra.*, lz.*, {_select_list(worker_sessions, "s", SESSION_PREFIX)},
       (SELECT json_agg(json_build_object({_REPORT_FIELDS}) ORDER BY p.reported_at, p.id)
          FROM attempt_stop_reports p WHERE p.attempt_id = ra.{ATTEMPT_PREFIX}id) AS reports,
       {store_now_sql()} AS observed_at
FROM {source}
JOIN LATERAL (
    SELECT {_select_list(runs, "r", RUN_PREFIX)}, {_select_list(run_attempts, "a", ATTEMPT_PREFIX)}
    FROM runs r JOIN run_attempts a ON a.run_id = r.id
    WHERE a.id = {key} AND g.got
    FOR UPDATE OF r, a
) ra ON true
LEFT JOIN LATERAL (
    SELECT {_select_list(run_dispatch_leases, "l", LEASE_PREFIX)}
    FROM run_dispatch_leases l
    WHERE l.run_id = ra.{RUN_PREFIX}id
      AND (ra.{ATTEMPT_PREFIX}lease_generation IS NULL
           OR l.generation = ra.{ATTEMPT_PREFIX}lease_generation)
    ORDER BY l.generation DESC
    LIMIT 1
    FOR UPDATE
) lz ON true
LEFT JOIN worker_sessions s ON s.id = ra.{ATTEMPT_PREFIX}session_id
{order_by}"""


@lru_cache(maxsize=2)
def lock_attempt_sql(skip_locked: bool) -> str:
    lock = (
        "pg_try_advisory_xact_lock" if skip_locked else "pg_advisory_xact_lock"
    ) + f"({ADVISORY_LOCK_NAMESPACE}, hashtext(%(attempt_id)s))"
    got = lock if skip_locked else f"{lock} IS NOT NULL"
    return _locked_rows_sql(f"(SELECT {got} AS got) g", "%(attempt_id)s")


@cache
def lock_attempts_sql() -> str:
    """Several Attempts, one after the other in the order given: each one's advisory lock, then
    its rows. Callers give them sorted, so that concurrent batches cannot deadlock."""
    source = (
        "unnest(%(attempt_ids)s::text[]) WITH ORDINALITY AS k(key, n)\n"
        "JOIN LATERAL (SELECT pg_advisory_xact_lock("
        f"{ADVISORY_LOCK_NAMESPACE}, hashtext(k.key)) IS NOT NULL AS got) g ON true"
    )
    return _locked_rows_sql(source, "k.key", "ORDER BY k.n")


def lock_attempt_params(attempt_id: str, clock_offset_ms: int) -> dict[str, Any]:
    return {"attempt_id": attempt_id, "clock_offset_ms": clock_offset_ms}


# --- apply --------------------------------------------------------------------------------------


# One statement's shape: per write, its kind, name, table, written columns and which fence
# values are NULL. The SQL text depends on nothing else, so it is built once per shape.
_Part = tuple[str, str, str, tuple[str, ...], tuple[tuple[str, bool], ...]]
_SQL_BY_SHAPE: dict[tuple[_Part, ...], str] = {}
_SHAPE_CACHE_LIMIT = 256


class ApplyStatement:
    """One Change as one statement: its SQL text, its parameters and the writes it expects."""

    def __init__(self) -> None:
        self.parts: list[_Part] = []
        self.names: list[str] = []
        self.params: dict[str, Any] = {}

    def update(
        self,
        name: str,
        table: Table,
        values: Mapping[str, Any],
        fence: Mapping[str, Any],
    ) -> None:
        """``UPDATE table SET values WHERE fence`` (a None fence value means IS NULL)."""
        columns = table.columns
        params = self.params
        for column, value in values.items():
            params[f"{name}_{column}"] = _param(columns[column], value)
        for column, value in fence.items():
            if value is not None:
                params[f"{name}_w_{column}"] = _param(columns[column], value)
        nulls = tuple((column, value is None) for column, value in fence.items())
        if values:
            self.parts.append(("update", name, table.name, tuple(values), nulls))
            self.names.append(name)
        else:
            # Nothing to write: the row must still be as it was read.
            self.parts.append(("check", name, table.name, (), nulls))

    def insert(self, name: str, table: Table, values: Mapping[str, Any]) -> None:
        columns = table.columns
        params = self.params
        for column, value in values.items():
            params[f"{name}_{column}"] = _param(columns[column], value)
        self.parts.append(("insert", name, table.name, tuple(values), ()))
        self.names.append(name)

    def sql(self) -> str:
        shape = tuple(self.parts)
        text = _SQL_BY_SHAPE.get(shape)
        if text is None:
            text = _build_sql(shape)
            if len(_SQL_BY_SHAPE) >= _SHAPE_CACHE_LIMIT:
                _SQL_BY_SHAPE.clear()
            _SQL_BY_SHAPE[shape] = text
        return text


_TABLES = {table.name: table for table in (runs, run_attempts, run_dispatch_leases, run_events)}


def _build_sql(shape: tuple[_Part, ...]) -> str:
    checks: list[str] = []
    ctes: list[str] = []
    for kind, name, table_name, written, nulls in shape:
        columns = _TABLES[table_name].columns
        if kind in ("update", "check"):
            where = " AND ".join(
                f"{column} IS NULL"
                if is_null
                else f"{column} = {_placeholder(columns[column], f'{name}_w_{column}')}"
                for column, is_null in nulls
            )
            assignments = ", ".join(
                f"{column} = {_placeholder(columns[column], f'{name}_{column}')}"
                for column in written
            )
            checks.append(f"EXISTS (SELECT 1 FROM {table_name} WHERE {where})")
            if kind == "check":
                continue
            ctes.append(
                f"{name} AS (UPDATE {table_name} SET {assignments}"
                f" FROM ok WHERE ok.ok AND {where} RETURNING 1)"
            )
        else:
            placeholders = ", ".join(
                _placeholder(columns[column], f"{name}_{column}") for column in written
            )
            ctes.append(
                f"{name} AS (INSERT INTO {table_name} ({', '.join(written)})"
                f" SELECT {placeholders} FROM ok WHERE ok.ok RETURNING 1)"
            )
    check = " AND ".join(checks) if checks else "true"
    counts = ", ".join(
        f"(SELECT count(*) FROM {part[1]}) AS {part[1]}" for part in shape if part[0] != "check"
    )
    return (
        f"WITH ok AS (SELECT {check} AS ok),\n"
        + ",\n".join(ctes)
        + f"\nSELECT ok.ok, {counts} FROM ok"
    )


def _changed(before: rows.Values, after: rows.Values, *keys: str) -> rows.Values:
    """The columns whose values differ (the key columns never change)."""
    return {
        name: value
        for name, value in after.items()
        if name not in keys and before.get(name) != value
    }


def apply_statement(
    before_run: Run,
    after_run: Run,
    before_attempt: Attempt | None,
    attempts: Sequence[Attempt],
    before_lease: DispatchLease | None,
    lease: DispatchLease | None,
    event: RunEvent,
) -> ApplyStatement:
    """The statement for a Change, fenced exactly as the Core statements of
    :mod:`adapters.postgres.queries` (``update_run``, ``update_attempt``, ``update_lease``).

    An update writes only the columns that change: the fence columns and the locks taken
    before make the rest equal to what was read."""
    statement = ApplyStatement()
    if after_run != before_run:
        statement.update(
            "u_run",
            runs,
            _changed(rows.run_values(before_run), rows.run_values(after_run), "id"),
            fence={
                "id": before_run.id,
                "status": before_run.status.value,
                "attempt_count": before_run.attempt_count,
            },
        )
    for index, attempt in enumerate(attempts):
        if before_attempt is not None and attempt.id == before_attempt.id:
            statement.update(
                f"u_att{index}",
                run_attempts,
                _changed(rows.attempt_values(before_attempt), rows.attempt_values(attempt), "id"),
                fence={
                    "id": before_attempt.id,
                    "status": before_attempt.status.value,
                    "lease_version": before_attempt.lease_version,
                },
            )
        else:
            statement.insert(f"i_att{index}", run_attempts, rows.attempt_values(attempt))
    if lease is not None:
        old = before_lease
        if old is not None and (old.run_id, old.generation) == (lease.run_id, lease.generation):
            if lease != old:
                statement.update(
                    "u_lease",
                    run_dispatch_leases,
                    _changed(
                        rows.lease_values(old), rows.lease_values(lease), "run_id", "generation"
                    ),
                    fence={
                        "run_id": old.run_id,
                        "generation": old.generation,
                        "version": old.version,
                        "status": old.status.value,
                        "token_hash": old.token_hash,
                    },
                )
        else:
            statement.insert("i_lease", run_dispatch_leases, rows.lease_values(lease))
    statement.insert("i_event", run_events, rows.event_values(event))
    return statement


# --- apply many ---------------------------------------------------------------------------------
#
# A batch of Changes as one statement of fixed shape: per table, the rows travel as parallel
# arrays that ``unnest`` turns back into rows, so the SQL text never changes and PostgreSQL
# plans it once. Every column is written; the fences are the same as for one Change.

_UPDATED: tuple[tuple[str, Table, tuple[str, ...], tuple[str, ...]], ...] = (
    ("runs", runs, ("id",), ("status", "attempt_count")),
    ("attempts", run_attempts, ("id",), ("status", "lease_version")),
    ("leases", run_dispatch_leases, ("run_id", "generation"), ("version", "status", "token_hash")),
)
_INSERTED: tuple[tuple[str, Table], ...] = (
    ("new_attempts", run_attempts),
    ("new_leases", run_dispatch_leases),
    ("events", run_events),
)


def _array_param(prefix: str, column: str) -> str:
    return f"{prefix}__{column}"


def _unnest(name: str, table: Table, columns: Sequence[tuple[str, str]]) -> str:
    """``v_<name>`` rows from parallel array parameters; ``columns`` is (alias, column)."""
    arrays = ", ".join(
        f"%({_array_param(name, alias)})s::{_sql_type(table.columns[column])}[]"
        for alias, column in columns
    )
    aliases = ", ".join(alias for alias, _ in columns)
    return f"v_{name} AS (SELECT * FROM unnest({arrays}) AS v({aliases}))"


@cache
def _written(table: Table, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The columns a statement writes: all but the key and the store-assigned identity."""
    return tuple(c.name for c in table.columns if c.name not in keys and not _is_identity(c))


def _is_identity(column: Column[Any]) -> bool:
    return column.identity is not None


@cache
def apply_many_sql() -> str:
    sources: list[str] = []
    checks: list[str] = []
    writes: list[str] = []
    names: list[str] = []
    for name, table, keys, fences in _UPDATED:
        written = _written(table, keys)
        columns = (
            [(key, key) for key in keys]
            + [(f"b_{fence}", fence) for fence in fences]
            + [(f"n_{column}", column) for column in written]
        )
        sources.append(_unnest(name, table, columns))
        match = " AND ".join(
            [f"t.{key} = v.{key}" for key in keys]
            + [f"t.{fence} IS NOT DISTINCT FROM v.b_{fence}" for fence in fences]
        )
        checks.append(
            f"(SELECT count(*) FROM {table.name} t JOIN v_{name} v ON {match})"
            f" = (SELECT count(*) FROM v_{name})"
        )
        assignments = ", ".join(f"{column} = v.n_{column}" for column in written)
        writes.append(
            f"w_{name} AS (UPDATE {table.name} t SET {assignments}"
            f" FROM v_{name} v, ok WHERE ok.ok AND {match} RETURNING 1)"
        )
        names.append(f"w_{name}")
    for name, table in _INSERTED:
        written = _written(table, ())
        sources.append(_unnest(name, table, [(column, column) for column in written]))
        listed = ", ".join(written)
        writes.append(
            f"w_{name} AS (INSERT INTO {table.name} ({listed})"
            f" SELECT {listed} FROM v_{name}, ok WHERE ok.ok RETURNING 1)"
        )
        names.append(f"w_{name}")
    counts = ", ".join(f"(SELECT count(*) FROM {name}) AS {name}" for name in names)
    return (
        "WITH "
        + ",\n".join(sources)
        + f",\nok AS (SELECT {' AND '.join(checks)} AS ok),\n"
        + ",\n".join(writes)
        + f"\nSELECT ok.ok, {counts} FROM ok"
    )


class ApplyMany:
    """The parameters of :func:`apply_many_sql` for a batch, and the row counts it expects."""

    def __init__(self) -> None:
        self.params: dict[str, list[Any]] = {}
        self.expected: dict[str, int] = {}
        for name, table, keys, fences in _UPDATED:
            columns = [
                *keys,
                *(f"b_{f}" for f in fences),
                *(f"n_{c}" for c in _written(table, keys)),
            ]
            for column in columns:
                self.params[_array_param(name, column)] = []
            self.expected[f"w_{name}"] = 0
        for name, table in _INSERTED:
            for column in _written(table, ()):
                self.params[_array_param(name, column)] = []
            self.expected[f"w_{name}"] = 0
        self.inserts_rows = False

    def update(
        self,
        name: str,
        table: Table,
        keys: Sequence[str],
        fence: Mapping[str, Any],
        after: Mapping[str, Any],
    ) -> None:
        columns = table.columns
        params = self.params
        for key in keys:
            params[_array_param(name, key)].append(_param(columns[key], after[key]))
        for column, value in fence.items():
            params[_array_param(name, f"b_{column}")].append(_param(columns[column], value))
        for column in _written(table, keys):
            params[_array_param(name, f"n_{column}")].append(_param(columns[column], after[column]))
        self.expected[f"w_{name}"] += 1

    def insert(self, name: str, table: Table, values: Mapping[str, Any]) -> None:
        columns = table.columns
        params = self.params
        for column in _written(table, ()):
            params[_array_param(name, column)].append(_param(columns[column], values[column]))
        self.expected[f"w_{name}"] += 1
        if name != "events":
            self.inserts_rows = True


def apply_many_statement(writes: Sequence[tuple[Any, Any]]) -> ApplyMany:
    """Parameters for ``(before snapshot, change)`` pairs, in order. Changes of one Run are
    merged: the first write's ``before`` is the fence, the last one's result is written, and
    every event is appended in order. A later change must start from the earlier one's result."""
    batch = ApplyMany()
    groups: dict[str, dict[str, Any]] = {}
    for before, change in writes:
        run_id = before.run.id
        if change.run.id != run_id:
            raise ValueError(f"change of run {change.run.id} applied to run {run_id}")
        group = groups.get(run_id)
        if group is None:
            group = groups[run_id] = {
                "before_run": before.run,
                "run": before.run,
                "attempts": {},
                "leases": {},
                "events": [],
            }
        elif before.run != group["run"]:
            raise ValueError(f"run {run_id}: a change does not start from the one before it")
        group["run"] = change.run
        for attempt in change.attempts:
            slot = group["attempts"].get(attempt.id)
            if slot is None:
                first = (
                    before.attempt
                    if (before.attempt is not None and before.attempt.id == attempt.id)
                    else None
                )
                group["attempts"][attempt.id] = [first, attempt]
            else:
                slot[1] = attempt
        lease = change.lease
        if lease is not None:
            key = (lease.run_id, lease.generation)
            slot = group["leases"].get(key)
            if slot is None:
                old = before.lease
                first = old if old is not None and (old.run_id, old.generation) == key else None
                group["leases"][key] = [first, lease]
            else:
                slot[1] = lease
        group["events"].append(change.event)
    for group in groups.values():
        first_run, last_run = group["before_run"], group["run"]
        if last_run != first_run:
            batch.update(
                "runs",
                runs,
                ("id",),
                {"status": first_run.status.value, "attempt_count": first_run.attempt_count},
                rows.run_values(last_run),
            )
        for first, last in group["attempts"].values():
            if first is None:
                batch.insert("new_attempts", run_attempts, rows.attempt_values(last))
            else:
                batch.update(
                    "attempts",
                    run_attempts,
                    ("id",),
                    {"status": first.status.value, "lease_version": first.lease_version},
                    rows.attempt_values(last),
                )
        for first, last in group["leases"].values():
            if first is None:
                batch.insert("new_leases", run_dispatch_leases, rows.lease_values(last))
            elif last != first:
                batch.update(
                    "leases",
                    run_dispatch_leases,
                    ("run_id", "generation"),
                    {
                        "version": first.version,
                        "status": first.status.value,
                        "token_hash": first.token_hash,
                    },
                    rows.lease_values(last),
                )
        for event in group["events"]:
            batch.insert("events", run_events, rows.event_values(event))
    return batch
