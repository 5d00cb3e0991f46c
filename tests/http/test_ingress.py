"""The worker ingress over HTTP, on the memory store and on PostgreSQL: the protocol end to end,
authentication, fences, and bad input that changes nothing and never gets a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from adapters.http import create_app
from adapters.memory import FakeClock, MemoryStore
from application.worker_commands import WorkerCommands
from domain.model import LeaseStatus, ReleaseReason, RunStatus, SessionStatus
from tests.application.support import CountingIdentities, run_view, store_view
from tests.http.conftest import LEASE_TTL_MS, TOKEN, Ingress, Session


def _view(ingress: Ingress, *sessions: Session) -> Any:
    return store_view(ingress.store, [s.session_id for s in sessions])


def _without_attempt(fence: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**{k: v for k, v in fence.items() if k != "attempt_id"}, **extra}


# --- the protocol -------------------------------------------------------------------------------


def test_register_heartbeat_start_renew_complete(ingress: Ingress) -> None:
    session = ingress.register()
    assert ingress.wakes == [1]  # a new session has capacity: the node may dispatch now
    assert session.offers() == []
    run_ids = ingress.offered(2)
    offers = session.offers()
    assert sorted(o["run_id"] for o in offers) == sorted(run_ids)
    assert {o["idempotency_key"] for o in offers} == set(run_ids)
    assert all(o["input"] in ({"i": 0}, {"i": 1}) for o in offers)
    fences = [
        {"attempt_id": o["attempt_id"], "generation": o["generation"], "version": o["version"],
         "token": f"{TOKEN}-{o['attempt_id']}"}
        for o in offers
    ]
    started = session.post("start", {"items": fences})
    assert started.status_code == 200, started.text
    body = started.json()
    assert [r["status"] for r in body["results"]] == [200, 200]
    assert [r["outcome"] for r in body["results"]] == ["running", "running"]
    assert all(r["expires_at_ms"] == body["now_ms"] + LEASE_TTL_MS for r in body["results"])

    ingress.advance(5_000)
    renewed = session.post("renew", {"items": fences}).json()
    assert [r["outcome"] for r in renewed["results"]] == ["renewed", "renewed"]

    done = session.post("complete", {"items": [
        {**fences[0], "succeeded": True, "output": {"answer": 42}},
        {**fences[1], "succeeded": False, "error": "task raised"},
    ]})
    assert [r["outcome"] for r in done.json()["results"]] == ["succeeded", "failed"]
    assert len(ingress.wakes) == 2
    by_attempt = {o["attempt_id"]: o["run_id"] for o in offers}
    ok = run_view(ingress.store, by_attempt[fences[0]["attempt_id"]])
    failed = run_view(ingress.store, by_attempt[fences[1]["attempt_id"]])
    assert ok.run.status is RunStatus.SUCCEEDED and ok.run.output == {"answer": 42}
    assert failed.run.status is RunStatus.FAILED and failed.run.error == "task raised"
    for view in (ok, failed):
        (lease,) = view.leases
        assert (lease.status, lease.version, lease.release_reason) == (
            LeaseStatus.RELEASED, 2, ReleaseReason.COMPLETED
        )

    assert session.post("drain").json() == {"status": "draining"}
    assert session.post("close").json() == {"status": "closed"}
    assert session.post("heartbeat").status_code == 409


def test_one_attempt_at_a_time(ingress: Ingress) -> None:
    session = ingress.register()
    (run_id,) = ingress.offered(1)
    (fence,) = session.fences()
    base = f"attempts/{fence['attempt_id']}"
    body = _without_attempt(fence)
    accepted = session.post(f"{base}/accept", body)
    assert accepted.status_code == 200 and accepted.json()["outcome"] == "accepted"
    activated = session.post(f"{base}/activate", body)
    assert activated.status_code == 200 and activated.json()["outcome"] == "running"
    assert session.post(f"{base}/renew", body).json()["outcome"] == "renewed"
    done = session.post(f"{base}/complete", {**body, "succeeded": True, "output": [1, 2]})
    assert done.status_code == 200 and done.json()["outcome"] == "succeeded"
    assert run_view(ingress.store, run_id).run.output == [1, 2]
    again = session.post(f"{base}/complete", {**body, "succeeded": True, "output": [1, 2]})
    assert again.json()["outcome"] == "already_completed"


def test_abandon_with_a_live_lease_and_after_close(ingress: Ingress) -> None:
    session = ingress.register()
    run_ids = ingress.offered(2)
    fences = session.fences()
    session.post("start", {"items": fences})
    lost = session.post("abandon", {"items": [{**fences[0], "detail": "shutting down"}]})
    assert lost.json()["results"][0]["outcome"] == "lost"
    ingress.advance(LEASE_TTL_MS)
    session.post("close")
    recorded = session.post(
        f"attempts/{fences[1]['attempt_id']}/abandon",
        _without_attempt(fences[1], detail="stopped"),
    )
    assert recorded.status_code == 200
    assert recorded.json()["outcome"] == "recorded"
    statuses = sorted(run_view(ingress.store, r).run.status.value for r in run_ids)
    assert statuses == ["lost", "running"]  # recovery settles the second one


# --- authentication -----------------------------------------------------------------------------


def test_missing_wrong_and_foreign_credentials(ingress: Ingress) -> None:
    session = ingress.register()
    other = ingress.register("w2")
    ingress.offered(1)
    (fence,) = session.fences()
    before = _view(ingress, session, other)
    items = {"items": [fence]}

    missing = session.post("start", items, headers={})
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = session.post("start", items, headers={"Authorization": "Bearer not-the-secret"})
    assert wrong.status_code == 401
    scheme = session.post("start", items, headers={"Authorization": f"Basic {session.secret}"})
    assert scheme.status_code == 401
    unknown = ingress.client.post("/v1/sessions/no-such-session/start", json=items,
                                  headers=session.auth)
    assert unknown.status_code == 404
    # another session's secret does not open this session ...
    crossed = session.post("start", items, headers=other.auth)
    assert crossed.status_code == 401
    # ... and another session cannot take this session's offer
    foreign = other.post("start", items)
    assert foreign.status_code == 200
    assert foreign.json()["results"][0]["status"] == 409
    assert _view(ingress, session, other) == before


def test_a_replaced_session_is_409_and_changes_nothing(ingress: Ingress) -> None:
    old = ingress.register("w1")
    ingress.offered(1)
    fences = old.fences()
    old.post("start", {"items": fences})
    new = ingress.register("w1")
    with ingress.store.unit_of_work() as uow:
        assert uow.sessions.get(old.session_id).status is SessionStatus.REPLACED
    before = _view(ingress, old, new)
    for command, body in (
        ("renew", {"items": fences}),
        ("complete", {"items": [{**fences[0], "succeeded": True}]}),
        ("heartbeat", None),
    ):
        response = old.post(command, body)
        assert response.status_code == 409, (command, response.text)
        assert response.json()["error"] == "session_rejected"
    assert _view(ingress, old, new) == before


def test_registration_token() -> None:
    store = MemoryStore(FakeClock())
    commands = WorkerCommands(store.unit_of_work, CountingIdentities(), lease_ttl_ms=1000)
    client = TestClient(create_app(commands, registration_token="let-me-in"))
    body = {"worker_id": "w", "capacity": 1, "tasks": ["t"]}
    assert client.post("/v1/sessions", json=body).status_code == 401
    wrong = client.post("/v1/sessions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    ok = client.post("/v1/sessions", json=body, headers={"Authorization": "Bearer let-me-in"})
    assert ok.status_code == 201
    with store.unit_of_work() as uow:
        assert len(uow.sessions.open_sessions_of("w")) == 1


# --- fences ---------------------------------------------------------------------------------------


def test_stale_fences_are_409_and_change_nothing(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.offered(2)
    fences = session.fences()
    session.post("start", {"items": fences})
    before = _view(ingress, session)
    stale = [
        {**fences[0], "version": 2},
        {**fences[0], "generation": 2},
        {**fences[0], "token": "z" * 40},
    ]
    for fence in stale:
        single = session.post(
            f"attempts/{fence['attempt_id']}/complete",
            _without_attempt(fence, succeeded=True),
        )
        assert single.status_code == 409, single.text
        assert single.json()["error"] == "fence_rejected"
    mixed = session.post("renew", {"items": [stale[0], fences[1]]}).json()["results"]
    assert [r["status"] for r in mixed] == [409, 200]
    assert mixed[0]["reason"] == "version_mismatch"
    after = _view(ingress, session)
    # Only the good renewal moved an expiry; nothing else changed.
    assert after.runs.keys() == before.runs.keys()
    for run_id, view in after.runs.items():
        assert view.run == before.runs[run_id].run
        assert view.events == before.runs[run_id].events
        assert [lease.version for lease in view.leases] == [1]


def test_after_recovery_the_old_fence_is_409(ingress: Ingress) -> None:
    session = ingress.register()
    (run_id,) = ingress.offered(1)
    (fence,) = session.fences()
    session.post("start", {"items": [fence]})
    ingress.advance(LEASE_TTL_MS)
    from application.recovery import RuntimeRecovery

    ingress.commands.attest_stopped(fence["attempt_id"], "host is gone")
    assert RuntimeRecovery(ingress.store.unit_of_work, ingress.store).run_once().recovered == 1
    (lease,) = run_view(ingress.store, run_id).leases
    assert (lease.status, lease.version, lease.release_reason) == (
        LeaseStatus.RELEASED, 2, ReleaseReason.LEASE_EXPIRED
    )
    before = _view(ingress, session)
    for command, extra in (("renew", {}), ("complete", {"succeeded": True})):
        response = session.post(f"attempts/{fence['attempt_id']}/{command}",
                                _without_attempt(fence, **extra))
        assert response.status_code == 409
    assert _view(ingress, session) == before


def test_a_closed_session_is_evidence_for_what_it_held(ingress: Ingress) -> None:
    from application.recovery import RuntimeRecovery

    session = ingress.register()
    (run_id,) = ingress.offered(1)
    session.post("start", {"items": session.fences()})
    recovery = RuntimeRecovery(ingress.store.unit_of_work, ingress.store)
    ingress.advance(LEASE_TTL_MS)
    assert recovery.run_once().awaiting_evidence == 1  # expired, still open: fail closed
    assert session.post("close").status_code == 200
    assert recovery.run_once().recovered == 1
    view = run_view(ingress.store, run_id)
    (attempt,) = view.attempts
    assert attempt.lost_evidence is not None
    assert attempt.lost_evidence.value == "session_closed"
    (lease,) = view.leases
    assert (lease.status, lease.version, lease.release_reason) == (
        LeaseStatus.RELEASED, 2, ReleaseReason.LEASE_EXPIRED
    )


# --- bad input ------------------------------------------------------------------------------------


BAD_BODIES = [
    pytest.param({"items": []}, id="empty-batch"),
    pytest.param({"items": [{"attempt_id": "a", "generation": 1, "version": 1}]}, id="no-token"),
    pytest.param({"items": [{"attempt_id": "a", "generation": "1", "version": 1,
                             "token": TOKEN}]}, id="string-number"),
    pytest.param({"items": [{"attempt_id": "a", "generation": 0, "version": 1,
                             "token": TOKEN}]}, id="generation-0"),
    pytest.param({"items": [{"attempt_id": "a", "generation": 1, "version": 1,
                             "token": "short"}]}, id="short-token"),
    pytest.param({"items": [{"attempt_id": "a", "generation": 1, "version": 1,
                             "token": TOKEN, "extra": 1}]}, id="unknown-field"),
    pytest.param({"items": [{"attempt_id": "", "generation": 1, "version": 1,
                             "token": TOKEN}]}, id="empty-id"),
    pytest.param({"items": [{"attempt_id": "a", "generation": 1, "version": 1,
                             "token": TOKEN}] * 257}, id="too-many"),
    pytest.param([1, 2], id="not-an-object"),
    pytest.param(None, id="no-body"),
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_schema_errors_are_422_and_change_nothing(ingress: Ingress, body: Any) -> None:
    session = ingress.register()
    ingress.offered(1)
    before = _view(ingress, session)
    response = session.post("renew", body)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_request"
    assert _view(ingress, session) == before


def test_validation_errors_never_echo_tokens(ingress: Ingress) -> None:
    session = ingress.register()
    secret_ish = "S3CRET-" + "q" * 300  # too long for a token
    response = session.post("renew", {"items": [
        {"attempt_id": "a", "generation": 1, "version": 1, "token": secret_ish}
    ]})
    assert response.status_code == 422
    assert "S3CRET" not in response.text


def test_duplicate_attempts_in_one_batch_are_422(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.offered(1)
    (fence,) = session.fences()
    before = _view(ingress, session)
    response = session.post("start", {"items": [fence, fence]})
    assert response.status_code == 422
    assert _view(ingress, session) == before


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        pytest.param(b"{not json", {"content-type": "application/json"}, id="broken-json"),
        pytest.param(b'{"items": []}', {"content-type": "text/plain"}, id="not-json-type"),
        pytest.param(b"\xff\xfe", {"content-type": "application/json"}, id="not-utf8"),
        pytest.param(b'{"items": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
                     {"content-type": "application/json"}, id="too-deep"),
    ],
)
def test_unparsable_bodies_are_422(ingress: Ingress, content: bytes,
                                   headers: dict[str, str]) -> None:
    session = ingress.register()
    response = session.post("renew", None, headers={**session.auth, **headers}, content=content)
    assert response.status_code == 422


def test_register_refuses_bad_sessions(ingress: Ingress) -> None:
    for body in (
        {"worker_id": "", "capacity": 1, "tasks": ["t"]},
        {"worker_id": "w", "capacity": 0, "tasks": ["t"]},
        {"worker_id": "w", "capacity": 1, "tasks": []},
        {"worker_id": "w", "capacity": 1, "tasks": [""]},
        {"worker_id": "w" * 201, "capacity": 1, "tasks": ["t"]},
    ):
        assert ingress.client.post("/v1/sessions", json=body).status_code == 422, body
    with ingress.store.unit_of_work() as uow:
        assert uow.sessions.open_sessions_of("w") == ()


def test_oversized_bodies_are_413(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.offered(1)
    (fence,) = session.fences()
    session.post("start", {"items": [fence]})
    before = _view(ingress, session)
    big = {"items": [{**fence, "succeeded": True, "output": "x" * (65 * 1024)}]}
    declared = session.post("complete", big)
    assert declared.status_code == 413
    assert declared.json()["error"] == "body_too_large"

    def chunks() -> Iterator[bytes]:
        for _ in range(100):
            yield b" " * 1024

    streamed = session.post("complete", None, content=chunks(),
                            headers={**session.auth, "content-type": "application/json"})
    assert streamed.status_code == 413
    assert _view(ingress, session) == before


def test_store_failures_are_503_not_500() -> None:
    store = MemoryStore(FakeClock())
    identities = CountingIdentities()
    commands = WorkerCommands(store.unit_of_work, identities, lease_ttl_ms=1000)
    client = TestClient(create_app(commands), raise_server_exceptions=False)
    grant = commands.register("w", 1, ["t"])
    store.close()  # every unit of work now fails
    response = client.post(f"/v1/sessions/{grant.session_id}/heartbeat",
                           headers={"Authorization": f"Bearer {grant.secret}"})
    assert response.status_code == 503
    assert response.json()["error"] == "unavailable"


def test_openapi_documents_every_call() -> None:
    store = MemoryStore(FakeClock())
    commands = WorkerCommands(store.unit_of_work, CountingIdentities(), lease_ttl_ms=1000)
    document = TestClient(create_app(commands)).get("/openapi.json").json()
    paths = set(document["paths"])
    for command in ("heartbeat", "drain", "close", "accept", "activate", "start", "renew",
                    "complete", "abandon"):
        assert f"/v1/sessions/{{session_id}}/{command}" in paths
    for command in ("accept", "activate", "start", "renew", "complete", "abandon"):
        assert f"/v1/sessions/{{session_id}}/attempts/{{attempt_id}}/{command}" in paths
    assert "/v1/sessions" in paths
    assert "HTTPBearer" in document["components"]["securitySchemes"]
    renew = document["paths"]["/v1/sessions/{session_id}/renew"]["post"]
    assert {"401", "404", "409", "413", "422", "503"} <= set(renew["responses"])
