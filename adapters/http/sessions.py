"""The session routes: register, heartbeat, drain, close (and the node's health).

A successful call of a session wakes that session's parked claim (see
:mod:`ql3.adapters.http.claims`): the worker may want it back."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ql3.adapters.http.auth import register_session
from ql3.adapters.http.deps import Credentials, Ingress, Secret, SessionId
from ql3.adapters.http.errors import ERRORS, translated
from ql3.adapters.http.schemas import (
    ErrorBody,
    HealthResponse,
    HeartbeatResponse,
    RegisterRequest,
    RegisterResponse,
    SessionStatusResponse,
)

node_routes = APIRouter(tags=["node"])
session_routes = APIRouter(prefix="/v1/sessions", tags=["sessions"])
# Registration names no session yet: it is refused for its token, its body or the store only.
REGISTER_ERRORS: dict[int | str, dict[str, Any]] = {
    status: ERRORS[status] for status in (401, 413, 422, 503)
}
REGISTER_ERRORS[403] = {"model": ErrorBody, "description": "The credential does not admit it."}


@node_routes.get("/v1/health", response_model=HealthResponse)
async def health() -> HealthResponse:
    return HealthResponse(status="ok")


@session_routes.post(
    "", response_model=RegisterResponse, status_code=201, responses=REGISTER_ERRORS
)
def register(body: RegisterRequest, credentials: Credentials, ingress: Ingress) -> RegisterResponse:
    """Open a session for a worker id. Open sessions of the same worker id are replaced:
    that is evidence that the process behind them no longer runs anything. When the node
    requires authentication, send a worker credential (or its registration token) as the
    bearer token (ADR 0008)."""
    commands = ingress.commands
    presented = credentials.credentials if credentials else None
    grant = register_session(
        ingress.registration_auth, commands, presented, body.worker_id, body.capacity, body.tasks
    )
    return RegisterResponse(
        session_id=grant.session_id,
        secret=grant.secret,
        replaced_session_ids=list(grant.replaced_session_ids),
        lease_ttl_ms=commands.lease_ttl_ms,
        heartbeat_interval_ms=ingress.heartbeat_interval_ms,
        now_ms=grant.registered_at_ms,
    )


@session_routes.post("/{session_id}/heartbeat", response_model=HeartbeatResponse, responses=ERRORS)
def heartbeat(session_id: SessionId, secret: Secret, ingress: Ingress) -> HeartbeatResponse:
    """Record liveness; answer with the session's status and the store's clock."""
    answer = translated(lambda: ingress.commands.poll(session_id, secret))
    ingress.signal.wake_session(session_id)
    return HeartbeatResponse(status=answer.status.value, now_ms=answer.now_ms)


@session_routes.post("/{session_id}/drain", response_model=SessionStatusResponse, responses=ERRORS)
def drain(session_id: SessionId, secret: Secret, ingress: Ingress) -> SessionStatusResponse:
    """No new work for this session; what it holds may finish."""
    translated(lambda: ingress.commands.drain(session_id, secret))
    ingress.signal.wake_session(session_id)
    return SessionStatusResponse(status="draining")


@session_routes.post("/{session_id}/close", response_model=SessionStatusResponse, responses=ERRORS)
def close(session_id: SessionId, secret: Secret, ingress: Ingress) -> SessionStatusResponse:
    """The worker executes nothing any more (not-running evidence for what it held)."""
    translated(lambda: ingress.commands.close(session_id, secret))
    ingress.signal.wake_session(session_id)
    return SessionStatusResponse(status="closed")
