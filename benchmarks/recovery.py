"""Runtime recovery throughput against pgbench TPC-B at the same number of clients.

Seeds N runtime-owned Runs whose only Attempt holds an expired ``leased`` lease and is a
recovery candidate the domain can settle: three in four are ``claimed`` Attempts that were
offered and accepted but never started (no evidence needed), one in four are ``running``
Attempts whose worker session is ``closed`` (trusted not-running evidence). Then it times
``RuntimeRecovery.run_once(page_size)`` of the Cluster composition root until no candidate is
left and verifies the outcome with SQL. Recovery runs the profile's ``recovery_concurrency``
transactions at once (``CLUSTER_DEFAULTS``, 3 unless ``--concurrency N``): the calling thread
and ``N - 1`` threads of each pass, each on its own pooled connection.

The reference is pgbench TPC-B on a separate database of the same server (scale N: one branch
row per client, so that its clients do not queue on one row lock), at the same number of
clients as recovery's transactions (``-c N -j N``) and, reported beside it, at one client
(``-c 1 -j 1``: it waits on each commit's flush alone, while concurrent transactions share
flushes). Each round runs the three (recovery, pgbench at N, pgbench at 1), its order rotated
by one from round to round, so that none always runs right after another; the figures are
medians over the rounds. ``ratio`` is the median of the per-round ``recovered_per_s /
pgbench_tps`` at equal clients (target >= 0.8); ``ratio_one_client`` the same against one
client.

``client_cpu_ms_per_attempt`` is the CPU time (user + system) of this process over the timed
recovery, per recovered Attempt: recovery's threads run in this process, so it covers them all
(and the page queries). ``postgres_cpu_ms_per_attempt`` is the CPU time of the server backends
of the store's pooled connections over the same interval (read from ``/proc``; None when the
server is not a process of this machine); the server's WAL writer and checkpointer, and the
sessions of anyone else on the server, are left out. ``page_query_share`` is the part of the
timed recovery spent fetching candidate pages: a pass's threads start once its page is read, so
that time is not shared. ``--profile`` runs cProfile, which sees the calling thread alone: the
page queries and that thread's share of each page's candidates.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from sqlalchemy import event

from benchmarks.common import (
    BenchmarkError,
    Stopwatch,
    bounded_int,
    connect,
    migrated_database,
    peak_rss_mb,
    positive_int,
    print_json,
    print_table,
    say,
    server_address,
    throwaway_database,
)
from benchmarks.processes import ServerCpu, cpu_seconds
from ql3.application.ports import HARD_PAGE_CAP

TARGET_RATIO = 0.8
RECOVERY_PAGE_SIZE_SETTING = 64
SESSIONS_PER_KIND = 32
STARTED_EVERY = 4  # every 4th Attempt is a started one whose session is closed
PGBENCH_CANDIDATES = ("/usr/bin/pgbench",)
TPS_LINE = re.compile(
    r"^tps = ([0-9.]+) \((?:without initial connection time|excluding connections establishing)\)",
    re.MULTILINE,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attempts", type=positive_int, default=10_000, metavar="N")
    parser.add_argument("--page-size", type=bounded_int(1, HARD_PAGE_CAP), default=64, metavar="N")
    parser.add_argument(
        "--pgbench-seconds",
        type=positive_int,
        default=15,
        metavar="S",
        help="pgbench time in all at each client count, split evenly over the rounds",
    )
    parser.add_argument(
        "--rounds",
        type=bounded_int(1, 50),
        default=5,
        metavar="R",
        help="R rounds of recovery, pgbench at N clients and pgbench at 1 client, the order"
        " rotated each round; figures are medians over the rounds",
    )
    parser.add_argument(
        "--concurrency",
        type=bounded_int(1, 8),
        default=None,
        metavar="N",
        help="recovery transactions at once, and pgbench's clients (default: the Cluster"
        " profile's recovery_concurrency)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the timed recovery under cProfile (the calling thread's part) and print"
        " where the time goes",
    )


# --- seeding -----------------------------------------------------------------------------------

# One statement per table, each set-based over generate_series. Attempt i belongs to Run i.
# Sessions: bench-open-NN are active (their worker stalled), bench-gone-NN are closed.
_SEED = (
    """
    INSERT INTO worker_sessions (id, worker_id, status, capacity, tasks, secret_hash,
                                 registered_at, last_heartbeat_at, closed_at)
    SELECT 'bench-' || kind || '-' || lpad(s::text, 2, '0'),
           'bench-worker-' || kind || '-' || lpad(s::text, 2, '0'),
           CASE kind WHEN 'open' THEN 'active' ELSE 'closed' END,
           64, '["bench.task"]'::jsonb, md5('secret-' || kind || s),
           now() - interval '1 hour', now() - interval '5 minutes',
           CASE kind WHEN 'open' THEN NULL ELSE now() - interval '5 minutes' END
    FROM generate_series(0, %(sessions)s::int - 1) AS s, (VALUES ('open'), ('gone')) AS k(kind)
    """,
    """
    INSERT INTO runs (id, task, owner, status, input, has_policy, attempt_count,
                      created_at, updated_at)
    SELECT 'bench-run-' || lpad(i::text, 9, '0'), 'bench.task', 'runtime',
           CASE WHEN i %% %(every)s = 0 THEN 'running' ELSE 'dispatching' END,
           jsonb_build_object('n', i), false, 1,
           now() - interval '10 minutes', now() - interval '9 minutes'
    FROM generate_series(1, %(n)s::int) AS i
    """,
    """
    INSERT INTO run_attempts (id, run_id, number, status, session_id, worker_id,
                              lease_generation, lease_version, offered_at, accepted_at,
                              started_at, created_at, updated_at)
    SELECT 'bench-attempt-' || lpad(i::text, 9, '0'), 'bench-run-' || lpad(i::text, 9, '0'), 1,
           CASE WHEN started THEN 'running' ELSE 'claimed' END,
           session, replace(session, 'bench-', 'bench-worker-'),
           1, 1, now() - interval '9 minutes', now() - interval '9 minutes',
           CASE WHEN started THEN now() - interval '9 minutes' END,
           now() - interval '10 minutes', now() - interval '9 minutes'
    FROM (
        SELECT i, i %% %(every)s = 0 AS started,
               'bench-' || CASE WHEN i %% %(every)s = 0 THEN 'gone' ELSE 'open' END
                   || '-' || lpad((i %% %(sessions)s)::text, 2, '0') AS session
        FROM generate_series(1, %(n)s::int) AS i
    ) AS seed
    """,
    """
    INSERT INTO run_dispatch_leases (run_id, generation, attempt_id, version, status,
                                     holder_session_id, token_hash, expires_at, granted_at)
    SELECT a.run_id, 1, a.id, 1, 'leased', a.session_id, md5('token-' || a.id),
           now() - interval '2 minutes',
           now() - interval '9 minutes'
    FROM run_attempts AS a
    """,
    """
    INSERT INTO run_events (run_id, attempt_id, type, at, data)
    SELECT a.run_id, a.id, e.type, a.offered_at, e.data
    FROM run_attempts AS a
    CROSS JOIN LATERAL (VALUES
        (1, 'run_admitted', '{"task": "bench.task"}'::jsonb),
        (2, 'attempt_offered', jsonb_build_object('session_id', a.session_id,
                                                  'worker_id', a.worker_id, 'generation', 1)),
        (3, 'attempt_accepted', '{}'::jsonb),
        (4, CASE WHEN a.status = 'running' THEN 'attempt_activated' END, '{}'::jsonb),
        (5, CASE WHEN a.status = 'running' THEN 'attempt_running' END, '{}'::jsonb)
    ) AS e(step, type, data)
    WHERE e.type IS NOT NULL
    ORDER BY a.run_id, e.step
    """,
)


def seed(url: str, attempts: int) -> float:
    """Seed the candidates; returns the seconds it took (VACUUM ANALYZE included)."""
    watch = Stopwatch()
    params = {"n": attempts, "every": STARTED_EVERY, "sessions": SESSIONS_PER_KIND}
    with connect(url) as conn:
        for statement in _SEED:
            conn.execute(statement, params)
        conn.commit()
    with connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    return watch.seconds()


def count_candidates(url: str) -> int:
    """Candidates as the store's own recovery query sees them (sanity check of the seed)."""
    from sqlalchemy import create_engine, func, select
    from sqlalchemy.pool import NullPool

    from ql3.adapters.postgres.queries import recovery_candidates_query

    query = recovery_candidates_query(10_000_000).subquery()
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            total = select(func.count()).select_from(query).where(query.c.run_id.is_not(None))
            return int(connection.execute(total).scalar_one())
    finally:
        engine.dispose()


