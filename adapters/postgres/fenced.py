"""Hand-written SQL for the store's hot paths: locking Attempts, a claim's locks, applying
Changes and admitting Runs.

Recovery, lost retry, admission and every worker command go through these steps, once per
candidate, batch or command. Built as SQLAlchemy Core statements they cost more CPU than the
database spends on them, so here each is one plain SQL text, generated once per shape from the
same table metadata (:mod:`ql3.adapters.sql.schema`) and run through the driver:

- :func:`lock_attempt_sql` takes the Attempt's transaction-level advisory lock (or tries it),
  then locks the Run, Attempt and lease rows, and reads the holder's session, the Attempt's stop
  reports and the store's clock, all in one statement. The lock is taken first: the row locks
  sit in a ``LATERAL`` subquery that depends on its result, so PostgreSQL cannot run them before
  it, and when a try-lock fails the subquery is skipped without touching a row.
- :func:`apply_statement` writes a whole Change as one statement of data-modifying CTEs. Every
  write is gated on one ``ok`` row that re-checks all the compare-and-set predicates together, so
  either all of the Change is written or none of it; the counts it returns tell which.
- :func:`lock_session_sql` and :func:`claim_sql` are a claim's locks (``lock_for_claim``), sent
  together in one round trip (a pipeline): the first locks the session row; the second, whose
  snapshot is therefore taken once that lock is held, counts the session's leases, reads the
  dispatch gate and, when it is open, locks the oldest claimable Attempts of each task.
- :func:`apply_many_sql` writes a batch of Changes (a claim's grants, hand-backs and
  completions; worker command batches) as one statement of fixed shape, the rows as one JSON
  document per table, gated the same way.
- :func:`add_many_sql` inserts a batch of admitted Runs with their Attempts, leases and events
  the same way, in one statement.

A statement whose writes put a Run into ``queued`` also calls ``pg_notify`` on
:data:`~ql3.adapters.postgres.queries.DISPATCH_CHANNEL`, gated like its writes: the notification is
delivered when (and only if) the transaction commits, so a parked claim wakes without a round
trip of its own.

Time columns travel as integer epoch milliseconds (``floor(extract(epoch ...) * 1000)`` on the
way out; on the way in aware datetimes, or milliseconds inside the JSON documents), as
:class:`ql3.adapters.sql.schema.EpochMillis` does for the Core statements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache, lru_cache
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy import JSON, Column, Table
from sqlalchemy.dialects import postgresql

from ql3.adapters.postgres.admission_batch import ADDED, JsonRows, queues_a_run
from ql3.adapters.postgres.queries import ADVISORY_LOCK_NAMESPACE, DISPATCH_CHANNEL
from ql3.adapters.sql import guards, rows
from ql3.adapters.sql.merge import merge_by_run
from ql3.adapters.sql.schema import (
    DISPATCH_GATE_ID,
    EpochMillis,
    attempt_stop_reports,
    dispatch_gate,
    in_declared_order,
    millis_to_datetime,
    run_attempts,
    run_dispatch_leases,
    run_events,
    runs,
    worker_sessions,
)
from ql3.domain.events import RunEvent
from ql3.domain.guards import CLAIMABLE_RUN, HANDED_BACK, UNCHANGED_SINCE_MADE
from ql3.domain.model import Attempt, DispatchLease, LeaseStatus, Run

RUN_PREFIX = "r_"
ATTEMPT_PREFIX = "a_"
LEASE_PREFIX = "l_"
SESSION_PREFIX = "s_"
GATE_PREFIX = "g_"

_NOTIFY = f"pg_notify('{DISPATCH_CHANNEL}', '')"


def _literal(status: Any) -> str:
    value = str(status.value)
    if "'" in value:
        raise ValueError(f"not a plain constant: {value!r}")
    return f"'{value}'"


def _one_of(column: str, statuses: frozenset[Any]) -> str:
    listed = ", ".join(_literal(status) for status in in_declared_order(statuses))
    return f"{column} IN ({listed})"


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


def _time_param(value: Any) -> Any:
    return millis_to_datetime(int(value))


def _converter(column: Column[Any]) -> Callable[[Any], Any] | None:
    """How a domain value of the column is handed to the driver (None: as it is)."""
    if _is_time(column):
        return _time_param
    if _is_json(column):
        return Jsonb
    return None


@cache
def _converters(table: Table) -> dict[str, Callable[[Any], Any] | None]:
    """:func:`_converter` of each of the table's columns, by name."""
    return {column.name: _converter(column) for column in table.columns}


