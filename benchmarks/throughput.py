"""Throughput through the worker ingress against PgQueuer, on the same server in the same run.

QL3 side: a migrated throwaway database and one ``ql3 serve`` node at its defaults for the whole
run. Each round admits ``--runs`` no-op Runs (``bench.noop``, no policy) through the bulk
admission API (``Admission.submit_many``, one transaction per batch of ``--admit-batch``) ->
``admitted_per_s``; then starts one ``ql3 worker --concurrency 8`` process (every other setting at
its default) and polls the database (every ~20 ms) until every Run has ``succeeded`` ->
``worked_per_s = runs / (all succeeded - worker spawned)``. The worker's start-up (interpreter,
one child process per slot, registration) is inside that interval; ``startup_s`` shows how much
of it that was. The worker is drained with SIGTERM and must exit 0; every Run must end with one
``succeeded`` Attempt whose lease is ``released`` on ``completed``. Every flag the node and the
worker get is printed with the result.

CPU per Attempt, over the same interval (worker spawned -> all succeeded), divided by the runs,
read from ``/proc/<pid>/stat`` (utime + stime, plus cutime + cstime of reaped children):
``cpu_ms_per_attempt_node`` is the ``ql3 serve`` process (the difference between the two
readings); ``cpu_ms_per_attempt_worker`` the ``ql3 worker`` process and every process under it
(its slot children), read once at the end, before the drain: the whole worker lives inside the
interval, start-up included; ``cpu_ms_per_attempt_postgres`` the PostgreSQL server (its
postmaster and every process under it: backends, WAL writer, checkpointer, ...; a backend that
exits in between is counted through the postmaster's reaped children), less the benchmark's own
polling session. The server must run on this machine for that one (else it is null); whatever
else the server does at the time is counted too.

PgQueuer side (the ``bench`` extra: ``pip install -e '.[bench]'``): its schema installed by
its own ``Queries.install()`` in a throwaway database of its own; each round enqueues the same
number of no-op jobs in one ``Queries.enqueue`` call -> ``pgqueuer_enqueue_per_s``, then one
``QueueManager`` (asyncpg) with 8 slots (``max_concurrent_tasks=8`` and the largest batch that
cap allows, 4) runs in drain mode until the queue is empty -> ``pgqueuer_worked_per_s``.

The two sides alternate (their order flips every round) for ``--rounds`` rounds; figures are
medians over the rounds and ``ratio`` is the median of the per-round ratios
``worked_per_s / pgqueuer_worked_per_s``. Targets: ``ratio >= 1.0`` and
``admitted_per_s >= pgqueuer_enqueue_per_s / 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import signal
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from benchmarks.common import (
    BenchmarkError,
    Stopwatch,
    bounded_int,
    connect,
    migrated_database,
    peak_rss_mb,
    print_json,
    print_table,
    say,
    throwaway_database,
)
from benchmarks.processes import (
    Process,
    Processes,
    ServerCpu,
    ingress_role,
    node_argv,
    role_url,
    tree_cpu_seconds,
    worker_argv,
)
from benchmarks.tasks import NOOP

TARGET_RATIO = 1.0
TARGET_ADMISSION_FRACTION = 1 / 3  # of PgQueuer's enqueue rate
SLOTS = 8
WORKER_ID = "bench-throughput-worker"
POLL_S = 0.02
WORK_TIMEOUT_S = 600.0
PGQUEUER_BATCH = SLOTS // 2  # PgQueuer needs max_concurrent_tasks >= 2 * batch_size
# The node runs at its defaults and the worker at its defaults but for the slots.
WORKER_FLAGS = ("--concurrency", str(SLOTS))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runs",
        type=bounded_int(1, 1_000_000),
        default=3_000,
        metavar="N",
        help="no-op runs (and PgQueuer jobs) per round",
    )
    parser.add_argument(
        "--rounds",
        type=bounded_int(1, 20),
        default=3,
        metavar="R",
        help="the two sides alternate R times; figures are medians over the rounds",
    )
    parser.add_argument(
        "--admit-batch",
        type=bounded_int(1, 10_000),
        default=1_000,
        metavar="N",
        help="runs per admission transaction",
    )
    parser.add_argument(
        "--ingress-login-role",
        action="store_true",
        help="the node's ingress connects as a login role of its own (ql3 db grant-ingress);"
        " by default it takes the default ingress role on the node's URL (ADR 0024)",
    )


def require_pgqueuer() -> str:
    """PgQueuer's version; a clean failure when the ``bench`` extra is missing."""
    try:
        import asyncpg  # noqa: F401
        import pgqueuer
    except ImportError as error:
        raise BenchmarkError(
            f"the PgQueuer reference needs the bench extra ({error.name} is missing):"
            " pip install -e '.[bench]'"
        ) from None
    return str(getattr(pgqueuer, "__version__", "unknown"))


