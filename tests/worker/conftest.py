"""Fixtures of the worker SDK tests: a real node (uvicorn, scheduler lifecycle, ingress) in this
process on the memory store with a wall clock, and workers run in threads.

``node``
    A :class:`LocalNode` on a fresh store; ``restart()`` stops its HTTP server and scheduler
    and starts new ones on the same port and store.
``ledger``
    The path of the tasks' side-effect ledger (``$QL3_E2E_LEDGER``), read with ``entries()``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.adapters.worker.settings import WorkerSettings
from ql3.application.admission import Admission
from ql3.application.identities import RandomIdentities
from ql3.bootstrap import node as node_root
from tests.worker.fakes import WorkerThread

__all__ = ["WorkerThread"]

LEASE_TTL_S = 1.5
CADENCE_S = 0.2


class WallClock(FakeClock):
    """The memory store's clock following real time (plus what a test adds)."""

    def __init__(self) -> None:
        super().__init__(0)

    def now_ms(self) -> int:
        return int(time.time() * 1000) + super().now_ms()


class NodeStore(MemoryStore):
    """A memory store that outlives the node processes built on it."""

    def close(self) -> None:
        pass


@dataclass
class LocalNode:
    store: NodeStore
    port: int = 0
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.store.unit_of_work, RandomIdentities())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        container = node_root.build(store=self.store, lease_ttl_s=LEASE_TTL_S, cadence_s=CADENCE_S)
        sock = node_root.bind_socket("127.0.0.1", self.port)
        self.port = sock.getsockname()[1]
        app = node_root.create_node_app(container)
        server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
        # Run in a thread, uvicorn leaves the test process's signal handlers alone.
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "the node did not start"
            time.sleep(0.01)
        self._server, self._thread = server, thread
        self._sock = sock

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
            self._sock.close()
        self._server = self._thread = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def run(self, run_id: str) -> Any:
        with self.store.unit_of_work() as uow:
            return uow.runs.get_run(run_id)

    def attempts(self, run_id: str) -> Any:
        with self.store.unit_of_work() as uow:
            return list(uow.runs.attempts_of(run_id))

    def leases(self, run_id: str) -> Any:
        with self.store.unit_of_work() as uow:
            return list(uow.runs.leases_of(run_id))

    def events(self, run_id: str) -> list[str]:
        with self.store.unit_of_work() as uow:
            return [e.event.type.value for e in uow.runs.events_of(run_id)]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)


@pytest.fixture
def node() -> Iterator[LocalNode]:
    local = LocalNode(store=NodeStore(WallClock()))
    local.start()
    try:
        yield local
    finally:
        local.stop()


class Ledger:
    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self, event: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [r for r in rows if event is None or r["event"] == event]


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv("QL3_E2E_LEDGER", str(path))
    monkeypatch.setenv("QL3_E2E_PREFIX", "e2e")
    return Ledger(path)


def worker_settings(
    node: LocalNode, worker_id: str = "w1", concurrency: int = 1, **extra: Any
) -> WorkerSettings:
    return WorkerSettings(
        ingress_url=node.url,
        app_spec="tests.e2e.tasks:app",
        worker_id=worker_id,
        tasks=("e2e.big", "e2e.double", "e2e.fail", "e2e.sleep"),
        concurrency=concurrency,
        **extra,
    )