def _params(params: dict[str, Any], prefix: str, table: Table, values: Mapping[str, Any]) -> None:
    """``values`` of ``table``'s columns into ``params`` as ``<prefix><column>``; None stays
    None (NULL)."""
    converters = _converters(table)
    for column, value in values.items():
        convert = converters[column]
        params[prefix + column] = value if value is None or convert is None else convert(value)


def store_now_sql(offset_param: str = "clock_offset_ms") -> str:
    """The store's clock (plus the test offset) as epoch milliseconds."""
    return (
        "(floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint"
        f" + %({offset_param})s::bigint)"
    )


@cache
def now_sql() -> str:
    """The store's clock, alone (``now_ms``)."""
    return f"SELECT {store_now_sql()} AS now_ms"


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


@cache
def get_session_sql() -> str:
    """A session by id (or NULL columns), the store's clock and the Attempt ids of the session's
    ``leased`` leases in id order (``ix_run_dispatch_leases_held``; what a claim's ``held``
    statement is checked against), in one row."""
    leased = _literal(LeaseStatus.LEASED)
    return (
        f"SELECT {store_now_sql()} AS observed_at,"
        f" {_select_list(worker_sessions, 'ws', SESSION_PREFIX)},"
        " ARRAY(SELECT h.attempt_id FROM run_dispatch_leases h"
        f" WHERE h.holder_session_id = ws.id AND h.status = {leased}"
        ' ORDER BY h.attempt_id COLLATE "C") AS held'
        " FROM (SELECT 1) one LEFT JOIN worker_sessions ws ON ws.id = %(session_id)s"
    )


# --- the claim's locks -------------------------------------------------------------------------
#
# Why two statements: under READ COMMITTED a statement reads one snapshot, taken when it starts,
# before any row lock it waits for. Counting the session's leases in the statement that waited
# for the session's lock would miss the leases the previous holder of that lock committed, and
# two claims of one session could together exceed its capacity. The count therefore runs in the
# next statement, sent in the same round trip (a pipeline), whose snapshot is taken once the lock
# is held. The limits of limited tasks (ADR 0014) are locked by the first statement for the same
# reason: the next one counts their Attempts in flight with every claim of them committed that
# held their lock before.


@cache
def lock_session_sql() -> str:
    """The claiming session's row, locked: claims of one session count its capacity one after the
    other; then, once it is held, the ``task_limits`` rows of the tasks named that have one, in
    task order: claims of a limited task, from any session of any replica, count what is in
    flight of it one after the other. A task without a limit costs one probe of the key's index
    in the same statement."""
    return """
WITH s AS MATERIALIZED (
    SELECT 1 AS locked FROM worker_sessions WHERE id = %(session_id)s FOR UPDATE
)
SELECT s.locked,
       (SELECT count(*) FROM (
            SELECT 1 FROM task_limits tl
            WHERE tl.task = ANY(%(tasks)s::text[]) AND EXISTS (SELECT 1 FROM s)
            ORDER BY tl.task
            FOR UPDATE
        ) k) AS limits_locked
FROM s"""


def _handed_back(alias: str) -> str:
    """An Attempt handed back and not claimed since (:data:`ql3.domain.guards.HANDED_BACK`, the
    predicate of ``ix_run_attempts_handed_back``)."""
    return guards.text(HANDED_BACK, {"attempt": alias})


