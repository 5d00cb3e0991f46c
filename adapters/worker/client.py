"""A small client of the worker ingress (HTTP). It knows the protocol, not the worker's policy.

An answer that refuses a call raises :class:`IngressRefused` (the call changed nothing); a
transport failure or a 5xx raises :class:`IngressUnavailable` (the outcome is unknown, the call
may be repeated: every call of the protocol is safe to repeat). A fenced batch longer than the
ingress takes in one call is sent in consecutive calls of at most :data:`MAX_BATCH_ITEMS`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

JsonValue = Any
MAX_BATCH_ITEMS = 256  # the ingress's limit per fenced batch


class IngressUnavailable(Exception):
    """The ingress could not be reached or failed; nothing is known about the outcome, unless
    ``sent`` is false: then the request never left (no connection), and changed nothing."""

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
class OfferData:
    run_id: str
    attempt_id: str
    attempt_number: int
    task: str
    input: JsonValue
    generation: int
    version: int
    expires_at_ms: int
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    status: str
    now_ms: int
    offers: tuple[OfferData, ...]


@dataclass(frozen=True, slots=True)
class ItemAnswer:
    attempt_id: str
    status: int
    outcome: str | None
    expires_at_ms: int | None
    error: str | None
    reason: str | None
    now_ms: int = 0  # the ingress's clock when it decided this item

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


class IngressClient:
    """One worker's connection to one ingress; holds the session once registered. Once
    registered, its calls may come from several threads (the HTTP client is shared)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 5.0,
        registration_token: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport
        )
        self._registration_token = registration_token
        self._session_id: str | None = None
        self._secret: str | None = None

    @property
    def session_id(self) -> str | None:
        return self._session_id

    def set_timeout(self, timeout_s: float) -> None:
        self._http.timeout = httpx.Timeout(timeout_s)

    def close_connection(self) -> None:
        self._http.close()

    # --- calls --------------------------------------------------------------------------------

    def register(self, worker_id: str, capacity: int, tasks: Sequence[str]) -> Registration:
        headers = (
            {"Authorization": f"Bearer {self._registration_token}"}
            if self._registration_token
            else {}
        )
        body = self._post(
            "/v1/sessions",
            {"worker_id": worker_id, "capacity": capacity, "tasks": list(tasks)},
            headers=headers,
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
        body = self._session_post("heartbeat", None)
        return Heartbeat(
            status=body["status"],
            now_ms=int(body["now_ms"]),
            offers=tuple(OfferData(**offer) for offer in body["offers"]),
        )

    def drain(self) -> None:
        self._session_post("drain", None)

    def close(self) -> None:
        self._session_post("close", None)

    def start(self, fences: Sequence[Fence]) -> BatchResult:
        """Accept, cross the start barrier and mark running, in one step."""
        return self._batch("start", [f.body() for f in fences])

    def accept(self, fences: Sequence[Fence]) -> BatchResult:
        """Bind each fence's token to its lease; nothing is started."""
        return self._batch("accept", [f.body() for f in fences])

    def activate(self, fences: Sequence[Fence]) -> BatchResult:
        """Cross the start barrier of accepted offers and mark them running."""
        return self._batch("activate", [f.body() for f in fences])

    def renew(self, fences: Sequence[Fence]) -> BatchResult:
        return self._batch("renew", [f.body() for f in fences])

    def complete(self, items: Sequence[tuple[Fence, bool, JsonValue, str | None]]) -> BatchResult:
        return self._batch(
            "complete",
            [
                {**fence.body(), "succeeded": ok, "output": output if ok else None, "error": error}
                for fence, ok, output, error in items
            ],
        )

    def abandon(self, items: Sequence[tuple[Fence, str]]) -> BatchResult:
        return self._batch(
            "abandon", [{**fence.body(), "detail": detail[:500]} for fence, detail in items]
        )

    # --- plumbing -----------------------------------------------------------------------------

    def _batch(self, command: str, items: list[dict[str, JsonValue]]) -> BatchResult:
        answers: dict[str, ItemAnswer] = {}
        first_now_ms: int | None = None
        for start in range(0, len(items), MAX_BATCH_ITEMS):
            try:
                body = self._session_post(
                    command, {"items": items[start : start + MAX_BATCH_ITEMS]}
                )
            except IngressUnavailable as error:
                if start and not error.sent:  # the earlier calls of the batch did go out
                    raise IngressUnavailable(str(error)) from None
                raise
            now_ms = int(body["now_ms"])
            first_now_ms = now_ms if first_now_ms is None else first_now_ms
            for item in body["results"]:
                answer = ItemAnswer(
                    attempt_id=item["attempt_id"],
                    status=int(item["status"]),
                    outcome=item.get("outcome"),
                    expires_at_ms=item.get("expires_at_ms"),
                    error=item.get("error"),
                    reason=item.get("reason"),
                    now_ms=now_ms,
                )
                answers[answer.attempt_id] = answer
        return BatchResult(now_ms=first_now_ms or 0, items=answers)

    def _session_post(self, command: str, payload: Mapping[str, JsonValue] | None) -> Any:
        if self._session_id is None or self._secret is None:
            raise RuntimeError("register a session first")
        return self._post(
            f"/v1/sessions/{self._session_id}/{command}",
            payload,
            headers={"Authorization": f"Bearer {self._secret}"},
        )

    def _post(
        self,
        path: str,
        payload: Mapping[str, JsonValue] | None,
        *,
        headers: Mapping[str, str],
    ) -> Any:
        try:
            response = self._http.post(path, json=payload, headers=dict(headers))
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise IngressUnavailable(f"{type(error).__name__}: {error}", sent=False) from None
        except httpx.HTTPError as error:
            raise IngressUnavailable(f"{type(error).__name__}: {error}") from None
        if response.status_code >= 500:
            raise IngressUnavailable(f"ingress answered {response.status_code}")
        try:
            body = response.json()
        except ValueError:
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
