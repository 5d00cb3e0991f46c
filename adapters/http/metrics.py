"""``GET /metrics``: the node's Prometheus metrics in the text exposition format (ADR 0010)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def metrics_routes(registry: CollectorRegistry) -> APIRouter:
    """The scrape reads the store (the gauges): off the event loop."""
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body = await run_in_threadpool(generate_latest, registry)
        return Response(content=body, media_type=CONTENT_TYPE_LATEST)

    return router
