"""The worker protocol as a worker speaks it, whatever carries it (ADR 0007, ADR 0023): the
fences, grants, completions, hand-backs and abandons it sends, the answers it gets, the two ways
a call can fail, and :class:`Transport`, the calls the worker's loop makes.

Two transports implement it: :class:`ql3.adapters.worker.client.IngressClient` (HTTP, a remote
worker) and :class:`ql3.adapters.worker.inprocess.InProcessTransport` (the worker commands
called in this process, Standalone and Edge). The ledger, the claimer and the reporter know only
this module."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

JsonValue = Any
MAX_BATCH_ITEMS = 256  # the ingress's limit per fenced batch, and per claim's completions
MAX_CLAIM = 256  # the most one claim asks for
# The status of a refused item, by its rejection (``error``): what it would have got as a call
# of its own. 200 is an item's success.
ITEM_STATUS = {
    "fence_rejected": 409,
    "invalid_state": 409,
    "session_rejected": 409,
    "conflict": 409,
    "unknown_attempt": 404,
    "invalid": 422,
}


class IngressUnavailable(Exception):
    """The ingress could not be reached or kept failing for the whole retry budget; nothing is
    known about the outcome, unless ``sent`` is false: then no request ever left (no
    connection), and nothing changed."""

    def __init__(self, message: str, *, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


class IngressRefused(Exception):
    """The ingress refused the call (4xx); nothing changed."""

    def __init__(self, status: int, error: str, message: str, reason: str | None = None):
        super().__init__(f"{status} {error}: {message}")
        self.status = status
        self.error = error
        self.message = message
        self.reason = reason

    @property
    def session_lost(self) -> bool:
        """The session itself is gone: unknown, wrong secret, closed or replaced."""
        return self.error in {"unknown_session", "unauthorized", "session_rejected"}


@dataclass(frozen=True, slots=True)
class Registration:
    session_id: str
    secret: str
    replaced_session_ids: tuple[str, ...]
    lease_ttl_ms: int
    heartbeat_interval_ms: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class Heartbeat:
    status: str
    now_ms: int


@dataclass(frozen=True, slots=True)
class Fence:
    attempt_id: str
    generation: int
    version: int
    token: str

    def body(self) -> dict[str, JsonValue]:
        return {
            "attempt_id": self.attempt_id,
            "generation": self.generation,
            "version": self.version,
            "token": self.token,
        }


@dataclass(frozen=True, slots=True)
class GrantData:
    """An Attempt a claim started for this session: its task may begin at once. The token was
    minted by the node for this lease and is sent once, in the claim's answer."""

    run_id: str
    attempt_id: str
    attempt_number: int
    task: str
    input: JsonValue
    generation: int
    version: int
    token: str
    expires_at_ms: int
    idempotency_key: str
    timeout_ms: int | None = None  # the run's execution timeout

    @property
    def timeout_s(self) -> float | None:
        return self.timeout_ms / 1000 if self.timeout_ms is not None else None

    @property
    def fence(self) -> Fence:
        return Fence(
            attempt_id=self.attempt_id,
            generation=self.generation,
            version=self.version,
            token=self.token,
        )


@dataclass(frozen=True, slots=True)
class Completion:
    """A task's outcome; ``timed_out``: a failure, the task stopped at its run's timeout."""

    fence: Fence
    succeeded: bool
    output: JsonValue = None
    error: str | None = None
    timed_out: bool = False

    def body(self) -> dict[str, JsonValue]:
        body: dict[str, JsonValue] = {
            **self.fence.body(),
            "succeeded": self.succeeded,
            "output": self.output if self.succeeded else None,
            "error": None if self.succeeded else self.error,
        }
        if self.timed_out and not self.succeeded:
            body["timed_out"] = True
        return body


@dataclass(frozen=True, slots=True)
class Release:
    """Hand back an Attempt whose task never began here."""

    fence: Fence
    cause: str

    def body(self) -> dict[str, JsonValue]:
        return {**self.fence.body(), "cause": self.cause[:500]}


@dataclass(frozen=True, slots=True)
class Abandonment:
    """A task that began here was stopped."""

    fence: Fence
    detail: str

    def body(self) -> dict[str, JsonValue]:
        return {**self.fence.body(), "detail": self.detail[:500]}


@dataclass(frozen=True, slots=True)
class ItemAnswer:
    attempt_id: str
    status: int
    outcome: str | None
    expires_at_ms: int | None
    error: str | None  # the rejection: fence_rejected, invalid_state, conflict, invalid...
    reason: str | None  # a fence rejection's reason: expired, released, token_mismatch...
    now_ms: int = 0  # the ingress's clock when it decided this item
    message: str | None = None  # a rejection's explanation

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def expires_in_s(self) -> float | None:
        """How long the lease still had when the ingress answered (its own clock)."""
        if self.expires_at_ms is None:
            return None
        return (self.expires_at_ms - self.now_ms) / 1000


@dataclass(frozen=True, slots=True)
class BatchResult:
    now_ms: int
    items: dict[str, ItemAnswer]
    sent_at: float = 0.0  # monotonic: when the request that got this answer was sent


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """A claim's answer. ``completed`` answers the completions it carried, ``released`` names
    the Attempts the node handed back because the ``held`` statement did not name them, and
    ``no_grant`` says why a claim that asked for work got none."""

    now_ms: int
    status: str
    completed: dict[str, ItemAnswer]
    released: tuple[str, ...]
    grants: tuple[GrantData, ...]
    no_grant: str | None
    detail: str | None
    sent_at: float = 0.0  # monotonic: when the request that got this answer was sent

    def expires_in_s(self, grant: GrantData) -> float:
        return (grant.expires_at_ms - self.now_ms) / 1000


class Transport(Protocol):
    """The calls of the worker protocol the worker's loop makes, for one session (registered
    first). A call that could not be made raises :class:`IngressUnavailable` (or the error of
    the store behind an in-process transport); one the other side refused raises
    :class:`IngressRefused`."""

    @property
    def other_calls(self) -> int:
        """How many calls of the session other than claims were sent so far (each ends a claim
        parked at the node)."""

    def register(
        self,
        worker_id: str,
        capacity: int,
        tasks: Sequence[str],
        *,
        budget_s: float | None = None,
    ) -> Registration: ...

    def heartbeat(self) -> Heartbeat: ...

    def drain(self) -> None: ...

    def close(self) -> None: ...

    def claim(
        self,
        limit: int,
        wait_ms: int = 0,
        held: Sequence[str] | None = None,
        completions: Sequence[Completion] = (),
    ) -> ClaimResult: ...

    def renew(self, fences: Sequence[Fence]) -> BatchResult: ...

    def complete(self, items: Sequence[Completion]) -> BatchResult: ...

    def abandon(self, items: Sequence[Abandonment]) -> BatchResult: ...

    def release(self, items: Sequence[Release]) -> BatchResult: ...


class RemoteTransport(Transport, Protocol):
    """A transport of a worker process (:class:`ql3.adapters.worker.runtime.Worker`): over
    HTTP to a node (:class:`ql3.adapters.worker.client.IngressClient`) or to the database
    itself (:class:`ql3.adapters.worker.direct.DirectTransport`). A call that could not be made
    is made again for ``retry_budget_s`` (a registered session's call: until answered, while
    ``keep_trying``), unless ``give_up`` says to stop."""

    retry_budget_s: float
    give_up: Callable[[], bool]
    keep_trying: bool

    def set_timeout(self, timeout_s: float) -> None: ...

    def close_connection(self) -> None: ...
