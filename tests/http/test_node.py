"""The node's wiring of the long poll: without a LISTEN connection every scheduler cycle wakes
the parked claims; uvicorn's shutdown releases them at once; the heartbeat interval follows
the lease TTL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from ql3.adapters.http import ClaimSignal
from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.adapters.postgres.listen import DispatchListener
from ql3.application.admission import Admission
from ql3.application.identities import RandomIdentities
from ql3.application.scheduler import CycleSummary
from ql3.bootstrap import node as node_root

CADENCE_S = 0.1
LEASE_TTL_S = 3.0


@dataclass
class RunningNode:
    container: node_root.NodeContainer
    server: uvicorn.Server
    thread: threading.Thread
    url: str
    admission: Admission

    def post(self, path: str, body: object = None, secret: str | None = None,
             timeout: float = 30) -> Any:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        response = httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=timeout)
        return response

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "the node did not stop"


@pytest.fixture
def running_node() -> Iterator[RunningNode]:
    store = MemoryStore(FakeClock())
    container = node_root.build(store=store, lease_ttl_s=LEASE_TTL_S, cadence_s=CADENCE_S)
    sock = node_root.bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    app = node_root.create_node_app(container)
    config = uvicorn.Config(app, lifespan="on", log_level="warning")
    server = node_root.NodeServer(config, container.claim_signal())
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the node did not start"
        time.sleep(0.01)
    node = RunningNode(
        container=container,
        server=server,
        thread=thread,
        url=f"http://127.0.0.1:{port}",
        admission=Admission(store.unit_of_work, RandomIdentities()),
    )
    try:
        yield node
    finally:
        if thread.is_alive():
            node.stop()
        sock.close()


def _register(node: RunningNode) -> tuple[str, str, dict[str, Any]]:
    response = node.post("/v1/sessions", {"worker_id": "w1", "capacity": 2, "tasks": ["t"]})
    assert response.status_code == 201, response.text
    body = response.json()
    return body["session_id"], body["secret"], body


def _claim_in_thread(node: RunningNode, session_id: str, secret: str,
                     body: dict[str, Any]) -> tuple[threading.Thread, list[Any], list[float]]:
    answers: list[Any] = []
    answered_at: list[float] = []

    def send() -> None:
        answers.append(node.post(f"/v1/sessions/{session_id}/claim", body, secret))
        answered_at.append(time.monotonic())

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, answers, answered_at


def _until_waiting(signal: ClaimSignal) -> None:
    deadline = time.monotonic() + 5
    while signal.waiting < 1:
        assert time.monotonic() < deadline, "no claim parked"
        time.sleep(0.005)


def test_without_a_listener_every_cycle_wakes_the_parked_claims(
    running_node: RunningNode,
) -> None:
    node = running_node
    assert node.container.dispatch_listener() is None  # a memory store: no LISTEN connection
    session_id, secret, registered = _register(node)
    assert registered["heartbeat_interval_ms"] == 3_000  # one lease TTL
    signal = node.container.claim_signal()
    thread, answers, answered_at = _claim_in_thread(
        node, session_id, secret, {"limit": 1, "wait_ms": 10_000}
    )
    _until_waiting(signal)
    run_id = node.admission.submit("t", {"n": 1})  # nothing wakes the signal but the cadence
    admitted = time.monotonic()
    thread.join(timeout=5)
    (response,) = answers
    assert response.status_code == 200, response.text
    assert [g["run_id"] for g in response.json()["grants"]] == [run_id]
    assert answered_at[0] - admitted < CADENCE_S + 1.0


def test_shutdown_releases_parked_claims_at_once(running_node: RunningNode) -> None:
    node = running_node
    session_id, secret, _ = _register(node)
    signal = node.container.claim_signal()
    thread, answers, answered_at = _claim_in_thread(
        node, session_id, secret, {"limit": 1, "wait_ms": 30_000}
    )
    _until_waiting(signal)
    stopping = time.monotonic()
    node.stop()
    thread.join(timeout=5)
    (response,) = answers
    assert response.status_code == 200, response.text
    assert response.json()["grants"] == []
    assert answered_at[0] - stopping < 2.0
    assert signal.closed


class _Listener:
    def __init__(self, connected: bool) -> None:
        self.connected = connected


def test_a_cycle_wakes_parked_claims_only_while_the_listener_is_down() -> None:
    signal = ClaimSignal()
    summary = CycleSummary(steps=())
    node_root.end_of_cycle(signal, _Listener(connected=True))(summary)  # type: ignore[arg-type]
    assert signal.generation == 0  # NOTIFY wakes them: the cycle stays quiet
    node_root.end_of_cycle(signal, _Listener(connected=False))(summary)  # type: ignore[arg-type]
    node_root.end_of_cycle(signal, None)(summary)
    assert signal.generation == 2


def test_the_listener_is_opened_for_a_postgresql_database_only() -> None:
    signal = ClaimSignal()
    assert node_root.open_dispatch_listener(None, signal) is None
    assert node_root.open_dispatch_listener("sqlite:///x.db", signal) is None
    listener = node_root.open_dispatch_listener("postgresql+psycopg://u@h/db", signal)
    assert isinstance(listener, DispatchListener)
    assert not listener.connected  # not started: nothing connects yet
    assert node_root.heartbeat_interval_ms(30.0) == 30_000
    assert node_root.heartbeat_interval_ms(0.03) == 50  # the floor