# --- QL3 ---------------------------------------------------------------------------------------

# Polled every POLL_S while the worker runs, so it must cost the server next to nothing: every
# Run not yet ended has exactly one non-terminal Attempt (a queued Run's is pristine), and the
# partial unique index on those Attempts holds only them. How the Runs ended is verified after.
_IN_FLIGHT = """
SELECT count(*) FROM run_attempts WHERE status IN ('claimed', 'starting', 'running')
"""

_CHECKS = (
    ("runs succeeded", "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) FROM runs"),
    (
        "attempts succeeded (one per run)",
        "SELECT count(*) FILTER (WHERE status = 'succeeded' AND number = 1), count(*)"
        " FROM run_attempts",
    ),
    (
        "leases released on completion",
        "SELECT count(*) FILTER (WHERE status = 'released' AND release_reason = 'completed'"
        " AND generation = 1), count(*) FROM run_dispatch_leases",
    ),
)


def verify(conn: psycopg.Connection[Any], expected: int) -> None:
    failures = []
    for what, statement in _CHECKS:
        row = conn.execute(statement).fetchone()
        assert row is not None
        good, total = int(row[0]), int(row[1])
        if good != expected or total != expected:
            failures.append(f"{what}: {good} of {total}, want {expected}")
    if failures:
        raise BenchmarkError("verification failed: " + "; ".join(failures))


def admit(admission: Any, runs: int, batch: int) -> float:
    """Admit ``runs`` no-op Runs in batches; returns the seconds it took."""
    from ql3.application.admission import AdmissionRequest

    requests = [AdmissionRequest(task=NOOP, input={"n": n}) for n in range(runs)]
    batches = [requests[start : start + batch] for start in range(0, runs, batch)]
    watch = Stopwatch()
    admitted = sum(len(admission.submit_many(requests)) for requests in batches)
    seconds = watch.seconds()
    if admitted != runs:
        raise BenchmarkError(f"admitted {admitted} runs, asked for {runs}")
    return seconds


def ql3_round(
    processes: Processes,
    conn: psycopg.Connection[Any],
    admission: Any,
    node: Process,
    node_url: str,
    runs: int,
    batch: int,
    expected_total: int,
) -> dict[str, float | None]:
    admit_s = admit(admission, runs, batch)
    server = ServerCpu.of(conn.info.backend_pid)
    poller = (conn.info.backend_pid,)
    node_cpu = tree_cpu_seconds(node.pid)
    server_cpu = server.seconds(excluding=poller) if server is not None else None
    worker = processes.start_worker(node_url, WORKER_ID, WORKER_FLAGS)
    registered_at: float | None = None
    while True:
        row = conn.execute(_IN_FLIGHT).fetchone()
        assert row is not None
        left = int(row[0])
        now = time.monotonic()
        if registered_at is None:
            found = conn.execute(
                "SELECT 1 FROM worker_sessions WHERE worker_id = %s AND status = 'active'",
                (WORKER_ID,),
            ).fetchone()
            if found is not None:
                registered_at = now
        if left == 0:
            break
        if now - worker.started_at > WORK_TIMEOUT_S:
            raise BenchmarkError(f"{left} run(s) not succeeded after {WORK_TIMEOUT_S:g}s")
        node.check_alive()
        worker.check_alive()
        time.sleep(POLL_S)
    work_s = now - worker.started_at
    worker_cpu = tree_cpu_seconds(worker.pid)
    node_cpu = tree_cpu_seconds(node.pid) - node_cpu
    if server is not None and server_cpu is not None:
        server_cpu = server.seconds(excluding=poller) - server_cpu
    status = worker.terminate()
    if status != 0:
        raise BenchmarkError(f"the worker did not drain cleanly ({status}): {worker.last_line()}")
    verify(conn, expected_total)
    return {
        "admit_s": admit_s,
        "work_s": work_s,
        "startup_s": (registered_at if registered_at is not None else now) - worker.started_at,
        "cpu_ms_node": 1000 * node_cpu / runs,
        "cpu_ms_worker": 1000 * worker_cpu / runs,
        "cpu_ms_postgres": None if server_cpu is None else 1000 * server_cpu / runs,
    }


