"""Tasks of the end-to-end tests. Each appends to a side-effect ledger (``$QL3_E2E_LEDGER``):
one JSON line per event, so the tests can tell how often a task body ran."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from benchmarks.tasks import append_line
from ql3.adapters.execution import TaskContext


def _ledger(event: str, context: TaskContext, **data: Any) -> None:
    path = os.environ.get("QL3_E2E_LEDGER")
    if not path:
        return
    line = json.dumps(
        {"event": event, "run_id": context.run_id, "attempt": context.attempt_number,
         "key": context.idempotency_key, "pid": os.getpid(), **data}
    )
    append_line(path, line)


def double(payload: Any, context: TaskContext) -> Any:
    _ledger("double", context)
    return {"doubled": payload["n"] * 2}


def sleep(payload: Any, context: TaskContext) -> Any:
    """Sleeps ``seconds``; with ``first_attempt_seconds`` the first attempt sleeps that long."""
    _ledger("start", context)
    seconds = payload.get("seconds", 0.0)
    if context.attempt_number == 1 and "first_attempt_seconds" in payload:
        seconds = payload["first_attempt_seconds"]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    _ledger("end", context)
    return {"slept": seconds, "attempt": context.attempt_number}


def fail(payload: Any, context: TaskContext) -> Any:
    _ledger("fail", context)
    raise RuntimeError(payload.get("message", "boom"))


def flaky(payload: Any, context: TaskContext) -> Any:
    """Raises on its first ``failures`` attempts, then succeeds."""
    _ledger("flaky", context)
    if context.attempt_number <= payload.get("failures", 0):
        raise RuntimeError(f"attempt {context.attempt_number} fails")
    return {"attempt": context.attempt_number}


def big(payload: Any, context: TaskContext) -> Any:
    """An output larger than the ingress takes in one request."""
    _ledger("big", context)
    return "x" * payload["bytes"]


def gather(payload: Any, context: TaskContext) -> Any:
    """A workflow step: its own input, and the outputs of the steps it comes after."""
    _ledger("gather", context, step=context.step_id, parents=dict(context.parents))
    return {"input": payload, "parents": dict(context.parents)}


TASKS = {
    "e2e.big": big,
    "e2e.gather": gather,
    "e2e.double": double,
    "e2e.sleep": sleep,
    "e2e.fail": fail,
    "e2e.flaky": flaky,
}


def app() -> dict[str, Any]:
    """The tasks under ``$QL3_E2E_PREFIX.``, so that each test's workers take only its runs."""
    prefix = os.environ.get("QL3_E2E_PREFIX", "e2e")
    return {f"{prefix}.{name.split('.', 1)[1]}": fn for name, fn in TASKS.items()}