def _claimable_part(handed_back: bool) -> str:
    """One of the two parts of a claim's candidates (as
    :func:`ql3.adapters.sql.sqlite.fenced.claimable_sql` on SQLite), per task named, locked:
    Attempts never changed since created, from ``ix_runs_claimable`` by their Runs' ``updated_at``;
    or Attempts handed back, from ``ix_run_attempts_handed_back`` by their own ``created_at``. Both
    the Run's highest priority first, then in the order of the Attempts' age: the first part in the
    order of its index, which it reads only as far as its limit however deep the queue and however
    its priorities mix; the second sorts the handed-back Attempts, which are few at any time."""
    if handed_back:
        source = "run_attempts a JOIN runs r ON r.id = a.run_id AND r.attempt_count = a.number"
        # Read only when ``h`` (of :func:`claim_sql`) found any Attempt handed back.
        part = f"{_handed_back('a')} AND EXISTS (SELECT 1 FROM h WHERE h.any)"
        order = "r.priority DESC, a.created_at, a.run_id"
    else:
        source = "runs r JOIN run_attempts a ON a.run_id = r.id AND a.number = r.attempt_count"
        part = guards.text(UNCHANGED_SINCE_MADE, {"attempt": "a"})
        order = "r.priority DESC, r.updated_at, r.id"
    return f"""
    SELECT t.n AS task_n, ra.*
    FROM unnest(%(tasks)s::text[]) WITH ORDINALITY AS t(task, n)
    CROSS JOIN LATERAL (
        SELECT {_select_list(runs, "r", RUN_PREFIX)},
               {_select_list(run_attempts, "a", ATTEMPT_PREFIX)}
        FROM {source}
        WHERE r.task = t.task
          AND {guards.text(CLAIMABLE_RUN, {"run": "r"})}
          AND {part}
          AND EXISTS (SELECT 1 FROM g WHERE g.{GATE_PREFIX}open)
          AND EXISTS (SELECT 1 FROM s)
        ORDER BY {order}
        LIMIT %(limit_per_task)s
        FOR UPDATE OF r, a SKIP LOCKED
    ) ra"""