# --- verification ------------------------------------------------------------------------------

_CHECKS = (
    (
        "runs",
        "SELECT count(*) FILTER (WHERE status = 'lost'), count(*) FROM runs",
    ),
    (
        "attempts",
        "SELECT count(*) FILTER (WHERE status = 'lost' AND lease_version = 2"
        " AND finished_at IS NOT NULL"
        " AND lost_evidence IS NOT DISTINCT FROM"
        "     CASE WHEN started_at IS NOT NULL THEN 'session_closed' END),"
        " count(*) FROM run_attempts",
    ),
    (
        "leases",
        "SELECT count(*) FILTER (WHERE status = 'released' AND version = 2"
        " AND release_reason = 'lease_expired' AND released_at IS NOT NULL),"
        " count(*) FROM run_dispatch_leases",
    ),
    (
        "attempt_lost events",
        "SELECT count(*) FILTER (WHERE lost = 1), count(*) FROM ("
        " SELECT (SELECT count(*) FROM run_events AS e"
        "         WHERE e.attempt_id = a.id AND e.run_id = a.run_id"
        "           AND e.type = 'attempt_lost') AS lost"
        " FROM run_attempts AS a) AS per_attempt",
    ),
    (
        "attempt_lost events in all",
        "SELECT count(*), count(*) FROM run_events WHERE type = 'attempt_lost'",
    ),
)


