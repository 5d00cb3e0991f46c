"""The claim (ADR 0007): one call that records completions, hands back what the worker no
longer holds and starts queued Attempts for the session, with a long poll.

The claim's transaction runs in a worker thread. When it asked for work (``limit > 0``), got
none because nothing is queued or the dispatch gate is closed, and may wait (``wait_ms > 0``),
the request parks: it awaits the node's :class:`~ql3.adapters.http.wake.ClaimSignal` and holds no
thread. A dispatch wake-up makes it claim again (without completions or a statement: the first
transaction committed them) and answer as soon as something is granted; the end of
``wait_ms``, the node's shutdown, another call of the same session or the client going away
make it answer at once. ``completed`` and ``released`` are always the first transaction's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ql3.adapters.http.batches import completion_of, item_document
from ql3.adapters.http.deps import Ingress, IngressState, Secret, SessionId
from ql3.adapters.http.errors import ERRORS, ApiError, translated
from ql3.adapters.http.schemas import ClaimRequest, ClaimResponse
from ql3.adapters.http.wake import ClaimTicket, Woken
from ql3.application.worker_commands import ClaimAnswer, Completion, Grant, NoGrant

log = logging.getLogger("ql3.ingress")

claim_routes = APIRouter(prefix="/v1/sessions/{session_id}", tags=["claims"], responses=ERRORS)

# A claim granted nothing for one of these reasons may wait for work.
WAITS_FOR = frozenset({NoGrant.NOTHING_QUEUED, NoGrant.GATE_CLOSED})


@claim_routes.post("/claim", response_model=ClaimResponse)
async def claim(
    session_id: SessionId,
    secret: Secret,
    body: ClaimRequest,
    request: Request,
    ingress: Ingress,
) -> JSONResponse:
    """Record ``completions``, hand back the session's attempts that ``held`` does not name,
    then start up to ``limit`` queued attempts of the session's tasks, fair across tasks. Each
    grant carries its lease token, sent once, here. With ``wait_ms``, wait that long for work
    when there is none (a long poll); a call of the same session (heartbeat, renew, complete,
    release, abandon, drain, close) ends the wait at once. A claim does not end another
    claim's wait."""
    deadline = time.monotonic() + body.wait_ms / 1000
    completions = [completion_of(i) for i in body.completions]
    with ingress.signal.ticket(session_id) as ticket:
        # The ticket is taken before the transaction: a wake-up during it is not lost.
        first = await _claim(ingress, session_id, secret, body.limit, completions, body.held)
        last = first
        if _waits(first, body.limit) and body.wait_ms > 0:
            last = await _park(ingress, ticket, request, secret, body.limit, first, deadline)
    # Built as plain JSON values: building it as ClaimResponse (which documents it), which the
    # framework then checks and dumps again, cost about 90 us of the node's CPU for 8 grants and
    # 8 completions, this about 35 us.
    return JSONResponse(claim_document(first, last))


def claim_document(first: ClaimAnswer, last: ClaimAnswer) -> dict[str, Any]:
    """The answer as :class:`ClaimResponse` spells it: what the first transaction recorded,
    what the last one granted."""
    return {
        "now_ms": last.now_ms,
        "status": last.status.value,
        "completed": [item_document(r) for r in first.completed],
        "released": list(first.released),
        "grants": [grant_document(g) for g in last.grants],
        "no_grant": last.no_grant.value if last.no_grant else None,
        "detail": last.detail,
    }


def grant_document(grant: Grant) -> dict[str, Any]:
    """A grant as :class:`GrantBody` spells it."""
    return {
        "run_id": grant.run_id,
        "attempt_id": grant.attempt_id,
        "attempt_number": grant.attempt_number,
        "task": grant.task,
        "input": grant.input,
        "generation": grant.generation,
        "version": grant.version,
        "token": grant.token,
        "expires_at_ms": grant.expires_at_ms,
        "idempotency_key": grant.idempotency_key,
        "timeout_ms": grant.timeout_ms,
    }


def _waits(answer: ClaimAnswer, limit: int) -> bool:
    return limit > 0 and not answer.grants and answer.no_grant in WAITS_FOR


async def _claim(
    ingress: IngressState,
    session_id: str,
    secret: str,
    limit: int,
    completions: Sequence[Completion] = (),
    held: Sequence[str] | None = None,
) -> ClaimAnswer:
    commands = ingress.commands

    def call() -> ClaimAnswer:
        return translated(
            lambda: commands.claim(
                session_id, secret, limit=limit, completions=completions, held=held
            )
        )

    return await to_thread.run_sync(call)


async def _park(
    ingress: IngressState,
    ticket: ClaimTicket,
    request: Request,
    secret: str,
    limit: int,
    answer: ClaimAnswer,
    deadline: float,
) -> ClaimAnswer:
    """Wait for work until ``deadline``; the last claim's answer."""
    watcher = asyncio.create_task(_watch_disconnect(request, ticket))
    try:
        while _waits(answer, limit):
            woken = await ticket.wait(deadline - time.monotonic())
            if woken is not Woken.DISPATCH:
                break
            try:
                answer = await _claim(ingress, ticket.session_id, secret, limit)
            except ApiError as error:
                # The first transaction committed: answer it rather than the refusal.
                log.info("a parked claim of session %s ends: %s", ticket.session_id, error)
                break
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    return answer


async def _watch_disconnect(request: Request, ticket: ClaimTicket) -> None:
    """End the ticket's wait when the client disconnects (the body is already read, so the
    next message the server gives is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            ticket.gone()
            return
