"""A small client of the worker ingress (HTTP, ADR 0007). It knows the protocol, not the
worker's policy.

A 4xx answer raises :class:`IngressRefused` at once, never repeated (the call changed nothing).
A 5xx answer or a transport failure is repeated, with capped exponential backoff and jitter,
for at most ``retry_budget_s``; then :class:`IngressUnavailable` is raised. A call of a
registered session is repeated for as long as no answer comes, while ``keep_trying`` holds
(ADR 0028): a node that is down, restarting or cut off, or whose database is down (503), does
not end the session, which lives in the database; the worker's own lease deadlines stop a task
whose lease it could not renew meanwhile. The client logs a warning each ``retry_budget_s`` it
goes on without an answer.

An ingress of several URLs (several nodes of one cluster: ``--ingress`` given more than once)
is one ingress reached at several addresses: each call goes to the current one, and a failed
try moves the client to the next for the tries after it. Repeating is safe:
a repeated completion answers ``already_completed``, a repeated renewal renews, a repeated
abandon or release finds the lease already settled, and a repeated claim carries the same
``held`` statement, which hands back whatever the lost answer had granted.

A fenced batch longer than the ingress takes in one call is sent in consecutive calls of at
most :data:`MAX_BATCH_ITEMS`."""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ql3.adapters.worker.protocol import (
    MAX_BATCH_ITEMS,
    MAX_CLAIM,
    Abandonment,
    BatchResult,
    ClaimResult,
    Completion,
    Fence,
    GrantData,
    Heartbeat,
    IngressRefused,
    IngressUnavailable,
    ItemAnswer,
    JsonValue,
    Registration,
    Release,
)

__all__ = [
    "MAX_BATCH_ITEMS",
    "MAX_CLAIM",
    "Abandonment",
    "BatchResult",
    "ClaimResult",
    "Completion",
    "Fence",
    "GrantData",
    "Heartbeat",
    "IngressClient",
    "IngressRefused",
    "IngressUnavailable",
    "ItemAnswer",
    "Registration",
    "Release",
]

RETRY_INITIAL_S = 0.05  # the first pause before a call is repeated
RETRY_CAP_S = 1.0  # the longest pause between two tries
DEFAULT_RETRY_BUDGET_S = 30.0
GIVE_UP_POLL_S = 0.05  # how often a pause between tries asks whether to give up

log = logging.getLogger("ql3.worker")


@dataclass
class _Tries:
    """The tries of one call: when the last one left, whether any did."""

    sent_at: float = 0.0
    sent: bool = False
    errors: list[str] = field(default_factory=list)


