"""Fixtures of the ingress tests: the FastAPI app over the application services, on the memory
store and on PostgreSQL.

``ingress``
    An :class:`Ingress`: a ``TestClient`` of the app, the store under it, the admission and
    dispatch services and ``advance(ms)`` for the store's clock. Parametrised ``memory`` and
    ``postgres`` (the module's database, emptied before each test).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from adapters.http import create_app
from adapters.memory import FakeClock, MemoryStore
from application.admission import Admission
from application.dispatch import TaskAttemptAdmission
from application.worker_commands import WorkerCommands
from tests.application.support import CountingIdentities

LEASE_TTL_MS = 30_000
TOKEN = "k" * 32


@dataclass
class Ingress:
    client: TestClient
    store: Any
    admission: Admission
    dispatch: TaskAttemptAdmission
    commands: WorkerCommands
    advance: Callable[[int], object]
    wakes: list[int] = field(default_factory=list)

    def register(self, worker_id: str = "w1", tasks: tuple[str, ...] = ("t",),
                 capacity: int = 4) -> Session:
        response = self.client.post(
            "/v1/sessions", json={"worker_id": worker_id, "capacity": capacity,
                                  "tasks": list(tasks)}
        )
        assert response.status_code == 201, response.text
        body = response.json()
        return Session(self, body["session_id"], body["secret"])

    def offered(self, count: int, task: str = "t") -> list[str]:
        run_ids = [self.admission.submit(task, {"i": i}) for i in range(count)]
        while self.dispatch.run_once().offered:
            pass
        return run_ids


@dataclass
class Session:
    ingress: Ingress
    session_id: str
    secret: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}

    def post(self, command: str, body: object = None, *, headers: dict[str, str] | None = None,
             **kwargs: Any) -> Any:
        return self.ingress.client.post(
            f"/v1/sessions/{self.session_id}/{command}",
            json=body,
            headers=self.auth if headers is None else headers,
            **kwargs,
        )

    def offers(self) -> list[dict[str, Any]]:
        response = self.post("heartbeat")
        assert response.status_code == 200, response.text
        offers: list[dict[str, Any]] = response.json()["offers"]
        return offers

    def fences(self, token: str = TOKEN) -> list[dict[str, Any]]:
        return [
            {"attempt_id": o["attempt_id"], "generation": o["generation"],
             "version": o["version"], "token": f"{token}-{o['attempt_id']}"}
            for o in self.offers()
        ]


def _services(store: Any, advance: Callable[[int], object]) -> Ingress:
    identities = CountingIdentities()
    uow = store.unit_of_work
    commands = WorkerCommands(uow, identities, lease_ttl_ms=LEASE_TTL_MS)
    wakes: list[int] = []
    app = create_app(commands, max_body_bytes=64 * 1024,
                     on_capacity_freed=lambda: wakes.append(1))
    return Ingress(
        client=TestClient(app),
        store=store,
        admission=Admission(uow, identities),
        dispatch=TaskAttemptAdmission(uow, store, lease_ttl_ms=LEASE_TTL_MS,
                                      max_silence_ms=60_000),
        commands=commands,
        advance=advance,
        wakes=wakes,
    )


@pytest.fixture(scope="module")
def pg_http_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    url: str = request.getfixturevalue("pg_database_url")
    from adapters.postgres.store import PostgresStore

    store = PostgresStore.from_url(url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.postgres)])
def ingress(request: pytest.FixtureRequest) -> Iterator[Ingress]:
    if request.param == "memory":
        memory = MemoryStore(FakeClock())
        yield _services(memory, memory.clock.advance)
        return
    store = request.getfixturevalue("pg_http_store")
    store.testing_reset()
    yield _services(store, store.testing_advance_clock)
