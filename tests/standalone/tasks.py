"""Task code for the standalone process tests (``--app tests.standalone.tasks:TASKS``).

Every execution leaves a marker file ``<name>-<attempt number>`` in the run's ``dir``, so a test
can tell which attempts ran, and how often."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ql3.adapters.execution import TaskContext


def hold(payload: dict[str, Any], context: TaskContext) -> dict[str, Any]:
    """Record the execution; attempt 1 then holds for ``first_s`` seconds, later attempts for
    ``later_s``."""
    marker = Path(payload["dir"]) / f"{payload['name']}-{context.attempt_number}"
    marker.write_text(context.idempotency_key)
    time.sleep(payload["first_s"] if context.attempt_number == 1 else payload.get("later_s", 0))
    return {"name": payload["name"], "attempt": context.attempt_number}


def echo(payload: Any) -> Any:
    return payload


TASKS = {"hold": hold, "echo": echo}
