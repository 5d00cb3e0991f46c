"""The worker ingress: the worker protocol over HTTP (FastAPI), with its OpenAPI document.

Every call after registration names its session in the path and carries the session secret as
``Authorization: Bearer <secret>``; fenced calls also carry the lease fence (attempt,
generation, version, token) in the body. Secrets and tokens are never part of a URL, never
logged, and compared in constant time (by the application service, on hashes).

The ingress calls :class:`~application.worker_commands.WorkerCommands` and nothing else: it
holds no SQL. Fenced commands travel in batches (one HTTP call, one transaction) with a result
per item, so one stale fence does not fail the others; the ``/attempts/{attempt_id}/...`` forms
are batches of one whose HTTP status is the item's.

Statuses: 401 missing or wrong secret, 404 unknown session or attempt, 409 stale fence or a
session that is no longer open, 413 body too large, 422 malformed request, 503 store
unavailable. A refused call changes nothing."""

# No ``from __future__ import annotations``: FastAPI reads the annotations of the endpoints
# defined inside create_app, and they name local values.

import hmac
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from adapters.http.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from adapters.http.schemas import (
    MAX_ID_LENGTH,
    AbandonBatch,
    AbandonBody,
    BatchResponse,
    CompleteBatch,
    CompleteBody,
    ErrorBody,
    FenceBatch,
    FenceBody,
    FenceItem,
    HealthResponse,
    HeartbeatResponse,
    ItemResultBody,
    OfferBody,
    RegisterRequest,
    RegisterResponse,
    SessionStatusResponse,
)
from application.worker_commands import (
    Abandonment,
    BatchAnswer,
    Completion,
    ItemResult,
    Rejection,
    SessionUnauthorized,
    StartStage,
    UnknownSession,
    WorkerCommands,
)
from domain.errors import DomainError, FenceRejected, InvalidAdmission, SessionRejected
from domain.fence import LeaseFence

log = logging.getLogger("ql3.ingress")

API_VERSION = "1"
MAX_ERRORS = 10  # validation problems reported, at most
MAX_ERROR_PATH = 12  # elements of each problem's location
T = TypeVar("T")
Wake = Callable[[], None]

# The status a refused item would have got as a call of its own.
_ITEM_STATUS = {
    Rejection.FENCE: 409,
    Rejection.STATE: 409,
    Rejection.SESSION: 409,
    Rejection.CONFLICT: 409,
    Rejection.UNKNOWN_ATTEMPT: 404,
    Rejection.INVALID: 422,
}

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong secret."},
    404: {"model": ErrorBody, "description": "Unknown session (or attempt)."},
    409: {"model": ErrorBody, "description": "Stale fence, or the session is no longer open."},
    413: {"model": ErrorBody, "description": "Body too large."},
    422: {"model": ErrorBody, "description": "Malformed request."},
    503: {"model": ErrorBody, "description": "The store is unavailable; nothing changed."},
}


