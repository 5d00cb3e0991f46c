"""The worker ingress's request and response bodies (they make the OpenAPI document).

Requests are strict: unknown fields, wrong types and out-of-range values are refused with 422
before anything is read or written."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from application.worker_commands import (
    MAX_BATCH_ITEMS,
    MAX_DETAIL_LENGTH,
    MAX_TOKEN_LENGTH,
    MIN_TOKEN_LENGTH,
)
from domain.sessions import MAX_CAPACITY

MAX_ID_LENGTH = 200
MAX_ERROR_LENGTH = 10_000

Identifier = Annotated[str, Field(min_length=1, max_length=MAX_ID_LENGTH)]
Token = Annotated[
    str,
    Field(
        min_length=MIN_TOKEN_LENGTH,
        max_length=MAX_TOKEN_LENGTH,
        description="The worker's own secret lease token, bound to the lease at accept.",
    ),
]
Counter = Annotated[int, Field(ge=1, le=2**62)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# --- sessions -----------------------------------------------------------------------------------


class RegisterRequest(_Request):
    worker_id: Identifier = Field(
        description="Names one execution slot: registering it again means the process behind "
        "its older session is gone."
    )
    capacity: Annotated[int, Field(ge=1, le=MAX_CAPACITY)]
    tasks: Annotated[list[Identifier], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]


class RegisterResponse(BaseModel):
    session_id: str
    secret: str = Field(description="Send as `Authorization: Bearer <secret>` on every call.")
    replaced_session_ids: list[str]
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    now_ms: int


class OfferBody(BaseModel):
    run_id: str
    attempt_id: str
    attempt_number: int
    task: str
    input: JsonValue
    generation: int
    version: int
    expires_at_ms: int
    idempotency_key: str


class HeartbeatResponse(BaseModel):
    status: str
    now_ms: int
    offers: list[OfferBody]


class SessionStatusResponse(BaseModel):
    status: str


# --- fenced batches -----------------------------------------------------------------------------


class FenceBody(_Request):
    generation: Counter
    version: Counter
    token: Token


class FenceItem(FenceBody):
    attempt_id: Identifier


class CompleteBody(FenceBody):
    succeeded: bool
    output: JsonValue = None
    error: Annotated[str | None, Field(max_length=MAX_ERROR_LENGTH)] = None


class CompleteItem(CompleteBody):
    attempt_id: Identifier


class AbandonBody(FenceBody):
    detail: Annotated[str, Field(max_length=MAX_DETAIL_LENGTH)] = ""


class AbandonItem(AbandonBody):
    attempt_id: Identifier


class FenceBatch(_Request):
    items: Annotated[list[FenceItem], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]


class CompleteBatch(_Request):
    items: Annotated[list[CompleteItem], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]


class AbandonBatch(_Request):
    items: Annotated[list[AbandonItem], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]


class ItemResultBody(BaseModel):
    attempt_id: str
    status: int = Field(
        description="200, or the status a single call would have got: 404, "
        "409 or 422. A refused item changed nothing."
    )
    outcome: str | None = None
    expires_at_ms: int | None = None
    error: str | None = None
    reason: str | None = None
    message: str | None = None


class BatchResponse(BaseModel):
    now_ms: int
    results: list[ItemResultBody]


class ErrorBody(BaseModel):
    error: str
    message: str
    reason: str | None = None


class HealthResponse(BaseModel):
    status: Literal["ok"]
