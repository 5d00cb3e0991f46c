"""The worker ingress: the worker protocol of ADR 0007 over HTTP (FastAPI), with its OpenAPI
document.

Every call after registration names its session in the path and carries the session secret as
``Authorization: Bearer <secret>``; fenced calls also carry the lease fence (attempt,
generation, version, token) in the body. Secrets and tokens are never part of a URL, never
logged, and compared in constant time (by the application service, on hashes).

Work is pulled: ``POST /v1/sessions/{session_id}/claim`` records completions, hands back what
the worker no longer holds and starts queued attempts, in one transaction, and may wait for
work (a long poll). Renewals, completions, releases and abandons travel in batches (one HTTP
call, one transaction) with a result per item, so one stale fence does not fail the others.

The ingress calls :class:`~ql3.application.worker_commands.WorkerCommands` and nothing else: it
holds no SQL.

Statuses: 401 missing or wrong secret, 404 unknown session, 409 a session that is no longer
open, 413 body too large, 422 malformed request (a string holding a NUL character included),
503 store unavailable. A refused call changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

from ql3.adapters.http.auth import RegistrationAuth
from ql3.adapters.http.batches import batch_routes
from ql3.adapters.http.claims import claim_routes
from ql3.adapters.http.deps import IngressState
from ql3.adapters.http.errors import install_error_handlers
from ql3.adapters.http.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from ql3.adapters.http.sessions import node_routes, session_routes
from ql3.adapters.http.wake import ClaimSignal
from ql3.application.worker_commands import WorkerCommands

API_VERSION = "1"
MIN_HEARTBEAT_INTERVAL_MS = 50

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def default_heartbeat_interval_ms(lease_ttl_ms: int) -> int:
    """One lease TTL: how often a session records that its worker lives. No decision reads
    that record (leases and evidence do, ADR 0012), so it costs one commit per worker and TTL;
    renewals keep their own schedule (a third of the TTL)."""
    return max(MIN_HEARTBEAT_INTERVAL_MS, lease_ttl_ms)


def create_app(
    commands: WorkerCommands,
    *,
    signal: ClaimSignal | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    registration_token: str | None = None,
    registration: RegistrationAuth | None = None,
    heartbeat_interval_ms: int | None = None,
    on_attempts_ended: Callable[[], None] | None = None,
    lifespan: Lifespan | None = None,
) -> FastAPI:
    """The ingress application over ``commands``.

    ``signal`` wakes parked claims (a new one when not given; the app's is
    ``app.state.ingress.signal``); it is closed when the app's lifespan ends, before
    ``lifespan``'s own shutdown. ``registration_token``, when given, must be presented (as a
    bearer token) to register a session. ``on_attempts_ended`` is called after an abandon
    that lost Attempts."""
    state = IngressState(
        commands=commands,
        signal=signal if signal is not None else ClaimSignal(),
        heartbeat_interval_ms=heartbeat_interval_ms
        or default_heartbeat_interval_ms(commands.lease_ttl_ms),
        registration_token=registration_token,
        registration=registration,
        on_attempts_ended=on_attempts_ended,
    )

    @asynccontextmanager
    async def app_lifespan(app: FastAPI) -> AsyncIterator[None]:
        if lifespan is None:
            try:
                yield
            finally:
                state.signal.close()
            return
        async with lifespan(app):
            try:
                yield
            finally:
                state.signal.close()  # parked claims answer before the node stops

    app = FastAPI(
        title="QL3 worker ingress",
        version=API_VERSION,
        description=(__doc__ or "").strip(),
        lifespan=app_lifespan,
    )
    app.state.ingress = state
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    install_error_handlers(app)
    for router in (node_routes, session_routes, claim_routes, batch_routes):
        app.include_router(router)
    return app