def verify(url: str, attempts: int) -> None:
    """Every Attempt lost, every lease released (v2, lease_expired), one attempt_lost event per
    Attempt. Raises BenchmarkError naming what does not hold."""
    failures = []
    with connect(url) as conn:
        for what, statement in _CHECKS:
            row = conn.execute(statement).fetchone()
            assert row is not None
            good, total = int(row[0]), int(row[1])
            if good != attempts or total != attempts:
                failures.append(f"{what}: {good} as expected of {total}, want {attempts}")
    if failures:
        raise BenchmarkError("verification failed: " + "; ".join(failures))


# --- the timed recovery ------------------------------------------------------------------------


@contextmanager
def statement_counter(engine: Any) -> Iterator[dict[str, int]]:
    """Counts statements sent through SQLAlchemy cursors and pool checkouts on ``engine``."""
    counts = {"statements": 0, "checkouts": 0}

    def on_statement(*_: Any) -> None:
        counts["statements"] += 1

    def on_checkout(*_: Any) -> None:
        counts["checkouts"] += 1

    event.listen(engine, "before_cursor_execute", on_statement)
    event.listen(engine.pool, "checkout", on_checkout)
    try:
        yield counts
    finally:
        event.remove(engine, "before_cursor_execute", on_statement)
        event.remove(engine.pool, "checkout", on_checkout)


class BackendCpu:
    """The CPU time of the server backends behind an engine's pooled connections, read from
    ``/proc`` (:class:`~benchmarks.processes.ServerCpu` finds out whether the server is a
    process of this machine). A backend first seen after :meth:`start` counts from zero."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._pids: set[int] = set()
        self._start: dict[int, float] = {}
        self.local = True

    def __enter__(self) -> BackendCpu:
        event.listen(self._engine.pool, "connect", self._on_connect)
        return self

    def __exit__(self, *_: object) -> None:
        event.remove(self._engine.pool, "connect", self._on_connect)

    def _on_connect(self, dbapi_connection: Any, _record: Any) -> None:
        pid = int(dbapi_connection.info.backend_pid)
        if ServerCpu.of(pid) is None:
            self.local = False
        self._pids.add(pid)

    def start(self) -> None:
        self._start = {pid: cpu_seconds(pid) for pid in self._pids}

    def seconds(self) -> float | None:
        """CPU seconds of the backends since :meth:`start`; None when the server is not local."""
        if not self.local or not self._pids:
            return None
        return sum(cpu_seconds(pid) - self._start.get(pid, 0.0) for pid in self._pids)


def configured_concurrency(requested: int | None) -> int:
    """The recovery transactions at once of the Cluster composition root: ``requested``, else
    the profile's ``recovery_concurrency`` (read off a container that opens nothing)."""
    from ql3.bootstrap.cluster import build

    settings: dict[str, Any] = {"database_url": "postgresql+psycopg://unused/unused"}
    if requested is not None:
        settings["recovery_concurrency"] = requested
    return int(build(**settings).config.recovery_concurrency())


