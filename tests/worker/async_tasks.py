"""Async tasks for the slot tests: ``tests.worker.async_tasks:TASKS``. Each writes a marker file
named by its input when it starts (and another when it was cancelled)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ql3 import TaskRegistry

TASKS = TaskRegistry()


@TASKS.task
async def nap(payload: dict[str, Any]) -> str:
    Path(payload["marker"]).write_text("started")
    try:
        await asyncio.sleep(payload.get("seconds", 60))
    except asyncio.CancelledError:
        Path(payload["marker"] + ".cancelled").write_text("cancelled")
        raise
    return "rested"


@TASKS.task
async def stubborn(payload: dict[str, Any]) -> str:
    Path(payload["marker"]).write_text("started")
    while True:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            continue  # ignores cancellation


@TASKS.task
def plain(payload: int) -> int:
    return payload + 1