# --- PgQueuer ----------------------------------------------------------------------------------


def asyncpg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def install_pgqueuer(dsn: str) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(dsn)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
        await conn.close()


async def serve_pgqueuer(dsn: str, register: Callable[[Any], None], **run_options: Any) -> None:
    """A PgQueuer consumer process's life: one ``QueueManager`` on one asyncpg connection, with
    the entrypoints ``register`` adds to it, run with ``run_options`` until SIGTERM or SIGINT."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries, QueueManager

    conn = await asyncpg.connect(dsn)
    try:
        manager = QueueManager(Queries(AsyncpgDriver(conn)))
        register(manager)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, manager.shutdown.set)
        await manager.run(**run_options)
    finally:
        if not conn.is_closed():
            await conn.close()


async def _pgqueuer_round(dsn: str, jobs: int) -> dict[str, float]:
    import asyncpg
    from pgqueuer import AsyncpgDriver, PgQueuer, Queries
    from pgqueuer.domain.types import QueueExecutionMode

    producer = await asyncpg.connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(producer))
        watch = Stopwatch()
        ids = await queries.enqueue([NOOP] * jobs, [None] * jobs, [0] * jobs)
        enqueue_s = watch.seconds()
        if len(ids) != jobs:
            raise BenchmarkError(f"PgQueuer enqueued {len(ids)} jobs, asked for {jobs}")

        done = 0
        watch = Stopwatch()
        consumer = await asyncpg.connect(dsn)
        try:
            manager = PgQueuer(AsyncpgDriver(consumer))

            @manager.entrypoint(NOOP)
            async def noop(job: Any) -> None:
                nonlocal done
                done += 1

            await manager.run(
                batch_size=PGQUEUER_BATCH,
                max_concurrent_tasks=SLOTS,
                mode=QueueExecutionMode.drain,
            )
            work_s = watch.seconds()
        finally:
            if not consumer.is_closed():
                await consumer.close()
        left = sum(s.count for s in await queries.queue_size() if s.status == "queued")
    finally:
        await producer.close()
    if done != jobs or left:
        raise BenchmarkError(f"PgQueuer ran {done} of {jobs} jobs; {left} still queued")
    return {"enqueue_s": enqueue_s, "work_s": work_s}


def pgqueuer_round(dsn: str, jobs: int) -> dict[str, float]:
    return asyncio.run(_pgqueuer_round(dsn, jobs))


# --- the command -------------------------------------------------------------------------------


def _median_or_none(values: list[float | None], digits: int = 3) -> float | None:
    known = [value for value in values if value is not None]
    return round(statistics.median(known), digits) if known else None


def _shown_argv(argv: list[str]) -> str:
    """A command line as printed: the value of ``--ingress-database-url`` without its password."""
    shown = list(argv)
    for index, flag in enumerate(shown[:-1]):
        if flag == "--ingress-database-url":
            shown[index + 1] = make_url(shown[index + 1]).render_as_string(hide_password=True)
    return "ql3 " + " ".join(shown)


def main(args: argparse.Namespace, admin: str) -> int:
    from ql3.bootstrap.cluster import build

    pgqueuer_version = require_pgqueuer()
    total = Stopwatch()
    runs = args.runs
    admitted: list[float] = []
    worked: list[float] = []
    startup: list[float] = []
    reference: list[float] = []
    enqueued: list[float] = []
    ratios: list[float] = []
    cpu: dict[str, list[float | None]] = {"node": [], "worker": [], "postgres": []}
    node_flags: list[str] = []
    role_scope: AbstractContextManager[str | None] = (
        ingress_role(admin) if args.ingress_login_role else nullcontext(None)
    )
    with (
        role_scope as role,
        migrated_database(admin, "ql3_bench_throughput") as url,
        throwaway_database(admin, "ql3_bench_pgqueuer") as (_, pgqueuer_url),
        Processes(url) as processes,
    ):
        dsn = asyncpg_dsn(pgqueuer_url)
        asyncio.run(install_pgqueuer(dsn))
        if role is not None:
            password = secrets.token_urlsafe(16)
            processes.ql3(
                "db",
                "grant-ingress",
                role,
                "--password-env",
                "QL3_BENCH_INGRESS_PASSWORD",
                env={"QL3_BENCH_INGRESS_PASSWORD": password},
            )
            node_flags += ["--ingress-database-url", role_url(url, role, password)]
        container = build(database_url=url)
        try:
            admission = container.core.admission()
            node, node_url = processes.start_node(node_flags)
            node_command = _shown_argv(node_argv(node_flags))
            worker_command = _shown_argv(worker_argv(node_url, WORKER_ID, WORKER_FLAGS))
            say(
                f"throughput: {runs:,} no-op runs per side and round, {args.rounds} round(s);"
                f" node: {node_command}; worker: {worker_command};"
                f" PgQueuer {pgqueuer_version} max_concurrent_tasks={SLOTS}"
                f" batch_size={PGQUEUER_BATCH}"
            )
            with connect(url, autocommit=True) as conn:
                for index in range(1, args.rounds + 1):
                    ours: dict[str, float | None] = {}
                    theirs: dict[str, float] = {}
                    order = ("ql3", "pgqueuer") if index % 2 else ("pgqueuer", "ql3")
                    for side in order:
                        if side == "ql3":
                            ours = ql3_round(
                                processes,
                                conn,
                                admission,
                                node,
                                node_url,
                                runs,
                                args.admit_batch,
                                runs * index,
                            )
                        else:
                            theirs = pgqueuer_round(dsn, runs)
                    admitted.append(runs / float(ours["admit_s"] or 0.0))
                    worked.append(runs / float(ours["work_s"] or 0.0))
                    startup.append(float(ours["startup_s"] or 0.0))
                    for name in cpu:
                        cpu[name].append(ours[f"cpu_ms_{name}"])
                    reference.append(runs / theirs["work_s"])
                    enqueued.append(runs / theirs["enqueue_s"])
                    ratios.append(worked[-1] / reference[-1])
                    say(
                        f"throughput: round {index}/{args.rounds}: admitted {admitted[-1]:,.0f}/s,"
                        f" worked {worked[-1]:,.0f}/s (start-up {startup[-1]:.2f}s),"
                        f" PgQueuer enqueued {enqueued[-1]:,.0f}/s, worked {reference[-1]:,.0f}/s,"
                        f" ratio {ratios[-1]:.3f}"
                    )
        finally:
            container.store().close()

    ratio = statistics.median(ratios)
    admitted_per_s = statistics.median(admitted)
    pgqueuer_enqueue_per_s = statistics.median(enqueued)
    admission_target = pgqueuer_enqueue_per_s * TARGET_ADMISSION_FRACTION
    meets_ratio = ratio >= TARGET_RATIO
    meets_admission = admitted_per_s >= admission_target
    result: dict[str, Any] = {
        "admitted_per_s": round(admitted_per_s, 1),
        "worked_per_s": round(statistics.median(worked), 1),
        "pgqueuer_worked_per_s": round(statistics.median(reference), 1),
        "pgqueuer_enqueue_per_s": round(pgqueuer_enqueue_per_s, 1),
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "meets_ratio_target": meets_ratio,
        "target_admitted_per_s": round(admission_target, 1),
        "meets_admission_target": meets_admission,
        "meets_target": meets_ratio and meets_admission,
        "cpu_ms_per_attempt_node": _median_or_none(cpu["node"]),
        "cpu_ms_per_attempt_worker": _median_or_none(cpu["worker"]),
        "cpu_ms_per_attempt_postgres": _median_or_none(cpu["postgres"]),
        "runs": runs,
        "rounds": args.rounds,
        "admit_batch": args.admit_batch,
        "slots": SLOTS,
        "startup_s_median": round(statistics.median(startup), 3),
        "admitted_per_s_per_round": [round(v, 1) for v in admitted],
        "worked_per_s_per_round": [round(v, 1) for v in worked],
        "pgqueuer_worked_per_s_per_round": [round(v, 1) for v in reference],
        "pgqueuer_enqueue_per_s_per_round": [round(v, 1) for v in enqueued],
        "ratio_per_round": [round(v, 3) for v in ratios],
        "cpu_ms_per_attempt_per_round": {
            name: [None if v is None else round(v, 3) for v in values]
            for name, values in cpu.items()
        },
        "node_flags": node_command,
        "ingress": (
            "own login role" if args.ingress_login_role else "default ingress role (SET ROLE)"
        ),
        "worker_flags": worker_command,
        "pgqueuer": (
            f"{pgqueuer_version} asyncpg max_concurrent_tasks={SLOTS}"
            f" batch_size={PGQUEUER_BATCH} drain"
        ),
        "peak_rss_mb": peak_rss_mb(),
        "total_seconds": round(total.seconds(), 1),
    }
    postgres_note = (
        "the server's processes, less the poll"
        if result["cpu_ms_per_attempt_postgres"] is not None
        else "not measured: the server is not a process of this machine"
    )
    print_table(
        "No-op throughput: one node + one worker (8 slots) vs PgQueuer (8 slots), medians",
        [
            ("runs", runs, "per side and round"),
            ("rounds", args.rounds, "the sides alternate"),
            ("admitted_per_s", result["admitted_per_s"], f"submit_many, {args.admit_batch}/tx"),
            (
                "pgqueuer_enqueue_per_s",
                result["pgqueuer_enqueue_per_s"],
                "Queries.enqueue, one call per round",
            ),
            (
                "meets_admission_target",
                meets_admission,
                f"admitted_per_s >= pgqueuer_enqueue_per_s / 3 = {admission_target:,.1f}",
            ),
            ("startup_s_median", result["startup_s_median"], "worker spawn -> registered"),
            ("worked_per_s", result["worked_per_s"], "worker spawn -> all runs succeeded"),
            ("pgqueuer_worked_per_s", result["pgqueuer_worked_per_s"], result["pgqueuer"]),
            ("ratio", result["ratio"], f"median of per-round ratios; target >= {TARGET_RATIO}"),
            ("meets_ratio_target", meets_ratio, ""),
            (
                "cpu_ms_per_attempt_node",
                _or_dash(result["cpu_ms_per_attempt_node"]),
                "ql3 serve, during the work",
            ),
            (
                "cpu_ms_per_attempt_worker",
                _or_dash(result["cpu_ms_per_attempt_worker"]),
                "ql3 worker and its slot processes, start-up included",
            ),
            (
                "cpu_ms_per_attempt_postgres",
                _or_dash(result["cpu_ms_per_attempt_postgres"]),
                postgres_note,
            ),
            ("meets_target", result["meets_target"], "both targets"),
            ("node_flags", "-", result["node_flags"]),
            ("ingress", "-", result["ingress"]),
            ("worker_flags", "-", result["worker_flags"]),
            ("total_seconds", result["total_seconds"], ""),
        ],
    )
    if args.json:
        print_json(result)
    return 0


def _or_dash(value: float | None) -> float | str:
    return "-" if value is None else value
