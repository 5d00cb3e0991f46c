"""The tasks the API tests declare (importable by a slot child as ``tests.api.tasks:TASKS``)."""

from __future__ import annotations

import asyncio
from typing import Any

from ql3 import Backoff, TaskRegistry

TASKS = TaskRegistry()


@TASKS.task
def echo(payload: Any) -> Any:
    return payload


@TASKS.task(
    safety="idempotent", retry_on_lost=True, max_attempts=3, backoff=Backoff(initial_ms=1000)
)
def resize(payload: dict[str, Any], context: Any) -> dict[str, Any]:
    return {"id": payload["id"], "attempt": context.attempt_number}


@TASKS.task(safety="unsafe")
def charge(payload: Any) -> str:
    return "charged"


@TASKS.task
def explode(payload: Any) -> None:
    raise ValueError(f"bad payload {payload!r}")


@TASKS.task(name="double")
async def double_async(payload: int) -> int:
    await asyncio.sleep(0)
    return payload * 2


@TASKS.task
def gather(payload: Any, context: Any) -> dict[str, Any]:
    """A workflow step: what it received, its own input and its parents' outputs."""
    return {"input": payload, "parents": dict(context.parents), "step": context.step_id}
