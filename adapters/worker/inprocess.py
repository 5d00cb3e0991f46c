"""The worker protocol carried in this process (ADR 0023): each call of the worker's loop is a
call of :class:`ql3.application.worker_commands.WorkerCommands` on the process's own store, with
the same transitions as a remote worker's call through the ingress. Standalone and Edge execute
their work through it.

Nothing is serialised and nothing is repeated: a call that fails (the database stayed locked,
say) raises the store's error and changed nothing; the loop makes it again later. A refusal of
the commands (a :class:`ql3.domain.errors.DomainError`) is raised as it is: the process owns
its database (the exclusive lock), so its session cannot be replaced or lost under it.

There is no long poll: a claim answers at once, and the loop learns that work is queued from
the database's wake channel."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from ql3.adapters.worker.protocol import (
    ITEM_STATUS,
    MAX_BATCH_ITEMS,
    Abandonment,
    BatchResult,
    ClaimResult,
    Completion,
    Fence,
    GrantData,
    Heartbeat,
    IngressRefused,
    ItemAnswer,
    Registration,
    Release,
)
from ql3.application import worker_commands as wc
from ql3.domain.errors import DomainError, FenceRejected, InvalidAdmission, SessionRejected
from ql3.domain.fence import LeaseFence

T = TypeVar("T")


class InProcessTransport:
    """One session of ``commands``, registered by :meth:`register`. Used by one thread."""

    def __init__(self, commands: wc.WorkerCommands) -> None:
        self._commands = commands
        self._session: wc.SessionGrant | None = None
        self._other_calls = 0

    @property
    def other_calls(self) -> int:
        return self._other_calls

    @property
    def lease_ttl_ms(self) -> int:
        return self._commands.lease_ttl_ms

    def register(
        self,
        worker_id: str,
        capacity: int,
        tasks: Sequence[str],
        *,
        budget_s: float | None = None,
    ) -> Registration:
        grant = self._commands.register(worker_id, capacity, list(tasks))
        self._session = grant
        ttl_ms = self._commands.lease_ttl_ms
        return Registration(
            session_id=grant.session_id,
            secret=grant.secret,
            replaced_session_ids=grant.replaced_session_ids,
            lease_ttl_ms=ttl_ms,
            heartbeat_interval_ms=ttl_ms,
            now_ms=grant.registered_at_ms,
        )

    def heartbeat(self) -> Heartbeat:
        session = self._require()
        self._other_calls += 1
        answer = self._commands.poll(session.session_id, session.secret)
        return Heartbeat(status=answer.status.value, now_ms=answer.now_ms)

    def drain(self) -> None:
        session = self._require()
        self._other_calls += 1
        self._commands.drain(session.session_id, session.secret)

    def close(self) -> None:
        session = self._require()
        self._other_calls += 1
        self._commands.close(session.session_id, session.secret)

    def claim(
        self,
        limit: int,
        wait_ms: int = 0,
        held: Sequence[str] | None = None,
        completions: Sequence[Completion] = (),
    ) -> ClaimResult:
        session = self._require()
        sent_at = time.monotonic()
        answer = self._commands.claim(
            session.session_id,
            session.secret,
            limit=limit,
            completions=[_completion(c) for c in completions],
            held=held,
        )
        return ClaimResult(
            now_ms=answer.now_ms,
            status=answer.status.value,
            completed=_items(answer.completed, answer.now_ms),
            released=answer.released,
            grants=tuple(_grant(g) for g in answer.grants),
            no_grant=answer.no_grant.value if answer.no_grant else None,
            detail=answer.detail,
            sent_at=sent_at,
        )

    def renew(self, fences: Sequence[Fence]) -> BatchResult:
        session = self._require()
        return self._batch(
            [_fence(f) for f in fences],
            lambda chunk: self._commands.renew_many(session.session_id, session.secret, chunk),
        )

    def complete(self, items: Sequence[Completion]) -> BatchResult:
        session = self._require()
        return self._batch(
            [_completion(c) for c in items],
            lambda chunk: self._commands.complete_many(session.session_id, session.secret, chunk),
        )

    def abandon(self, items: Sequence[Abandonment]) -> BatchResult:
        session = self._require()
        return self._batch(
            [
                wc.Abandonment(fence=_fence(a.fence), detail=a.detail[: wc.MAX_DETAIL_LENGTH])
                for a in items
            ],
            lambda chunk: self._commands.abandon_many(session.session_id, session.secret, chunk),
        )

    def release(self, items: Sequence[Release]) -> BatchResult:
        session = self._require()
        return self._batch(
            [
                wc.Release(fence=_fence(r.fence), cause=r.cause[: wc.MAX_DETAIL_LENGTH])
                for r in items
            ],
            lambda chunk: self._commands.release_many(session.session_id, session.secret, chunk),
        )

    def _batch(self, items: list[T], call: Callable[[list[T]], wc.BatchAnswer]) -> BatchResult:
        """At most :data:`MAX_BATCH_ITEMS` per call, as the ingress takes them."""
        self._other_calls += 1
        sent_at = time.monotonic()
        answers: dict[str, ItemAnswer] = {}
        first_ms: int | None = None
        for start in range(0, len(items), MAX_BATCH_ITEMS):
            answer = call(items[start : start + MAX_BATCH_ITEMS])
            first_ms = answer.now_ms if first_ms is None else first_ms
            answers.update(_items(answer.results, answer.now_ms))
        return BatchResult(now_ms=first_ms or 0, items=answers, sent_at=sent_at)

    def _require(self) -> wc.SessionGrant:
        if self._session is None:
            raise RuntimeError("register a session first")
        return self._session


def refusal(error: BaseException) -> IngressRefused | None:
    """The worker commands' refusal ``error`` as the ingress answers it (its status and error
    code, most specific class first); None when ``error`` is not a refusal (the store failed,
    and its transaction rolled back)."""
    if isinstance(error, wc.UnknownSession):
        return IngressRefused(404, "unknown_session", str(error))
    if isinstance(error, wc.SessionUnauthorized):
        return IngressRefused(401, "unauthorized", "wrong session secret")
    if isinstance(error, SessionRejected):
        return IngressRefused(409, "session_rejected", str(error))
    if isinstance(error, FenceRejected):
        return IngressRefused(409, "fence_rejected", str(error), error.reason.value)
    if isinstance(error, InvalidAdmission):
        return IngressRefused(422, "invalid_request", str(error))
    if isinstance(error, DomainError):
        return IngressRefused(409, "conflict", str(error))
    return None


def _fence(fence: Fence) -> LeaseFence:
    return LeaseFence(
        attempt_id=fence.attempt_id,
        generation=fence.generation,
        version=fence.version,
        token=fence.token,
    )


def _completion(completion: Completion) -> wc.Completion:
    return wc.Completion(
        fence=_fence(completion.fence),
        succeeded=completion.succeeded,
        output=completion.output if completion.succeeded else None,
        error=None if completion.succeeded else completion.error,
        timed_out=completion.timed_out and not completion.succeeded,
    )


def _grant(grant: wc.Grant) -> GrantData:
    return GrantData(
        run_id=grant.run_id,
        attempt_id=grant.attempt_id,
        attempt_number=grant.attempt_number,
        task=grant.task,
        input=grant.input,
        generation=grant.generation,
        version=grant.version,
        token=grant.token,
        expires_at_ms=grant.expires_at_ms,
        idempotency_key=grant.idempotency_key,
        timeout_ms=grant.timeout_ms,
    )


def _items(results: Sequence[wc.ItemResult], now_ms: int) -> dict[str, ItemAnswer]:
    return {
        r.attempt_id: ItemAnswer(
            attempt_id=r.attempt_id,
            status=200 if r.rejection is None else ITEM_STATUS[r.rejection.value],
            outcome=r.outcome.value if r.outcome else None,
            expires_at_ms=r.expires_at_ms,
            error=r.rejection.value if r.rejection else None,
            reason=r.reason,
            now_ms=now_ms,
            message=r.message,
        )
        for r in results
    }
