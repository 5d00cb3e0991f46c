"""How the ingress answers a refusal: the error bodies, the status of each refusal of the
application service, and the handlers that keep every client mistake a 4xx.

Statuses: 401 missing or wrong secret, 404 unknown session, 409 stale fence or a session that
is no longer open, 413 body too large, 422 malformed request (also a command's
``InvalidAdmission``), 503 store unavailable. A refused call changes nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ql3.adapters.http.schemas import ErrorBody, InvalidRequestBody, Problem
from ql3.adapters.worker.inprocess import refusal

log = logging.getLogger("ql3.ingress")

T = TypeVar("T")
MAX_ERRORS = 10  # validation problems reported, at most
MAX_ERROR_PATH = 12  # elements of each problem's location
MAX_MESSAGE = 200

# The error answers every session call documents (OpenAPI ``responses``).
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing or wrong secret."},
    404: {"model": ErrorBody, "description": "Unknown session."},
    409: {"model": ErrorBody, "description": "The session is no longer open."},
    413: {"model": ErrorBody, "description": "Body too large."},
    422: {"model": InvalidRequestBody, "description": "Malformed request; nothing changed."},
    503: {"model": ErrorBody, "description": "The store is unavailable; nothing changed."},
}


class ApiError(Exception):
    """A refusal with its HTTP status and error body."""

    def __init__(self, status_code: int, error: str, message: str, reason: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.error = error
        self.message = message
        self.reason = reason


def translated(call: Callable[[], T]) -> T:
    """Run a command; its refusals become :class:`ApiError` (:func:`refusal`, the mapping a
    direct worker's transport shares)."""
    try:
        return call()
    except Exception as error:
        refused = refusal(error)
        if refused is not None:
            raise ApiError(refused.status, refused.error, refused.message, refused.reason) from None
        # the store failed: the transaction rolled back
        log.error("command failed: %s: %s", type(error).__name__, _first_line(error))
        raise ApiError(503, "unavailable", "the store is unavailable; nothing changed") from None


def error_response(
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


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _api_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ApiError)
    headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
    return error_response(error.status_code, error.error, error.message, error.reason, headers)


async def _invalid(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    # The offending input is not echoed back: it may hold a token.
    problems = [
        Problem(
            loc=[p if isinstance(p, int) else str(p) for p in e.get("loc", ())][:MAX_ERROR_PATH],
            msg=str(e.get("msg", ""))[:MAX_MESSAGE],
            type=str(e.get("type", "")),
        )
        for e in error.errors()[:MAX_ERRORS]
    ]
    if problems:
        where = ".".join(str(p) for p in problems[0].loc)
        message = f"{where}: {problems[0].msg}"
    else:
        message = "invalid request"
    body = InvalidRequestBody(error="invalid_request", message=message, detail=problems)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=422)


async def _http_error(_request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    if error.status_code == 400:  # a body that could not be parsed at all
        return error_response(422, "invalid_request", "the body could not be parsed")
    return error_response(error.status_code, "http_error", str(error.detail), headers=error.headers)


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0][:300] if text else ""
