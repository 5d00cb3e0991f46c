"""Throughput of both worker forms against PgQueuer and Procrastinate, on the same server in the
same run.

QL3 side: a migrated throwaway database and one ``ql3 serve`` node at its defaults for the whole
run. Each round and form admits ``--runs`` no-op Runs (``bench.noop``, no policy) through the
bulk admission API (``Admission.submit_many``, one transaction per batch of ``--admit-batch``)
-> ``admitted_per_s``; then starts one ``ql3 worker --concurrency 8`` process (every other
setting at its default) in one of the two forms of ADR 0026: ``direct`` (``--database-url``, as
a login role made by ``ql3 db grant-ingress``: the worker calls the fenced functions itself)
and ``http`` (``--ingress``: through the node). It polls the database (every ~20 ms) until
every Run has ``succeeded`` -> ``{form}_worked_per_s = runs / (all succeeded - worker
spawned)``. The worker's start-up (interpreter, one child process per slot, registration) is
inside that interval; ``startup_s_median_{form}`` shows how much of it that was. The worker is
drained with SIGTERM and must exit 0; every Run must end with one ``succeeded`` Attempt whose
lease is ``released`` on ``completed``. Every flag the node and the workers get is printed with
the result.

CPU per Attempt, over the same interval (worker spawned -> all succeeded), divided by the runs,
read from ``/proc/<pid>/stat`` (utime + stime, plus cutime + cstime of reaped children):
``cpu_ms_per_attempt_node_{form}`` is the ``ql3 serve`` process (the difference between the two
readings); ``cpu_ms_per_attempt_worker_{form}`` the ``ql3 worker`` process and every process
under it (its slot children), read once at the end, before the drain: the whole worker lives
inside the interval, start-up included; ``cpu_ms_per_attempt_postgres_{form}`` the PostgreSQL
server (its postmaster and every process under it: backends, WAL writer, checkpointer, ...; a
backend that exits in between is counted through the postmaster's reaped children), less the
benchmark's own polling session. The server must run on this machine for that one (else it is
null); whatever else the server does at the time is counted too.

Resident memory (``VmRSS`` from ``/proc/<pid>/status``, MiB): the node's process and the worker's
tree (the worker and its slot children), once a tenth of the round's Runs have succeeded
(``rss_mb_{node,worker}_10pct_{form}``) and when all have (``rss_mb_{node,worker}_end_{form}``),
medians over the rounds. Target: every end figure within 10 % of its 10 % mark.

References (the ``bench`` extra: ``pip install -e '.[bench]'``), each in a throwaway database of
its own with its schema installed by its own code, run in this process:

- PgQueuer: each round enqueues the same number of no-op jobs in one ``Queries.enqueue`` call
  -> ``pgqueuer_enqueue_per_s``, then one ``QueueManager`` (asyncpg) with 8 slots
  (``max_concurrent_tasks=8`` and the largest batch that cap allows, 4) runs in drain mode
  until the queue is empty -> ``pgqueuer_worked_per_s``;
- Procrastinate: each round defers the same number of no-op jobs in one ``batch_defer_async``
  call, then one worker (``run_worker_async(concurrency=8, wait=False)``, psycopg) runs until
  the queue is empty -> ``procrastinate_worked_per_s``.

The sides take turns (their order rotates every round) for ``--rounds`` rounds; figures are
medians over the rounds and ``ratio`` is the median of the per-round ratios
``direct_worked_per_s / pgqueuer_worked_per_s`` (``http_ratio`` likewise,
``procrastinate_ratio`` for direct against Procrastinate, reported). Targets: ``ratio >= 1.0``,
``http_ratio >= 0.5`` and ``admitted_per_s >= pgqueuer_enqueue_per_s / 3``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import time
from collections.abc import Callable
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
    direct_worker_argv,
    ingress_role,
    node_argv,
    shown_argv,
    tree_cpu_seconds,
    tree_rss_mb,
    worker_argv,
)
from benchmarks.tasks import NOOP

TARGET_RATIO = 1.0  # direct / PgQueuer
TARGET_HTTP_RATIO = 0.5  # http / PgQueuer
TARGET_ADMISSION_FRACTION = 1 / 3  # of PgQueuer's enqueue rate
TARGET_RSS_GROWTH = 0.10  # the end of a round's work against its 10 % mark
RSS_MARK = 0.10  # the share of a round's Runs done at the first memory reading
PROCRASTINATE_QUEUE = "bench"
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


def require_procrastinate() -> str:
    """Procrastinate's version; a clean failure when the ``bench`` extra is missing."""
    try:
        import procrastinate
    except ImportError as error:
        raise BenchmarkError(
            f"the Procrastinate reference needs the bench extra ({error.name} is missing):"
            " pip install -e '.[bench]'"
        ) from None
    from importlib.metadata import version

    return str(getattr(procrastinate, "__version__", None) or version("procrastinate"))


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
    worker_command: list[str],
    runs: int,
    batch: int,
    expected_total: int,
) -> dict[str, float | None]:
    admit_s = admit(admission, runs, batch)
    server = ServerCpu.of(conn.info.backend_pid)
    poller = (conn.info.backend_pid,)
    node_cpu = tree_cpu_seconds(node.pid)
    server_cpu = server.seconds(excluding=poller) if server is not None else None
    worker = processes.start("worker", worker_command)
    registered_at: float | None = None
    rss_mark: tuple[float | None, float | None] | None = None
    while True:
        row = conn.execute(_IN_FLIGHT).fetchone()
        assert row is not None
        left = int(row[0])
        now = time.monotonic()
        if rss_mark is None and runs - left >= runs * RSS_MARK:
            rss_mark = (tree_rss_mb(node.pid), tree_rss_mb(worker.pid))
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
    rss_end = (tree_rss_mb(node.pid), tree_rss_mb(worker.pid))
    rss_mark = rss_mark or rss_end
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
        "rss_mb_node_10pct": rss_mark[0],
        "rss_mb_worker_10pct": rss_mark[1],
        "rss_mb_node_end": rss_end[0],
        "rss_mb_worker_end": rss_end[1],
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


