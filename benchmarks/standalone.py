"""Throughput of the Standalone profile on SQLite against Huey's ``SqliteHuey``, on the same disk
in the same run.

QL3 side: each round admits ``--runs`` no-op Runs (``bench.noop``, no policy) into a fresh SQLite
file through the Standalone bootstrap's bulk admission (``Admission.submit_many``, the path of
``ql3 submit --database-url sqlite:///PATH``, one transaction per batch of 500) ->
``admitted_per_s``; then starts one real
``ql3 standalone --app benchmarks.tasks:TASKS --db PATH --capacity 4`` child process and polls the
file read-only (every ~20 ms) until every Run has ``succeeded`` ->
``worked_per_s = runs / (all succeeded - process spawned)``. The start-up (interpreter, the
database's lock, startup recovery) is inside that interval, as in the throughput benchmark;
``startup_s`` is the spawn -> the process's ``ql3 standalone on`` line. The process is stopped
with SIGTERM and must exit 0; every Run must end with one ``succeeded`` Attempt.

Huey side (the ``bench`` extra: ``pip install -e '.[bench]'``): each round enqueues the same
number of no-op tasks (one ``SqliteHuey`` enqueue each; a task returns ``True`` so that its
result, stored by Huey in its ``kv`` table, says it ran) into a fresh file in the same temporary
directory -> ``huey_enqueued_per_s``; then starts one consumer child process with 4 thread
workers (``python -m benchmarks.standalone``: what ``huey_consumer -w 4 -k thread`` runs,
every other setting at its default) and polls the file read-only until every result is there ->
``huey_worked_per_s = runs / (all results - process spawned)``.

CPU: ``cpu_ms_per_run`` and ``huey_cpu_ms_per_run`` are each child's user+sys time (from
``/proc``, read once the last run is done, so start-up included) per run, medians.

Durability: ``durability`` and ``huey_durability`` are the ``PRAGMA synchronous`` and
``PRAGMA journal_mode`` of each side's own connection, read through the QL3 Standalone store
(built with the bootstrap's defaults, as the child builds it) and through ``SqliteHuey``'s
storage.

The two sides alternate (their order flips every round) for ``--rounds`` rounds; figures are
medians over the rounds and ``ratio`` is the median of the per-round ratios
``worked_per_s / huey_worked_per_s``. Target: ``ratio >= 1.0``.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from contextlib import closing
from typing import Any

from benchmarks.common import (
    BenchmarkError,
    Stopwatch,
    bounded_int,
    peak_rss_mb,
    print_json,
    print_table,
    say,
)
from benchmarks.processes import Process, Processes, cpu_seconds
from benchmarks.tasks import APP_SPEC, NOOP, huey_noop

TARGET_RATIO = 1.0
CAPACITY = 4
ADMIT_BATCH = 500
POLL_S = 0.02
WORK_TIMEOUT_S = 600.0
READY_LINE = "ql3 standalone on "
HUEY_NAME = "bench"
SYNCHRONOUS = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runs",
        type=bounded_int(1, 1_000_000),
        default=2_000,
        metavar="N",
        help="no-op runs (and Huey tasks) per round",
    )
    parser.add_argument(
        "--rounds",
        type=bounded_int(1, 20),
        default=3,
        metavar="R",
        help="the two sides alternate R times; figures are medians over the rounds",
    )


def require_huey() -> str:
    """Huey's version; a clean failure when the ``bench`` extra is missing."""
    try:
        import huey
    except ImportError as error:
        raise BenchmarkError(
            f"the Huey reference needs the bench extra ({error.name} is missing):"
            " pip install -e '.[bench]'"
        ) from None
    return str(getattr(huey, "__version__", "unknown"))


def durability(connection: Any) -> str:
    """``synchronous=... journal_mode=...`` of a DB-API SQLite connection."""
    synchronous = int(connection.execute("PRAGMA synchronous").fetchone()[0])
    journal = str(connection.execute("PRAGMA journal_mode").fetchone()[0])
    return f"synchronous={SYNCHRONOUS.get(synchronous, synchronous)} journal_mode={journal}"


def read_only(path: str) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)


def count(connection: sqlite3.Connection, statement: str, *params: object) -> int:
    return int(connection.execute(statement, params).fetchone()[0])


def work_until(
    process: Process, done: Any, runs: int, ready_line: str | None = None
) -> dict[str, float]:
    """Poll ``done()`` (how many finished) until it reaches ``runs``; seconds since the spawn."""
    ready_at: float | None = None
    while True:
        finished = done()
        now = time.monotonic()
        if ready_line is not None and ready_at is None and ready_line in process.output():
            ready_at = now
        if finished >= runs:
            break
        if now - process.started_at > WORK_TIMEOUT_S:
            raise BenchmarkError(
                f"{process.name}: {runs - finished} of {runs} not done after {WORK_TIMEOUT_S:g}s"
            )
        process.check_alive()
        time.sleep(POLL_S)
    return {
        "work_s": now - process.started_at,
        "startup_s": (ready_at if ready_at is not None else now) - process.started_at,
        # user+sys of the process from its spawn to the last run done (read before it stops)
        "cpu_s": cpu_seconds(process.pid),
    }


