"""Throughput through the worker ingress against PgQueuer, on the same server in the same run.

QL3 side: a migrated throwaway database and one ``ql3 serve`` node for the whole run. Each round
admits ``--runs`` no-op Runs (``bench.noop``, no policy) through the bulk admission API
(``Admission.submit_many``, one transaction per batch of ``--admit-batch``) -> ``admitted_per_s``;
then starts one ``ql3 worker --concurrency 8`` process and polls the database (every ~20 ms)
until every Run has ``succeeded`` -> ``worked_per_s = runs / (all succeeded - worker spawned)``.
The worker's start-up (interpreter, one child process per slot, registration) is inside that
interval; ``startup_s`` shows how much of it that was. The worker is drained with SIGTERM and must
exit 0; every Run must end with one ``succeeded`` Attempt whose lease is ``released`` on
``completed``.

PgQueuer side (the ``bench`` extra: ``pip install -e '.[bench]'``): its schema installed by
its own ``Queries.install()`` in a throwaway database of its own; each round enqueues the same
number of no-op jobs in one batch, then one ``QueueManager`` (asyncpg) with 8 slots
(``max_concurrent_tasks=8`` and the largest batch that cap allows, 4) runs in drain mode until the
queue is empty -> ``pgqueuer_worked_per_s``.

The two sides alternate (their order flips every round) for ``--rounds`` rounds; figures are
medians over the rounds and ``ratio`` is the median of the per-round ratios
``worked_per_s / pgqueuer_worked_per_s``. Target: ``ratio >= 1.0``.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time
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
from benchmarks.processes import Process, Processes, ingress_role, role_url
from benchmarks.tasks import NOOP

TARGET_RATIO = 1.0
SLOTS = 8
WORKER_ID = "bench-throughput-worker"
POLL_S = 0.02
WORK_TIMEOUT_S = 600.0
PGQUEUER_BATCH = SLOTS // 2  # PgQueuer needs max_concurrent_tasks >= 2 * batch_size
# Flags chosen for throughput; printed with the result.
NODE_FLAGS = (
    "--dispatch-page-size",
    "64",  # the hard page cap: one cycle may offer every free slot at once
    "--cadence",
    "0.05",  # the scheduler is also woken whenever a worker frees capacity
    "--lease-ttl",
    "30",  # renewals are rare; no-op tasks finish long before
    "--log-level",
    "warning",
)
WORKER_FLAGS = (
    "--concurrency",
    str(SLOTS),
    "--poll-interval",
    "0.05",  # longest wait between asks for work while a slot is free
    "--prefetch",
    str(7 * SLOTS),  # offers accepted ahead of free slots, activated as slots free
    "--log-level",
    "warning",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
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
        "--least-privilege-ingress",
        action="store_true",
        help="the node's ingress connects as its own role (ql3 db grant-ingress), as in"
        " production; by default it shares the node's database URL",
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
    from application.admission import AdmissionRequest

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
) -> dict[str, float]:
    admit_s = admit(admission, runs, batch)
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
    status = worker.terminate()
    if status != 0:
        raise BenchmarkError(f"the worker did not drain cleanly ({status}): {worker.last_line()}")
    verify(conn, expected_total)
    return {
        "admit_s": admit_s,
        "work_s": work_s,
        "startup_s": (registered_at if registered_at is not None else now) - worker.started_at,
    }


# --- PgQueuer ----------------------------------------------------------------------------------


def asyncpg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _pgqueuer_install(dsn: str) -> None:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    conn = await asyncpg.connect(dsn)
    try:
        await Queries(AsyncpgDriver(conn)).install()
    finally:
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


def main(args: argparse.Namespace, admin: str) -> int:
    from bootstrap.cluster import build

    pgqueuer_version = require_pgqueuer()
    total = Stopwatch()
    runs = args.runs
    say(
        f"throughput: {runs:,} no-op runs per side and round, {args.rounds} round(s);"
        f" node {' '.join(NODE_FLAGS)}; worker {' '.join(WORKER_FLAGS)};"
        f" PgQueuer {pgqueuer_version} max_concurrent_tasks={SLOTS} batch_size={PGQUEUER_BATCH}"
    )
    admitted: list[float] = []
    worked: list[float] = []
    startup: list[float] = []
    reference: list[float] = []
    ratios: list[float] = []
    node_flags = list(NODE_FLAGS)
    role_scope: AbstractContextManager[str | None] = (
        ingress_role(admin) if args.least_privilege_ingress else nullcontext(None)
    )
    with (
        role_scope as role,
        migrated_database(admin, "ql3_bench_throughput") as url,
        throwaway_database(admin, "ql3_bench_pgqueuer") as (_, pgqueuer_url),
        Processes(url) as processes,
    ):
        dsn = asyncpg_dsn(pgqueuer_url)
        asyncio.run(_pgqueuer_install(dsn))
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
            with connect(url, autocommit=True) as conn:
                for index in range(1, args.rounds + 1):
                    sides: dict[str, dict[str, float]] = {}
                    order = ("ql3", "pgqueuer") if index % 2 else ("pgqueuer", "ql3")
                    for side in order:
                        if side == "ql3":
                            sides[side] = ql3_round(
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
                            sides[side] = pgqueuer_round(dsn, runs)
                    ours, theirs = sides["ql3"], sides["pgqueuer"]
                    admitted.append(runs / ours["admit_s"])
                    worked.append(runs / ours["work_s"])
                    startup.append(ours["startup_s"])
                    reference.append(runs / theirs["work_s"])
                    ratios.append(worked[-1] / reference[-1])
                    say(
                        f"throughput: round {index}/{args.rounds}: admitted {admitted[-1]:,.0f}/s,"
                        f" worked {worked[-1]:,.0f}/s (start-up {startup[-1]:.2f}s),"
                        f" PgQueuer {reference[-1]:,.0f}/s, ratio {ratios[-1]:.3f}"
                    )
        finally:
            container.store().close()

    ratio = statistics.median(ratios)
    result: dict[str, Any] = {
        "admitted_per_s": round(statistics.median(admitted), 1),
        "worked_per_s": round(statistics.median(worked), 1),
        "pgqueuer_worked_per_s": round(statistics.median(reference), 1),
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "runs": runs,
        "rounds": args.rounds,
        "admit_batch": args.admit_batch,
        "slots": SLOTS,
        "startup_s_median": round(statistics.median(startup), 3),
        "admitted_per_s_per_round": [round(v, 1) for v in admitted],
        "worked_per_s_per_round": [round(v, 1) for v in worked],
        "pgqueuer_worked_per_s_per_round": [round(v, 1) for v in reference],
        "ratio_per_round": [round(v, 3) for v in ratios],
        "node_flags": " ".join(NODE_FLAGS),
        "ingress": "own role" if args.least_privilege_ingress else "node's database URL",
        "worker_flags": " ".join(WORKER_FLAGS),
        "pgqueuer": (
            f"{pgqueuer_version} asyncpg max_concurrent_tasks={SLOTS}"
            f" batch_size={PGQUEUER_BATCH} drain"
        ),
        "peak_rss_mb": peak_rss_mb(),
        "total_seconds": round(total.seconds(), 1),
    }
    print_table(
        "No-op throughput: one node + one worker (8 slots) vs PgQueuer (8 slots), medians",
        [
            ("runs", runs, "per side and round"),
            ("rounds", args.rounds, "the sides alternate"),
            ("admitted_per_s", result["admitted_per_s"], f"submit_many, {args.admit_batch}/tx"),
            ("startup_s_median", result["startup_s_median"], "worker spawn -> registered"),
            ("worked_per_s", result["worked_per_s"], "worker spawn -> all runs succeeded"),
            ("pgqueuer_worked_per_s", result["pgqueuer_worked_per_s"], result["pgqueuer"]),
            ("ratio", result["ratio"], f"median of per-round ratios; target >= {TARGET_RATIO}"),
            ("meets_target", result["meets_target"], ""),
            ("node_flags", "-", result["node_flags"]),
            ("ingress", "-", result["ingress"]),
            ("worker_flags", "-", result["worker_flags"]),
            ("total_seconds", result["total_seconds"], ""),
        ],
    )
    if args.json:
        print_json(result)
    return 0