@cache
def claim_sql() -> str:
    """What a claim decides from, in one statement after :func:`lock_session_sql`: the session
    with the number of ``leased`` leases it holds, the dispatch gate, the store's clock and, while
    the gate is open and the session exists, up to ``limit_per_task`` claimable Attempts of each
    task with their Runs, locked (``FOR UPDATE SKIP LOCKED``: rows another transaction holds are
    passed over), each with its Run's latest lease, the ``leased`` leases per task of those
    candidates and the limits of the tasks named (locked by :func:`lock_session_sql`). One row
    per candidate, or one row with NULL candidate columns when there is none.

    Each task's candidates are its queued Runs' latest Attempts (numbered ``attempt_count``),
    highest priority first, then oldest Attempt first: the first of the two parts of
    :func:`_claimable_part` merged, each
    part read from its index and stopping at the limit, however deep the queue. Each part locks
    up to the limit, so a few more rows than are returned may stay locked until the transaction
    ends (other claims pass over them). ``h`` says whether any Attempt is handed back (one probe
    of its index): a generic plan may read the handed-back part from the task's queued Runs
    (estimated at one row, they are the whole queue), probing each for a handed-back Attempt, so
    that part runs only when there is one, which is seldom. The latest Attempt of a queued Run
    is pristine (every transition that queues a Run leaves it so); the store checks it, but the
    statement does not: the planner multiplies the selectivities of the six columns a pristine
    Attempt has NULL, which in a long history all vary together, and concluding that almost no
    queued Run qualifies it would read every pristine Attempt and sort them instead of reading
    the few first entries of an index.

    No advisory lock is taken: the Attempts locked here are pristine Attempts of ``queued`` Runs,
    which runtime recovery (non-pristine Attempts of dispatching, running or lost Runs) and lost
    retry (``lost`` and ``retry_wait`` Runs) never touch. Everything else that writes them (a
    cancellation, another claim) takes the Run's row lock first, which this statement holds or
    skips. The Run's row lock also keeps its leases as read here: no lease of a Run is written
    without it, so the latest lease is read without a lock of its own."""
    leased = _literal(LeaseStatus.LEASED)
    return f"""
WITH s AS MATERIALIZED (
    SELECT {_select_list(worker_sessions, "ws", SESSION_PREFIX)},
           (SELECT count(*) FROM run_dispatch_leases h
             WHERE h.holder_session_id = ws.id AND h.status = {leased}) AS held
    FROM worker_sessions ws
    WHERE ws.id = %(session_id)s
),
g AS MATERIALIZED (
    SELECT {_select_list(dispatch_gate, "dg", GATE_PREFIX, skip=("id",))}
    FROM dispatch_gate dg
    WHERE dg.id = {DISPATCH_GATE_ID}
),
h AS MATERIALIZED (
    SELECT EXISTS (SELECT 1 FROM run_attempts hb WHERE {_handed_back("hb")}) AS any
),
fresh AS MATERIALIZED ({_claimable_part(False)}
),
handed_back AS MATERIALIZED ({_claimable_part(True)}
),
c AS MATERIALIZED (
    SELECT ranked.*
    FROM (
        SELECT u.*, row_number() OVER (
                   PARTITION BY u.task_n
                   ORDER BY u.{RUN_PREFIX}priority DESC, u.{ATTEMPT_PREFIX}created_at,
                            u.{RUN_PREFIX}id
               ) AS task_rank
        FROM (SELECT * FROM fresh UNION ALL SELECT * FROM handed_back) u
    ) ranked
    WHERE ranked.task_rank <= %(limit_per_task)s
),
f AS MATERIALIZED (
    SELECT json_object_agg(x.task, x.in_flight) AS in_flight_by_task
    FROM (
        SELECT fr.task, count(*) AS in_flight
        FROM run_dispatch_leases fl JOIN runs fr ON fr.id = fl.run_id
        WHERE fl.status = {leased}
          AND fr.task IN (SELECT c.{RUN_PREFIX}task FROM c)
        GROUP BY fr.task
    ) x
),
k AS MATERIALIZED (
    SELECT json_object_agg(tl.task, tl.max_running) AS task_limits
    FROM task_limits tl
    WHERE tl.task = ANY(%(tasks)s::text[])
)
SELECT {store_now_sql()} AS observed_at, s.*, g.*, f.in_flight_by_task, k.task_limits, c.*, lz.*
FROM f
CROSS JOIN k
LEFT JOIN s ON true
LEFT JOIN g ON true
LEFT JOIN c ON true
LEFT JOIN LATERAL (
    SELECT {_select_list(run_dispatch_leases, "l", LEASE_PREFIX)}
    FROM run_dispatch_leases l
    WHERE l.run_id = c.{RUN_PREFIX}id
    ORDER BY l.generation DESC
    LIMIT 1
) lz ON true
ORDER BY c.task_n, c.task_rank"""


def claim_params(
    session_id: str, tasks: Sequence[str], limit_per_task: int, clock_offset_ms: int
) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "tasks": list(tasks),
        "limit_per_task": limit_per_task,
        "clock_offset_ms": clock_offset_ms,
    }


# --- apply --------------------------------------------------------------------------------------


# One statement's shape: per write, its kind, name, table, written columns and which fence
# values are NULL. The SQL text depends on nothing else, so it is built once per shape.
_Part = tuple[str, str, str, tuple[str, ...], tuple[tuple[str, bool], ...]]
_SQL_BY_SHAPE: dict[tuple[tuple[_Part, ...], bool], str] = {}
_SHAPE_CACHE_LIMIT = 256


