"""Latency from admission to start: from just before the submit call to the first line of the
task body, for both worker forms, against PgQueuer, on the same server in the same run.

Each Run (or PgQueuer job) is a ``bench.stamp`` task: its first line reads the wall clock
(``time.time()``) and it leaves that, as text, in a file named in its input, in a private
temporary directory. The benchmark reads ``time.time()`` just before each submit call; a Run's
latency is its stamp minus that reading (one clock: every process runs on this machine). The
benchmark polls the directory to know that a Run started; the figures do not depend on how often.

QL3 sides, one per worker form (ADR 0026): a migrated throwaway database, one ``ql3 serve`` node
at its defaults and one ``ql3 worker --concurrency 8`` (every other setting at its default),
spawned as the throughput benchmark spawns them: ``direct`` (``--database-url`` as a login role
of ``ql3 db grant-ingress``; its claims wait on its own LISTEN connection) and ``http``
(``--ingress``: its claims wait at the node). Each Run is admitted with ``Admission.submit``
(one Run, one transaction) through the Cluster bootstrap in the benchmark's process. Every flag
the node and the workers get is printed with the result; the figures of a form carry its name
as a prefix.

PgQueuer side (the ``bench`` extra: ``pip install -e '.[bench]'``): its schema installed by its
own ``Queries.install()`` in a throwaway database of its own; one ``QueueManager`` (asyncpg,
``max_concurrent_tasks=8``, ``batch_size=4`` as in the throughput benchmark, otherwise its
defaults) runs the same task in a child process of its own (``python -m benchmarks.latency``);
each job is enqueued with one ``Queries.enqueue`` call.

Each side runs, in turn, on a fresh cluster: a warm-up of 8 Runs at once (one per slot, not
measured), then two phases. *idle*: ``--runs`` single Runs, one at a time: submit, wait for it to
start, pause 20-100 ms (the same pseudo-random pauses for both sides), the next ->
``idle_p50_ms``, ``idle_p99_ms``. *load*: an open-loop schedule of ``--rate`` Runs per second for
``--seconds`` seconds, each submitted at its scheduled time from one thread (a submit that falls
behind goes at once; ``load_lag_ms_max`` says how far behind), then every Run waited for ->
``load_p50_ms``, ``load_p99_ms``. PgQueuer's figures carry the ``pgqueuer_`` prefix.

Targets: ``direct_idle_p50_ms <= 5``, ``direct_idle_p99_ms <= 20``, ``direct_load_p99_ms <= 2 *
pgqueuer_load_p99_ms``; ``http_idle_p50_ms <= 10``, ``http_load_p99_ms <= 3 *
pgqueuer_load_p99_ms``. p99 is the nearest-rank percentile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from benchmarks.common import (
    BenchmarkError,
    Stopwatch,
    bounded_int,
    connect,
    median,
    migrated_database,
    peak_rss_mb,
    percentile,
    print_json,
    print_table,
    say,
    throwaway_database,
)
from benchmarks.processes import (
    Process,
    Processes,
    direct_worker_argv,
    ingress_role,
    node_argv,
    shown_argv,
    wait_until,
    worker_argv,
)
from benchmarks.tasks import STAMP, write_stamp
from benchmarks.throughput import asyncpg_dsn, install_pgqueuer, require_pgqueuer, serve_pgqueuer

SLOTS = 8
WORKER_ID = "bench-latency-worker"
WORKER_FLAGS = ("--concurrency", str(SLOTS))  # the node and the worker at their defaults
PGQUEUER_BATCH = SLOTS // 2  # PgQueuer needs max_concurrent_tasks >= 2 * batch_size
PAUSE_S = (0.02, 0.1)  # between two idle Runs
PAUSE_SEED = 20_100  # both sides pause alike
START_TIMEOUT_S = 60.0  # one Run, submit -> started
DRAIN_TIMEOUT_S = 900.0  # the end of the load schedule -> every Run started
POLL_S = 0.002  # the stamp directory while one Run is awaited
DRAIN_POLL_S = 0.05
DSN_ENV = "QL3_BENCH_PGQUEUER_DSN"
FORMS = ("direct", "http")
# Each target of a form: (figure, bound, whether the bound is a factor of PgQueuer's figure).
TARGETS: dict[str, tuple[tuple[str, float, bool], ...]] = {
    "direct": (("idle_p50", 5.0, False), ("idle_p99", 20.0, False), ("load_p99", 2.0, True)),
    "http": (("idle_p50", 10.0, False), ("load_p99", 3.0, True)),
}


def positive_float(high: float) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not 0 < value <= high:
            raise argparse.ArgumentTypeError(f"must be within (0, {high:g}], got {text}")
        return value

    parse.__name__ = f"number (0, {high:g}]"
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runs",
        type=bounded_int(1, 100_000),
        default=50,
        metavar="N",
        help="single Runs of the idle phase, per side",
    )
    parser.add_argument(
        "--rate",
        type=positive_float(10_000),
        default=200.0,
        metavar="PER_S",
        help="Runs per second offered in the load phase",
    )
    parser.add_argument(
        "--seconds",
        type=positive_float(3_600),
        default=20.0,
        metavar="S",
        help="length of the load phase",
    )


# --- the stamps --------------------------------------------------------------------------------


class Stamps:
    """The directory the ``bench.stamp`` tasks write to, and the submit times beside it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.submitted: dict[str, float] = {}

    def payload(self, name: str) -> dict[str, str]:
        return {"dir": self.directory, "name": name}

    def started(self, name: str) -> float | None:
        try:
            with open(os.path.join(self.directory, name)) as handle:
                return float(handle.read())
        except FileNotFoundError:
            return None

    def has_started(self, name: str) -> Callable[[], bool]:
        return lambda: self.started(name) is not None

    def count(self, prefix: str) -> int:
        return sum(
            1
            for name in os.listdir(self.directory)
            if name.startswith(prefix) and not name.endswith(".part")
        )

    def latencies_ms(self, names: Sequence[str]) -> list[float]:
        latencies = []
        for name in names:
            started = self.started(name)
            if started is None:
                raise BenchmarkError(f"{name} has no stamp")
            latencies.append(1000 * (started - self.submitted[name]))
        return latencies


