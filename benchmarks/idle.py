"""The cost of one full Cluster cycle with nothing to do, empty versus a large finished history.

(a) An empty database; (b) a database holding N finished Runs (``succeeded``, each with its
``succeeded`` Attempt, its ``released`` lease and the six events of its life), seeded with
set-based SQL in batches and then VACUUM ANALYZEd. On each, after a few warm-up cycles, it times
``--cycles`` calls of ``container.coordinator().run_cycle()`` of the Cluster composition root
(runtime recovery -> lost retry -> trigger schedule -> workflow frontier -> task attempt
admission) and counts the SQL statements of each cycle.

What is counted: every statement the store sends through a SQLAlchemy cursor during the cycle
(``before_cursor_execute`` on the store's engine): the page queries and any lock/read/write
statements. Not counted, because the driver or the pool sends them outside a cursor: the BEGIN
psycopg sends before a transaction's first statement and the ROLLBACK/COMMIT that ends it. Pool
checkouts are reported separately (``checkouts_per_cycle``), since each of them costs those
extra round trips (the pool's check of a connection at checkout sends nothing).

Targets: ``queries_per_cycle`` <= 6 and ``ratio = median_ms_large / median_ms_empty`` <= 1.5.

Each database also serves ``--cycles`` reads of the operations view, what a metrics scrape and
``ql3 status`` read (``scrape_median_ms_*``, ``scrape_ratio`` = large / empty, target <= 1.5).

Then what idle processes write (:mod:`benchmarks.idle_writes`), each watched ``--idle-seconds``:
an idle ``ql3 standalone`` process (``standalone_writes_per_min``, target 0) and one node with
four idle workers (``cluster_commits_per_min``, target <= 30; ``cluster_wal_bytes_per_min``).
"""

from __future__ import annotations

import argparse
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from sqlalchemy import event

from benchmarks import idle_writes
from benchmarks.common import (
    BenchmarkError,
    Stopwatch,
    connect,
    median,
    migrated_database,
    peak_rss_mb,
    percentile,
    positive_int,
    print_json,
    print_table,
    say,
)