class ApplyStatement:
    """One Change as one statement: its SQL text, its parameters and the writes it expects."""

    def __init__(self) -> None:
        self.parts: list[_Part] = []
        self.names: list[str] = []
        self.params: dict[str, Any] = {}
        # Whether the Change puts its Run into ``queued``: the statement then notifies.
        self.notify = False

    def update(
        self,
        name: str,
        table: Table,
        values: Mapping[str, Any],
        fence: Mapping[str, Any],
    ) -> None:
        """``UPDATE table SET values WHERE fence`` (a None fence value means IS NULL)."""
        _params(self.params, f"{name}_", table, values)
        _params(self.params, f"{name}_w_", table, {c: v for c, v in fence.items() if v is not None})
        nulls = tuple((column, value is None) for column, value in fence.items())
        if values:
            self.parts.append(("update", name, table.name, tuple(values), nulls))
            self.names.append(name)
        else:
            # Nothing to write: the row must still be as it was read.
            self.parts.append(("check", name, table.name, (), nulls))

    def insert(self, name: str, table: Table, values: Mapping[str, Any]) -> None:
        _params(self.params, f"{name}_", table, values)
        self.parts.append(("insert", name, table.name, tuple(values), ()))
        self.names.append(name)

    def sql(self) -> str:
        shape = (tuple(self.parts), self.notify)
        text = _SQL_BY_SHAPE.get(shape)
        if text is None:
            text = _build_sql(*shape)
            if len(_SQL_BY_SHAPE) >= _SHAPE_CACHE_LIMIT:
                _SQL_BY_SHAPE.clear()
            _SQL_BY_SHAPE[shape] = text
        return text


_TABLES = {table.name: table for table in (runs, run_attempts, run_dispatch_leases, run_events)}


def _build_sql(shape: tuple[_Part, ...], notify: bool) -> str:
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
    if notify:
        counts += f", (SELECT count(*) FROM (SELECT {_NOTIFY} FROM ok WHERE ok.ok) n) AS notified"
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
    """The statement for a Change, each update fenced on what the transaction read: the Run on
    its status and attempt count, the Attempt on its status and lease version, the lease on its
    version, status and token hash.

    An update writes only the columns that change: the fence columns and the locks taken
    before make the rest equal to what was read."""
    statement = ApplyStatement()
    if after_run != before_run:
        statement.update(
            "u_run",
            runs,
            _changed(rows.run_values(before_run), rows.run_values(after_run), "id"),
            fence={"id": before_run.id, **guards.fence_values("runs", rows.run_values(before_run))},
        )
    for index, attempt in enumerate(attempts):
        if before_attempt is not None and attempt.id == before_attempt.id:
            statement.update(
                f"u_att{index}",
                run_attempts,
                _changed(rows.attempt_values(before_attempt), rows.attempt_values(attempt), "id"),
                fence={
                    "id": before_attempt.id,
                    **guards.fence_values("run_attempts", rows.attempt_values(before_attempt)),
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
                        **guards.fence_values("run_dispatch_leases", rows.lease_values(old)),
                    },
                )
        else:
            statement.insert("i_lease", run_dispatch_leases, rows.lease_values(lease))
    statement.insert("i_event", run_events, rows.event_values(event))
    statement.notify = queues_a_run(after_run)
    return statement


# --- apply many ---------------------------------------------------------------------------------
#
# A batch of Changes as one statement of fixed shape: per table, the rows travel as one JSON
# document (an array of objects, each without its null columns) that ``json_to_recordset`` turns
# back into rows, so the SQL text never changes and PostgreSQL plans it once. The parameter is
# ``json``, not ``jsonb``: it is read once, row by row, and building a ``jsonb`` value of it
# first only adds work for the server. Every column is written; the fences are the
# same as for one Change. The values are the domain's (times as epoch milliseconds, converted in
# the statement; JSON columns nested as they are): measured on a batch of 8 claims and 8
# completions, this costs the client about a quarter of the CPU of one array parameter per
# column, most of which went to adapting the arrays' datetimes and texts.

