"""The worker ingress over HTTP, on the memory store and on PostgreSQL: the claim protocol end to
end, authentication, fences, and bad input that changes nothing and never gets a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ql3.adapters.http import create_app
from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.application.ports import DispatchGate
from ql3.application.worker_commands import WorkerCommands
from ql3.domain.model import LeaseStatus, ReleaseReason, RunStatus, SessionStatus
from tests.application.support import CountingIdentities, event_types, run_view, store_view
from tests.http.conftest import LEASE_TTL_MS, Ingress, Session, fence

TOKEN = "k" * 32


def _view(ingress: Ingress, *sessions: Session) -> Any:
    return store_view(ingress.store, [s.session_id for s in sessions])


def _grants(session: Session, count: int, limit: int = 4) -> list[dict[str, Any]]:
    answer = session.claim(limit)
    assert len(answer["grants"]) == count, answer
    grants: list[dict[str, Any]] = answer["grants"]
    return grants


# --- the protocol -------------------------------------------------------------------------------


def test_claim_renew_complete(ingress: Ingress) -> None:
    session = ingress.register()
    empty = session.claim(2)
    assert (empty["grants"], empty["no_grant"], empty["status"]) == ([], "nothing_queued", "active")
    run_ids = ingress.queued(2)
    answer = session.claim(2)
    grants = answer["grants"]
    assert sorted(g["run_id"] for g in grants) == sorted(run_ids)
    assert {g["idempotency_key"] for g in grants} == set(run_ids)
    assert sorted(g["input"]["i"] for g in grants) == [0, 1]
    assert all(g["task"] == "t" and g["attempt_number"] == 1 for g in grants)
    assert all((g["generation"], g["version"]) == (1, 1) for g in grants)
    # The lease starts at the claim's lock (the store's clock), within the call's transaction.
    assert all(abs(g["expires_at_ms"] - answer["now_ms"] - LEASE_TTL_MS) < 1_000 for g in grants)
    assert answer["no_grant"] is None and answer["completed"] == answer["released"] == []
    for grant in grants:
        assert run_view(ingress.store, grant["run_id"]).run.status is RunStatus.RUNNING
        assert "attempt_started" in event_types(ingress.store, grant["run_id"])
    fences = [fence(g) for g in grants]

    ingress.advance(5_000)
    renewed = session.post("renew", {"items": fences}).json()
    assert [r["outcome"] for r in renewed["results"]] == ["renewed", "renewed"]
    assert all(r["expires_at_ms"] == renewed["now_ms"] + LEASE_TTL_MS for r in renewed["results"])

    done = session.post(
        "complete",
        {
            "items": [
                {**fences[0], "succeeded": True, "output": {"answer": 42}},
                {**fences[1], "succeeded": False, "error": "task raised"},
            ]
        },
    )
    assert [r["outcome"] for r in done.json()["results"]] == ["succeeded", "failed"]
    assert ingress.ended == []  # completions do not wake the cadence
    ok = run_view(ingress.store, grants[0]["run_id"])
    failed = run_view(ingress.store, grants[1]["run_id"])
    assert ok.run.status is RunStatus.SUCCEEDED and ok.run.output == {"answer": 42}
    assert failed.run.status is RunStatus.FAILED and failed.run.error == "task raised"
    for view in (ok, failed):
        (lease,) = view.leases
        assert (lease.status, lease.version, lease.release_reason) == (
            LeaseStatus.RELEASED,
            2,
            ReleaseReason.COMPLETED,
        )
    again = session.post("complete", {"items": [{**fences[0], "succeeded": True}]})
    assert again.json()["results"][0]["outcome"] == "already_completed"

    assert session.post("drain").json() == {"status": "draining"}
    drained = session.claim(1)
    assert (drained["status"], drained["no_grant"]) == ("draining", "session_not_active")
    assert session.post("close").json() == {"status": "closed"}
    assert session.post("heartbeat").status_code == 409


def test_heartbeat_answers_status_and_clock_only(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.queued(1)
    response = session.post("heartbeat")
    assert response.status_code == 200
    assert set(response.json()) == {"status", "now_ms"}
    assert response.json()["status"] == "active"


def test_a_completion_and_the_next_claim_travel_in_one_call(ingress: Ingress) -> None:
    session = ingress.register(capacity=1)
    first, second = ingress.queued(2)
    (grant,) = _grants(session, 1, limit=1)
    assert session.claim(1)["no_grant"] == "no_capacity"
    answer = session.claim(1, completions=[{**fence(grant), "succeeded": True, "output": [1]}])
    assert [(r["attempt_id"], r["outcome"], r["status"]) for r in answer["completed"]] == [
        (grant["attempt_id"], "succeeded", 200)
    ]
    (next_grant,) = answer["grants"]  # the slot the completion freed, refilled at once
    assert {grant["run_id"], next_grant["run_id"]} == {first, second}
    assert run_view(ingress.store, grant["run_id"]).run.output == [1]
    assert ingress.ended == []  # completions do not wake the cadence


def test_a_refused_completion_in_a_claim_is_an_item_result(ingress: Ingress) -> None:
    session = ingress.register(capacity=1)
    ingress.queued(1)
    (grant,) = _grants(session, 1, limit=1)
    stale = {**fence(grant), "version": 2, "succeeded": True}
    answer = session.claim(1, completions=[stale])
    ((result,),) = (answer["completed"],)
    assert (result["status"], result["error"], result["reason"]) == (
        409,
        "fence_rejected",
        "version_mismatch",
    )
    assert answer["no_grant"] == "no_capacity"
    assert ingress.ended == []


def test_the_held_statement_hands_back_what_the_worker_does_not_hold(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.queued(2)
    kept, lost_answer = _grants(session, 2)
    answer = session.claim(0, held=[kept["attempt_id"]])
    assert answer["released"] == [lost_answer["attempt_id"]]
    assert answer["grants"] == [] and answer["no_grant"] is None
    view = run_view(ingress.store, lost_answer["run_id"])
    assert view.run.status is RunStatus.QUEUED
    assert (view.leases[-1].status, view.leases[-1].release_reason) == (
        LeaseStatus.RELEASED,
        ReleaseReason.HANDED_BACK,
    )
    assert "attempt_released" in event_types(ingress.store, lost_answer["run_id"])
    assert run_view(ingress.store, kept["run_id"]).run.status is RunStatus.RUNNING
    # Claimed again, under the next lease generation: the old fence is refused.
    (again,) = _grants(session, 1)
    assert (again["attempt_id"], again["generation"]) == (lost_answer["attempt_id"], 2)
    old = session.post("renew", {"items": [fence(lost_answer)]}).json()["results"][0]
    assert (old["status"], old["error"]) == (409, "fence_rejected")
    # A statement naming everything hands nothing back.
    assert session.claim(0, held=[kept["attempt_id"], again["attempt_id"]])["released"] == []


def test_release_hands_back_an_unstarted_attempt(ingress: Ingress) -> None:
    session = ingress.register()
    (run_id,) = ingress.queued(1)
    (grant,) = _grants(session, 1)
    released = session.post("release", {"items": [{**fence(grant), "cause": "draining"}]})
    assert released.status_code == 200, released.text
    (result,) = released.json()["results"]
    assert (result["status"], result["outcome"]) == (200, "released")
    view = run_view(ingress.store, run_id)
    assert view.run.status is RunStatus.QUEUED
    (lease,) = view.leases
    assert (lease.status, lease.release_reason) == (LeaseStatus.RELEASED, ReleaseReason.HANDED_BACK)
    twice = session.post("release", {"items": [fence(grant)]}).json()["results"][0]
    assert (twice["status"], twice["error"]) == (409, "fence_rejected")
    (again,) = _grants(session, 1)
    assert again["run_id"] == run_id and again["generation"] == 2


def test_abandon_with_a_live_lease_and_after_close(ingress: Ingress) -> None:
    session = ingress.register()
    run_ids = ingress.queued(2)
    fences = [fence(g) for g in _grants(session, 2)]
    lost = session.post("abandon", {"items": [{**fences[0], "detail": "shutting down"}]})
    assert lost.json()["results"][0]["outcome"] == "lost"
    assert ingress.ended == [1]
    ingress.advance(LEASE_TTL_MS)
    session.post("close")
    recorded = session.post("abandon", {"items": [{**fences[1], "detail": "stopped"}]})
    assert recorded.status_code == 200
    assert recorded.json()["results"][0]["outcome"] == "recorded"
    statuses = sorted(run_view(ingress.store, r).run.status.value for r in run_ids)
    assert statuses == ["lost", "running"]  # recovery settles the second one


def test_a_closed_gate_grants_nothing_and_says_why(ingress: Ingress) -> None:
    session = ingress.register()
    (run_id,) = ingress.queued(1)
    reason = "runtime_recovery failed: OperationalError"
    with ingress.store.unit_of_work() as uow:
        uow.gate.set(DispatchGate(open=False, reason=reason, changed_at_ms=uow.now_ms()))
        uow.commit()
    answer = session.claim(1)
    assert answer["grants"] == []
    assert (answer["no_grant"], answer["detail"]) == ("dispatch_gate_closed", reason)
    waited = session.claim(1, wait_ms=50)  # a closed gate may wait too: it still answers
    assert (waited["no_grant"], waited["detail"]) == ("dispatch_gate_closed", reason)
    assert run_view(ingress.store, run_id).run.status is RunStatus.QUEUED
    with ingress.store.unit_of_work() as uow:
        uow.gate.set(DispatchGate(open=True, changed_at_ms=uow.now_ms()))
        uow.commit()
    assert len(session.claim(1)["grants"]) == 1


# --- authentication -----------------------------------------------------------------------------


def test_missing_wrong_and_foreign_credentials(ingress: Ingress) -> None:
    session = ingress.register()
    other = ingress.register("w2")
    ingress.queued(1)
    (grant,) = _grants(session, 1)
    before = _view(ingress, session, other)
    items = {"items": [fence(grant)]}

    missing = session.post("renew", items, headers={})
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert session.post("claim", {"limit": 1}, headers={}).status_code == 401
    wrong = session.post("renew", items, headers={"Authorization": "Bearer not-the-secret"})
    assert wrong.status_code == 401
    scheme = session.post("renew", items, headers={"Authorization": f"Basic {session.secret}"})
    assert scheme.status_code == 401
    unknown = ingress.client.post(
        "/v1/sessions/no-such-session/claim", json={"limit": 1}, headers=session.auth
    )
    assert unknown.status_code == 404
    assert unknown.json()["error"] == "unknown_session"
    # another session's secret does not open this session ...
    crossed = session.post("renew", items, headers=other.auth)
    assert crossed.status_code == 401
    # ... and another session cannot use this session's lease
    foreign = other.post("renew", items)
    assert foreign.status_code == 200
    assert foreign.json()["results"][0]["status"] == 409
    assert _view(ingress, session, other) == before


def test_a_replaced_session_is_409_and_changes_nothing(ingress: Ingress) -> None:
    old = ingress.register("w1")
    ingress.queued(1)
    fences = [fence(g) for g in _grants(old, 1)]
    new = ingress.register("w1")
    with ingress.store.unit_of_work() as uow:
        assert uow.sessions.get(old.session_id).status is SessionStatus.REPLACED
    before = _view(ingress, old, new)
    for command, body in (
        ("renew", {"items": fences}),
        ("complete", {"items": [{**fences[0], "succeeded": True}]}),
        ("release", {"items": fences}),
        ("claim", {"limit": 1}),
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
    assert ok.json()["heartbeat_interval_ms"] == 1_000  # one lease TTL
    with store.unit_of_work() as uow:
        assert len(uow.sessions.open_sessions_of("w")) == 1


# --- fences ---------------------------------------------------------------------------------------


def test_stale_fences_are_409_and_change_nothing(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.queued(2)
    fences = [fence(g) for g in _grants(session, 2)]
    before = _view(ingress, session)
    stale = [
        {**fences[0], "version": 2},
        {**fences[0], "generation": 2},
        {**fences[0], "token": "z" * 40},
    ]
    for item in stale:
        done = session.post("complete", {"items": [{**item, "succeeded": True}]})
        assert done.status_code == 200, done.text
        (result,) = done.json()["results"]
        assert (result["status"], result["error"]) == (409, "fence_rejected")
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


def test_a_closed_session_is_evidence_for_what_it_held(ingress: Ingress) -> None:
    from ql3.application.recovery import RuntimeRecovery

    session = ingress.register()
    (run_id,) = ingress.queued(1)
    _grants(session, 1)
    recovery = RuntimeRecovery(ingress.store.unit_of_work, ingress.store)
    ingress.advance(LEASE_TTL_MS)
    assert recovery.run_once().awaiting_evidence == 1  # expired, still open: fail closed
    assert session.post("close").status_code == 200
    assert recovery.run_once().recovered == 1
    view = run_view(ingress.store, run_id)
    (attempt,) = view.attempts
    assert attempt.lost_evidence is not None
    assert attempt.lost_evidence.value == "session_closed"


# --- removed routes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "accept",
        "activate",
        "start",
        "attempts/a-1/accept",
        "attempts/a-1/activate",
        "attempts/a-1/start",
        "attempts/a-1/renew",
        "attempts/a-1/complete",
        "attempts/a-1/abandon",
    ],
)
def test_the_offer_protocol_routes_are_gone(ingress: Ingress, path: str) -> None:
    session = ingress.register()
    body = {"items": [{"attempt_id": "a-1", "generation": 1, "version": 1, "token": TOKEN}]}
    response = session.post(path, body)
    assert response.status_code in (404, 405), response.text


# --- bad input ------------------------------------------------------------------------------------


BAD_BODIES = [
    pytest.param({"items": []}, id="empty-batch"),
    pytest.param({"items": [{"attempt_id": "a", "generation": 1, "version": 1}]}, id="no-token"),
    pytest.param(
        {"items": [{"attempt_id": "a", "generation": "1", "version": 1, "token": TOKEN}]},
        id="string-number",
    ),
    pytest.param(
        {"items": [{"attempt_id": "a", "generation": 0, "version": 1, "token": TOKEN}]},
        id="generation-0",
    ),
    pytest.param(
        {"items": [{"attempt_id": "a", "generation": 1, "version": 1, "token": "short"}]},
        id="short-token",
    ),
    pytest.param(
        {"items": [{"attempt_id": "a", "generation": 1, "version": 1, "token": TOKEN, "x": 1}]},
        id="unknown-field",
    ),
    pytest.param(
        {"items": [{"attempt_id": "", "generation": 1, "version": 1, "token": TOKEN}]},
        id="empty-id",
    ),
    pytest.param(
        {"items": [{"attempt_id": "a", "generation": 1, "version": 1, "token": TOKEN}] * 257},
        id="too-many",
    ),
    pytest.param([1, 2], id="not-an-object"),
    pytest.param(None, id="no-body"),
]


@pytest.mark.parametrize("body", BAD_BODIES)
def test_schema_errors_are_422_and_change_nothing(ingress: Ingress, body: Any) -> None:
    session = ingress.register()
    ingress.queued(1)
    before = _view(ingress, session)
    response = session.post("renew", body)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "invalid_request"
    assert _view(ingress, session) == before


BAD_CLAIMS = [
    pytest.param({}, id="no-limit"),
    pytest.param({"limit": -1}, id="negative-limit"),
    pytest.param({"limit": 257}, id="limit-too-large"),
    pytest.param({"limit": 1, "wait_ms": 30_001}, id="wait-too-long"),
    pytest.param({"limit": 1, "wait_ms": -1}, id="negative-wait"),
    pytest.param({"limit": 1, "held": [""]}, id="empty-held-id"),
    pytest.param({"limit": 1, "held": ["a"] * 1025}, id="too-many-held"),
    pytest.param({"limit": 1, "completions": [{"attempt_id": "a"}]}, id="bad-completion"),
    pytest.param({"limit": 1, "extra": True}, id="unknown-field"),
]


@pytest.mark.parametrize("body", BAD_CLAIMS)
def test_bad_claims_are_422_and_change_nothing(ingress: Ingress, body: Any) -> None:
    session = ingress.register()
    ingress.queued(1)
    before = _view(ingress, session)
    response = session.post("claim", body)
    assert response.status_code == 422, response.text
    assert _view(ingress, session) == before


def test_an_invalid_admission_of_a_command_is_422(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.queued(1)
    (grant,) = _grants(session, 1)
    before = _view(ingress, session)
    twice = [{**fence(grant), "succeeded": True}] * 2  # one attempt twice: the command refuses
    claimed = session.post("claim", {"limit": 1, "completions": twice})
    assert claimed.status_code == 422, claimed.text
    assert claimed.json()["error"] == "invalid_request"
    renewed = session.post("renew", {"items": [fence(grant), fence(grant)]})
    assert renewed.status_code == 422
    assert _view(ingress, session) == before


def _nul(text: str) -> str:
    return text[:1] + "\x00" + text[1:]


def test_a_nul_in_the_worker_id_or_a_task_name_is_422(ingress: Ingress) -> None:
    for body in (
        {"worker_id": _nul("w1"), "capacity": 1, "tasks": ["t"]},
        {"worker_id": "w1", "capacity": 1, "tasks": ["t", _nul("task")]},
    ):
        response = ingress.client.post("/v1/sessions", json=body)
        assert response.status_code == 422, response.text
        assert "NUL" in response.json()["message"]
    with ingress.store.unit_of_work() as uow:
        assert uow.sessions.open_sessions_of("w1") == ()


def test_a_nul_in_the_session_id_is_422(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.queued(1)
    before = _view(ingress, session)
    for command, body in (
        ("claim", {"limit": 1}),
        ("heartbeat", None),
        ("drain", None),
        ("renew", {"items": [{"attempt_id": "a", "generation": 1, "version": 1, "token": TOKEN}]}),
    ):
        response = ingress.client.post(
            f"/v1/sessions/{session.session_id}%00/{command}", json=body, headers=session.auth
        )
        assert response.status_code == 422, (command, response.text)
        assert response.json()["detail"][0]["loc"] == ["path", "session_id"]
    assert _view(ingress, session) == before


def test_a_nul_in_an_attempt_id_is_422(ingress: Ingress) -> None:
    session = ingress.register()
    ingress.queued(1)
    (grant,) = _grants(session, 1)
    bad = {**fence(grant), "attempt_id": _nul(grant["attempt_id"])}
    before = _view(ingress, session)
    for command, body in (
        ("renew", {"items": [bad]}),
        ("complete", {"items": [{**bad, "succeeded": True}]}),
        ("release", {"items": [bad]}),
        ("abandon", {"items": [bad]}),
        ("claim", {"limit": 1, "completions": [{**bad, "succeeded": True}]}),
        ("claim", {"limit": 1, "held": [_nul(grant["attempt_id"])]}),
    ):
        response = session.post(command, body)
        assert response.status_code == 422, (command, response.text)
        assert "NUL" in response.json()["message"]
    assert _view(ingress, session) == before


@pytest.mark.parametrize(
    ("command", "item"),
    [
        pytest.param("renew", {"token": _nul(TOKEN)}, id="token"),
        pytest.param("release", {"cause": _nul("draining")}, id="cause"),
        pytest.param("abandon", {"detail": _nul("stopped")}, id="detail"),
        pytest.param("complete", {"succeeded": False, "error": _nul("boom")}, id="error"),
        pytest.param("complete", {"succeeded": True, "output": ["a", {"b": _nul("c")}]},
                     id="output-string"),
        pytest.param("complete", {"succeeded": True, "output": {_nul("key"): 1}},
                     id="output-key"),
    ],
)
def test_a_nul_in_any_other_string_is_422(ingress: Ingress, command: str, item: Any) -> None:
    session = ingress.register()
    ingress.queued(1)
    (grant,) = _grants(session, 1)
    before = _view(ingress, session)
    response = session.post(command, {"items": [{**fence(grant), **item}]})
    assert response.status_code == 422, response.text
    if command == "complete":
        claimed = session.post("claim", {"limit": 1, "completions": [{**fence(grant), **item}]})
        assert claimed.status_code == 422, claimed.text
    assert _view(ingress, session) == before


def test_a_lone_surrogate_is_422(ingress: Ingress) -> None:
    raw = b'{"worker_id": "w\\ud800", "capacity": 1, "tasks": ["t"]}'
    response = ingress.client.post(
        "/v1/sessions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422, response.text


def test_validation_errors_never_echo_tokens(ingress: Ingress) -> None:
    session = ingress.register()
    secret_ish = "S3CRET-" + "q" * 300  # too long for a token
    response = session.post(
        "renew",
        {"items": [{"attempt_id": "a", "generation": 1, "version": 1, "token": secret_ish}]},
    )
    assert response.status_code == 422
    assert "S3CRET" not in response.text


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        pytest.param(b"{not json", {"content-type": "application/json"}, id="broken-json"),
        pytest.param(b'{"items": []}', {"content-type": "text/plain"}, id="not-json-type"),
        pytest.param(b"\xff\xfe", {"content-type": "application/json"}, id="not-utf8"),
        pytest.param(
            b'{"items": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
            {"content-type": "application/json"},
            id="too-deep",
        ),
    ],
)
def test_unparsable_bodies_are_422(
    ingress: Ingress, content: bytes, headers: dict[str, str]
) -> None:
    session = ingress.register()
    for command in ("renew", "claim"):
        response = session.post(
            command, None, headers={**session.auth, **headers}, content=content
        )
        assert response.status_code == 422, (command, response.text)


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
    ingress.queued(1)
    (grant,) = _grants(session, 1)
    before = _view(ingress, session)
    big = {"items": [{**fence(grant), "succeeded": True, "output": "x" * (65 * 1024)}]}
    declared = session.post("complete", big)
    assert declared.status_code == 413
    assert declared.json()["error"] == "body_too_large"

    def chunks() -> Iterator[bytes]:
        for _ in range(100):
            yield b" " * 1024

    streamed = session.post(
        "complete",
        None,
        content=chunks(),
        headers={**session.auth, "content-type": "application/json"},
    )
    assert streamed.status_code == 413
    assert _view(ingress, session) == before


def test_store_failures_are_503_not_500() -> None:
    store = MemoryStore(FakeClock())
    identities = CountingIdentities()
    commands = WorkerCommands(store.unit_of_work, identities, lease_ttl_ms=1000)
    client = TestClient(create_app(commands), raise_server_exceptions=False)
    grant = commands.register("w", 1, ["t"])
    store.close()  # every unit of work now fails
    auth = {"Authorization": f"Bearer {grant.secret}"}
    for command, body in (("heartbeat", None), ("claim", {"limit": 1, "wait_ms": 1000})):
        path = f"/v1/sessions/{grant.session_id}/{command}"
        response = client.post(path, headers=auth, json=body)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "unavailable"


def test_openapi_documents_every_call() -> None:
    store = MemoryStore(FakeClock())
    commands = WorkerCommands(store.unit_of_work, CountingIdentities(), lease_ttl_ms=1000)
    document = TestClient(create_app(commands)).get("/openapi.json").json()
    paths = set(document["paths"])
    session_calls = {
        f"/v1/sessions/{{session_id}}/{command}"
        for command in (
            "heartbeat", "drain", "close", "claim", "renew", "complete", "release", "abandon"
        )
    }
    assert paths == {"/v1/health", "/v1/sessions", *session_calls}
    assert "HTTPBearer" in document["components"]["securitySchemes"]
    schemas = document["components"]["schemas"]
    for path in session_calls:
        operation = document["paths"][path]["post"]
        assert {"401", "404", "409", "413", "422", "503"} <= set(operation["responses"]), path
        invalid = operation["responses"]["422"]["content"]["application/json"]["schema"]
        assert invalid["$ref"].endswith("/InvalidRequestBody"), path
    claim = document["paths"]["/v1/sessions/{session_id}/claim"]["post"]
    ok = claim["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok["$ref"].endswith("/ClaimResponse")
    request = claim["requestBody"]["content"]["application/json"]["schema"]
    assert request["$ref"].endswith("/ClaimRequest")
    assert set(schemas["ClaimRequest"]["properties"]) == {"limit", "wait_ms", "held", "completions"}
    assert set(schemas["ClaimResponse"]["properties"]) == {
        "now_ms", "status", "completed", "released", "grants", "no_grant", "detail"
    }
    assert set(schemas["GrantBody"]["properties"]) == {
        "run_id", "attempt_id", "attempt_number", "task", "input", "generation", "version",
        "token", "expires_at_ms", "idempotency_key", "timeout_ms",
    }
    assert "timed_out" in schemas["CompleteItem"]["properties"]
    assert set(schemas["HeartbeatResponse"]["properties"]) == {"status", "now_ms"}
    assert "cause" in schemas["ReleaseItem"]["properties"]
