"""One scheduler replica in its own process: ``python -m tests.replicas.replica_main``.

It builds its own Cluster container (so its own engine, pool and connections), opens one
connection, announces ``<barrier>/ready-<name>``, waits for ``<barrier>/go`` so that every replica
starts together, then runs cycles until one recovers nothing and leaves nothing to do: no
recovery candidate examined, no lost Run settled, no more pages. It prints one JSON document on
stdout: its name, pid and the summary of every cycle (``CycleSummary.as_dict()`` plus timings).
A ``run_cycle`` that raises (it never should) is reported under ``escaped`` and ends the loop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ql3.application.scheduler import CycleSummary
from ql3.bootstrap.cluster import build

BARRIER_TIMEOUT_S = 60.0


def finished(summary: CycleSummary) -> bool:
    """The cycle recovered nothing and there is nothing left for recovery or lost retry."""
    if not summary.ok:
        return False
    recovery = summary.step("runtime_recovery")
    lost_retry = summary.step("lost_retry")
    if recovery is None or lost_retry is None:
        return False
    return (
        recovery.counts.get("examined") == 0
        and recovery.counts.get("has_more") == 0
        and not any(lost_retry.counts.values())
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--barrier", required=True, type=Path)
    parser.add_argument("--name", required=True)
    parser.add_argument("--max-cycles", type=int, default=500)
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args(argv)

    container = build(
        database_url=args.url,
        recovery_page_size=args.page_size,
        lost_retry_page_size=args.page_size,
    )
    coordinator = container.coordinator()
    store = container.store()
    with store.engine.connect():  # pay for the first connection before the start line
        pass

    (args.barrier / f"ready-{args.name}").touch()
    go = args.barrier / "go"
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not go.exists():
        if time.monotonic() > deadline:
            print(json.dumps({"name": args.name, "error": "barrier timeout"}))
            return 2
        time.sleep(0.002)

    started = time.time()
    cycles: list[dict[str, object]] = []
    escaped: str | None = None
    try:
        for _ in range(args.max_cycles):
            t0 = time.monotonic()
            try:
                summary = coordinator.run_cycle()
            except BaseException as error:  # never expected: run_cycle reports, never raises
                escaped = f"{type(error).__name__}: {error}"
                break
            record = summary.as_dict()
            record["seconds"] = round(time.monotonic() - t0, 4)
            cycles.append(record)
            if finished(summary):
                break
    finally:
        store.close()
    report = {
        "name": args.name,
        "pid": os.getpid(),
        "started_at": started,
        "elapsed_s": round(time.time() - started, 3),
        "cycles": cycles,
        "escaped": escaped,
    }
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