_UPDATED: tuple[tuple[str, Table, tuple[str, ...], tuple[str, ...]], ...] = (
    ("runs", runs, ("id",), guards.fence_columns("runs")),
    ("attempts", run_attempts, ("id",), guards.fence_columns("run_attempts")),
    (
        "leases",
        run_dispatch_leases,
        ("run_id", "generation"),
        guards.fence_columns("run_dispatch_leases"),
    ),
)
_INSERTED: tuple[tuple[str, Table], ...] = (
    ("new_attempts", run_attempts),
    ("new_leases", run_dispatch_leases),
    ("events", run_events),
)


@cache
def _record_type(column: Column[Any]) -> str:
    """How a column travels in a JSON row: times as epoch milliseconds."""
    if _is_time(column):
        return "bigint"
    if _is_json(column):
        return "jsonb"
    return _sql_type(column)


def _input(column: Column[Any], ref: str) -> str:
    """A column's value as it enters the table (the inverse of :func:`_output`)."""
    if _is_time(column):
        return f"(timestamptz 'epoch' + {ref} * interval '1 millisecond')"
    return ref


def _records(name: str, table: Table, columns: Sequence[tuple[str, str]]) -> str:
    """``v_<name>`` rows from the JSON parameter ``name``; ``columns`` is (field, column)."""
    fields = ", ".join(
        f"{field} {_record_type(table.columns[column])}" for field, column in columns
    )
    return f"v_{name} AS (SELECT * FROM json_to_recordset(%({name})s::json) AS v({fields}))"


@cache
def _written(table: Table, keys: tuple[str, ...]) -> tuple[str, ...]:
    """The columns a statement writes: all but the key and the store-assigned identity."""
    return tuple(c.name for c in table.columns if c.name not in keys and not _is_identity(c))


def _is_identity(column: Column[Any]) -> bool:
    return column.identity is not None


def _inserts(name: str, table: Table, gate: str) -> tuple[str, str]:
    """The source and the INSERT of one inserted table's rows (``gate``: its FROM and WHERE)."""
    written = _written(table, ())
    source = _records(name, table, [(column, column) for column in written])
    values = ", ".join(_input(table.columns[column], f"v.{column}") for column in written)
    write = (
        f"w_{name} AS (INSERT INTO {table.name} ({', '.join(written)})"
        f" SELECT {values} FROM v_{name} v{gate} RETURNING 1)"
    )
    return source, write


# Sent before a batch statement in the same round trip: the plan of a batch statement is made
# once per connection and kept, and a plan made while a table was small (a new database) scans
# that table whole for as long as the connection lives. Without sequential scans the batch
# reaches each of its rows through the key's index, whatever the table's size was then.
INDEX_PLANS_SQL = "SELECT set_config('enable_seqscan', 'off', true) AS setting"


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
        sources.append(_records(name, table, columns))
        # The first key again as an array: the planner then probes the table's index for
        # each row instead of scanning the table to hash-join the batch (a JSON record set is
        # estimated at 100 rows, a batch holds a few).
        match = " AND ".join(
            [f"t.{key} = v.{key}" for key in keys]
            + [f"t.{keys[0]} = ANY(ARRAY(SELECT {keys[0]} FROM v_{name}))"]
            + [f"t.{fence} IS NOT DISTINCT FROM v.b_{fence}" for fence in fences]
        )
        checks.append(
            f"(SELECT count(*) FROM {table.name} t JOIN v_{name} v ON {match})"
            f" = (SELECT count(*) FROM v_{name})"
        )
        assignments = ", ".join(
            f"{column} = {_input(table.columns[column], f'v.n_{column}')}" for column in written
        )
        writes.append(
            f"w_{name} AS (UPDATE {table.name} t SET {assignments}"
            f" FROM v_{name} v, ok WHERE ok.ok AND {match} RETURNING 1)"
        )
        names.append(f"w_{name}")
    for name, table in _INSERTED:
        source, write = _inserts(name, table, ", ok WHERE ok.ok")
        sources.append(source)
        writes.append(write)
        names.append(f"w_{name}")
    counts = ", ".join(f"(SELECT count(*) FROM {name}) AS {name}" for name in names)
    notified = (
        f"(SELECT count(*) FROM (SELECT {_NOTIFY} FROM ok"
        " WHERE ok.ok AND %(notify)s::boolean) n) AS notified"
    )
    return (
        "WITH "
        + ",\n".join(sources)
        + f",\nok AS (SELECT {' AND '.join(checks)} AS ok),\n"
        + ",\n".join(writes)
        + f"\nSELECT ok.ok, {counts}, {notified} FROM ok"
    )


