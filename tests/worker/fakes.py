"""Fakes for the worker's unit tests.

:class:`FakeNode` answers the ingress's HTTP API (ADR 0007) in memory, behind an
``httpx.MockTransport``, so the worker runs with its real :class:`IngressClient` (bodies,
retries, refusals) against a node whose every call is recorded and can be delayed, failed or
have its answer dropped. It keeps the protocol's rules: a claim settles its completions, hands
back the session's leased Attempts its ``held`` statement does not name (cause ``not_held``,
not grantable again in the same claim), then grants up to ``limit`` within the capacity; with
nothing to grant it parks until work is queued (then it claims again), any other call of the
session arrives (then it answers at once), or ``wait_ms`` passes.

:class:`FakeChildren` makes slot children that run the tasks in the slot's thread: ``double``
returns at once, ``sleep`` sleeps (and can be killed), ``big`` returns a large output, ``fail``
fails.

:class:`WorkerThread` runs a :class:`Worker` in a thread. :class:`DropsFirstGrantingClaimAnswer`
and :class:`PausesFirstGrantingClaimAnswer` are real HTTP transports (for a real node) that lose,
or hold up, the answer of the first claim that granted anything."""

from __future__ import annotations

import itertools
import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ql3.adapters.worker.client import IngressClient
from ql3.adapters.worker.runtime import Worker
from ql3.adapters.worker.settings import WorkerSettings
from ql3.adapters.worker.slot import Job, JobOutcome, SlotError

URL = "http://fake-node"
SECRET = "s" * 32


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Lease:
    session: str
    generation: int
    version: int
    token: str
    expires_at_ms: int
    status: str = "leased"
    reason: str | None = None


@dataclass
class FakeRun:
    run_id: str
    attempt_id: str
    task: str
    input: Any
    status: str = "queued"
    output: Any = None
    error: str | None = None
    generation: int = 0
    lease: Lease | None = None
    events: list[tuple[str, Any]] = field(default_factory=list)


@dataclass
class ClaimRecord:
    limit: int
    wait_ms: int
    held: list[str] | None
    completions: list[str]
    leased_on_arrival: set[str]
    released: list[str] = field(default_factory=list)
    grants: list[str] = field(default_factory=list)
    answered: bool = False