# The phases are coroutines so that PgQueuer's asyncpg calls are awaited in one event loop, with
# nothing between the clock reading and the call; QL3's submit is a plain call. Nothing else runs
# in that loop, so the phases block it while they sleep and wait.
Submit = Callable[[dict[str, str]], Awaitable[object]]


async def submit_one(stamps: Stamps, submit: Submit, name: str) -> None:
    stamps.submitted[name] = time.time()
    await submit(stamps.payload(name))


async def warm_up(stamps: Stamps, submit: Submit, watch: Sequence[Process]) -> None:
    names = [f"warm-{n}" for n in range(SLOTS)]
    for name in names:
        await submit_one(stamps, submit, name)
    wait_until(
        lambda: stamps.count("warm-") == len(names),
        START_TIMEOUT_S,
        "the warm-up runs to start",
        DRAIN_POLL_S,
        watch=watch,
    )


async def idle_phase(
    stamps: Stamps, submit: Submit, runs: int, watch: Sequence[Process]
) -> list[float]:
    pauses = random.Random(PAUSE_SEED)
    names = [f"idle-{n}" for n in range(runs)]
    for name in names:
        await submit_one(stamps, submit, name)
        wait_until(
            stamps.has_started(name),
            START_TIMEOUT_S,
            f"{name} to start",
            POLL_S,
            watch=watch,
        )
        time.sleep(pauses.uniform(*PAUSE_S))
    return stamps.latencies_ms(names)


async def load_phase(
    stamps: Stamps, submit: Submit, rate: float, seconds: float, watch: Sequence[Process]
) -> dict[str, Any]:
    """The open-loop schedule, then every Run waited for."""
    runs = max(1, round(rate * seconds))
    names = [f"load-{n}" for n in range(runs)]
    lag_s = 0.0
    begin = time.perf_counter()
    for index, name in enumerate(names):
        due = begin + index / rate
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        lag_s = max(lag_s, time.perf_counter() - due)
        await submit_one(stamps, submit, name)
    first, last = stamps.submitted[names[0]], stamps.submitted[names[-1]]
    wait_until(
        lambda: stamps.count("load-") == runs,
        DRAIN_TIMEOUT_S,
        f"the {runs} runs of the load phase to start",
        DRAIN_POLL_S,
        watch=watch,
    )
    return {
        "latencies": stamps.latencies_ms(names),
        "runs": runs,
        "achieved_per_s": (runs - 1) / (last - first) if last > first else rate,
        "lag_ms_max": 1000 * lag_s,
    }