class ApplyMany(JsonRows):
    """The rows of :func:`apply_many_sql` for a batch."""

    def __init__(self) -> None:
        super().__init__([name for name, *_ in _UPDATED] + [name for name, _ in _INSERTED])

    def update(
        self,
        name: str,
        keys: Sequence[str],
        fence: Mapping[str, Any],
        after: Mapping[str, Any],
    ) -> None:
        row = {f"n_{column}": value for column, value in after.items() if column not in keys}
        row.update((key, after[key]) for key in keys)
        row.update((f"b_{column}", value) for column, value in fence.items())
        self.add(name, row)

    def insert(self, name: str, values: dict[str, Any]) -> None:
        self.add(name, values)


def apply_many_statement(writes: Sequence[tuple[Any, Any]]) -> ApplyMany:
    """Parameters for ``(before snapshot, change)`` pairs, in order. Changes of one Run are
    merged: the first write's ``before`` is the fence, the last one's result is written, and
    every event is appended in order. A later change must start from the earlier one's result."""
    batch = ApplyMany()
    merged = merge_by_run(writes, out_of_order=ValueError)
    for group in merged.runs.values():
        first_run, last_run = group.before, group.run
        if queues_a_run(last_run):
            batch.notify = True
        if last_run != first_run:
            batch.update(
                "runs",
                ("id",),
                guards.fence_values("runs", rows.run_values(first_run)),
                rows.run_values(last_run),
            )
        for attempt in group.attempts.values():
            if attempt.first is None:
                batch.insert("new_attempts", rows.attempt_values(attempt.last))
            else:
                batch.update(
                    "attempts",
                    ("id",),
                    guards.fence_values("run_attempts", rows.attempt_values(attempt.first)),
                    rows.attempt_values(attempt.last),
                )
        for lease in group.leases.values():
            if lease.first is None:
                batch.insert("new_leases", rows.lease_values(lease.last))
            elif lease.last != lease.first:
                batch.update(
                    "leases",
                    ("run_id", "generation"),
                    guards.fence_values("run_dispatch_leases", rows.lease_values(lease.first)),
                    rows.lease_values(lease.last),
                )
    for event in merged.events:
        batch.insert("events", rows.event_values(event))
    return batch


# --- add many -----------------------------------------------------------------------------------
#
# Admission of a batch: every Run, Attempt, lease and event of the batch inserted by one
# statement of fixed shape, the rows as JSON documents (as for apply many). Inserts meet unique
# indexes and checks, so the store runs it under a savepoint.

_ADDED: tuple[tuple[str, Table], ...] = tuple(
    zip(ADDED, (runs, run_attempts, run_dispatch_leases, run_events), strict=True)
)


@cache
def add_many_sql() -> str:
    sources: list[str] = []
    writes: list[str] = []
    for name, table in _ADDED:
        source, write = _inserts(name, table, "")
        sources.append(source)
        writes.append(write)
    counts = ", ".join(f"(SELECT count(*) FROM w_{name}) AS w_{name}" for name, _ in _ADDED)
    notified = f"(SELECT count(*) FROM (SELECT {_NOTIFY} WHERE %(notify)s::boolean) n) AS notified"
    return "WITH " + ",\n".join(sources + writes) + f"\nSELECT {counts}, {notified}"