class FakeNode:
    def __init__(self, *, lease_ttl_ms: int = 3000, heartbeat_interval_ms: int = 1000) -> None:
        self.lease_ttl_ms = lease_ttl_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.cond = threading.Condition()
        self.runs: dict[str, FakeRun] = {}  # by attempt id
        self.queue: list[str] = []  # attempt ids, oldest first
        self.sessions: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.claims: list[ClaimRecord] = []
        self.unavailable: set[str] = set()  # commands answered 503 (``*``: every one)
        self.unavailable_status = 503  # 503: the store is down; 502: no node behind a proxy
        # Called with (command, request body, answer body) before a call is answered; it may
        # raise (an httpx error drops the answer: the call happened, the worker never hears).
        self.before_answer: Callable[[str, Any, Any], None] | None = None
        self._ids = itertools.count(1)
        self._pokes = 0

    # --- the test's side --------------------------------------------------------------------------

    def submit(self, task: str, payload: Any = None) -> str:
        n = next(self._ids)
        run = FakeRun(run_id=f"run-{n:03}", attempt_id=f"att-{n:03}", task=task, input=payload)
        with self.cond:
            self.runs[run.attempt_id] = run
            self.queue.append(run.attempt_id)
            self.cond.notify_all()
        return run.attempt_id

    def run(self, attempt_id: str) -> FakeRun:
        with self.cond:
            return self.runs[attempt_id]

    def commands(self, command: str) -> list[Any]:
        with self.cond:
            return [body for c, body in self.calls if c == command]

    def items(self, command: str) -> list[dict[str, Any]]:
        return [item for body in self.commands(command) for item in body["items"]]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    def recover(self, attempt_id: str) -> None:
        """Runtime recovery: the expired lease is released, the Attempt lost."""
        with self.cond:
            run = self.runs[attempt_id]
            assert run.lease is not None
            run.lease.status, run.lease.reason = "released", "lease_expired"
            run.status = "lost"
            run.events.append(("lost", None))

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def client_factory(self) -> Callable[[WorkerSettings], IngressClient]:
        return lambda settings: IngressClient(URL, transport=self.transport())

    # --- HTTP -------------------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")
        body = json.loads(request.content) if request.content else None
        if parts == ["v1", "sessions"]:
            command, session_id = "register", None
        else:
            command, session_id = parts[3], parts[2]
        with self.cond:
            self.calls.append((command, body))
            if command in self.unavailable or "*" in self.unavailable:
                return httpx.Response(
                    self.unavailable_status, json={"error": "unavailable", "message": "down"}
                )
        if session_id is not None:
            session = self.sessions.get(session_id)
            if session is None:
                return _error(404, "unknown_session")
            if request.headers.get("authorization") != f"Bearer {SECRET}":
                return _error(401, "unauthorized")
            if session["status"] in ("closed", "replaced"):
                return _error(409, "session_rejected")
        answer = getattr(self, f"_{command}")(session_id, body)
        if isinstance(answer, httpx.Response):
            return answer
        if self.before_answer is not None:
            self.before_answer(command, body, answer)
        return httpx.Response(200, json=answer)

    def _register(self, _: None, body: Any) -> Any:
        session_id = f"session-{next(self._ids)}"
        with self.cond:
            self.sessions[session_id] = {
                "status": "active",
                "capacity": body["capacity"],
                "tasks": body["tasks"],
            }
        return {
            "session_id": session_id,
            "secret": SECRET,
            "replaced_session_ids": [],
            "lease_ttl_ms": self.lease_ttl_ms,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "now_ms": now_ms(),
        }

    def _poke(self) -> None:
        """Any call of the session wakes its parked claim (hold the lock)."""
        self._pokes += 1
        self.cond.notify_all()

    def _heartbeat(self, session_id: str, _: Any) -> Any:
        with self.cond:
            self._poke()
            return {"status": self.sessions[session_id]["status"], "now_ms": now_ms()}

    def _drain(self, session_id: str, _: Any) -> Any:
        with self.cond:
            self.sessions[session_id]["status"] = "draining"
            self._poke()
        return {"status": "draining"}

    def _close(self, session_id: str, _: Any) -> Any:
        with self.cond:
            self.sessions[session_id]["status"] = "closed"
            self._poke()
        return {"status": "closed"}

    def _claim(self, session_id: str, body: Any) -> Any:
        deadline = time.monotonic() + body["wait_ms"] / 1000
        with self.cond:
            session = self.sessions[session_id]
            held = body["held"]
            completion_ids = [c["attempt_id"] for c in body["completions"]]
            record = ClaimRecord(
                limit=body["limit"],
                wait_ms=body["wait_ms"],
                held=held,
                completions=completion_ids,
                leased_on_arrival=self._leased(session_id),
            )
            self.claims.append(record)
            now = now_ms()
            completed = [self._complete_item(session_id, c, now) for c in body["completions"]]
            released: list[str] = []
            if held is not None:
                stated = set(held) | set(completion_ids)
                for attempt_id in sorted(self._leased(session_id) - stated):
                    self._hand_back(self.runs[attempt_id], "not_held", now)
                    released.append(attempt_id)
            record.released = released
            grants = self._grant(session_id, body["limit"], exclude=set(released))
            pokes = self._pokes
            while not grants and body["limit"] > 0 and session["status"] == "active":
                left = deadline - time.monotonic()
                if left <= 0 or self._pokes != pokes:
                    break
                self.cond.wait(left)
                if self._pokes == pokes:
                    grants = self._grant(session_id, body["limit"], exclude=set())
            record.grants = [g["attempt_id"] for g in grants]
            record.answered = True
            no_grant = None
            if body["limit"] > 0 and not grants:
                no_grant = (
                    "session_not_active" if session["status"] != "active" else ("nothing_queued")
                )
            return {
                "now_ms": now,
                "status": session["status"],
                "completed": completed,
                "released": released,
                "grants": grants,
                "no_grant": no_grant,
                "detail": None,
            }

    def _leased(self, session_id: str) -> set[str]:
        return {
            r.attempt_id
            for r in self.runs.values()
            if r.lease is not None and r.lease.status == "leased" and r.lease.session == session_id
        }

    def _grant(self, session_id: str, limit: int, exclude: set[str]) -> list[dict[str, Any]]:
        session = self.sessions[session_id]
        if limit <= 0 or session["status"] != "active":
            return []
        room = min(limit, session["capacity"] - len(self._leased(session_id)))
        grants = []
        for attempt_id in list(self.queue):
            if len(grants) >= room:
                break
            run = self.runs[attempt_id]
            if attempt_id in exclude or run.task not in session["tasks"]:
                continue
            self.queue.remove(attempt_id)
            run.generation += 1
            run.status = "running"
            run.lease = Lease(
                session=session_id,
                generation=run.generation,
                version=1,
                token=secrets.token_urlsafe(24),
                expires_at_ms=now_ms() + self.lease_ttl_ms,
            )
            run.events.append(("started", run.generation))
            grants.append(
                {
                    "run_id": run.run_id,
                    "attempt_id": run.attempt_id,
                    "attempt_number": 1,
                    "task": run.task,
                    "input": run.input,
                    "generation": run.generation,
                    "version": 1,
                    "token": run.lease.token,
                    "expires_at_ms": run.lease.expires_at_ms,
                    "idempotency_key": run.run_id,
                }
            )
        return grants

    def _hand_back(self, run: FakeRun, cause: str, now: int) -> None:
        assert run.lease is not None
        run.lease.status, run.lease.reason = "released", "handed_back"
        run.status = "queued"
        run.events.append(("released", cause))
        self.queue.append(run.attempt_id)
        self.cond.notify_all()

    def _fence(
        self, session_id: str, item: dict[str, Any], now: int, *, expired_ok: bool = False
    ) -> tuple[FakeRun | None, dict[str, Any] | None]:
        run = self.runs.get(item["attempt_id"])
        if run is None:
            return None, _item(item["attempt_id"], 404, error="unknown_attempt")
        lease = run.lease
        if (
            lease is None
            or lease.session != session_id
            or lease.token != item["token"]
            or lease.generation != item["generation"]
            or lease.version != item["version"]
        ):
            return None, _item(run.attempt_id, 409, error="fence_rejected", reason="token_mismatch")
        if lease.status != "leased":
            return None, _item(run.attempt_id, 409, error="fence_rejected", reason="released")
        if not expired_ok and now > lease.expires_at_ms:
            return None, _item(run.attempt_id, 409, error="fence_rejected", reason="expired")
        return run, None

    def _complete_item(self, session_id: str, item: dict[str, Any], now: int) -> dict[str, Any]:
        run = self.runs.get(item["attempt_id"])
        if (
            run is not None
            and run.lease is not None
            and run.lease.reason == "completed"
            and run.lease.token == item["token"]
        ):
            return _item(run.attempt_id, 200, outcome="already_completed")
        run, refused = self._fence(session_id, item, now)
        if refused is not None:
            return refused
        assert run is not None and run.lease is not None
        run.lease.status, run.lease.reason, run.lease.version = "released", "completed", 2
        run.status = "succeeded" if item["succeeded"] else "failed"
        run.output, run.error = item["output"], item["error"]
        run.events.append((run.status, None))
        return _item(run.attempt_id, 200, outcome=run.status)

    def _batch(self, session_id: str, body: Any, decide: Callable[..., dict[str, Any]]) -> Any:
        with self.cond:
            now = now_ms()
            results = [decide(session_id, item, now) for item in body["items"]]
            self._poke()
        return {"now_ms": now, "results": results}

    def _complete(self, session_id: str, body: Any) -> Any:
        return self._batch(session_id, body, self._complete_item)

    def _renew(self, session_id: str, body: Any) -> Any:
        def decide(session_id: str, item: dict[str, Any], now: int) -> dict[str, Any]:
            run, refused = self._fence(session_id, item, now)
            if refused is not None:
                return refused
            assert run is not None and run.lease is not None
            run.lease.expires_at_ms = now + self.lease_ttl_ms
            return _item(
                run.attempt_id, 200, outcome="renewed", expires_at_ms=run.lease.expires_at_ms
            )

        return self._batch(session_id, body, decide)

    def _release(self, session_id: str, body: Any) -> Any:
        def decide(session_id: str, item: dict[str, Any], now: int) -> dict[str, Any]:
            run, refused = self._fence(session_id, item, now, expired_ok=True)
            if refused is not None:
                return refused
            assert run is not None
            self._hand_back(run, item["cause"], now)
            return _item(run.attempt_id, 200, outcome="released")

        return self._batch(session_id, body, decide)

    def _abandon(self, session_id: str, body: Any) -> Any:
        def decide(session_id: str, item: dict[str, Any], now: int) -> dict[str, Any]:
            run, refused = self._fence(session_id, item, now, expired_ok=True)
            if refused is not None:
                return refused
            assert run is not None and run.lease is not None
            expired = now > run.lease.expires_at_ms
            if not expired:
                run.lease.status, run.lease.reason = "released", "abandoned"
                run.status = "lost"
            run.events.append(("abandoned", item["detail"]))
            return _item(run.attempt_id, 200, outcome="recorded" if expired else "lost")

        return self._batch(session_id, body, decide)