def run_recovery(
    url: str,
    attempts: int,
    page_size: int,
    profiler: cProfile.Profile | None,
    concurrency: int,
) -> dict[str, Any]:
    from ql3.bootstrap.cluster import build

    container = build(
        database_url=url,
        recovery_page_size=RECOVERY_PAGE_SIZE_SETTING,
        recovery_concurrency=concurrency,
    )
    store = container.store()
    page_seconds = [0.0]
    fetch_page = store.recovery_candidates

    def timed_page(limit: int) -> Any:
        # Pages are fetched by the pass's calling thread before its threads start.
        started = time.perf_counter()
        try:
            return fetch_page(limit)
        finally:
            page_seconds[0] += time.perf_counter() - started

    try:
        recovery = container.runtime_recovery()
        with BackendCpu(store.engine) as backends, ExitStack() as warm:
            # Warm the connections a pass holds (its threads' and the page query's) and the
            # compiled-statement cache outside the clock, changing nothing.
            for _ in range(min(concurrency + 1, store.engine.pool.size())):
                warm.enter_context(store.engine.connect())
            warm.close()
            with store.unit_of_work() as uow:
                uow.now_ms()
            recovered = passes = 0
            with statement_counter(store.engine) as counts:
                if profiler is not None:
                    profiler.enable()
                backends.start()
                store.recovery_candidates = timed_page  # type: ignore[method-assign]
                watch = Stopwatch()
                cpu_start = time.process_time()
                while True:
                    report = recovery.run_once(page_size)
                    passes += 1
                    recovered += report.recovered
                    if report.examined == 0:
                        break
                    if report.recovered == 0:
                        raise BenchmarkError(
                            f"recovery stopped making progress after {recovered} attempts:"
                            f" {report.counts()}"
                        )
                seconds = watch.seconds()
                cpu_seconds_ = time.process_time() - cpu_start
                server_seconds = backends.seconds()
                del store.recovery_candidates
                if profiler is not None:
                    profiler.disable()
    finally:
        store.close()
    if recovered != attempts:
        raise BenchmarkError(f"recovered {recovered} attempts, seeded {attempts}")
    return {
        "recovered": recovered,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds_,
        "postgres_cpu_seconds": server_seconds,
        "page_seconds": page_seconds[0],
        "passes": passes,
        "statements": counts["statements"],
        "checkouts": counts["checkouts"],
    }


# --- pgbench -----------------------------------------------------------------------------------


def pgbench_binary() -> str:
    for candidate in PGBENCH_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("pgbench")
    if found is None:
        raise BenchmarkError("pgbench not found (looked at /usr/bin/pgbench and on PATH)")
    return found


def _pgbench(args: list[str], admin: str, database: str, timeout_s: float) -> str:
    address = server_address(admin)
    env = dict(os.environ)
    if address.password is not None:
        env["PGPASSWORD"] = address.password
    command = [
        pgbench_binary(),
        "-h",
        address.host,
        "-p",
        str(address.port),
        "-U",
        address.user,
        *args,
        database,
    ]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchmarkError(f"pgbench {' '.join(args)} did not finish in {timeout_s}s") from None
    if done.returncode != 0:
        detail = " ".join((done.stderr or done.stdout).split())[-400:]
        raise BenchmarkError(f"pgbench {' '.join(args)} failed ({done.returncode}): {detail}")
    return done.stdout


@contextmanager
def pgbench_database(admin: str, clients: int) -> Iterator[str]:
    """A TPC-B database of scale ``clients`` (one branch row per client, so that the clients
    do not queue on one branch's row lock), initialised once for every round; dropped
    afterwards."""
    with throwaway_database(admin, "ql3_bench_pgbench") as (name, _):
        _pgbench(["-i", "-s", str(max(1, clients)), "-q"], admin, name, timeout_s=300)
        yield name


