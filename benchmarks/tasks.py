"""Tasks the benchmarks' ``ql3 worker`` processes run (``--app benchmarks.tasks:TASKS``).

``bench.noop`` returns at once: a throughput run measures the runtime, not the task.
``bench.sleep`` sleeps ``first_attempt_seconds`` on attempt 1 and ``seconds`` (default 0) on
later attempts, so a worker can be killed in the middle of attempt 1 and the retry is quick.
``bench.stamp`` reads the wall clock in its first line and leaves it, as text, in the file
``name`` of the directory ``dir`` (both from its input): the latency benchmark reads when each
Run started from there. ``bench.ledger`` records each execution in a ledger, the file ``ledger``
of its input, one JSON line appended per event: ``start`` as its first act, then it sleeps
``seconds``, then ``end``; each line names the job's ``key`` (from its input), the attempt and
the wall clock. The chaos benchmark counts executions, pickups and completions from it; its
PgQueuer and Procrastinate consumers write theirs through :func:`record` too. ``huey_noop`` is
the standalone benchmark's no-op task for Huey, which names a task after its function's module:
here it is the same in the producer and the consumer.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ql3.adapters.execution import TaskContext

NOOP = "bench.noop"
SLEEP = "bench.sleep"
STAMP = "bench.stamp"
LEDGER = "bench.ledger"
APP_SPEC = "benchmarks.tasks:TASKS"


def noop(payload: Any) -> None:
    return None


def sleep(payload: Any, context: TaskContext) -> dict[str, Any]:
    seconds = float(payload.get("seconds", 0.0))
    if context.attempt_number == 1 and "first_attempt_seconds" in payload:
        seconds = float(payload["first_attempt_seconds"])
    time.sleep(seconds)
    return {"slept": seconds, "attempt": context.attempt_number}


def write_stamp(directory: str, name: str, started: float) -> None:
    """``started`` into ``directory/name``, which appears whole (written aside, then renamed)."""
    path = os.path.join(directory, name)
    with open(path + ".part", "w") as handle:
        handle.write(repr(started))
    os.replace(path + ".part", path)


def stamp(payload: Any) -> None:
    started = time.time()
    write_stamp(payload["dir"], payload["name"], started)


def record(ledger: str, event: str, key: str, attempt: int | None = None) -> None:
    """One ledger line (see :func:`append_line`)."""
    append_line(
        ledger, json.dumps({"event": event, "key": key, "attempt": attempt, "t": time.time()})
    )


def append_line(path: str, line: str) -> None:
    """``line`` and a newline appended to ``path`` in one ``write`` (O_APPEND): lines of
    concurrent writers never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def ledger_task(payload: Any, context: TaskContext) -> None:
    record(payload["ledger"], "start", payload["key"], context.attempt_number)
    time.sleep(float(payload.get("seconds", 0.0)))
    record(payload["ledger"], "end", payload["key"], context.attempt_number)


def huey_noop(n: int) -> bool:
    """Huey stores what a task returns; ``True`` leaves a result that says it ran."""
    return True


TASKS = {NOOP: noop, SLEEP: sleep, STAMP: stamp, LEDGER: ledger_task}
