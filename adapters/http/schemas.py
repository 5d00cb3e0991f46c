"""The worker ingress's request and response bodies (they make the OpenAPI document).

Requests are strict: unknown fields, wrong types and out-of-range values are refused with 422
before anything is read or written. Every string a request carries, down to the strings of a
JSON output, must be one the store can keep: no NUL character and no lone surrogate
(:data:`Text`, :func:`storable_json`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from ql3.application.worker_commands import (
    MAX_BATCH_ITEMS,
    MAX_CLAIM,
    MAX_DETAIL_LENGTH,
    MAX_TOKEN_LENGTH,
    MIN_TOKEN_LENGTH,
)
from ql3.domain.sessions import MAX_CAPACITY

MAX_ID_LENGTH = 200
MAX_ERROR_LENGTH = 10_000
MAX_WAIT_MS = 30_000
MAX_HELD = MAX_CLAIM * 4


def storable(text: str) -> str:
    """``text`` unchanged when the store can keep it; ValueError (a 422) otherwise."""
    if "\x00" in text:
        raise ValueError("must not contain a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogate)") from None
    return text


def storable_json(value: JsonValue) -> JsonValue:
    """``value`` unchanged when every string in it (keys included) is :func:`storable`."""
    pending: list[JsonValue] = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            storable(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                storable(key)
                pending.append(child)
        elif isinstance(item, list):
            pending.extend(item)
    return value


# A string a request may carry: anything but NUL and lone surrogates.
Text = Annotated[str, AfterValidator(storable)]
Identifier = Annotated[Text, Field(min_length=1, max_length=MAX_ID_LENGTH)]
Token = Annotated[
    Text,
    Field(
        min_length=MIN_TOKEN_LENGTH,
        max_length=MAX_TOKEN_LENGTH,
        description="The lease token a claim granted (sent once, in the claim's answer).",
    ),
]
Counter = Annotated[int, Field(ge=1, le=2**62)]
Output = Annotated[JsonValue, AfterValidator(storable_json)]


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
    heartbeat_interval_ms: int = Field(description="How often to heartbeat (once per lease TTL).")
    now_ms: int = Field(description="The store's clock.")


class HeartbeatResponse(BaseModel):
    status: str
    now_ms: int


class SessionStatusResponse(BaseModel):
    status: str


# --- fenced batches -----------------------------------------------------------------------------


class FenceItem(_Request):
    attempt_id: Identifier
    generation: Counter
    version: Counter
    token: Token


class CompleteItem(FenceItem):
    succeeded: bool
    output: Output = None
    error: Annotated[Text | None, Field(max_length=MAX_ERROR_LENGTH)] = None
    timed_out: bool = Field(
        default=False,
        description="A failure: the worker stopped the task at its run's timeout.",
    )


class AbandonItem(FenceItem):
    detail: Annotated[Text, Field(max_length=MAX_DETAIL_LENGTH)] = ""


class ReleaseItem(FenceItem):
    cause: Annotated[Text, Field(min_length=1, max_length=MAX_DETAIL_LENGTH)] = Field(
        default="not_started",
        description="Why the task never began here (a drain, a self-fence before the start, "
        "a slot that failed to start).",
    )


class FenceBatch(_Request):
    items: Annotated[list[FenceItem], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]


class CompleteBatch(_Request):
    items: Annotated[list[CompleteItem], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]


class AbandonBatch(_Request):
    items: Annotated[list[AbandonItem], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]


class ReleaseBatch(_Request):
    items: Annotated[list[ReleaseItem], Field(min_length=1, max_length=MAX_BATCH_ITEMS)]


class ItemResultBody(BaseModel):
    attempt_id: str
    status: int = Field(
        description="200, or the status the item would have got as a call of its own: 404, "
        "409 or 422. A refused item changed nothing."
    )
    outcome: str | None = Field(
        default=None,
        description="renewed, succeeded, failed, already_completed, lost, recorded, released, "
        "or cancelled (an abandon or hand-back of an attempt whose run was cancelled: taken, "
        "nothing changed).",
    )
    expires_at_ms: int | None = None
    error: str | None = None
    reason: str | None = Field(
        default=None,
        description="Why a fence was refused: no_lease, attempt_mismatch, generation_mismatch, "
        "version_mismatch, token_mismatch, released, expired, or cancelled (the run was "
        "cancelled and the lease released for it: stop the task and abandon it).",
    )
    message: str | None = None


class BatchResponse(BaseModel):
    now_ms: int
    results: list[ItemResultBody]


# --- the claim ----------------------------------------------------------------------------------


class ClaimRequest(_Request):
    limit: Annotated[int, Field(ge=0, le=MAX_CLAIM)] = Field(
        description="Attempts to start at most (0: only record completions and the statement)."
    )
    wait_ms: Annotated[int, Field(ge=0, le=MAX_WAIT_MS)] = Field(
        default=0,
        description="How long to wait for work when there is none (a long poll).",
    )
    held: Annotated[list[Identifier], Field(max_length=MAX_HELD)] | None = Field(
        default=None,
        description="Every attempt the worker holds (running, or finished with its completion "
        "not yet answered). The session's other leased attempts are handed back. null: no "
        "statement.",
    )
    completions: Annotated[list[CompleteItem], Field(max_length=MAX_BATCH_ITEMS)] = Field(
        default_factory=list, description="Outcomes to record before claiming."
    )


class GrantBody(BaseModel):
    run_id: str
    attempt_id: str
    attempt_number: int
    task: str
    input: JsonValue
    generation: int
    version: int
    token: str = Field(description="The lease token: sent once, here.")
    expires_at_ms: int
    idempotency_key: str
    timeout_ms: int | None = Field(
        default=None,
        description="The run's execution timeout: the worker stops the task once it has run "
        "this long and reports a failure that timed out. null: no timeout.",
    )


class ClaimResponse(BaseModel):
    now_ms: int
    status: str = Field(description="The session's status.")
    completed: list[ItemResultBody] = Field(description="The completions' results, in order.")
    released: list[str] = Field(description="Attempts handed back: not held by the worker.")
    grants: list[GrantBody] = Field(description="Attempts started for the session.")
    no_grant: (
        Literal["dispatch_gate_closed", "session_not_active", "no_capacity", "nothing_queued"]
        | None
    ) = Field(default=None, description="Why nothing was granted, when work was asked for.")
    detail: str | None = Field(default=None, description="The closed gate's reason.")


# --- errors and the node ------------------------------------------------------------------------


class ErrorBody(BaseModel):
    error: str
    message: str
    reason: str | None = None


class Problem(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class InvalidRequestBody(ErrorBody):
    detail: list[Problem] | None = Field(
        default=None, description="The first validation problems (the input is not echoed)."
    )


class HealthResponse(BaseModel):
    status: Literal["ok"]