class ApiError(Exception):
    def __init__(self, status_code: int, error: str, message: str, reason: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.error = error
        self.message = message
        self.reason = reason


def _error_response(
    status_code: int,
    error: str,
    message: str,
    reason: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = ErrorBody(error=error, message=message, reason=reason)
    return JSONResponse(
        body.model_dump(exclude_none=True),
        status_code=status_code,
        headers=dict(headers) if headers else None,
    )


def _translated(call: Callable[[], T]) -> T:
    """Run a command; its refusals become HTTP errors (most specific class first)."""
    try:
        return call()
    except UnknownSession as error:
        raise ApiError(404, "unknown_session", str(error)) from None
    except SessionUnauthorized:
        raise ApiError(401, "unauthorized", "wrong session secret") from None
    except SessionRejected as error:
        raise ApiError(409, "session_rejected", str(error)) from None
    except FenceRejected as error:
        raise ApiError(409, "fence_rejected", str(error), error.reason.value) from None
    except InvalidAdmission as error:
        raise ApiError(422, "invalid_request", str(error)) from None
    except DomainError as error:
        raise ApiError(409, "conflict", str(error)) from None
    except Exception as error:  # the store failed: the transaction rolled back
        log.error("command failed: %s: %s", type(error).__name__, _first_line(error))
        raise ApiError(503, "unavailable", "the store is unavailable; nothing changed") from None


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0][:300] if text else ""


def _fence(attempt_id: str, body: FenceBody) -> LeaseFence:
    return LeaseFence(
        attempt_id=attempt_id, generation=body.generation, version=body.version, token=body.token
    )


def _item_body(result: ItemResult) -> ItemResultBody:
    return ItemResultBody(
        attempt_id=result.attempt_id,
        status=200 if result.rejection is None else _ITEM_STATUS[result.rejection],
        outcome=result.outcome.value if result.outcome else None,
        expires_at_ms=result.expires_at_ms,
        error=result.rejection.value if result.rejection else None,
        reason=result.reason,
        message=result.message,
    )


def _batch_body(answer: BatchAnswer) -> BatchResponse:
    return BatchResponse(now_ms=answer.now_ms, results=[_item_body(r) for r in answer.results])


def _single(answer: BatchAnswer) -> JSONResponse:
    (result,) = answer.results
    body = _item_body(result)
    if result.rejection is not None:
        return _error_response(
            body.status, result.rejection.value, result.message or "", result.reason
        )
    document = body.model_dump(exclude_none=True)
    document["now_ms"] = answer.now_ms
    return JSONResponse(document)


def create_app(
    commands: WorkerCommands,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    registration_token: str | None = None,
    heartbeat_interval_ms: int | None = None,
    on_capacity_freed: Wake | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """The ingress application over ``commands``.

    ``registration_token``, when given, must be presented (as a bearer token) to register a
    session. ``on_capacity_freed`` is called after a registration, completion or abandon, so a
    node can run its dispatch step without waiting for the next cadence."""
    app = FastAPI(
        title="QL3 worker ingress",
        version=API_VERSION,
        description=(__doc__ or "").strip(),
        lifespan=lifespan,
    )
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    bearer = HTTPBearer(auto_error=False, description="The session secret.")
    interval_ms = heartbeat_interval_ms or max(100, commands.lease_ttl_ms // 3)

    def wake() -> None:
        if on_capacity_freed is None:
            return
        try:
            on_capacity_freed()
        except Exception:  # a wake-up is an optimisation; the cadence runs anyway
            log.exception("waking the scheduler failed")

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
        return _error_response(error.status_code, error.error, error.message, error.reason, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        # The offending input is not echoed back: it may hold a token.
        problems = [
            {
                "loc": list(e.get("loc", ()))[:MAX_ERROR_PATH],
                "msg": str(e.get("msg", ""))[:200],
                "type": e.get("type", ""),
            }
            for e in error.errors()[:MAX_ERRORS]
        ]
        first = problems[0] if problems else {"loc": [], "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return JSONResponse(
            {"error": "invalid_request", "message": f"{where}: {first['msg']}", "detail": problems},
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 400:  # a body that could not be parsed at all
            return _error_response(422, "invalid_request", "the body could not be parsed")
        return _error_response(
            error.status_code, "http_error", str(error.detail), headers=error.headers
        )

    def secret_of(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> str:
        if credentials is None or not credentials.credentials:
            raise ApiError(401, "unauthorized", "send the session secret as a bearer token")
        return credentials.credentials

    Secret = Annotated[str, Depends(secret_of)]
    SessionId = Annotated[str, Path(min_length=1, max_length=MAX_ID_LENGTH)]
    AttemptId = Annotated[str, Path(min_length=1, max_length=MAX_ID_LENGTH)]

    @app.get("/v1/health", response_model=HealthResponse, tags=["node"])
    def health() -> HealthResponse:
        return HealthResponse(status="ok")

    @app.post(
        "/v1/sessions",
        response_model=RegisterResponse,
        status_code=201,
        responses=_ERRORS,
        tags=["sessions"],
    )
    def register(
        body: RegisterRequest,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> RegisterResponse:
        """Open a session for a worker id. Open sessions of the same worker id are replaced:
        that is evidence that the process behind them no longer runs anything."""
        if registration_token is not None:
            presented = credentials.credentials if credentials else ""
            if not hmac.compare_digest(presented.encode(), registration_token.encode()):
                raise ApiError(401, "unauthorized", "wrong or missing registration token")
        grant = _translated(lambda: commands.register(body.worker_id, body.capacity, body.tasks))
        wake()
        return RegisterResponse(
            session_id=grant.session_id,
            secret=grant.secret,
            replaced_session_ids=list(grant.replaced_session_ids),
            lease_ttl_ms=commands.lease_ttl_ms,
            heartbeat_interval_ms=interval_ms,
            now_ms=grant.registered_at_ms,
        )

    @app.post(
        "/v1/sessions/{session_id}/heartbeat",
        response_model=HeartbeatResponse,
        responses=_ERRORS,
        tags=["sessions"],
    )
    def heartbeat(session_id: SessionId, secret: Secret) -> HeartbeatResponse:
        """Record liveness; answer with the session's open offers and their fences."""
        answer = _translated(lambda: commands.poll(session_id, secret))
        return HeartbeatResponse(
            status=answer.status.value,
            now_ms=answer.now_ms,
            offers=[
                OfferBody(
                    run_id=o.run_id,
                    attempt_id=o.attempt_id,
                    attempt_number=o.attempt_number,
                    task=o.task,
                    input=o.input,
                    generation=o.generation,
                    version=o.version,
                    expires_at_ms=o.expires_at_ms,
                    idempotency_key=o.idempotency_key,
                )
                for o in answer.offers
            ],
        )

    @app.post(
        "/v1/sessions/{session_id}/drain",
        response_model=SessionStatusResponse,
        responses=_ERRORS,
        tags=["sessions"],
    )
    def drain(session_id: SessionId, secret: Secret) -> SessionStatusResponse:
        """No new offers for this session; what it holds may finish."""
        _translated(lambda: commands.drain(session_id, secret))
        return SessionStatusResponse(status="draining")

    @app.post(
        "/v1/sessions/{session_id}/close",
        response_model=SessionStatusResponse,
        responses=_ERRORS,
        tags=["sessions"],
    )
    def close(session_id: SessionId, secret: Secret) -> SessionStatusResponse:
        """The worker executes nothing any more (not-running evidence for what it held)."""
        _translated(lambda: commands.close(session_id, secret))
        return SessionStatusResponse(status="closed")

    # --- fenced batches ---------------------------------------------------------------------

    def start(
        session_id: str, secret: str, items: Sequence[FenceItem], stage: StartStage
    ) -> BatchAnswer:
        fences = [_fence(i.attempt_id, i) for i in items]
        return _translated(lambda: commands.start_many(session_id, secret, fences, stage))

    def renew(session_id: str, secret: str, items: Sequence[FenceItem]) -> BatchAnswer:
        fences = [_fence(i.attempt_id, i) for i in items]
        return _translated(lambda: commands.renew_many(session_id, secret, fences))

    def complete(
        session_id: str, secret: str, items: Sequence[tuple[str, CompleteBody]]
    ) -> BatchAnswer:
        completions = [
            Completion(
                fence=_fence(attempt_id, body),
                succeeded=body.succeeded,
                output=body.output,
                error=body.error,
            )
            for attempt_id, body in items
        ]
        answer = _translated(lambda: commands.complete_many(session_id, secret, completions))
        if any(r.ok for r in answer.results):
            wake()
        return answer

    def abandon(
        session_id: str, secret: str, items: Sequence[tuple[str, AbandonBody]]
    ) -> BatchAnswer:
        gone = [
            Abandonment(fence=_fence(attempt_id, body), detail=body.detail)
            for attempt_id, body in items
        ]
        answer = _translated(lambda: commands.abandon_many(session_id, secret, gone))
        if any(r.ok for r in answer.results):
            wake()
        return answer

    batch: dict[str, Any] = {
        "response_model": BatchResponse,
        "responses": _ERRORS,
        "tags": ["batches"],
    }

    @app.post("/v1/sessions/{session_id}/accept", **batch)
    def accept_batch(session_id: SessionId, secret: Secret, body: FenceBatch) -> BatchResponse:
        """Take offers: bind each fence's token to its lease (no start barrier yet)."""
        return _batch_body(start(session_id, secret, body.items, StartStage.ACCEPTED))

    @app.post("/v1/sessions/{session_id}/activate", **batch)
    def activate_batch(session_id: SessionId, secret: Secret, body: FenceBatch) -> BatchResponse:
        """Cross the start barrier of accepted offers and mark them running."""
        return _batch_body(start(session_id, secret, body.items, StartStage.ACTIVATED))

    @app.post("/v1/sessions/{session_id}/start", **batch)
    def start_batch(session_id: SessionId, secret: Secret, body: FenceBatch) -> BatchResponse:
        """Accept, activate and mark running in one step, for each offer."""
        return _batch_body(start(session_id, secret, body.items, StartStage.STARTED))

    @app.post("/v1/sessions/{session_id}/renew", **batch)
    def renew_batch(session_id: SessionId, secret: Secret, body: FenceBatch) -> BatchResponse:
        """Extend leases (no version change)."""
        return _batch_body(renew(session_id, secret, body.items))

    @app.post("/v1/sessions/{session_id}/complete", **batch)
    def complete_batch(session_id: SessionId, secret: Secret, body: CompleteBatch) -> BatchResponse:
        """Report outcomes: succeeded with an output, or failed with an error."""
        return _batch_body(complete(session_id, secret, [(i.attempt_id, i) for i in body.items]))

    @app.post("/v1/sessions/{session_id}/abandon", **batch)
    def abandon_batch(session_id: SessionId, secret: Secret, body: AbandonBatch) -> BatchResponse:
        """The worker stopped executing these attempts (allowed on a closed session too)."""
        return _batch_body(abandon(session_id, secret, [(i.attempt_id, i) for i in body.items]))

    # --- one attempt at a time -------------------------------------------------------------

    single: dict[str, Any] = {
        "responses": _ERRORS,
        "tags": ["attempts"],
        "response_model": ItemResultBody,
    }
    prefix = "/v1/sessions/{session_id}/attempts/{attempt_id}"

    def one(attempt_id: str, body: FenceBody) -> list[FenceItem]:
        return [FenceItem(attempt_id=attempt_id, **body.model_dump())]

    @app.post(f"{prefix}/accept", **single)
    def accept_one(
        session_id: SessionId, attempt_id: AttemptId, secret: Secret, body: FenceBody
    ) -> JSONResponse:
        return _single(start(session_id, secret, one(attempt_id, body), StartStage.ACCEPTED))

    @app.post(f"{prefix}/activate", **single)
    def activate_one(
        session_id: SessionId, attempt_id: AttemptId, secret: Secret, body: FenceBody
    ) -> JSONResponse:
        return _single(start(session_id, secret, one(attempt_id, body), StartStage.ACTIVATED))

    @app.post(f"{prefix}/start", **single)
    def start_one(
        session_id: SessionId, attempt_id: AttemptId, secret: Secret, body: FenceBody
    ) -> JSONResponse:
        return _single(start(session_id, secret, one(attempt_id, body), StartStage.STARTED))

    @app.post(f"{prefix}/renew", **single)
    def renew_one(
        session_id: SessionId, attempt_id: AttemptId, secret: Secret, body: FenceBody
    ) -> JSONResponse:
        return _single(renew(session_id, secret, one(attempt_id, body)))

    @app.post(f"{prefix}/complete", **single)
    def complete_one(
        session_id: SessionId, attempt_id: AttemptId, secret: Secret, body: CompleteBody
    ) -> JSONResponse:
        return _single(complete(session_id, secret, [(attempt_id, body)]))

    @app.post(f"{prefix}/abandon", **single)
    def abandon_one(
        session_id: SessionId, attempt_id: AttemptId, secret: Secret, body: AbandonBody
    ) -> JSONResponse:
        return _single(abandon(session_id, secret, [(attempt_id, body)]))

    return app
