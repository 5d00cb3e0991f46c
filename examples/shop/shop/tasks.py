"""The shop's tasks, each declared with the retry policy its side effects allow."""

from __future__ import annotations

import asyncio
from typing import Any

from ql3 import Backoff, TaskContext, TaskRegistry

tasks = TaskRegistry()


@tasks.task(
    safety="idempotent", retry_on_lost=True, max_attempts=3, backoff=Backoff(initial_ms=2_000)
)
def ship_order(order: dict[str, Any], context: TaskContext) -> dict[str, Any]:
    """Book the parcel. The carrier deduplicates bookings by our key, so a retry is safe."""
    return {"order_id": order["order_id"], "tracking": f"TRK-{context.idempotency_key[:12]}"}


@tasks.task(safety="unsafe")
async def email_receipt(order: dict[str, Any]) -> dict[str, Any]:
    """Send the receipt (an async task). A second email would annoy: never repeated."""
    await asyncio.sleep(0)  # a real shop awaits its mail API here
    return {"sent_to": order["email"]}
