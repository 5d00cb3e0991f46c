from domain.orders import Order

import ql3

tasks = ql3.TaskRegistry()


@tasks.task(safety="idempotent", retry_on_error=True, max_attempts=3)
def charge(payload: dict) -> dict:
    order = Order(id=payload["id"], items=payload["items"])
    return {"order": order.id, "cents": order.total_cents(250)}
