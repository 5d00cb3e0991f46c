"""The worker ingress over HTTP (FastAPI on uvicorn)."""

from adapters.http.app import create_app
from adapters.http.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit

__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodySizeLimit", "create_app"]