class IngressClient:
    """One worker's connection to one ingress, at one URL or several (tried in turn); holds the
    session once registered. Once registered, its calls may come from several threads (the HTTP
    client is shared)."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        timeout_s: float = 5.0,
        registration_token: str | None = None,
        transport: httpx.BaseTransport | None = None,
        retry_budget_s: float = DEFAULT_RETRY_BUDGET_S,
        ca_file: str | None = None,
    ) -> None:
        # An https:// ingress is verified against ``ca_file`` (PEM) or the system's authorities.
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=ca_file) if ca_file is not None else True
        )
        self._bases = tuple(
            url.rstrip("/") for url in ([base_url] if isinstance(base_url, str) else base_url)
        )
        if not self._bases:
            raise ValueError("an ingress needs at least one URL")
        self._at = 0  # the URL calls go to
        self._http = httpx.Client(timeout=timeout_s, transport=transport, verify=verify)
        # Each absolute URL, parsed once: the client would merge and parse a relative one on
        # every call (about two thirds of building a request).
        self._urls: dict[tuple[int, str], httpx.URL] = {}
        self._timeout_s = timeout_s
        self._registration_token = registration_token
        self._session_id: str | None = None
        self._secret: str | None = None
        self.retry_budget_s = retry_budget_s
        # Asked between tries: true stops the repeating (the worker is stopping).
        self.give_up: Callable[[], bool] = lambda: False
        # A session's call is repeated past the budget until answered (false once stopping).
        self.keep_trying = True
        self._counter = threading.Lock()
        self._other_calls = 0

    @property
    def session_id(self) -> str | None:
        return self._session_id

    @property
    def base_url(self) -> str:
        """The URL calls go to now."""
        return self._bases[self._at]

    @property
    def other_calls(self) -> int:
        """How many calls of the session other than claims were sent so far: each ends a
        claim parked at the node."""
        return self._other_calls

    def set_timeout(self, timeout_s: float) -> None:
        """The read timeout of every call but a claim's (which adds its own wait)."""
        self._timeout_s = timeout_s
        self._http.timeout = httpx.Timeout(timeout_s)

    def close_connection(self) -> None:
        self._http.close()

    # --- sessions -------------------------------------------------------------------------------

    def register(
        self,
        worker_id: str,
        capacity: int,
        tasks: Sequence[str],
        *,
        budget_s: float | None = None,
    ) -> Registration:
        headers = (
            {"Authorization": f"Bearer {self._registration_token}"}
            if self._registration_token
            else {}
        )
        body, _ = self._post(
            "/v1/sessions",
            {"worker_id": worker_id, "capacity": capacity, "tasks": list(tasks)},
            headers=headers,
            budget_s=budget_s,
        )
        grant = Registration(
            session_id=body["session_id"],
            secret=body["secret"],
            replaced_session_ids=tuple(body["replaced_session_ids"]),
            lease_ttl_ms=int(body["lease_ttl_ms"]),
            heartbeat_interval_ms=int(body["heartbeat_interval_ms"]),
            now_ms=int(body["now_ms"]),
        )
        self._session_id, self._secret = grant.session_id, grant.secret
        return grant

    def heartbeat(self) -> Heartbeat:
        body, _ = self._session_post("heartbeat", None)
        return Heartbeat(status=str(body["status"]), now_ms=int(body["now_ms"]))

    def drain(self) -> None:
        self._session_post("drain", None)

    def close(self) -> None:
        self._session_post("close", None)

    # --- the claim ------------------------------------------------------------------------------

    def claim(
        self,
        limit: int,
        wait_ms: int = 0,
        held: Sequence[str] | None = None,
        completions: Sequence[Completion] = (),
    ) -> ClaimResult:
        """Report ``completions``, state every Attempt the worker holds (``held``), and ask
        for up to ``limit`` Attempts, waiting at the node for at most ``wait_ms`` if none is
        queued. One call, one transaction at the node."""
        if not 0 <= limit <= MAX_CLAIM:
            raise ValueError(f"a claim asks for 0..{MAX_CLAIM} attempts")
        if len(completions) > MAX_BATCH_ITEMS:
            raise ValueError(f"a claim carries at most {MAX_BATCH_ITEMS} completions")
        payload = {
            "limit": limit,
            "wait_ms": wait_ms,
            "held": None if held is None else list(held),
            "completions": [c.body() for c in completions],
        }
        body, tries = self._session_post(
            "claim", payload, timeout_s=self._timeout_s + wait_ms / 1000
        )
        now_ms = int(body["now_ms"])
        return ClaimResult(
            now_ms=now_ms,
            status=str(body["status"]),
            completed=_items(body.get("completed") or [], now_ms),
            released=tuple(body.get("released") or ()),
            grants=tuple(GrantData(**grant) for grant in body.get("grants") or ()),
            no_grant=body.get("no_grant"),
            detail=body.get("detail"),
            sent_at=tries.sent_at,
        )

    # --- fenced batches -------------------------------------------------------------------------

    def renew(self, fences: Sequence[Fence]) -> BatchResult:
        return self._batch("renew", [f.body() for f in fences])

    def complete(self, items: Sequence[Completion]) -> BatchResult:
        return self._batch("complete", [c.body() for c in items])

    def abandon(self, items: Sequence[Abandonment]) -> BatchResult:
        return self._batch("abandon", [a.body() for a in items])

    def release(self, items: Sequence[Release]) -> BatchResult:
        return self._batch("release", [r.body() for r in items])

    # --- plumbing -------------------------------------------------------------------------------

    def _batch(self, command: str, items: list[dict[str, JsonValue]]) -> BatchResult:
        answers: dict[str, ItemAnswer] = {}
        first: tuple[int, float] | None = None
        for start in range(0, len(items), MAX_BATCH_ITEMS):
            body, tries = self._session_post(
                command, {"items": items[start : start + MAX_BATCH_ITEMS]}
            )
            now_ms = int(body["now_ms"])
            first = first or (now_ms, tries.sent_at)
            answers.update(_items(body["results"], now_ms))
        now_ms, sent_at = first or (0, time.monotonic())
        return BatchResult(now_ms=now_ms, items=answers, sent_at=sent_at)

    def _session_post(
        self,
        command: str,
        payload: Mapping[str, JsonValue] | None,
        *,
        timeout_s: float | None = None,
    ) -> tuple[Any, _Tries]:
        if self._session_id is None or self._secret is None:
            raise RuntimeError("register a session first")
        if command != "claim":
            with self._counter:
                self._other_calls += 1
        return self._post(
            f"/v1/sessions/{self._session_id}/{command}",
            payload,
            headers={"Authorization": f"Bearer {self._secret}"},
            timeout_s=timeout_s,
            until_answered=True,
        )

    def _post(
        self,
        path: str,
        payload: Mapping[str, JsonValue] | None,
        *,
        headers: Mapping[str, str],
        timeout_s: float | None = None,
        budget_s: float | None = None,
        until_answered: bool = False,
    ) -> tuple[Any, _Tries]:
        """Send until answered: a 4xx raises at once; a 5xx or a transport failure is tried
        again after a pause (doubling up to :data:`RETRY_CAP_S`, each drawn between half and
        all of it), at the next URL if there are several, the last try when the budget is
        spent. ``until_answered``: while :attr:`keep_trying`, the budget is renewed each time
        it is spent, with a warning."""
        budget = self.retry_budget_s if budget_s is None else budget_s
        started = time.monotonic()
        deadline = started + budget
        pause = RETRY_INITIAL_S
        tries = _Tries()
        command = path.rsplit("/", 1)[-1]
        while True:
            tries.sent_at = time.monotonic()
            at = self._at
            try:
                return self._post_once(at, path, payload, headers, timeout_s), tries
            except IngressUnavailable as error:
                tries.sent = tries.sent or error.sent
                tries.errors.append(str(error))
                self._move_on(at, error)
                now = time.monotonic()
                if now >= deadline and until_answered and self.keep_trying and not self.give_up():
                    log.warning(
                        "the ingress has not answered %s for %.0f s (%d tries: %s); trying on",
                        command,
                        now - started,
                        len(tries.errors),
                        error,
                    )
                    deadline = now + budget
                if now >= deadline or self.give_up():
                    raise IngressUnavailable(
                        f"the ingress did not answer {command} within {budget:.1f} s "
                        f"({len(tries.errors)} tries): {error}",
                        sent=tries.sent,
                    ) from None
                until = min(now + random.uniform(pause / 2, pause), deadline)
                while (left := until - time.monotonic()) > 0 and not self.give_up():
                    time.sleep(min(left, GIVE_UP_POLL_S))
                pause = min(pause * 2, RETRY_CAP_S)

    def _move_on(self, at: int, error: IngressUnavailable) -> None:
        """A try at URL ``at`` failed: the next tries go to the next URL (once, whichever
        thread saw it first)."""
        if len(self._bases) == 1 or self._at != at:
            return
        self._at = (at + 1) % len(self._bases)
        log.info(
            "ingress %s did not answer (%s); moving to %s", self._bases[at], error, self.base_url
        )

    def _post_once(
        self,
        at: int,
        path: str,
        payload: Mapping[str, JsonValue] | None,
        headers: Mapping[str, str],
        timeout_s: float | None,
    ) -> Any:
        timeout = httpx.Timeout(timeout_s) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
        url = self._urls.get((at, path))
        if url is None:
            url = self._urls[at, path] = httpx.URL(self._bases[at] + path)
        try:
            response = self._http.post(url, json=payload, headers=dict(headers), timeout=timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise IngressUnavailable(f"{type(error).__name__}: {error}", sent=False) from None
        except httpx.HTTPError as error:
            raise IngressUnavailable(f"{type(error).__name__}: {error}") from None
        if response.status_code >= 500:
            raise IngressUnavailable(f"ingress answered {response.status_code}")
        try:
            body = response.json()
        except ValueError:
            if response.status_code >= 400:  # refused, whatever the body says
                raise IngressRefused(response.status_code, "refused", response.text[:200]) from None
            raise IngressUnavailable(
                f"ingress answered {response.status_code} without JSON"
            ) from None
        if response.status_code >= 400:
            raise IngressRefused(
                response.status_code,
                str(body.get("error", "refused")),
                str(body.get("message", "")),
                body.get("reason"),
            )
        return body


def _items(results: Sequence[Mapping[str, Any]], now_ms: int) -> dict[str, ItemAnswer]:
    answers = {}
    for item in results:
        answer = ItemAnswer(
            attempt_id=item["attempt_id"],
            status=int(item["status"]),
            outcome=item.get("outcome"),
            expires_at_ms=item.get("expires_at_ms"),
            error=item.get("error"),
            reason=item.get("reason"),
            now_ms=now_ms,
            message=item.get("message"),
        )
        answers[answer.attempt_id] = answer
    return answers
