"""Registration at the ingress with worker credentials (ADR 0008): 401 for no, unknown,
revoked or expired credentials, 403 for a credential that does not admit the worker id or the
tasks; a refusal changes nothing and its log line holds no secret."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ql3.adapters.cli.secure import is_loopback
from ql3.adapters.http import create_app
from ql3.adapters.http.auth import RegistrationAuth
from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.application.credentials import CredentialCommands
from ql3.application.worker_commands import WorkerCommands
from tests.application.support import CountingIdentities


class Node:
    def __init__(self, *, required: bool, token: str | None = None) -> None:
        self.store = MemoryStore(FakeClock())
        identities = CountingIdentities()
        self.credentials = CredentialCommands(self.store.unit_of_work, identities)
        commands = WorkerCommands(self.store.unit_of_work, identities, lease_ttl_ms=30_000)
        auth = RegistrationAuth(credentials=self.credentials, token=token, required=required)
        self.client = TestClient(create_app(commands, registration=auth))

    def register(self, bearer: str | None, worker_id: str = "host-a-1",
                 tasks: tuple[str, ...] = ("t",)) -> Any:
        headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
        body = {"worker_id": worker_id, "capacity": 1, "tasks": list(tasks)}
        return self.client.post("/v1/sessions", json=body, headers=headers)

    def open_sessions(self, *worker_ids: str) -> int:
        with self.store.unit_of_work() as uow:
            return sum(len(uow.sessions.open_sessions_of(w)) for w in worker_ids)


def test_a_required_credential_admits_and_refuses(caplog: pytest.LogCaptureFixture) -> None:
    node = Node(required=True)
    issued = node.credentials.issue("host-a-*", tasks=["t"])
    caplog.set_level(logging.INFO, logger="ql3.ingress")
    for bearer in (None, "wrong", "ql3w_" + "z" * 43):
        answer = node.register(bearer)
        assert answer.status_code == 401, answer.text
        assert answer.headers["WWW-Authenticate"] == "Bearer"
    assert node.register(issued.secret, "host-b-1").status_code == 403
    scope = node.register(issued.secret, tasks=("t", "other"))
    assert (scope.status_code, scope.json()["reason"]) == (403, "task_not_allowed")
    assert node.open_sessions("host-a-1", "host-b-1") == 0
    ok = node.register(issued.secret)
    assert ok.status_code == 201
    assert node.open_sessions("host-a-1") == 1
    node.credentials.revoke(issued.credential.id)
    revoked = node.register(issued.secret)
    assert (revoked.status_code, revoked.json()["reason"]) == (401, "revoked")
    assert node.open_sessions("host-a-1") == 0  # the session went with its credential
    session = ok.json()
    heartbeat = node.client.post(
        f"/v1/sessions/{session['session_id']}/heartbeat",
        headers={"Authorization": f"Bearer {session['secret']}"},
    )
    assert heartbeat.status_code == 409
    assert "refused" in caplog.text
    assert issued.secret not in caplog.text and session["secret"] not in caplog.text


def test_an_expired_credential_is_401_and_changes_nothing() -> None:
    node = Node(required=True)
    issued = node.credentials.issue("*", expires_in_ms=1_000)
    node.store.clock.advance(1_000)
    before = node.credentials.audit(issued.credential.id)
    answer = node.register(issued.secret)
    assert (answer.status_code, answer.json()["reason"]) == (401, "expired")
    assert node.open_sessions("host-a-1") == 0
    assert node.credentials.audit(issued.credential.id) == before


def test_without_requirement_anonymous_registers_but_a_bad_bearer_does_not() -> None:
    node = Node(required=False)
    assert node.register(None).status_code == 201
    assert node.register("wrong", "host-a-2").status_code == 401
    issued = node.credentials.issue("host-a-*", tasks=["t"])
    assert node.register(issued.secret, "host-b-1").status_code == 403
    assert node.open_sessions("host-a-1", "host-a-2", "host-b-1") == 1


def test_the_shared_token_still_admits_beside_credentials() -> None:
    node = Node(required=True, token="shared-" + "t" * 30)
    assert node.register("shared-" + "t" * 30).status_code == 201
    assert node.register(None, "host-a-2").status_code == 401


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
     ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
     ("node.example.com", False)],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
