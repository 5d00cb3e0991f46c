"""The fenced batches: renew, complete, release, abandon.

Each is one HTTP call and one transaction, with a result per item, so one stale fence does not
fail the others; an item's ``status`` is the one it would have got as a call of its own. A
successful batch wakes the session's parked claim (see :mod:`ql3.adapters.http.claims`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ql3.adapters.http.deps import Ingress, Secret, SessionId
from ql3.adapters.http.errors import ERRORS, translated
from ql3.adapters.http.schemas import (
    AbandonBatch,
    BatchResponse,
    CompleteBatch,
    CompleteItem,
    FenceBatch,
    FenceItem,
    ItemResultBody,
    ReleaseBatch,
)
from ql3.adapters.worker.protocol import ITEM_STATUS
from ql3.application.worker_commands import (
    Abandonment,
    BatchAnswer,
    BatchOutcome,
    Completion,
    ItemResult,
    Release,
)
from ql3.domain.fence import LeaseFence

batch_routes = APIRouter(
    prefix="/v1/sessions/{session_id}",
    tags=["batches"],
    responses={
        **ERRORS,
        409: {
            "model": ERRORS[409]["model"],
            "description": "The session is no longer open (a stale fence is an item's 409).",
        },
    },
)



def fence_of(item: FenceItem) -> LeaseFence:
    return LeaseFence(
        attempt_id=item.attempt_id,
        generation=item.generation,
        version=item.version,
        token=item.token,
    )


def completion_of(item: CompleteItem) -> Completion:
    return Completion(
        fence=fence_of(item),
        succeeded=item.succeeded,
        output=item.output,
        error=item.error,
        timed_out=item.timed_out,
    )


def item_document(result: ItemResult) -> dict[str, Any]:
    """One item's result as :class:`ItemResultBody` spells it, as plain JSON values."""
    return {
        "attempt_id": result.attempt_id,
        "status": 200 if result.rejection is None else ITEM_STATUS[result.rejection.value],
        "outcome": result.outcome.value if result.outcome else None,
        "expires_at_ms": result.expires_at_ms,
        "error": result.rejection.value if result.rejection else None,
        "reason": result.reason,
        "message": result.message,
    }


def item_body(result: ItemResult) -> ItemResultBody:
    return ItemResultBody(**item_document(result))


def batch_body(answer: BatchAnswer) -> BatchResponse:
    return BatchResponse(now_ms=answer.now_ms, results=[item_body(r) for r in answer.results])


@batch_routes.post("/renew", response_model=BatchResponse)
def renew(
    session_id: SessionId, secret: Secret, body: FenceBatch, ingress: Ingress
) -> BatchResponse:
    """Extend leases (no version change)."""
    fences = [fence_of(i) for i in body.items]
    answer = translated(lambda: ingress.commands.renew_many(session_id, secret, fences))
    ingress.signal.wake_session(session_id)
    return batch_body(answer)


@batch_routes.post("/complete", response_model=BatchResponse)
def complete(
    session_id: SessionId, secret: Secret, body: CompleteBatch, ingress: Ingress
) -> BatchResponse:
    """Report outcomes: succeeded with an output, or failed with an error. Repeating a
    recorded completion answers ``already_completed``."""
    completions = [completion_of(i) for i in body.items]
    answer = translated(lambda: ingress.commands.complete_many(session_id, secret, completions))
    ingress.signal.wake_session(session_id)
    return batch_body(answer)


@batch_routes.post("/release", response_model=BatchResponse)
def release(
    session_id: SessionId, secret: Secret, body: ReleaseBatch, ingress: Ingress
) -> BatchResponse:
    """Hand back attempts whose task never began here (a drain, a self-fence before the start,
    a slot that failed to start): each goes back to the queue with no ``lost`` verdict
    (outcome ``released``). An expired lease may still be handed back."""
    releases = [Release(fence=fence_of(i), cause=i.cause) for i in body.items]
    answer = translated(lambda: ingress.commands.release_many(session_id, secret, releases))
    ingress.signal.wake_session(session_id)
    return batch_body(answer)


@batch_routes.post("/abandon", response_model=BatchResponse)
def abandon(
    session_id: SessionId, secret: Secret, body: AbandonBatch, ingress: Ingress
) -> BatchResponse:
    """The worker stopped executing these attempts (allowed on a closed session too): a live
    lease is lost at once, an expired one keeps the report as evidence (``recorded``), one
    released because its run was cancelled answers ``cancelled`` and changes nothing."""
    gone = [Abandonment(fence=fence_of(i), detail=i.detail) for i in body.items]
    answer = translated(lambda: ingress.commands.abandon_many(session_id, secret, gone))
    ingress.signal.wake_session(session_id)
    if any(r.ok and r.outcome is not BatchOutcome.CANCELLED for r in answer.results):
        ingress.attempts_ended()  # a cancelled attempt ended when it was cancelled
    return batch_body(answer)