# --- QL3 ---------------------------------------------------------------------------------------

_CHECKS = (
    ("runs succeeded", "SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) FROM runs"),
    (
        "attempts succeeded (one per run)",
        "SELECT count(*) FILTER (WHERE status = 'succeeded' AND number = 1), count(*)"
        " FROM run_attempts",
    ),
)


def admit(path: str, runs: int) -> tuple[float, str]:
    """Admit ``runs`` no-op Runs into a new database at ``path``; the seconds it took and the
    store's durability."""
    from ql3.application.admission import AdmissionRequest
    from ql3.bootstrap.standalone import build

    container = build(database_path=path)
    try:
        admission = container.core.admission()
        requests = [AdmissionRequest(task=NOOP, input={"n": n}) for n in range(runs)]
        watch = Stopwatch()
        admitted = sum(
            len(admission.submit_many(requests[start : start + ADMIT_BATCH]))
            for start in range(0, runs, ADMIT_BATCH)
        )
        seconds = watch.seconds()
        with container.store().engine.connect() as connection:
            setting = durability(connection.connection.driver_connection)
    finally:
        container.store().close()
    if admitted != runs:
        raise BenchmarkError(f"admitted {admitted} runs, asked for {runs}")
    return seconds, setting


def ql3_argv(path: str) -> list[str]:
    return ["standalone", "--app", APP_SPEC, "--db", path, "--capacity", str(CAPACITY)]


def ql3_round(processes: Processes, directory: str, index: int, runs: int) -> dict[str, Any]:
    path = os.path.join(directory, f"ql3-{index}.sqlite")
    admit_s, setting = admit(path, runs)
    with closing(read_only(path)) as poll:
        process = processes.start(f"standalone-{index}", ql3_argv(path))
        figures = work_until(
            process,
            lambda: count(poll, "SELECT count(*) FROM runs WHERE status = 'succeeded'"),
            runs,
            READY_LINE,
        )
        status = process.terminate()
        if status != 0:
            raise BenchmarkError(
                f"ql3 standalone did not stop cleanly ({status}): {process.last_line()}"
            )
        failures = []
        for what, statement in _CHECKS:
            good, total = poll.execute(statement).fetchone()
            if good != runs or total != runs:
                failures.append(f"{what}: {good} of {total}, want {runs}")
        if failures:
            raise BenchmarkError("verification failed: " + "; ".join(failures))
    return {**figures, "admit_s": admit_s, "durability": setting}


# --- Huey --------------------------------------------------------------------------------------


def make_huey(path: str) -> tuple[Any, Any]:
    """A ``SqliteHuey`` at ``path`` (its defaults) and its no-op task."""
    from huey import SqliteHuey

    huey = SqliteHuey(HUEY_NAME, filename=path)
    return huey, huey.task(name=NOOP)(huey_noop)


def consume(path: str) -> int:
    """The Huey consumer's process: 4 thread workers until SIGTERM or SIGINT."""
    huey, _ = make_huey(path)
    huey.create_consumer(workers=CAPACITY, worker_type="thread").run()
    return 0


def huey_round(processes: Processes, directory: str, index: int, runs: int) -> dict[str, Any]:
    path = os.path.join(directory, f"huey-{index}.db")
    huey, noop = make_huey(path)
    watch = Stopwatch()
    for n in range(runs):
        noop(n)
    enqueue_s = watch.seconds()
    setting = durability(huey.storage.conn)
    queued = huey.pending_count()
    if queued != runs:
        raise BenchmarkError(f"Huey holds {queued} tasks, {runs} were enqueued")
    with closing(read_only(path)) as poll:
        process = processes.start(f"huey-{index}", [path], module="benchmarks.standalone")
        figures = work_until(
            process,
            lambda: count(poll, "SELECT count(*) FROM kv WHERE queue = ?", HUEY_NAME),
            runs,
        )
        status = process.terminate()
        if status != 0:
            raise BenchmarkError(
                f"the Huey consumer did not stop cleanly ({status}): {process.last_line()}"
            )
        left = count(poll, "SELECT count(*) FROM task WHERE queue = ?", HUEY_NAME)
    huey.storage.close()
    if left:
        raise BenchmarkError(f"Huey left {left} tasks queued")
    return {**figures, "enqueue_s": enqueue_s, "durability": setting}


# --- the command -------------------------------------------------------------------------------