# --- Procrastinate -----------------------------------------------------------------------------


def _procrastinate_app(conninfo: str, done: list[int]) -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo))

    @app.task(name=NOOP, queue=PROCRASTINATE_QUEUE)
    async def noop(n: int) -> None:
        done[0] += 1

    return app


async def _install_procrastinate(conninfo: str) -> None:
    app = _procrastinate_app(conninfo, [0])
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


async def _procrastinate_round(conninfo: str, jobs: int) -> dict[str, float]:
    done = [0]
    app = _procrastinate_app(conninfo, done)
    async with app.open_async():
        watch = Stopwatch()
        await app.tasks[NOOP].batch_defer_async(*({"n": n} for n in range(jobs)))
        defer_s = watch.seconds()
        watch = Stopwatch()
        await app.run_worker_async(
            queues=[PROCRASTINATE_QUEUE],
            concurrency=SLOTS,
            wait=False,
            install_signal_handlers=False,
            delete_jobs="never",
        )
        work_s = watch.seconds()
    with connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
        ).fetchone()
    left = int(row[0]) if row is not None else -1
    if done[0] != jobs or left:
        raise BenchmarkError(f"Procrastinate ran {done[0]} of {jobs} jobs; {left} not done")
    return {"enqueue_s": defer_s, "work_s": work_s}


def procrastinate_round(conninfo: str, jobs: int) -> dict[str, float]:
    return asyncio.run(_procrastinate_round(conninfo, jobs))


# --- the command -------------------------------------------------------------------------------


def _median_or_none(values: list[float | None], digits: int = 3) -> float | None:
    known = [value for value in values if value is not None]
    return round(statistics.median(known), digits) if known else None


FORMS = ("direct", "http")
"""The two forms of a worker (ADR 0026): ``direct`` calls the fenced functions on the database
as a login role of ``ql3 db grant-ingress``; ``http`` goes through the node's ingress."""