async def run_phases(
    args: argparse.Namespace, stamps: Stamps, submit: Submit, watch: Sequence[Process], side: str
) -> dict[str, Any]:
    await warm_up(stamps, submit, watch)
    idle = await idle_phase(stamps, submit, args.runs, watch)
    say(
        f"latency: {side} idle: p50 {median(idle):.1f} ms, p99 {percentile(idle, 0.99):.1f} ms"
        f" over {len(idle)} runs"
    )
    load = await load_phase(stamps, submit, args.rate, args.seconds, watch)
    latencies = load["latencies"]
    say(
        f"latency: {side} load: p50 {median(latencies):.1f} ms,"
        f" p99 {percentile(latencies, 0.99):.1f} ms over {load['runs']} runs"
        f" offered at {load['achieved_per_s']:,.1f}/s"
    )
    return {"idle": idle, **load}


# --- QL3 ---------------------------------------------------------------------------------------


def ql3_side(args: argparse.Namespace, admin: str, form: str) -> dict[str, Any]:
    from ql3.bootstrap.cluster import build

    with (
        ingress_role(admin) as role,
        migrated_database(admin, "ql3_bench_latency") as url,
        Processes(url) as processes,
        tempfile.TemporaryDirectory(prefix="ql3-bench-stamps-") as directory,
    ):
        container = build(database_url=url)
        try:
            admission = container.core.admission()
            node, node_url = processes.start_node(())
            if form == "direct":
                argv = direct_worker_argv(processes.grant_login_role(role), WORKER_ID, WORKER_FLAGS)
            else:
                argv = worker_argv(node_url, WORKER_ID, WORKER_FLAGS)
            worker = processes.start(f"worker-{form}", argv)
            node_command = "ql3 " + " ".join(node_argv(()))
            worker_command = shown_argv(argv)
            say(f"latency ({form}): node: {node_command}; worker: {worker_command}")
            stamps = Stamps(directory)

            async def submit(payload: dict[str, str]) -> object:
                return admission.submit(STAMP, payload)

            figures = asyncio.run(run_phases(args, stamps, submit, [node, worker], f"QL3 {form}"))
            with connect(url, autocommit=True) as conn:
                expected = len(stamps.submitted)

                def all_succeeded() -> bool:
                    row = conn.execute(
                        "SELECT count(*) FROM runs WHERE status = 'succeeded'"
                    ).fetchone()
                    return row is not None and int(row[0]) == expected

                wait_until(
                    all_succeeded, START_TIMEOUT_S, "every run to succeed", DRAIN_POLL_S, [worker]
                )
            status = worker.terminate()
            if status != 0:
                raise BenchmarkError(
                    f"the worker did not drain cleanly ({status}): {worker.last_line()}"
                )
        finally:
            container.store().close()
    return {**figures, "node_flags": node_command, "worker_flags": worker_command}


# --- PgQueuer ----------------------------------------------------------------------------------


def _stamp_entrypoint(manager: Any) -> None:
    @manager.entrypoint(STAMP)
    async def stamp(job: Any) -> None:
        started = time.time()
        payload = json.loads(job.payload)
        write_stamp(payload["dir"], payload["name"], started)


def consume() -> int:
    """The PgQueuer consumer's process: one QueueManager until SIGTERM or SIGINT."""
    asyncio.run(
        serve_pgqueuer(
            os.environ[DSN_ENV],
            _stamp_entrypoint,
            batch_size=PGQUEUER_BATCH,
            max_concurrent_tasks=SLOTS,
        )
    )
    return 0


def pgqueuer_side(args: argparse.Namespace, admin: str) -> dict[str, Any]:
    import asyncpg
    from pgqueuer import AsyncpgDriver, Queries

    with (
        throwaway_database(admin, "ql3_bench_pgqueuer") as (_, url),
        Processes(None) as processes,
        tempfile.TemporaryDirectory(prefix="ql3-bench-stamps-") as directory,
        asyncio.Runner() as runner,
    ):
        dsn = asyncpg_dsn(url)
        runner.run(install_pgqueuer(dsn))
        consumer = processes.start(
            "pgqueuer-consumer", [], module="benchmarks.latency", env={DSN_ENV: dsn}
        )
        producer = runner.run(asyncpg.connect(dsn))
        try:
            queries = Queries(AsyncpgDriver(producer))
            stamps = Stamps(directory)

            async def submit(payload: dict[str, str]) -> object:
                return await queries.enqueue(STAMP, json.dumps(payload).encode(), 0)

            figures = runner.run(run_phases(args, stamps, submit, [consumer], "PgQueuer"))
        finally:
            runner.run(producer.close())
        status = consumer.terminate()
        if status != 0:
            raise BenchmarkError(
                f"the PgQueuer consumer did not stop cleanly ({status}): {consumer.last_line()}"
            )
    return figures


