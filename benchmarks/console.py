"""The operator console's pages: p95 time of each, on an empty database and beside a large
finished history, in one run (ADR 0020).

(a) An empty database; (b) a database holding N finished Runs (the ``idle`` benchmark's seed:
each ``succeeded`` with its Attempt, lease and six events, admitted over 30 days, VACUUM
ANALYZEd). Both then get the same few live Runs: queued, failed, a workflow. The console runs
in this process (the app ``ql3 console`` serves) and each page is asked for ``--requests``
times through Starlette's test client after a warm-up: the time measured is the server's, the
page's queries and its rendering, without a network.

Keys: ``page_p95_ms_empty`` and ``page_p95_ms_large`` (each page's p95 in ms), ``ratio`` (the
largest large / empty ratio of a page), ``ratios``. Targets: ``ratio`` <= 1.5 and every page's
p95 <= 100 ms beside 1,000,000 finished Runs."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import (
    BenchmarkError,
    Stopwatch,
    migrated_database,
    peak_rss_mb,
    percentile,
    positive_int,
    print_json,
    print_table,
    say,
)
from benchmarks.idle import seed_finished

TARGET_RATIO = 1.5
TARGET_P95_MS = 100.0
WARMUP = 5
# A ratio of two tiny times says little: a page under this many ms is on target either way.
RATIO_FLOOR_MS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--finished", type=positive_int, default=1_000_000, metavar="N")
    parser.add_argument("--requests", type=positive_int, default=60, metavar="N")


def _live_runs(url: str) -> dict[str, str]:
    """The live Runs both databases get: two queued, a failed one, a workflow."""
    from ql3.application.admission import Admission, AdmissionRequest
    from ql3.application.identities import RandomIdentities
    from ql3.application.workflows import Workflows
    from ql3.bootstrap.producer import open_postgres_store

    store = open_postgres_store(url, pool_size=1)
    try:
        identities = RandomIdentities()
        admission = Admission(store.unit_of_work, identities)
        queued = admission.submit_many(
            [AdmissionRequest(task="bench.live", input={"n": n}) for n in range(2)]
        )
        cancelled = admission.submit("bench.live", {"n": 3})
        admission.cancel(cancelled, "benchmark")
        workflow = Workflows(store.unit_of_work, identities).submit(
            {
                "name": "bench.workflow",
                "steps": [
                    {"id": "a", "task": "bench.live", "input": {}},
                    {"id": "b", "task": "bench.live", "input": {}, "after": ["a"]},
                ],
            }
        )
    finally:
        store.close()
    return {"queued": queued[0], "cancelled": cancelled, "workflow": workflow}


def _pages(live: dict[str, str]) -> dict[str, str]:
    return {
        "overview": "/",
        "runs": "/runs",
        "runs_failed": "/runs?status=failed",
        "runs_succeeded": "/runs?status=succeeded",
        "runs_next_page": "/runs?status=succeeded&order=oldest&after=0.a",
        "run": f"/runs/{live['cancelled']}",
        "workflow": f"/runs/{live['workflow']}",
        "tasks": "/tasks",
        "workers": "/workers",
        "triggers": "/triggers",
        "workflows": "/workflows",
        "doctor": "/doctor",
    }


def measure(url: str, requests: int) -> dict[str, float]:
    from fastapi.testclient import TestClient

    from ql3.bootstrap import console
    from ql3.bootstrap.producer import open_postgres_store

    live = _live_runs(url)
    store = open_postgres_store(url, pool_size=2)
    built = console.build(store, anonymous=console.LOCAL_OPERATOR)
    try:
        client = TestClient(built.app)
        timings: dict[str, float] = {}
        for name, path in _pages(live).items():
            for _ in range(WARMUP):
                response = client.get(path)
                if response.status_code != 200:
                    raise BenchmarkError(f"{path} answered {response.status_code}")
            spent: list[float] = []
            for _ in range(requests):
                watch = Stopwatch()
                client.get(path)
                spent.append(watch.seconds() * 1000)
            timings[name] = round(percentile(spent, 0.95), 3)
        return timings
    finally:
        built.close()
        store.close()


def main(args: argparse.Namespace, admin: str) -> int:
    total = Stopwatch()
    with migrated_database(admin, "ql3_bench_console_empty") as url:
        say(f"console: {args.requests} requests of each page on an empty database")
        empty = measure(url, args.requests)
    with migrated_database(admin, "ql3_bench_console_large") as url:
        say(f"console: seeding {args.finished:,} finished runs")
        seed_s, vacuum_s, _ = seed_finished(url, args.finished)
        say(f"console: seeded in {seed_s:.1f}s; {args.requests} requests of each page")
        large = measure(url, args.requests)
    ratios = {
        name: round(max(large[name], RATIO_FLOOR_MS) / max(empty[name], RATIO_FLOOR_MS), 3)
        for name in empty
    }
    ratio = max(ratios.values())
    slowest = max(large.values())
    result: dict[str, Any] = {
        "page_p95_ms_empty": empty,
        "page_p95_ms_large": large,
        "ratio": ratio,
        "ratios": ratios,
        "slowest_page_p95_ms_large": slowest,
        "finished": args.finished,
        "requests": args.requests,
        "ratio_floor_ms": RATIO_FLOOR_MS,
        "seed_seconds": round(seed_s, 1),
        "vacuum_analyze_seconds": round(vacuum_s, 1),
        "peak_rss_mb": peak_rss_mb(),
        "target_ratio": TARGET_RATIO,
        "target_p95_ms": TARGET_P95_MS,
        "meets_targets": ratio <= TARGET_RATIO and slowest <= TARGET_P95_MS,
        "total_seconds": round(total.seconds(), 1),
    }
    print_table(
        f"Console pages, p95 of {args.requests} requests: empty vs {args.finished:,} finished runs",
        [(name, f"{empty[name]} / {large[name]} ms", f"x{ratios[name]}") for name in empty],
    )
    if args.json:
        print_json(result)
    return 0