def run_pgbench(admin: str, database: str, seconds: int, clients: int = 1) -> float:
    """TPC-B with ``clients`` clients on as many threads; returns tps without connection
    establishment."""
    output = _pgbench(
        ["-c", str(clients), "-j", str(clients), "-T", str(seconds)],
        admin,
        database,
        timeout_s=seconds + 120,
    )
    match = TPS_LINE.search(output)
    if match is None:
        raise BenchmarkError(f"no tps line in pgbench output: {output.strip()[-400:]!r}")
    return float(match.group(1))


# --- the command -------------------------------------------------------------------------------


def _profile_text(profiler: cProfile.Profile, limit: int = 30) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats(pstats.SortKey.TIME).print_stats(limit)
    stats.sort_stats(pstats.SortKey.CUMULATIVE).print_stats(limit)
    return out.getvalue()


def recovery_round(
    admin: str,
    attempts: int,
    page_size: int,
    profiler: cProfile.Profile | None,
    concurrency: int,
) -> dict[str, Any]:
    """Seed ``attempts`` candidates in a fresh database, recover them all, verify, drop it."""
    with migrated_database(admin, "ql3_bench_recovery") as url:
        seed_s = seed(url, attempts)
        candidates = count_candidates(url)
        if candidates != attempts:
            raise BenchmarkError(
                f"the store's recovery query sees {candidates} candidates, seeded {attempts}"
            )
        timed = run_recovery(url, attempts, page_size, profiler, concurrency)
        verify(url, attempts)
    timed["seed_seconds"] = seed_s
    return timed


