from typing import Any

from domain.orders import Order


def checkout(runtime: Any, order: Order) -> str:
    """Admit the order's charge as a run of the runtime given."""
    return str(runtime.submit("charge", {"id": order.id, "items": order.items}))
