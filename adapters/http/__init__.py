"""The worker ingress over HTTP (FastAPI on uvicorn)."""

from ql3.adapters.http.app import create_app, default_heartbeat_interval_ms
from ql3.adapters.http.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from ql3.adapters.http.wake import ClaimSignal, ClaimTicket, Woken

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "BodySizeLimit",
    "ClaimSignal",
    "ClaimTicket",
    "Woken",
    "create_app",
    "default_heartbeat_interval_ms",
]