# --- the command -------------------------------------------------------------------------------


def _ms(value: float) -> float:
    return round(value, 2)


def main(args: argparse.Namespace, admin: str) -> int:
    pgqueuer_version = require_pgqueuer()
    total = Stopwatch()
    load_runs = max(1, round(args.rate * args.seconds))
    say(
        f"latency: {args.runs} idle runs, then {load_runs:,} runs at {args.rate:g}/s for"
        f" {args.seconds:g}s, per side; PgQueuer {pgqueuer_version}"
        f" max_concurrent_tasks={SLOTS} batch_size={PGQUEUER_BATCH}"
    )
    sides = {form: ql3_side(args, admin, form) for form in FORMS}
    sides["pgqueuer"] = pgqueuer_side(args, admin)

    figures: dict[str, float] = {}
    for name, side in sides.items():
        for phase, values in (("idle", side["idle"]), ("load", side["latencies"])):
            figures[f"{name}_{phase}_p50_ms"] = _ms(median(values))
            figures[f"{name}_{phase}_p99_ms"] = _ms(percentile(values, 0.99))
            figures[f"{name}_{phase}_max_ms"] = _ms(max(values))
    targets: dict[str, float] = {}
    meets: dict[str, bool] = {}
    for form, bounds in TARGETS.items():
        for figure, bound, of_pgqueuer in bounds:
            limit = bound * figures[f"pgqueuer_{figure}_ms"] if of_pgqueuer else bound
            targets[f"target_{form}_{figure}_ms"] = _ms(limit)
            meets[f"meets_{form}_{figure}_target"] = figures[f"{form}_{figure}_ms"] <= limit
    result: dict[str, Any] = {
        **{
            f"{name}_{phase}_{figure}_ms": figures[f"{name}_{phase}_{figure}_ms"]
            for name in sides
            for phase in ("idle", "load")
            for figure in ("p50", "p99")
        },
        **targets,
        **meets,
        "meets_target": all(meets.values()),
        "idle_runs": args.runs,
        "load_runs": sides["direct"]["runs"],
        "rate_per_s": args.rate,
        "seconds": args.seconds,
        "warmup_runs": SLOTS,
        "slots": SLOTS,
        **{
            f"{name}_load_achieved_per_s": round(side["achieved_per_s"], 1)
            for name, side in sides.items()
        },
        **{f"{name}_load_lag_ms_max": _ms(side["lag_ms_max"]) for name, side in sides.items()},
        **{
            f"{name}_{phase}_max_ms": figures[f"{name}_{phase}_max_ms"]
            for name in sides
            for phase in ("idle", "load")
        },
        "node_flags": sides["http"]["node_flags"],
        **{f"{form}_worker_flags": sides[form]["worker_flags"] for form in FORMS},
        "submit": "Admission.submit, one run per call",
        "pgqueuer": (
            f"{pgqueuer_version} asyncpg QueueManager max_concurrent_tasks={SLOTS}"
            f" batch_size={PGQUEUER_BATCH}; Queries.enqueue, one job per call"
        ),
        "peak_rss_mb": peak_rss_mb(),
        "total_seconds": round(total.seconds(), 1),
    }
    rows: list[tuple[str, Any, str]] = [
        ("idle_runs", args.runs, "one at a time, 20-100 ms apart"),
        ("load_runs", result["load_runs"], f"{args.rate:g}/s for {args.seconds:g}s, open loop"),
    ]
    for name in sides:
        for phase in ("idle", "load"):
            for figure in ("p50", "p99"):
                key = f"{name}_{phase}_{figure}_ms"
                target = targets.get(f"target_{name}_{phase}_{figure}_ms")
                rows.append((key, result[key], "" if target is None else f"target <= {target:g}"))
        rows.append(
            (
                f"{name}_load_achieved_per_s",
                result[f"{name}_load_achieved_per_s"],
                "submitted in the load phase",
            )
        )
    rows += [(key, value, "") for key, value in meets.items()]
    rows += [
        ("meets_target", result["meets_target"], "every target"),
        ("node_flags", "-", result["node_flags"]),
        *((f"{form}_worker_flags", "-", result[f"{form}_worker_flags"]) for form in FORMS),
        ("pgqueuer", "-", result["pgqueuer"]),
        ("total_seconds", result["total_seconds"], ""),
    ]
    print_table(
        "Submit -> task started: one node + one worker (8 slots), direct and http, vs PgQueuer"
        " (8 slots)",
        rows,
    )
    if args.json:
        print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(consume())
