"""Tasks the benchmarks' ``ql3 worker`` processes run (``--app benchmarks.tasks:TASKS``).

``bench.noop`` returns at once: a throughput run measures the runtime, not the task.
``bench.sleep`` sleeps ``first_attempt_seconds`` on attempt 1 and ``seconds`` (default 0) on
later attempts, so a worker can be killed in the middle of attempt 1 and the retry is quick.
"""

from __future__ import annotations

import time
from typing import Any

from adapters.execution import TaskContext

NOOP = "bench.noop"
SLEEP = "bench.sleep"
APP_SPEC = "benchmarks.tasks:TASKS"


def noop(payload: Any) -> None:
    return None


def sleep(payload: Any, context: TaskContext) -> dict[str, Any]:
    seconds = float(payload.get("seconds", 0.0))
    if context.attempt_number == 1 and "first_attempt_seconds" in payload:
        seconds = float(payload["first_attempt_seconds"])
    time.sleep(seconds)
    return {"slept": seconds, "attempt": context.attempt_number}


TASKS = {NOOP: noop, SLEEP: sleep}