def main(args: argparse.Namespace, admin: str) -> int:
    huey_version = require_huey()
    total = Stopwatch()
    runs = args.runs
    say(
        f"standalone: {runs:,} no-op runs per side and round, {args.rounds} round(s);"
        f" ql3 {' '.join(ql3_argv('PATH'))}; Huey {huey_version} SqliteHuey,"
        f" consumer workers={CAPACITY} worker_type=thread"
    )
    admitted: list[float] = []
    worked: list[float] = []
    cpu_ms: list[float] = []
    huey_cpu_ms: list[float] = []
    startup: list[float] = []
    enqueued: list[float] = []
    reference: list[float] = []
    ratios: list[float] = []
    settings: dict[str, set[str]] = {"ql3": set(), "huey": set()}
    with (
        tempfile.TemporaryDirectory(prefix="ql3-bench-standalone-") as directory,
        Processes(None) as processes,
    ):
        for index in range(1, args.rounds + 1):
            sides: dict[str, dict[str, Any]] = {}
            order = ("ql3", "huey") if index % 2 else ("huey", "ql3")
            for side in order:
                if side == "ql3":
                    sides[side] = ql3_round(processes, directory, index, runs)
                else:
                    sides[side] = huey_round(processes, directory, index, runs)
                settings[side].add(sides[side]["durability"])
            ours, theirs = sides["ql3"], sides["huey"]
            admitted.append(runs / ours["admit_s"])
            worked.append(runs / ours["work_s"])
            startup.append(ours["startup_s"])
            enqueued.append(runs / theirs["enqueue_s"])
            reference.append(runs / theirs["work_s"])
            ratios.append(worked[-1] / reference[-1])
            cpu_ms.append(ours["cpu_s"] * 1000 / runs)
            huey_cpu_ms.append(theirs["cpu_s"] * 1000 / runs)
            say(
                f"standalone: round {index}/{args.rounds}: admitted {admitted[-1]:,.0f}/s,"
                f" worked {worked[-1]:,.0f}/s (start-up {startup[-1]:.2f}s),"
                f" Huey enqueued {enqueued[-1]:,.0f}/s, worked {reference[-1]:,.0f}/s,"
                f" ratio {ratios[-1]:.3f}; CPU per run {cpu_ms[-1]:.3f} ms (Huey"
                f" {huey_cpu_ms[-1]:.3f} ms)"
            )

    ratio = statistics.median(ratios)
    result: dict[str, Any] = {
        "worked_per_s": round(statistics.median(worked), 1),
        "huey_worked_per_s": round(statistics.median(reference), 1),
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "meets_target": ratio >= TARGET_RATIO,
        "durability": " / ".join(sorted(settings["ql3"])),
        "huey_durability": " / ".join(sorted(settings["huey"])),
        "admitted_per_s": round(statistics.median(admitted), 1),
        "huey_enqueued_per_s": round(statistics.median(enqueued), 1),
        "runs": runs,
        "rounds": args.rounds,
        "capacity": CAPACITY,
        "startup_s_median": round(statistics.median(startup), 3),
        "cpu_ms_per_run": round(statistics.median(cpu_ms), 3),
        "huey_cpu_ms_per_run": round(statistics.median(huey_cpu_ms), 3),
        "worked_per_s_per_round": [round(v, 1) for v in worked],
        "huey_worked_per_s_per_round": [round(v, 1) for v in reference],
        "ratio_per_round": [round(v, 3) for v in ratios],
        "ql3_flags": "ql3 " + " ".join(ql3_argv("PATH")),
        "huey": f"{huey_version} SqliteHuey consumer workers={CAPACITY} worker_type=thread",
        "peak_rss_mb": peak_rss_mb(),
        "total_seconds": round(total.seconds(), 1),
    }
    print_table(
        "No-op throughput on SQLite: ql3 standalone (capacity 4) vs SqliteHuey (4 threads),"
        " medians",
        [
            ("runs", runs, "per side and round"),
            ("rounds", args.rounds, "the sides alternate"),
            ("admitted_per_s", result["admitted_per_s"], f"submit_many, {ADMIT_BATCH}/tx"),
            ("huey_enqueued_per_s", result["huey_enqueued_per_s"], "one enqueue per task"),
            ("startup_s_median", result["startup_s_median"], "spawn -> serving"),
            ("worked_per_s", result["worked_per_s"], "spawn -> all runs succeeded"),
            ("huey_worked_per_s", result["huey_worked_per_s"], "spawn -> all results stored"),
            ("ratio", result["ratio"], f"median of per-round ratios; target >= {TARGET_RATIO}"),
            ("cpu_ms_per_run", result["cpu_ms_per_run"], "ql3 standalone user+sys, start-up in"),
            ("huey_cpu_ms_per_run", result["huey_cpu_ms_per_run"], "consumer user+sys"),
            ("meets_target", result["meets_target"], ""),
            ("durability", "-", result["durability"]),
            ("huey_durability", "-", result["huey_durability"]),
            ("ql3_flags", "-", result["ql3_flags"]),
            ("huey", "-", result["huey"]),
            ("total_seconds", result["total_seconds"], ""),
        ],
    )
    if args.json:
        print_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(consume(sys.argv[1]))
