"""The claim's long poll (ADR 0007): a claim that found nothing parks on the app's claim signal
without holding a thread, and answers on a dispatch wake-up with work, at the end of
``wait_ms``, at shutdown, on another call of its session, or when its client goes away."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi.testclient import TestClient

from ql3.adapters.http import ClaimSignal, Woken, create_app
from ql3.application.worker_commands import ClaimAnswer
from ql3.domain.model import RunStatus
from tests.application.support import run_view
from tests.http.conftest import Ingress, Session, fence


def test_a_parked_claim_answers_soon_after_an_admission_and_a_wake_up(
    memory_ingress: Ingress,
) -> None:
    ingress = memory_ingress
    session = ingress.register()
    pending = session.claim_in_thread(2, wait_ms=10_000)
    ingress.wait_until_waiting()
    (run_id,) = ingress.queued(1)
    woken_at = time.monotonic()
    ingress.signal.wake()
    answer = pending.result()
    assert pending.answered_at - woken_at < 0.05  # typically 3 to 10 ms
    (grant,) = answer["grants"]
    assert grant["run_id"] == run_id
    assert answer["no_grant"] is None
    assert run_view(ingress.store, run_id).run.status is RunStatus.RUNNING
    assert ingress.signal.claims == 0  # the ticket was given back


def test_a_wake_up_without_work_keeps_the_claim_parked(memory_ingress: Ingress) -> None:
    ingress = memory_ingress
    session = ingress.register()
    other = ingress.register("w2", tasks=("other",))
    pending = session.claim_in_thread(1, wait_ms=10_000)
    ingress.wait_until_waiting()
    ingress.queued(1, task="other")  # not a task of this session
    generation = ingress.signal.generation
    ingress.signal.wake()
    time.sleep(0.05)
    assert not pending.done.is_set()
    ingress.wait_until_waiting()  # claimed again, found nothing, parked again
    assert ingress.signal.generation == generation + 1
    assert other.claim(1)["grants"]  # the other session's work was there all along
    (run_id,) = ingress.queued(1)
    ingress.signal.wake()
    assert [g["run_id"] for g in pending.result()["grants"]] == [run_id]


def test_a_claim_returns_empty_after_wait_ms(memory_ingress: Ingress) -> None:
    session = memory_ingress.register()
    started = time.monotonic()
    answer = session.claim(2, wait_ms=200)
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 1.5
    assert (answer["grants"], answer["no_grant"]) == ([], "nothing_queued")


def test_only_a_claim_that_may_wait_parks(memory_ingress: Ingress) -> None:
    ingress = memory_ingress
    session = ingress.register(capacity=1)
    for body in ({"limit": 0, "wait_ms": 5_000}, {"limit": 1, "wait_ms": 0}):
        started = time.monotonic()
        assert session.claim(**body)["grants"] == []
        assert time.monotonic() - started < 1.0, body
    ingress.queued(1)
    assert len(session.claim(1)["grants"]) == 1
    started = time.monotonic()
    full = session.claim(1, wait_ms=5_000)  # no capacity: waiting would not help
    assert full["no_grant"] == "no_capacity"
    assert time.monotonic() - started < 1.0


def test_completions_are_answered_from_the_first_transaction(memory_ingress: Ingress) -> None:
    ingress = memory_ingress
    session = ingress.register(capacity=2)
    ingress.queued(2)
    kept, dropped = session.claim(2)["grants"]
    pending = session.claim_in_thread(
        1,
        wait_ms=10_000,
        held=[kept["attempt_id"]],
        completions=[{**fence(kept), "succeeded": True}],
    )
    ingress.wait_until_waiting()  # the hand-back is committed, not yet claimable in that call
    ingress.signal.wake()  # on PostgreSQL, the hand-back's NOTIFY
    answer = pending.result()
    assert [(r["attempt_id"], r["outcome"]) for r in answer["completed"]] == [
        (kept["attempt_id"], "succeeded")
    ]
    assert answer["released"] == [dropped["attempt_id"]]
    (grant,) = answer["grants"]
    assert (grant["attempt_id"], grant["generation"]) == (dropped["attempt_id"], 2)
    assert ingress.ended == []


class _WakeDuringTheTransaction:
    """Commands whose first claim finds nothing, then admits work and wakes the signal before
    it returns: the wake-up falls between the transaction and the wait."""

    def __init__(self, ingress: Ingress) -> None:
        self._ingress = ingress
        self._inner = ingress.commands
        self.claims = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def claim(self, *args: Any, **kwargs: Any) -> ClaimAnswer:
        answer = self._inner.claim(*args, **kwargs)
        self.claims += 1
        if self.claims == 1:
            self._ingress.queued(1)
            self._ingress.signal.wake()
        return answer


def test_a_wake_up_during_the_claim_transaction_is_not_lost(memory_ingress: Ingress) -> None:
    ingress = memory_ingress
    session = ingress.register()
    commands = _WakeDuringTheTransaction(ingress)
    ingress.client = TestClient(create_app(commands, signal=ingress.signal))  # type: ignore[arg-type]
    started = time.monotonic()
    answer = session.claim(1, wait_ms=10_000)
    assert time.monotonic() - started < 1.0
    assert len(answer["grants"]) == 1
    assert commands.claims == 2


def test_another_call_of_the_session_ends_its_parked_claim(memory_ingress: Ingress) -> None:
    ingress = memory_ingress
    session = ingress.register()
    other = ingress.register("w2")
    ingress.queued(1)
    (grant,) = other.claim(1)["grants"]
    pending = session.claim_in_thread(1, wait_ms=10_000)
    ingress.wait_until_waiting()
    assert other.post("heartbeat").status_code == 200  # another session's call: no effect
    assert other.post("renew", {"items": [fence(grant)]}).status_code == 200
    assert session.post("claim", {"limit": 0}).status_code == 200  # a claim: no effect
    time.sleep(0.05)
    assert not pending.done.is_set()
    sent = time.monotonic()
    assert session.post("heartbeat").status_code == 200
    assert pending.result()["grants"] == []
    assert pending.answered_at - sent < 0.5
    for command, body in (
        ("renew", {"items": [fence(grant)]}),  # its items are refused: still a call of the session
        ("drain", None),
    ):
        pending = session.claim_in_thread(1, wait_ms=10_000)
        ingress.wait_until_waiting()
        sent = time.monotonic()
        assert session.post(command, body).status_code == 200
        assert pending.result()["grants"] == []
        assert pending.answered_at - sent < 0.5, command


class _Call:
    """One claim sent straight to the ASGI app, whose client may go away (``disconnect``)."""

    def __init__(self, app: Any, session: Session, body: dict[str, Any]) -> None:
        self.app = app
        self.payload = json.dumps(body).encode()
        path = f"/v1/sessions/{session.session_id}/claim"
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.payload)).encode()),
                (b"authorization", f"Bearer {session.secret}".encode()),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        self.disconnect = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self._messages = [{"type": "http.request", "body": self.payload, "more_body": False}]

    async def receive(self) -> dict[str, Any]:
        if self._messages:
            return self._messages.pop()
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def start(self) -> asyncio.Task[None]:
        return asyncio.create_task(self.app(self.scope, self.receive, self.send))

    @property
    def status(self) -> int:
        (start,) = [m for m in self.sent if m["type"] == "http.response.start"]
        status: int = start["status"]
        return status

    @property
    def answer(self) -> dict[str, Any]:
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        answer: dict[str, Any] = json.loads(body)
        return answer


async def _until_waiting(signal: ClaimSignal, claims: int = 1) -> None:
    async with asyncio.timeout(5):
        while signal.waiting < claims:
            await asyncio.sleep(0.002)


def test_a_parked_claim_is_released_by_shutdown(memory_ingress: Ingress) -> None:
    ingress = memory_ingress
    session = ingress.register()
    app = ingress.client.app
    calls = [_Call(app, session, {"limit": 1, "wait_ms": 20_000}) for _ in range(2)]

    async def run() -> float:
        async with app.router.lifespan_context(app):  # type: ignore[attr-defined]
            tasks = [call.start() for call in calls]
            await _until_waiting(ingress.signal, 2)
            stopping = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
        return time.monotonic() - stopping

    assert asyncio.run(run()) < 1.0
    for call in calls:
        assert call.status == 200
        assert (call.answer["grants"], call.answer["no_grant"]) == ([], "nothing_queued")
    assert ingress.signal.closed
    # No claim parks any more.
    started = time.monotonic()
    assert session.claim(1, wait_ms=5_000)["grants"] == []
    assert time.monotonic() - started < 1.0


def test_a_parked_claim_ends_when_its_client_goes_away(memory_ingress: Ingress) -> None:
    ingress = memory_ingress
    session = ingress.register()
    call = _Call(ingress.client.app, session, {"limit": 1, "wait_ms": 20_000})

    async def run() -> float:
        task = call.start()
        await _until_waiting(ingress.signal)
        gone = time.monotonic()
        call.disconnect.set()
        await asyncio.wait_for(task, timeout=5)
        return time.monotonic() - gone

    assert asyncio.run(run()) < 0.5
    assert ingress.signal.claims == 0
    # Work admitted now is not granted to the client that went away.
    (run_id,) = ingress.queued(1)
    ingress.signal.wake()
    assert run_view(ingress.store, run_id).run.status is RunStatus.QUEUED


def test_the_signal_wakes_tickets_of_any_loop_from_any_thread() -> None:
    signal = ClaimSignal()

    async def wait(session_id: str, timeout: float) -> Woken:
        with signal.ticket(session_id) as ticket:
            return await ticket.wait(timeout)

    async def scenario() -> list[Woken]:
        waits = [asyncio.create_task(wait("s1", 5)), asyncio.create_task(wait("s2", 5))]
        while signal.waiting < 2:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(signal.wake_session, "s1")
        first = await waits[0]
        assert not waits[1].done()
        await asyncio.to_thread(signal.wake)
        return [first, await waits[1], await wait("s3", 0.01)]

    assert asyncio.run(scenario()) == [Woken.SESSION, Woken.DISPATCH, Woken.TIMEOUT]

    async def after_close() -> Woken:
        with signal.ticket("s1") as ticket:
            signal.close()
            return await ticket.wait(5)

    assert asyncio.run(after_close()) is Woken.SHUTDOWN