def _median(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def round_order(index: int) -> tuple[str, ...]:
    """Round ``index`` (from 0) runs recovery, pgbench at N clients and pgbench at 1 client in
    this order, rotated by one each round."""
    steps = ("recovery", "pgbench", "pgbench_one_client")
    shift = index % len(steps)
    return steps[shift:] + steps[:shift]


def main(args: argparse.Namespace, admin: str) -> int:
    total = Stopwatch()
    profiler = cProfile.Profile() if args.profile else None
    concurrency = configured_concurrency(args.concurrency)
    rounds = min(args.rounds, args.attempts)
    per_round = [args.attempts // rounds + (i < args.attempts % rounds) for i in range(rounds)]
    pgbench_s = max(1, args.pgbench_seconds // rounds)
    rates: list[float] = []
    tps_list: list[float] = []
    tps_one_list: list[float] = []
    ratio_list: list[float] = []
    ratio_one_list: list[float] = []
    cpu_per_attempt: list[float] = []
    server_per_attempt: list[float | None] = []
    recovered = 0
    seconds = seeded_s = page_s = 0.0
    checkouts = passes = 0
    say(
        f"recovery: {args.attempts:,} expired candidates in {rounds} rounds, {concurrency}"
        f" transactions at once; each round also pgbench TPC-B -T {pgbench_s} at"
        f" -c {concurrency} -j {concurrency} and at -c 1 -j 1, the order rotated"
    )
    with pgbench_database(admin, concurrency) as pgbench_db:
        for index, attempts in enumerate(per_round):
            figures: dict[str, Any] = {}
            for step in round_order(index):
                if step == "recovery":
                    figures[step] = recovery_round(
                        admin, attempts, args.page_size, profiler, concurrency
                    )
                elif step == "pgbench":
                    figures[step] = run_pgbench(admin, pgbench_db, pgbench_s, concurrency)
                else:
                    figures[step] = run_pgbench(admin, pgbench_db, pgbench_s, 1)
            timed = figures["recovery"]
            round_tps, round_tps_one = figures["pgbench"], figures["pgbench_one_client"]
            rate = timed["recovered"] / timed["seconds"]
            rates.append(rate)
            tps_list.append(round_tps)
            tps_one_list.append(round_tps_one)
            ratio_list.append(rate / round_tps)
            ratio_one_list.append(rate / round_tps_one)
            cpu_per_attempt.append(timed["cpu_seconds"] * 1000 / timed["recovered"])
            server = timed["postgres_cpu_seconds"]
            server_per_attempt.append(
                None if server is None else server * 1000 / timed["recovered"]
            )
            recovered += timed["recovered"]
            seconds += timed["seconds"]
            seeded_s += timed["seed_seconds"]
            page_s += timed["page_seconds"]
            checkouts += timed["checkouts"]
            passes += timed["passes"]
            say(
                f"recovery: round {index + 1}/{rounds} ({', '.join(round_order(index))}):"
                f" {rate:,.1f} recovered/s, pgbench {round_tps:,.1f} tps at {concurrency}"
                f" clients (ratio {rate / round_tps:.3f}), {round_tps_one:,.1f} tps at 1"
                f" (ratio {rate / round_tps_one:.3f})"
            )
    ratio = statistics.median(ratio_list)
    server_ms = _median(server_per_attempt)
    result: dict[str, Any] = {
        "recovered_per_s": round(statistics.median(rates), 1),
        "pgbench_tps": round(statistics.median(tps_list), 1),
        "pgbench_clients": concurrency,
        "ratio": round(ratio, 3),
        "pgbench_tps_one_client": round(statistics.median(tps_one_list), 1),
        "ratio_one_client": round(statistics.median(ratio_one_list), 3),
        "concurrency": concurrency,
        "client_cpu_ms_per_attempt": round(statistics.median(cpu_per_attempt), 3),
        "postgres_cpu_ms_per_attempt": _rounded(server_ms, 3),
        "peak_rss_mb": peak_rss_mb(),
        "attempts": recovered,
        "rounds": rounds,
        "ratio_per_round": [round(value, 3) for value in ratio_list],
        "ratio_one_client_per_round": [round(value, 3) for value in ratio_one_list],
        "recovered_per_s_per_round": [round(value, 1) for value in rates],
        "pgbench_tps_per_round": [round(value, 1) for value in tps_list],
        "pgbench_tps_one_client_per_round": [round(value, 1) for value in tps_one_list],
        "client_cpu_ms_per_attempt_per_round": [round(value, 3) for value in cpu_per_attempt],
        "postgres_cpu_ms_per_attempt_per_round": [
            _rounded(value, 3) for value in server_per_attempt
        ],
        "started_with_closed_session": sum(n // STARTED_EVERY for n in per_round),
        "page_size": args.page_size,
        "recovery_seconds": round(seconds, 3),
        "passes": passes,
        "page_query_share": round(page_s / seconds, 3),
        "checkouts_per_attempt": round(checkouts / recovered, 2),
        "seed_seconds": round(seeded_s, 2),
        "pgbench_seconds": pgbench_s * rounds,
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "total_seconds": round(total.seconds(), 1),
    }
    clients = f"{concurrency} client{'s' if concurrency != 1 else ''}"
    print_table(
        f"Runtime recovery vs pgbench TPC-B at {clients} (and at 1), medians over rounds",
        [
            ("attempts", recovered, "expired leased; 1 in 4 started + session closed"),
            ("rounds", rounds, "recovery, pgbench at N, pgbench at 1; order rotated"),
            ("seed_seconds", result["seed_seconds"], "set-based INSERT ... SELECT + VACUUM"),
            ("recovery_seconds", result["recovery_seconds"], f"{passes} run_once passes"),
            ("concurrency", concurrency, "recovery transactions at once"),
            ("recovered_per_s", result["recovered_per_s"], f"page size {args.page_size}"),
            (
                "client_cpu_ms_per_attempt",
                result["client_cpu_ms_per_attempt"],
                "CPU of this process, its threads included",
            ),
            (
                "postgres_cpu_ms_per_attempt",
                "-" if server_ms is None else result["postgres_cpu_ms_per_attempt"],
                "CPU of the store's backends",
            ),
            (
                "page_query_share",
                result["page_query_share"],
                "of recovery's time spent fetching pages",
            ),
            ("checkouts_per_attempt", result["checkouts_per_attempt"], "pool checkouts"),
            ("pgbench_tps", result["pgbench_tps"], f"-c {concurrency} -j {concurrency}"),
            ("ratio", result["ratio"], f"median of per-round ratios; target >= {TARGET_RATIO}"),
            ("pgbench_tps_one_client", result["pgbench_tps_one_client"], "-c 1 -j 1"),
            ("ratio_one_client", result["ratio_one_client"], "median of per-round ratios"),
            ("peak_rss_mb", result["peak_rss_mb"], "ru_maxrss of this process"),
            ("total_seconds", result["total_seconds"], ""),
        ],
    )
    if profiler is not None:
        print(_profile_text(profiler))
    if args.json:
        print_json(result)
    return 0
