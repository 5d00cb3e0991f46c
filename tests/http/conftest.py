"""Fixtures of the ingress tests: the FastAPI app over the application services, on the memory
store and on PostgreSQL.

``ingress``
    An :class:`Ingress`: a ``TestClient`` of the app, the store under it, the admission service,
    the app's claim signal and ``advance(ms)`` for the store's clock. Parametrised ``memory``
    and ``postgres`` (the module's database, emptied before each test).
``memory_ingress``
    The same on the memory store only (the long-poll tests, whose timing is the ingress's).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ql3.adapters.http import ClaimSignal, create_app
from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.application.admission import Admission
from ql3.application.worker_commands import WorkerCommands
from tests.application.support import CountingIdentities

LEASE_TTL_MS = 30_000


@dataclass
class Ingress:
    client: TestClient
    store: Any
    admission: Admission
    commands: WorkerCommands
    signal: ClaimSignal
    advance: Callable[[int], object]
    ended: list[int] = field(default_factory=list)

    def register(
        self, worker_id: str = "w1", tasks: tuple[str, ...] = ("t",), capacity: int = 4
    ) -> Session:
        response = self.client.post(
            "/v1/sessions",
            json={"worker_id": worker_id, "capacity": capacity, "tasks": list(tasks)},
        )
        assert response.status_code == 201, response.text
        body = response.json()
        return Session(self, body["session_id"], body["secret"])

    def queued(self, count: int, task: str = "t") -> list[str]:
        """Admit ``count`` Runs of ``task``: each waits, queued, for a claim."""
        return [self.admission.submit(task, {"i": i}) for i in range(count)]

    def wait_until_waiting(self, claims: int = 1, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.signal.waiting < claims:
            assert time.monotonic() < deadline, "no claim parked"
            time.sleep(0.002)


@dataclass
class Session:
    ingress: Ingress
    session_id: str
    secret: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    def post(
        self,
        command: str,
        body: object = None,
        *,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        return self.ingress.client.post(
            f"/v1/sessions/{self.session_id}/{command}",
            json=body,
            headers=self.auth if headers is None else headers,
            **kwargs,
        )

    def claim(self, limit: int = 4, **body: Any) -> dict[str, Any]:
        """A claim that must succeed; its answer."""
        response = self.post("claim", {"limit": limit, **body})
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def claim_in_thread(self, limit: int = 4, **body: Any) -> Pending:
        """A claim sent from another thread (it may park); ``result()`` waits for it."""
        pending = Pending()

        def send() -> None:
            try:
                pending.response = self.post("claim", {"limit": limit, **body})
            finally:
                pending.answered_at = time.monotonic()
                pending.done.set()

        pending.thread = threading.Thread(target=send, daemon=True)
        pending.thread.start()
        return pending


@dataclass
class Pending:
    done: threading.Event = field(default_factory=threading.Event)
    response: Any = None
    answered_at: float = 0.0
    thread: threading.Thread | None = None

    def result(self, timeout: float = 10.0) -> dict[str, Any]:
        assert self.done.wait(timeout), "the claim did not answer"
        assert self.response is not None
        assert self.response.status_code == 200, self.response.text
        answer: dict[str, Any] = self.response.json()
        return answer


def fence(grant: dict[str, Any]) -> dict[str, Any]:
    """The fence of a grant, as the fenced calls take it."""
    return {k: grant[k] for k in ("attempt_id", "generation", "version", "token")}


def services(store: Any, advance: Callable[[int], object], **app_options: Any) -> Ingress:
    identities = CountingIdentities()
    uow = store.unit_of_work
    commands = WorkerCommands(uow, identities, lease_ttl_ms=LEASE_TTL_MS)
    signal = ClaimSignal()
    ended: list[int] = []
    app = create_app(
        commands,
        signal=signal,
        max_body_bytes=64 * 1024,
        on_attempts_ended=lambda: ended.append(1),
        **app_options,
    )
    return Ingress(
        client=TestClient(app),
        store=store,
        admission=Admission(uow, identities),
        commands=commands,
        signal=signal,
        advance=advance,
        ended=ended,
    )


@pytest.fixture(scope="module")
def pg_http_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    url: str = request.getfixturevalue("pg_database_url")
    from ql3.adapters.postgres.store import PostgresStore

    store = PostgresStore.from_url(url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.postgres)])
def ingress(request: pytest.FixtureRequest) -> Iterator[Ingress]:
    if request.param == "memory":
        memory = MemoryStore(FakeClock())
        yield services(memory, memory.clock.advance)
        return
    store = request.getfixturevalue("pg_http_store")
    store.testing_reset()
    yield services(store, store.testing_advance_clock)


@pytest.fixture
def memory_ingress() -> Ingress:
    memory = MemoryStore(FakeClock())
    return services(memory, memory.clock.advance)