TARGET_QUERIES = 6
TARGET_RATIO = 1.5
WARMUP_CYCLES = 5
BATCH_RUNS = 50_000
SEED_CONNECTIONS = 2
SESSIONS = 64
EVENTS_PER_RUN = 6
TABLE_NAMES = (
    "runs",
    "run_attempts",
    "run_dispatch_leases",
    "run_events",
    "worker_sessions",
    "attempt_stop_reports",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--finished", type=positive_int, default=1_000_000, metavar="N")
    parser.add_argument("--cycles", type=positive_int, default=200, metavar="N")
    parser.add_argument(
        "--idle-seconds",
        type=positive_int,
        default=60,
        metavar="S",
        help="how long the idle Standalone process and the idle cluster are watched",
    )


# --- seeding -----------------------------------------------------------------------------------

_SESSIONS = """
INSERT INTO worker_sessions (id, worker_id, status, capacity, tasks, secret_hash,
                             registered_at, last_heartbeat_at, closed_at)
SELECT 'done-session-' || lpad(s::text, 3, '0'), 'done-worker-' || lpad(s::text, 3, '0'),
       'closed', 16, '["bench.task.0", "bench.task.1", "bench.task.2", "bench.task.3"]'::jsonb,
       md5('secret-' || s), now() - interval '31 days', now() - interval '1 hour',
       now() - interval '1 hour'
FROM generate_series(0, %(sessions)s::int - 1) AS s
"""

# Run i lived (in seconds after t0 = now() - 30 days + 2 s * i): admitted at +0, offered at +1,
# accepted at +1.1, activated at +1.2, running at +1.3, succeeded at +2.
_BATCH = (
    """
    INSERT INTO runs (id, task, owner, status, input, output, has_policy, retry_on_lost,
                      max_attempts, safety, backoff_initial_ms, backoff_multiplier,
                      backoff_cap_ms, backoff_jitter, attempt_count, created_at, updated_at)
    SELECT 'done-run-' || lpad(i::text, 9, '0'), 'bench.task.' || (i %% 4), 'runtime',
           'succeeded', jsonb_build_object('n', i), '{"ok": true}'::jsonb,
           true, true, 3, 'idempotent', 1000, 2.0, 60000, 0.0, 1,
           t0 + i * interval '2 seconds', t0 + i * interval '2 seconds' + interval '2 seconds'
    FROM generate_series(%(lo)s::int, %(hi)s::int) AS i,
         (SELECT now() - interval '30 days' AS t0) AS clock
    """,
    """
    INSERT INTO run_attempts (id, run_id, number, status, session_id, worker_id,
                              lease_generation, lease_version, offered_at, accepted_at,
                              started_at, finished_at, created_at, updated_at)
    SELECT 'done-attempt-' || lpad(i::text, 9, '0'), 'done-run-' || lpad(i::text, 9, '0'), 1,
           'succeeded', 'done-session-' || lpad((i %% %(sessions)s)::text, 3, '0'),
           'done-worker-' || lpad((i %% %(sessions)s)::text, 3, '0'), 1, 2,
           t + interval '1 second', t + interval '1100 milliseconds',
           t + interval '1200 milliseconds', t + interval '2 seconds',
           t, t + interval '2 seconds'
    FROM (SELECT i, now() - interval '30 days' + i * interval '2 seconds' AS t
          FROM generate_series(%(lo)s::int, %(hi)s::int) AS i) AS seed
    """,
    """
    INSERT INTO run_dispatch_leases (run_id, generation, attempt_id, version, status,
                                     holder_session_id, token_hash, expires_at, granted_at,
                                     release_reason, released_at)
    SELECT 'done-run-' || lpad(i::text, 9, '0'), 1, 'done-attempt-' || lpad(i::text, 9, '0'),
           2, 'released', 'done-session-' || lpad((i %% %(sessions)s)::text, 3, '0'),
           md5('token-' || i), t + interval '31 seconds', t + interval '1 second',
           'completed', t + interval '2 seconds'
    FROM (SELECT i, now() - interval '30 days' + i * interval '2 seconds' AS t
          FROM generate_series(%(lo)s::int, %(hi)s::int) AS i) AS seed
    """,
    # LATERAL: a nested loop that emits each Run's six events in order, without a sort.
    """
    INSERT INTO run_events (run_id, attempt_id, type, at, data)
    SELECT 'done-run-' || lpad(i::text, 9, '0'), 'done-attempt-' || lpad(i::text, 9, '0'),
           e.type, t + e.after, e.data
    FROM (SELECT i, now() - interval '30 days' + i * interval '2 seconds' AS t
          FROM generate_series(%(lo)s::int, %(hi)s::int) AS i) AS seed
    CROSS JOIN LATERAL (VALUES
        ('run_admitted', interval '0', '{"task": "bench.task"}'::jsonb, i),
        ('attempt_offered', interval '1 second', '{"generation": 1}'::jsonb, i),
        ('attempt_accepted', interval '1100 milliseconds', '{}'::jsonb, i),
        ('attempt_activated', interval '1200 milliseconds', '{}'::jsonb, i),
        ('attempt_running', interval '1300 milliseconds', '{}'::jsonb, i),
        ('attempt_succeeded', interval '2 seconds', '{}'::jsonb, i)
    ) AS e(type, after, data, run)
    """,
)

# Foreign keys the seed skips checking row by row (see _without_fk_triggers), checked in bulk.
_DANGLING = """
SELECT (SELECT count(*) FROM run_attempts AS a
        WHERE NOT EXISTS (SELECT FROM runs AS r WHERE r.id = a.run_id))
     + (SELECT count(*) FROM run_dispatch_leases AS l
        WHERE NOT EXISTS (SELECT FROM run_attempts AS a WHERE a.id = l.attempt_id)
           OR NOT EXISTS (SELECT FROM runs AS r WHERE r.id = l.run_id))
"""


def _without_fk_triggers(conn: psycopg.Connection[Any]) -> bool:
    """Bulk-load mode for this session: foreign-key triggers do not fire (the seed is consistent
    by construction and checked in bulk afterwards). Needs a superuser; False if refused."""
    try:
        conn.execute("SET session_replication_role = replica")
    except psycopg.errors.InsufficientPrivilege:
        conn.rollback()
        return False
    return True


def _seed_batches(
    url: str,
    batches: Sequence[tuple[int, int]],
    errors: list[BaseException],
    fk_checked: list[bool],
) -> None:
    try:
        with connect(url) as conn:
            conn.execute("SET synchronous_commit = off")
            fk_checked.append(not _without_fk_triggers(conn))
            for lo, hi in batches:
                params = {"lo": lo, "hi": hi, "sessions": SESSIONS}
                for statement in _BATCH:
                    conn.execute(statement, params)
                conn.commit()
    except BaseException as error:  # reported by the caller's thread
        errors.append(error)


def seed_finished(url: str, finished: int) -> tuple[float, float, bool]:
    """Seed ``finished`` finished Runs in batches of BATCH_RUNS over SEED_CONNECTIONS
    connections, then VACUUM ANALYZE. Returns (seconds seeding, seconds vacuuming, whether
    foreign keys were checked row by row)."""
    watch = Stopwatch()
    with connect(url) as conn:
        conn.execute(_SESSIONS, {"sessions": SESSIONS})
        conn.commit()
    batches = [
        (lo, min(finished, lo + BATCH_RUNS - 1)) for lo in range(1, finished + 1, BATCH_RUNS)
    ]
    errors: list[BaseException] = []
    fk_checked: list[bool] = []
    threads = [
        threading.Thread(
            target=_seed_batches,
            args=(url, batches[k::SEED_CONNECTIONS], errors, fk_checked),
            daemon=True,
        )
        for k in range(min(SEED_CONNECTIONS, len(batches)))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    seed_s = watch.seconds()
    watch = Stopwatch()
    with connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return seed_s, watch.seconds(), all(fk_checked)


def table_rows(url: str) -> dict[str, int]:
    with connect(url) as conn:
        return {
            name: int(conn.execute(f"SELECT count(*) FROM {name}").fetchone()[0])  # type: ignore[index]
            for name in TABLE_NAMES
        }


def check_seed(url: str, finished: int) -> dict[str, int]:
    counts = table_rows(url)
    want = {
        "runs": finished,
        "run_attempts": finished,
        "run_dispatch_leases": finished,
        "run_events": finished * EVENTS_PER_RUN,
        "worker_sessions": SESSIONS,
    }
    wrong = {name: counts[name] for name, value in want.items() if counts[name] != value}
    if wrong:
        raise BenchmarkError(f"seeding left unexpected row counts: {wrong}, want {want}")
    with connect(url) as conn:
        row = conn.execute(_DANGLING).fetchone()
    if row is None or int(row[0]) != 0:
        raise BenchmarkError(f"seeding left rows whose foreign keys do not resolve: {row}")
    return counts


# --- the measured cycles -----------------------------------------------------------------------


@contextmanager
def cycle_counter(engine: Any) -> Iterator[dict[str, Any]]:
    """Statements through SQLAlchemy cursors and pool checkouts, while ``counting`` is set."""
    state: dict[str, Any] = {"counting": False, "statements": [], "checkouts": 0}

    def on_statement(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if state["counting"]:
            state["statements"].append(statement)

    def on_checkout(*_: Any) -> None:
        if state["counting"]:
            state["checkouts"] += 1

    event.listen(engine, "before_cursor_execute", on_statement)
    event.listen(engine.pool, "checkout", on_checkout)
    try:
        yield state
    finally:
        event.remove(engine, "before_cursor_execute", on_statement)
        event.remove(engine.pool, "checkout", on_checkout)


def _idle(summary: Any) -> bool:
    """The cycle succeeded and every step found nothing to do."""
    if not summary.ok:
        return False
    return all(value == 0 for step in summary.steps for value in step.counts.values())


# How to tell the store's candidate queries apart by their text (first match wins).
_KNOWN_STATEMENTS = (
    ("resolvable", "recovery_candidates (runtime recovery)"),
    ("'retry_wait'", "due_retries (lost retry)"),
    ("'lost'", "lost_runs (lost retry)"),
    ("in_flight", "available_sessions (task attempt admission)"),
    ("task_rank", "queued_attempts (task attempt admission)"),
)


def describe_statement(statement: str) -> str:
    for marker, name in _KNOWN_STATEMENTS:
        if marker in statement:
            return name
    names = set(re.findall(r"\b(?:FROM|JOIN|INTO|UPDATE)\s+(\w+)", statement))
    return "other: " + (", ".join(sorted(names & set(TABLE_NAMES))) or statement[:60])


def measure_cycles(url: str, cycles: int) -> dict[str, Any]:
    from ql3.bootstrap.cluster import build

    container = build(database_url=url)
    store = container.store()
    try:
        coordinator = container.coordinator()
        for _ in range(WARMUP_CYCLES):
            coordinator.run_cycle()
        timings: list[float] = []
        queries: list[int] = []
        checkouts: list[int] = []
        statements: list[str] = []
        with cycle_counter(store.engine) as state:
            for _ in range(cycles):
                state["statements"], state["checkouts"] = [], 0
                state["counting"] = True
                watch = Stopwatch()
                summary = coordinator.run_cycle()
                elapsed_ms = watch.seconds() * 1000
                state["counting"] = False
                if not _idle(summary):
                    raise BenchmarkError(f"an idle cycle did something: {summary.as_dict()}")
                timings.append(elapsed_ms)
                queries.append(len(state["statements"]))
                checkouts.append(state["checkouts"])
                statements = statements or list(state["statements"])
        scrapes = _scrape_timings(store, cycles)
    finally:
        store.close()
    if len(set(queries)) != 1:
        raise BenchmarkError(f"statements per idle cycle vary: {sorted(set(queries))}")
    return {
        "median_ms": median(timings),
        "p90_ms": percentile(timings, 0.9),
        "min_ms": min(timings),
        "queries": queries[0],
        "checkouts": max(checkouts),
        "statements": [describe_statement(statement) for statement in statements],
        "scrape_median_ms": median(scrapes),
    }


def _scrape_timings(store: Any, count: int) -> list[float]:
    """What a metrics scrape (or ``ql3 status``) reads: the operations view, ``count`` times."""
    from ql3.application.ports import HARD_PAGE_CAP

    store.operations_view(HARD_PAGE_CAP)  # warm
    timings: list[float] = []
    for _ in range(count):
        watch = Stopwatch()
        store.operations_view(HARD_PAGE_CAP)
        timings.append(watch.seconds() * 1000)
    return timings


# --- the command -------------------------------------------------------------------------------


def main(args: argparse.Namespace, admin: str) -> int:
    total = Stopwatch()
    with migrated_database(admin, "ql3_bench_idle_empty") as url:
        say(f"idle: {args.cycles} cycles on an empty database")
        empty = measure_cycles(url, args.cycles)
    with migrated_database(admin, "ql3_bench_idle_large") as url:
        say(f"idle: seeding {args.finished:,} finished runs")
        seed_s, vacuum_s, fk_checked = seed_finished(url, args.finished)
        counts = check_seed(url, args.finished)
        say(f"idle: seeded in {seed_s:.1f}s, VACUUM ANALYZE {vacuum_s:.1f}s; {args.cycles} cycles")
        large = measure_cycles(url, args.cycles)
    say(f"idle: an idle standalone process, {args.idle_seconds}s")
    standalone = idle_writes.standalone_writes(args.idle_seconds)
    with migrated_database(admin, "ql3_bench_idle_cluster") as url:
        say(f"idle: a node and {idle_writes.WORKERS} idle workers, {args.idle_seconds}s")
        cluster = idle_writes.cluster_commits(admin, url, args.idle_seconds)
    writes_ok = (
        standalone["standalone_writes_per_min"] <= idle_writes.TARGET_STANDALONE_WRITES
        and cluster["cluster_commits_per_min"] <= idle_writes.TARGET_CLUSTER_COMMITS
    )
    queries = max(empty["queries"], large["queries"])
    ratio = large["median_ms"] / empty["median_ms"]
    scrape_ratio = large["scrape_median_ms"] / empty["scrape_median_ms"]
    result: dict[str, Any] = {
        "queries_per_cycle": queries,
        "median_ms_empty": round(empty["median_ms"], 3),
        "median_ms_large": round(large["median_ms"], 3),
        "ratio": round(ratio, 3),
        "scrape_median_ms_empty": round(empty["scrape_median_ms"], 3),
        "scrape_median_ms_large": round(large["scrape_median_ms"], 3),
        "scrape_ratio": round(scrape_ratio, 3),
        "queries_per_cycle_empty": empty["queries"],
        "queries_per_cycle_large": large["queries"],
        "checkouts_per_cycle": max(empty["checkouts"], large["checkouts"]),
        "p90_ms_empty": round(empty["p90_ms"], 3),
        "p90_ms_large": round(large["p90_ms"], 3),
        "finished": args.finished,
        "cycles": args.cycles,
        "seed_seconds": round(seed_s, 1),
        "vacuum_analyze_seconds": round(vacuum_s, 1),
        "event_rows": counts["run_events"],
        "seed_fk_checked_per_row": fk_checked,
        "peak_rss_mb": peak_rss_mb(),
        **standalone,
        **cluster,
        "idle_seconds": args.idle_seconds,
        "target_queries_per_cycle": TARGET_QUERIES,
        "target_ratio": TARGET_RATIO,
        "target_scrape_ratio": TARGET_RATIO,
        "target_standalone_writes_per_min": idle_writes.TARGET_STANDALONE_WRITES,
        "target_cluster_commits_per_min": idle_writes.TARGET_CLUSTER_COMMITS,
        "meets_targets": queries <= TARGET_QUERIES
        and ratio <= TARGET_RATIO
        and scrape_ratio <= TARGET_RATIO
        and writes_ok,
        "total_seconds": round(total.seconds(), 1),
    }
    print_table(
        "Idle Cluster cycle: empty database vs finished history",
        [
            ("finished", args.finished, "succeeded runs, 1 attempt + 1 lease + 6 events each"),
            (
                "seed_seconds",
                result["seed_seconds"],
                f"batches of {BATCH_RUNS:,} runs on {SEED_CONNECTIONS} connections"
                + ("" if fk_checked else "; FKs checked in bulk after"),
            ),
            ("vacuum_analyze_seconds", result["vacuum_analyze_seconds"], ""),
            ("cycles", args.cycles, f"measured, after {WARMUP_CYCLES} warm-up cycles"),
            ("queries_per_cycle", queries, f"cursor statements; target <= {TARGET_QUERIES}"),
            ("checkouts_per_cycle", result["checkouts_per_cycle"], "each: BEGIN, END"),
            ("median_ms_empty", result["median_ms_empty"], f"p90 {result['p90_ms_empty']}"),
            ("median_ms_large", result["median_ms_large"], f"p90 {result['p90_ms_large']}"),
            ("ratio", result["ratio"], f"large / empty; target <= {TARGET_RATIO}"),
            (
                "scrape_ratio",
                result["scrape_ratio"],
                f"a metrics scrape's reads, large / empty ({result['scrape_median_ms_empty']} ms,"
                f" {result['scrape_median_ms_large']} ms); target <= {TARGET_RATIO}",
            ),
            (
                "standalone_writes_per_min",
                result["standalone_writes_per_min"],
                f"write calls of an idle ql3 standalone ({result['standalone_write_bytes_per_min']}"
                f" bytes/min); target <= {idle_writes.TARGET_STANDALONE_WRITES}",
            ),
            (
                "cluster_commits_per_min",
                result["cluster_commits_per_min"],
                f"1 node + {idle_writes.WORKERS} idle workers;"
                f" target <= {idle_writes.TARGET_CLUSTER_COMMITS}",
            ),
            (
                "cluster_wal_bytes_per_min",
                result["cluster_wal_bytes_per_min"],
                "the server's WAL, whatever else it served meanwhile",
            ),
            ("total_seconds", result["total_seconds"], ""),
        ],
    )
    print("statements of one idle cycle (large database):")
    for number, name in enumerate(large["statements"], start=1):
        print(f"  {number}. {name}")
    if args.json:
        print_json(result)
    return 0