def _item(attempt_id: str, status: int, **fields: Any) -> dict[str, Any]:
    return {"attempt_id": attempt_id, "status": status, **fields}


def _error(status: int, error: str) -> httpx.Response:
    return httpx.Response(status, json={"error": error, "message": error})


class WorkerThread:
    """A :class:`Worker` run in a thread; ``result`` is its exit status or its exception."""

    def __init__(self, settings: WorkerSettings, **options: Any) -> None:
        self.worker = Worker(settings, **options)
        self.result: int | BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.result = self.worker.run()
        except BaseException as error:
            self.result = error

    def start(self) -> WorkerThread:
        self.thread.start()
        return self

    def join(self, timeout: float = 30.0) -> int | BaseException | None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the worker did not finish"
        return self.result


# --- slot children ----------------------------------------------------------------------------


class FakeChildren:
    """Makes :class:`FakeChild` slots and records what their tasks did."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.began: list[str] = []  # attempt ids whose task began, in order
        self.killed: list[str] = []
        self.failing_starts = 0  # the next so many starts of a child fail
        self.dead: set[str] = set()  # slot names whose child is found dead at the next job
        self.pids = itertools.count(1000)

    def factory(self, app_spec: str, name: str) -> FakeChild:
        return FakeChild(self, name)

    def ran(self, attempt_id: str) -> int:
        with self.lock:
            return self.began.count(attempt_id)


class FakeChild:
    def __init__(self, registry: FakeChildren, name: str) -> None:
        self.registry = registry
        self.name = name
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._current: str | None = None
        self._stop = threading.Event()
        self._cancelled: set[str] = set()

    @property
    def pid(self) -> int | None:
        return self._pid

    def start(self) -> None:
        with self.registry.lock:
            if self.registry.failing_starts > 0:
                self.registry.failing_starts -= 1
                raise SlotError("cannot import the app")
            self._pid = next(self.registry.pids)

    def run(self, job: Job) -> JobOutcome:
        with self._lock:
            if job.attempt_id in self._cancelled:
                self._cancelled.discard(job.attempt_id)
                return JobOutcome(False, error="stopped by the worker", killed=True, started=False)
            with self.registry.lock:
                dead = self.name in self.registry.dead
                self.registry.dead.discard(self.name)
            if dead:
                self._pid = None
                return JobOutcome(False, error="the slot process exited with -9", started=False)
            self._current = job.attempt_id
            self._stop.clear()
        with self.registry.lock:
            self.registry.began.append(job.attempt_id)
        try:
            return self._task(job)
        finally:
            with self._lock:
                self._current = None

    def _task(self, job: Job) -> JobOutcome:
        name = job.task.rsplit(".", 1)[-1]
        payload = job.input or {}
        if name == "double":
            return JobOutcome(True, output={"doubled": 2 * payload["n"]})
        if name == "sleep":
            if self._stop.wait(payload["seconds"]):
                self._pid = None  # killed with its process group
                return JobOutcome(False, error="stopped by the worker", killed=True)
            return JobOutcome(True, output={"slept": payload["seconds"]})
        if name == "big":
            return JobOutcome(True, output="x" * payload["bytes"])
        return JobOutcome(False, error=f"RuntimeError: {payload.get('message', 'boom')}")

    def kill(self, attempt_id: str | None = None) -> bool:
        with self._lock:
            if attempt_id is not None and self._current != attempt_id:
                self._cancelled.add(attempt_id)
                return False
            if self._current is None:
                return False
            with self.registry.lock:
                self.registry.killed.append(self._current)
            self._stop.set()
            return True

    def close(self) -> None:
        self._pid = None


# --- a transport that loses one answer ------------------------------------------------------


class DropsFirstGrantingClaimAnswer(httpx.BaseTransport):
    """A real HTTP transport, except that the answer of the first claim that granted anything
    never arrives: the node committed the claim, the worker sees a reset connection."""

    def __init__(self) -> None:
        self._inner = httpx.HTTPTransport()
        self._lock = threading.Lock()
        self.dropped: list[list[str]] = []  # the attempt ids of the lost grants

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        if not request.url.path.endswith("/claim"):
            return response
        response.read()
        with self._lock:
            if not self.dropped and response.status_code == 200:
                grants = json.loads(response.content).get("grants") or []
                if grants:
                    self.dropped.append([g["attempt_id"] for g in grants])
                    response.close()
                    raise httpx.ReadError("connection reset by peer", request=request)
        return response

    def close(self) -> None:
        self._inner.close()


class PausesFirstGrantingClaimAnswer(httpx.BaseTransport):
    """A real HTTP transport that, before handing the worker the answer of the first claim that
    granted anything, calls ``before`` (which may, say, drain the worker)."""

    def __init__(self, before: Callable[[], None]) -> None:
        self._inner = httpx.HTTPTransport()
        self._before = before
        self._lock = threading.Lock()
        self.paused: list[list[str]] = []  # the attempt ids of the grants it held up

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        if not request.url.path.endswith("/claim"):
            return response
        response.read()
        with self._lock:
            if self.paused or response.status_code != 200:
                return response
            grants = json.loads(response.content).get("grants") or []
            if not grants:
                return response
            self.paused.append([g["attempt_id"] for g in grants])
        self._before()
        return response

    def close(self) -> None:
        self._inner.close()