def main(args: argparse.Namespace, admin: str) -> int:
    from ql3.bootstrap.cluster import build

    pgqueuer_version = require_pgqueuer()
    procrastinate_version = require_procrastinate()
    total = Stopwatch()
    runs = args.runs
    admitted: list[float] = []
    worked: dict[str, list[float]] = {form: [] for form in FORMS}
    startup: dict[str, list[float]] = {form: [] for form in FORMS}
    ratios: dict[str, list[float]] = {form: [] for form in FORMS}
    reference: list[float] = []
    enqueued: list[float] = []
    procrastinate: list[float] = []
    procrastinate_ratios: list[float] = []
    rss: dict[str, dict[str, list[float | None]]] = {
        form: {f"{who}_{when}": [] for who in ("node", "worker") for when in ("10pct", "end")}
        for form in FORMS
    }
    cpu: dict[str, dict[str, list[float | None]]] = {
        form: {"node": [], "worker": [], "postgres": []} for form in FORMS
    }
    node_flags: list[str] = []
    with (
        ingress_role(admin) as role,
        migrated_database(admin, "ql3_bench_throughput") as url,
        throwaway_database(admin, "ql3_bench_pgqueuer") as (_, pgqueuer_url),
        throwaway_database(admin, "ql3_bench_procrastinate") as (_, procrastinate_url),
        Processes(url) as processes,
    ):
        dsn = asyncpg_dsn(pgqueuer_url)
        asyncio.run(install_pgqueuer(dsn))
        procrastinate_dsn = asyncpg_dsn(procrastinate_url)
        asyncio.run(_install_procrastinate(procrastinate_dsn))
        login_url = processes.grant_login_role(role)
        if args.ingress_login_role:
            node_flags += ["--ingress-database-url", login_url]
        container = build(database_url=url)
        try:
            admission = container.core.admission()
            node, node_url = processes.start_node(node_flags)
            workers = {
                "http": worker_argv(node_url, WORKER_ID, WORKER_FLAGS),
                "direct": direct_worker_argv(login_url, WORKER_ID, WORKER_FLAGS),
            }
            node_command = shown_argv(node_argv(node_flags))
            shown = {form: shown_argv(argv) for form, argv in workers.items()}
            say(
                f"throughput: {runs:,} no-op runs per side and round, {args.rounds} round(s);"
                f" node: {node_command}; workers: {shown['direct']} | {shown['http']};"
                f" PgQueuer {pgqueuer_version} max_concurrent_tasks={SLOTS}"
                f" batch_size={PGQUEUER_BATCH}; Procrastinate {procrastinate_version}"
                f" concurrency={SLOTS}"
            )
            sides = ("direct", "http", "pgqueuer", "procrastinate")
            done = 0
            with connect(url, autocommit=True) as conn:
                for index in range(1, args.rounds + 1):
                    ours: dict[str, dict[str, float | None]] = {}
                    theirs: dict[str, float] = {}
                    second: dict[str, float] = {}
                    shift = (index - 1) % len(sides)
                    for side in sides[shift:] + sides[:shift]:
                        if side == "pgqueuer":
                            theirs = pgqueuer_round(dsn, runs)
                            continue
                        if side == "procrastinate":
                            second = procrastinate_round(procrastinate_dsn, runs)
                            continue
                        done += runs
                        ours[side] = ql3_round(
                            processes,
                            conn,
                            admission,
                            node,
                            workers[side],
                            runs,
                            args.admit_batch,
                            done,
                        )
                    reference.append(runs / theirs["work_s"])
                    enqueued.append(runs / theirs["enqueue_s"])
                    procrastinate.append(runs / second["work_s"])
                    for form in FORMS:
                        figures = ours[form]
                        admitted.append(runs / float(figures["admit_s"] or 0.0))
                        worked[form].append(runs / float(figures["work_s"] or 0.0))
                        startup[form].append(float(figures["startup_s"] or 0.0))
                        for name in cpu[form]:
                            cpu[form][name].append(figures[f"cpu_ms_{name}"])
                        for name in rss[form]:
                            rss[form][name].append(figures[f"rss_mb_{name}"])
                        ratios[form].append(worked[form][-1] / reference[-1])
                    procrastinate_ratios.append(worked["direct"][-1] / procrastinate[-1])
                    say(
                        f"throughput: round {index}/{args.rounds}:"
                        f" direct {worked['direct'][-1]:,.0f}/s,"
                        f" http {worked['http'][-1]:,.0f}/s,"
                        f" PgQueuer enqueued {enqueued[-1]:,.0f}/s, worked {reference[-1]:,.0f}/s,"
                        f" Procrastinate worked {procrastinate[-1]:,.0f}/s,"
                        f" ratios {ratios['direct'][-1]:.3f} / {ratios['http'][-1]:.3f}"
                    )
        finally:
            container.store().close()

    ratio = statistics.median(ratios["direct"])
    http_ratio = statistics.median(ratios["http"])
    admitted_per_s = statistics.median(admitted)
    pgqueuer_enqueue_per_s = statistics.median(enqueued)
    admission_target = pgqueuer_enqueue_per_s * TARGET_ADMISSION_FRACTION
    meets_ratio = ratio >= TARGET_RATIO and http_ratio >= TARGET_HTTP_RATIO
    meets_admission = admitted_per_s >= admission_target
    rss_medians = {
        f"rss_mb_{name}_{form}": _median_or_none(rss[form][name], 1)
        for form in FORMS
        for name in rss[form]
    }
    meets_rss = all(
        (end := rss_medians[f"rss_mb_{who}_end_{form}"]) is not None
        and (mark := rss_medians[f"rss_mb_{who}_10pct_{form}"]) is not None
        and end <= mark * (1 + TARGET_RSS_GROWTH)
        for form in FORMS
        for who in ("node", "worker")
    )
    result: dict[str, Any] = {
        "admitted_per_s": round(admitted_per_s, 1),
        "direct_worked_per_s": round(statistics.median(worked["direct"]), 1),
        "http_worked_per_s": round(statistics.median(worked["http"]), 1),
        "pgqueuer_worked_per_s": round(statistics.median(reference), 1),
        "pgqueuer_enqueue_per_s": round(pgqueuer_enqueue_per_s, 1),
        "procrastinate_worked_per_s": round(statistics.median(procrastinate), 1),
        "ratio": round(ratio, 3),
        "http_ratio": round(http_ratio, 3),
        "procrastinate_ratio": round(statistics.median(procrastinate_ratios), 3),
        "target_ratio": TARGET_RATIO,
        "target_http_ratio": TARGET_HTTP_RATIO,
        "meets_ratio_target": meets_ratio,
        "target_admitted_per_s": round(admission_target, 1),
        "meets_admission_target": meets_admission,
        **rss_medians,
        "target_rss_growth": TARGET_RSS_GROWTH,
        "meets_rss_target": meets_rss,
        "meets_target": meets_ratio and meets_admission and meets_rss,
        **{
            f"cpu_ms_per_attempt_{name}_{form}": _median_or_none(cpu[form][name])
            for form in FORMS
            for name in cpu[form]
        },
        "runs": runs,
        "rounds": args.rounds,
        "admit_batch": args.admit_batch,
        "slots": SLOTS,
        **{
            f"startup_s_median_{form}": round(statistics.median(startup[form]), 3) for form in FORMS
        },
        "admitted_per_s_per_round": [round(v, 1) for v in admitted],
        **{f"{form}_worked_per_s_per_round": [round(v, 1) for v in worked[form]] for form in FORMS},
        "pgqueuer_worked_per_s_per_round": [round(v, 1) for v in reference],
        "pgqueuer_enqueue_per_s_per_round": [round(v, 1) for v in enqueued],
        "procrastinate_worked_per_s_per_round": [round(v, 1) for v in procrastinate],
        **{f"{form}_ratio_per_round": [round(v, 3) for v in ratios[form]] for form in FORMS},
        "node_flags": node_command,
        "ingress": (
            "own login role" if args.ingress_login_role else "default ingress role (SET ROLE)"
        ),
        "direct_worker_flags": shown["direct"],
        "http_worker_flags": shown["http"],
        "pgqueuer": (
            f"{pgqueuer_version} asyncpg max_concurrent_tasks={SLOTS}"
            f" batch_size={PGQUEUER_BATCH} drain"
        ),
        "procrastinate": (
            f"{procrastinate_version} psycopg run_worker_async(concurrency={SLOTS}, wait=False)"
        ),
        "peak_rss_mb": peak_rss_mb(),
        "total_seconds": round(total.seconds(), 1),
    }
    have_postgres = result["cpu_ms_per_attempt_postgres_direct"] is not None
    postgres_note = (
        "the server's processes, less the poll"
        if have_postgres
        else "not measured: the server is not a process of this machine"
    )
    rows: list[tuple[str, Any, str]] = [
        ("runs", runs, "per side and round"),
        ("rounds", args.rounds, "the sides take turns"),
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
        ("direct_worked_per_s", result["direct_worked_per_s"], "worker spawn -> all succeeded"),
        ("http_worked_per_s", result["http_worked_per_s"], "worker spawn -> all succeeded"),
        ("pgqueuer_worked_per_s", result["pgqueuer_worked_per_s"], result["pgqueuer"]),
        (
            "procrastinate_worked_per_s",
            result["procrastinate_worked_per_s"],
            result["procrastinate"],
        ),
        (
            "ratio",
            result["ratio"],
            f"direct / PgQueuer, per-round median; target >= {TARGET_RATIO}",
        ),
        (
            "http_ratio",
            result["http_ratio"],
            f"http / PgQueuer, per-round median; target >= {TARGET_HTTP_RATIO}",
        ),
        ("meets_ratio_target", meets_ratio, "both ratios"),
        (
            "procrastinate_ratio",
            result["procrastinate_ratio"],
            "direct / Procrastinate, per-round median; reported",
        ),
    ]
    for form in FORMS:
        rows += [
            (
                f"cpu_ms_per_attempt_node_{form}",
                _or_dash(result[f"cpu_ms_per_attempt_node_{form}"]),
                "ql3 serve, during the work",
            ),
            (
                f"cpu_ms_per_attempt_worker_{form}",
                _or_dash(result[f"cpu_ms_per_attempt_worker_{form}"]),
                "ql3 worker and its slot processes, start-up included",
            ),
            (
                f"cpu_ms_per_attempt_postgres_{form}",
                _or_dash(result[f"cpu_ms_per_attempt_postgres_{form}"]),
                postgres_note,
            ),
        ]
        for who, what in (("node", "ql3 serve"), ("worker", "ql3 worker and its slot processes")):
            rows += [
                (
                    f"rss_mb_{who}_{when}_{form}",
                    _or_dash(result[f"rss_mb_{who}_{when}_{form}"]),
                    f"{what}, {label}",
                )
                for when, label in (("10pct", "a tenth of the runs done"), ("end", "all done"))
            ]
    rows += [
        (
            "meets_rss_target",
            meets_rss,
            f"every end within {TARGET_RSS_GROWTH:.0%} of its 10 % mark",
        ),
        ("meets_target", result["meets_target"], "every target"),
        ("node_flags", "-", result["node_flags"]),
        ("ingress", "-", result["ingress"]),
        ("direct_worker_flags", "-", result["direct_worker_flags"]),
        ("http_worker_flags", "-", result["http_worker_flags"]),
        ("total_seconds", result["total_seconds"], ""),
    ]
    print_table(
        "No-op throughput: one node + one worker (8 slots), direct and http, vs PgQueuer and"
        " Procrastinate (8 slots each), medians",
        rows,
    )
    if args.json:
        print_json(result)
    return 0


def _or_dash(value: float | None) -> float | str:
    return "-" if value is None else value
