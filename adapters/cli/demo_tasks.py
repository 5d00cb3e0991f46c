"""The task code of ``ql3 demo`` (``--app ql3.adapters.cli.demo_tasks:TASKS``).

Each task sleeps for the ``seconds`` its input names, standing for real work, and returns a
small JSON result; ``parse-upload`` fails the way task code fails."""

from __future__ import annotations

import time
from typing import Any

from ql3.adapters.execution import TaskContext


def _work(payload: dict[str, Any], context: TaskContext) -> dict[str, Any]:
    time.sleep(float(payload.get("seconds", 0)))
    return {"done": payload.get("what", "work"), "attempt": context.attempt_number}


def ping(payload: Any) -> str:
    return "pong"


def parse_upload(payload: dict[str, Any]) -> None:
    raise ValueError(f"{payload.get('file', 'upload')} is not valid CSV (line 3)")


TASKS = {
    "ping": ping,
    "resize-image": _work,
    "charge-card": _work,
    "send-report": _work,
    "parse-upload": parse_upload,
}
