"""Calls of the ingress functions made by hand as the ingress role, as a compromised ingress
could make them: only a worker's transition under its fence gets through (a claim only of a
pristine queued Attempt, under an open gate, within the session's capacity, for the session that
presents its secret); everything else is answered ``conflict`` or ``refused`` and changes
nothing."""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from attrs import evolve
from psycopg import errors
from psycopg.types.json import Jsonb

from ql3.adapters.postgres.queries import ADVISORY_LOCK_NAMESPACE
from ql3.application.admission import Admission
from ql3.domain.fence import LeaseFence, hash_token
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.ingress.support import Env, Worker, expire_lease, register, set_gate
from tests.postgres_server import connect

Outcome = tuple[int, str, str | None]
Connection = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def role_connection(ingress_url: str) -> Iterator[Connection]:
    """A connection as the ingress role, in a transaction (the "now" of an item must be a time
    observed in the transaction that writes it)."""
    with connect(ingress_url) as connection:
        connection.autocommit = False
        yield connection
        connection.rollback()


def now_of(connection: Connection) -> str:
    found = connection.execute(
        "SELECT date_trunc('milliseconds', statement_timestamp())"
    ).fetchone()
    assert found is not None
    return str(found[0].isoformat())


def later(now: str, **delta: float) -> str:
    return (dt.datetime.fromisoformat(now) + dt.timedelta(**delta)).isoformat()


def call(connection: Connection, function: str, items: Any) -> list[Outcome]:
    found = connection.execute(
        f"SELECT item, outcome, detail FROM {function}(%s) ORDER BY item", [Jsonb(items)]
    ).fetchall()
    connection.commit()
    return [(int(item), str(outcome), detail) for item, outcome, detail in found]


def claim_lock(
    connection: Connection, worker: Worker, tasks: list[str], limit: int, secret: str | None = None
) -> dict[str, Any]:
    found = connection.execute(
        "SELECT ql3_ingress_claim_lock(%s, %s, %s, %s)",
        (worker.session_id, hash_token(secret or worker.secret), tasks, limit),
    ).fetchone()
    assert found is not None
    answer: dict[str, Any] = found[0]
    return answer


def _forge(item: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    forged = copy.deepcopy(item)
    *parents, last = path.split(".")
    target = forged
    for key in parents:
        target = target[key]
    target[last] = value
    return forged


def run_status(env: Env, run_id: str) -> str:
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
    assert run is not None
    return run.status.value


def attempt_of(env: Env, run_id: str) -> str:
    with env.admin.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(run_id)
    return attempt.id


@dataclass
class Started:
    """A Run whose Attempt a worker claimed (and so started) through the ingress."""

    env: Env
    worker: Worker
    run_id: str
    fence: LeaseFence

    @property
    def secret_hash(self) -> str:
        return hash_token(self.worker.secret)

    @property
    def token_hash(self) -> str:
        return hash_token(self.fence.token)

    def complete_item(self, now: str) -> dict[str, Any]:
        """A well-formed completion of the started Attempt, as the ingress store sends it."""
        return {
            "session_id": self.worker.session_id,
            "secret_hash": self.secret_hash,
            "run_id": self.run_id,
            "attempt_id": self.fence.attempt_id,
            "run": {
                "status": "running",
                "attempt_count": 1,
                "to": {"status": "succeeded", "output": {"forged": True}, "updated_at": now},
            },
            "attempt": {
                "status": "running",
                "lease_version": 1,
                "to": {
                    "status": "succeeded",
                    "lease_version": 2,
                    "finished_at": now,
                    "updated_at": now,
                },
            },
            "lease": {
                "generation": 1,
                "version": 1,
                "status": "leased",
                "token_hash": self.token_hash,
                "to": {
                    "status": "released",
                    "version": 2,
                    "release_reason": "completed",
                    "released_at": now,
                },
            },
            "event": {
                "type": "attempt_succeeded",
                "attempt_id": self.fence.attempt_id,
                "at": now,
                "data": {},
            },
        }

    def release_item(self, now: str) -> dict[str, Any]:
        """A well-formed hand-back of the started Attempt, as the ingress store sends it."""
        return {
            "session_id": self.worker.session_id,
            "secret_hash": self.secret_hash,
            "run_id": self.run_id,
            "attempt_id": self.fence.attempt_id,
            "run": {
                "status": "running",
                "attempt_count": 1,
                "to": {"status": "queued", "updated_at": now},
            },
            "attempt": {
                "status": "running",
                "lease_version": 1,
                "to": {
                    "status": "claimed",
                    "session_id": None,
                    "worker_id": None,
                    "lease_generation": None,
                    "lease_version": None,
                    "offered_at": None,
                    "accepted_at": None,
                    "started_at": None,
                    "updated_at": now,
                },
            },
            "lease": {
                "generation": 1,
                "version": 1,
                "status": "leased",
                "token_hash": self.token_hash,
                "to": {
                    "status": "released",
                    "version": 2,
                    "release_reason": "handed_back",
                    "released_at": now,
                },
            },
            "event": {
                "type": "attempt_released",
                "attempt_id": self.fence.attempt_id,
                "at": now,
                "data": {
                    "cause": "not_started",
                    "previous_status": "running",
                    "session_id": self.worker.session_id,
                    "lease_generation": 1,
                    "lease_version": 2,
                },
            },
        }

    def renew_item(self, expires_at: str, **changes: Any) -> dict[str, Any]:
        return {
            "session_id": self.worker.session_id,
            "secret_hash": self.secret_hash,
            "run_id": self.run_id,
            "attempt_id": self.fence.attempt_id,
            "generation": 1,
            "version": 1,
            "token_hash": self.token_hash,
            "expires_at": expires_at,
            **changes,
        }


def claim_item(
    worker: Worker, run_id: str, attempt_id: str, now: str, generation: int = 1
) -> dict[str, Any]:
    """A well-formed claim of a queued Run's pristine Attempt, as the ingress store sends it."""
    session_id = worker.session_id
    with worker.env.admin.unit_of_work() as uow:
        session = uow.sessions.get(session_id)
    assert session is not None
    worker_id = session.worker_id
    return {
        "session_id": session_id,
        "secret_hash": hash_token(worker.secret),
        "run_id": run_id,
        "attempt_id": attempt_id,
        "run": {
            "status": "queued",
            "attempt_count": 1,
            "to": {"status": "running", "updated_at": now},
        },
        "attempt": {
            "status": "claimed",
            "lease_version": None,
            "to": {
                "status": "running",
                "session_id": session_id,
                "worker_id": worker_id,
                "lease_generation": generation,
                "lease_version": 1,
                "offered_at": now,
                "accepted_at": now,
                "started_at": now,
                "updated_at": now,
            },
        },
        "new_lease": {
            "run_id": run_id,
            "generation": generation,
            "attempt_id": attempt_id,
            "version": 1,
            "status": "leased",
            "holder_session_id": session_id,
            "token_hash": hash_token("a token minted for this claim"),
            "expires_at": later(now, seconds=30),
            "granted_at": now,
            "release_reason": None,
            "released_at": None,
        },
        "event": {
            "type": "attempt_started",
            "attempt_id": attempt_id,
            "at": now,
            "data": {"session_id": session_id, "worker_id": worker_id, "generation": generation},
        },
    }


@pytest.fixture
def started(env: Env) -> Started:
    run_id = env.admission.submit("t", {"x": 1})
    worker = register(env)
    (fence,) = worker.take_all()
    return Started(env=env, worker=worker, run_id=run_id, fence=fence)


@dataclass
class Queued:
    env: Env
    worker: Worker
    run_id: str
    attempt_id: str


@pytest.fixture
def queued(started: Started) -> Queued:
    """A queued Run with its pristine Attempt, and the started worker (capacity 4, one held)."""
    run_id = started.env.admission.submit("t", {"y": 2})
    attempt_id = attempt_of(started.env, run_id)
    return Queued(env=started.env, worker=started.worker, run_id=run_id, attempt_id=attempt_id)


# --- completions, renewals, abandon reports -----------------------------------------------------


def test_a_well_formed_completion_under_the_live_fence_goes_through(
    started: Started, role_connection: Connection
) -> None:
    item = started.complete_item(now_of(role_connection))
    assert call(role_connection, "ql3_ingress_apply", [item]) == [(1, "ok", None)]
    assert run_status(started.env, started.run_id) == "succeeded"
    # The same call again: the lease is released now.
    item = started.complete_item(now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None


@pytest.mark.parametrize(
    ("path", "value", "outcome", "detail"),
    [
        ("lease.token_hash", hash_token("a guessed token of the worker"), "conflict", "presented"),
        ("secret_hash", hash_token("a guessed secret"), "conflict", "not authenticated"),
        ("session_id", "no-such-session", "conflict", "not authenticated"),
        ("lease.version", 2, "conflict", "presented"),
        ("attempt.status", "starting", "conflict", "changed since"),
        ("event.type", "run_cancelled", "refused", "not a worker transition"),
        ("event.type", "retry_scheduled", "refused", "not a worker transition"),
        # The offer protocol's transitions are no longer taken (ADR 0007).
        ("event.type", "attempt_accepted", "refused", "not a worker transition"),
        ("event.type", "attempt_activated", "refused", "not a worker transition"),
        ("event.type", "attempt_running", "refused", "not a worker transition"),
        ("event.type", "attempt_offered", "refused", "not a worker transition"),
        ("event.attempt_id", "another", "refused", "event belongs"),
        ("run.to.input", {"rewritten": True}, "refused", "may not change input"),
        ("attempt.to.worker_id", "someone-else", "refused", "may not change worker_id"),
        ("lease.to.holder_session_id", "x", "refused", "may not change holder_session_id"),
        ("lease.to.token_hash", hash_token("x"), "refused", "may not change token_hash"),
        ("lease.to.expires_at", "2999-01-01T00:00:00+00:00", "refused", "may not change expires"),
        ("run.to.status", "cancelled", "refused", "complete takes"),
        ("lease.to.version", 7, "refused", "version one step up"),
        ("lease.to.release_reason", "lease_expired", "refused", "released for completed"),
        ("run.to.updated_at", "2000-01-01T00:00:00+00:00", "refused", "observed in this"),
        ("event.at", "2999-01-01T00:00:00+00:00", "refused", "observed in this"),
        ("attempt.to.finished_at", "not a time", "refused", "invalid input syntax"),
        ("report", {"kind": "operator_attested"}, "refused", "carries a report"),
    ],
)
def test_forged_changes_are_refused_and_change_nothing(
    started: Started,
    role_connection: Connection,
    path: str,
    value: Any,
    outcome: str,
    detail: str,
) -> None:
    before = started.env.dump()
    item = _forge(started.complete_item(now_of(role_connection)), path, value)
    ((_, got, message),) = call(role_connection, "ql3_ingress_apply", [item])
    assert got == outcome
    assert message is not None and detail in message
    assert started.env.dump() == before


def test_an_expired_lease_cannot_be_completed_or_renewed(
    started: Started, role_connection: Connection
) -> None:
    expire_lease(started.env.admin, started.run_id)
    before = started.env.dump()
    now = now_of(role_connection)
    ((_, outcome, detail),) = call(
        role_connection, "ql3_ingress_apply", [started.complete_item(now)]
    )
    assert outcome == "conflict" and detail is not None and "expired" in detail
    now = now_of(role_connection)
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_renew", [started.renew_item(now)])
    assert outcome == "conflict" and detail is not None and "expired" in detail
    assert started.env.dump() == before


def test_only_the_workers_own_abandon_report_can_be_recorded(
    started: Started, role_connection: Connection
) -> None:
    expire_lease(started.env.admin, started.run_id)
    now = now_of(role_connection)
    item = started.complete_item(now)
    item["run"]["to"] = item["attempt"]["to"] = item["lease"]["to"] = {}
    item["event"] = {
        "type": "evidence_recorded",
        "attempt_id": started.fence.attempt_id,
        "at": now,
        "data": {"evidence": "operator_attested", "detail": "forged"},
    }
    item["report"] = {
        "attempt_id": started.fence.attempt_id,
        "kind": "operator_attested",
        "reported_at": now,
        "detail": "forged",
    }
    before = started.env.dump()
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "refused" and detail is not None and "own abandon report" in detail
    assert started.env.dump() == before
    now = now_of(role_connection)
    item["event"].update(at=now, data={"evidence": "worker_abandoned", "detail": "stopped"})
    item["report"].update(kind="worker_abandoned", reported_at=now, detail="stopped")
    assert call(role_connection, "ql3_ingress_apply", [item]) == [(1, "ok", None)]
    with started.env.admin.unit_of_work() as uow:
        reports = uow.evidence.reports_for(started.fence.attempt_id)
    assert [(r.kind.value, r.detail) for r in reports] == [("worker_abandoned", "stopped")]


def test_another_sessions_credentials_do_not_reach_the_attempt(
    started: Started, role_connection: Connection
) -> None:
    other = register(started.env, "w2")
    before = started.env.dump()
    for make in (started.complete_item, started.release_item):
        item = make(now_of(role_connection))
        item = _forge(
            _forge(item, "session_id", other.session_id), "secret_hash", hash_token(other.secret)
        )
        ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
        assert outcome == "conflict" and detail is not None and "another session" in detail
    assert started.env.dump() == before


def test_a_queued_run_cannot_be_marked_succeeded(
    queued: Queued, started: Started, role_connection: Connection
) -> None:
    before = started.env.dump()
    item = started.complete_item(now_of(role_connection))
    item.update(run_id=queued.run_id, attempt_id=queued.attempt_id)
    item["event"]["attempt_id"] = queued.attempt_id
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None and "holds no lease" in detail
    assert started.env.dump() == before


def test_renewals_move_forward_by_at_most_a_day_and_answer_per_item(
    started: Started, role_connection: Connection
) -> None:
    with started.env.admin.unit_of_work() as uow:
        (lease,) = uow.runs.leases_of(started.run_id)
    before = started.env.dump()
    far = "2999-01-01T00:00:00+00:00"
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_renew", [started.renew_item(far)])
    assert outcome == "refused" and detail is not None and "at most 1 day" in detail
    assert started.env.dump() == before
    # One call, two items: the forged one is refused on its own, the good one is written.
    row = role_connection.execute(
        "SELECT (statement_timestamp() + interval '1 minute')::text"
    ).fetchone()
    assert row is not None
    items = [
        started.renew_item(str(row[0]), token_hash=hash_token("forged")),
        started.renew_item(str(row[0])),
    ]
    outcomes = call(role_connection, "ql3_ingress_renew", items)
    assert [(i, o) for i, o, _ in outcomes] == [(1, "conflict"), (2, "ok")]
    with started.env.admin.unit_of_work() as uow:
        (renewed,) = uow.runs.leases_of(started.run_id)
        events = uow.runs.events_of(started.run_id)
    assert renewed.expires_at_ms > lease.expires_at_ms
    assert renewed.version == lease.version
    assert len(events) == len(before["run_events"])  # a renewal writes no event


def test_malformed_calls_fail_as_a_whole(started: Started, role_connection: Connection) -> None:
    malformed: tuple[Any, ...] = ({"not": "an array"}, [], [{}] * 257)
    for items in malformed:
        with pytest.raises(psycopg.Error) as raised:
            call(role_connection, "ql3_ingress_apply", items)
        assert raised.value.sqlstate == "Q3R01"
        role_connection.rollback()
    ((_, outcome, _),) = call(role_connection, "ql3_ingress_apply", [{"event": {}}])
    assert outcome == "refused"


def test_the_functions_wait_for_the_attempts_advisory_lock(
    started: Started, pg_database_url: str, role_connection: Connection
) -> None:
    with connect(pg_database_url) as admin:
        admin.autocommit = False
        admin.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
            (ADVISORY_LOCK_NAMESPACE, started.fence.attempt_id),
        )
        role_connection.execute("SET lock_timeout = '200ms'")
        now = now_of(role_connection)
        with pytest.raises(errors.LockNotAvailable):
            call(role_connection, "ql3_ingress_renew", [started.renew_item(now)])
        role_connection.rollback()
        admin.rollback()


def test_sessions_cannot_be_forged_through_their_functions(
    env: Env, role_connection: Connection
) -> None:
    worker = register(env, "w1")
    env.workers.close(worker.session_id, worker.secret)
    other = register(env, "w2")
    before = env.dump()
    now = now_of(role_connection)
    reopen = {
        "id": worker.session_id,
        "secret_hash": hash_token(worker.secret),
        "status": "closed",
        "to": {"status": "active"},
    }
    replace = {
        "id": other.session_id,
        "secret_hash": hash_token(other.secret),
        "status": "active",
        "to": {"status": "replaced", "closed_at": now},
    }
    change_capacity = {
        "id": other.session_id,
        "secret_hash": hash_token(other.secret),
        "status": "active",
        "to": {"last_heartbeat_at": now, "capacity": 1000},
    }
    outcomes = call(
        role_connection, "ql3_ingress_update_sessions", [reopen, replace, change_capacity]
    )
    assert [o for _, o, _ in outcomes] == ["refused", "refused", "refused"]
    # A registration that does not replace the worker id's open session.
    now = now_of(role_connection)
    session = {
        "id": "forged-session",
        "worker_id": "w2",
        "status": "active",
        "capacity": 4,
        "tasks": ["t"],
        "secret_hash": hash_token("s"),
        "registered_at": now,
        "last_heartbeat_at": now,
        "closed_at": None,
    }
    ((_, outcome, detail),) = call(
        role_connection, "ql3_ingress_register_sessions", [{"session": session, "replaced": []}]
    )
    assert outcome == "conflict" and detail is not None and "open sessions" in detail
    assert env.dump() == before


# --- claims -------------------------------------------------------------------------------------


def test_a_well_formed_claim_goes_through_once(queued: Queued, role_connection: Connection) -> None:
    item = claim_item(queued.worker, queued.run_id, queued.attempt_id, now_of(role_connection))
    assert call(role_connection, "ql3_ingress_apply", [item]) == [(1, "ok", None)]
    assert run_status(queued.env, queued.run_id) == "running"
    with queued.env.admin.unit_of_work() as uow:
        (lease,) = uow.runs.leases_of(queued.run_id)
        events = [e.event.type.value for e in uow.runs.events_of(queued.run_id)]
    assert (lease.holder_session_id, lease.generation, lease.token_hash) == (
        queued.worker.session_id,
        1,
        hash_token("a token minted for this claim"),
    )
    assert events == ["run_admitted", "attempt_started"]
    # Claimed already: the same claim again is no longer what was read.
    item = claim_item(queued.worker, queued.run_id, queued.attempt_id, now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None and "changed since" in detail


@pytest.mark.parametrize(
    ("path", "value", "outcome", "detail"),
    [
        ("secret_hash", hash_token("a guessed secret"), "conflict", "not authenticated"),
        ("run.status", "running", "conflict", "changed since"),
        ("attempt.lease_version", 1, "conflict", "changed since"),
        ("attempt.to.session_id", "another-session", "refused", "for the claiming session"),
        ("attempt.to.worker_id", "another-worker", "refused", "for the claiming session"),
        ("attempt.to.lease_generation", 5, "refused", "next lease generation"),
        ("attempt.to.lease_version", 2, "refused", "version 1"),
        ("attempt.to.status", "starting", "refused", "for the claiming session"),
        ("attempt.to.finished_at", None, "refused", "may not change finished_at"),
        ("attempt.to.started_at", "2000-01-01T00:00:00+00:00", "refused", "at once, now"),
        ("run.to.status", "succeeded", "refused", "for the claiming session"),
        ("run.to.output", {"forged": True}, "refused", "may not change output"),
        ("run.to.updated_at", "2999-01-01T00:00:00+00:00", "refused", "observed in this"),
        ("new_lease.holder_session_id", "another-session", "refused", "to the claiming session"),
        ("new_lease.generation", 2, "refused", "next generation"),
        ("new_lease.version", 3, "refused", "next generation"),
        ("new_lease.status", "released", "refused", "new leased lease"),
        ("new_lease.token_hash", None, "refused", "hash of a token"),
        ("new_lease.token_hash", "not-a-hash", "refused", "hash of a token"),
        ("new_lease.expires_at", "2999-01-01T00:00:00+00:00", "refused", "at most 1 day"),
        ("new_lease.expires_at", "2000-01-01T00:00:00+00:00", "refused", "moves forward"),
        ("new_lease.release_reason", "completed", "refused", "new leased lease"),
        ("event.data.generation", 9, "refused", "names its session, worker and generation"),
        ("event.data.forged", True, "refused", "may not change forged"),
        ("event.at", "2999-01-01T00:00:00+00:00", "refused", "observed in this"),
        ("report", {"kind": "worker_abandoned"}, "refused", "carries no report"),
    ],
)
def test_forged_claims_are_refused_and_change_nothing(
    queued: Queued,
    role_connection: Connection,
    path: str,
    value: Any,
    outcome: str,
    detail: str,
) -> None:
    before = queued.env.dump()
    item = claim_item(queued.worker, queued.run_id, queued.attempt_id, now_of(role_connection))
    if path == "new_lease.expires_at" and value.startswith("2000"):
        # An expiry before the claim's "now".
        value = later(item["run"]["to"]["updated_at"], seconds=-1)
    item = _forge(item, path, value)
    ((_, got, message),) = call(role_connection, "ql3_ingress_apply", [item])
    assert (got, message and detail in message) == (outcome, True), message
    assert queued.env.dump() == before


def test_a_claim_that_skips_the_gate_is_refused(
    queued: Queued, role_connection: Connection
) -> None:
    set_gate(queued.env.admin, open=False, reason="lost retry failed")
    before = queued.env.dump()
    item = claim_item(queued.worker, queued.run_id, queued.attempt_id, now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None and "dispatch gate is closed" in detail
    assert queued.env.dump() == before


def test_a_claim_beyond_the_sessions_capacity_is_refused(
    env: Env, role_connection: Connection
) -> None:
    env.admission.submit("t")
    worker = register(env, capacity=1)
    assert len(worker.take_all()) == 1  # its one slot is taken
    run_id = env.admission.submit("t")
    before = env.dump()
    item = claim_item(worker, run_id, attempt_of(env, run_id), now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "refused" and detail is not None and "its capacity is 1" in detail
    assert env.dump() == before


def test_a_started_attempt_cannot_be_claimed(started: Started, role_connection: Connection) -> None:
    """Not queued, not pristine: presented as read, the claim is refused; presented as the
    pristine Attempt it no longer is, it is a conflict."""
    before = started.env.dump()
    now = now_of(role_connection)
    item = claim_item(started.worker, started.run_id, started.fence.attempt_id, now, generation=2)
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None and "changed since" in detail
    item = _forge(_forge(item, "run.status", "running"), "attempt.status", "running")
    item["attempt"]["lease_version"] = 1
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "refused" and detail is not None and "pristine attempt of a queued" in detail
    assert started.env.dump() == before


def test_a_queued_attempt_that_is_not_pristine_cannot_be_claimed(
    queued: Queued, role_connection: Connection
) -> None:
    with queued.env.admin.engine.begin() as connection:
        connection.exec_driver_sql(
            "UPDATE run_attempts SET offered_at = statement_timestamp() WHERE id = %(id)s",
            {"id": queued.attempt_id},
        )
    before = queued.env.dump()
    item = claim_item(queued.worker, queued.run_id, queued.attempt_id, now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "refused" and detail is not None and "pristine" in detail
    assert queued.env.dump() == before


def test_a_claim_for_another_session_or_task_is_refused(
    queued: Queued, role_connection: Connection
) -> None:
    env = queued.env
    other = register(env, "w2")
    elsewhere = register(env, "w3", tasks=("elsewhere",))
    before = env.dump()
    # Another session's credentials, the first session's claim.
    item = claim_item(queued.worker, queued.run_id, queued.attempt_id, now_of(role_connection))
    item = _forge(
        _forge(item, "session_id", other.session_id), "secret_hash", hash_token(other.secret)
    )
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "refused" and detail is not None and "for the claiming session" in detail
    # A session's own claim, of a task it does not serve.
    item = claim_item(elsewhere, queued.run_id, queued.attempt_id, now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "refused" and detail is not None and "does not serve task t" in detail
    assert env.dump() == before
    # A session of task t, but draining.
    drained = register(env, "w4")
    env.workers.drain(drained.session_id, drained.secret)
    before = env.dump()
    item = claim_item(drained, queued.run_id, queued.attempt_id, now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None and "takes no new work" in detail
    assert env.dump() == before


def test_claims_are_counted_after_the_completions_of_the_same_call(
    env: Env, role_connection: Connection
) -> None:
    """Items go in Attempt order, claims last: a completion frees its slot before a claim of
    the same call counts the session's leases, whatever the ids."""

    class Ids:
        def __init__(self, ids: list[str]) -> None:
            self._ids = iter(ids)

        def new_id(self) -> str:
            return next(self._ids)

        def new_secret(self) -> str:
            raise AssertionError("admission mints no secret")

    Admission(env.admin.unit_of_work, Ids(["run-b", "attempt-b"])).submit("t")
    worker = register(env, capacity=1)
    (fence,) = worker.take_all()
    assert fence.attempt_id == "attempt-b"
    Admission(env.admin.unit_of_work, Ids(["run-a", "attempt-a"])).submit("t")
    started = Started(env=env, worker=worker, run_id="run-b", fence=fence)
    now = now_of(role_connection)
    claim = claim_item(worker, "run-a", "attempt-a", now)  # sorts before attempt-b
    outcomes = call(role_connection, "ql3_ingress_apply", [claim, started.complete_item(now)])
    assert outcomes == [(1, "ok", None), (2, "ok", None)]
    assert (run_status(env, "run-a"), run_status(env, "run-b")) == ("running", "succeeded")


# --- hand-backs ---------------------------------------------------------------------------------


def test_a_well_formed_hand_back_goes_through_once(
    started: Started, role_connection: Connection
) -> None:
    expire_lease(started.env.admin, started.run_id)  # handing back gives an expired lease up too
    item = started.release_item(now_of(role_connection))
    assert call(role_connection, "ql3_ingress_apply", [item]) == [(1, "ok", None)]
    assert run_status(started.env, started.run_id) == "queued"
    item = started.release_item(now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None


@pytest.mark.parametrize(
    ("path", "value", "outcome", "detail"),
    [
        ("lease.token_hash", hash_token("a guessed token"), "conflict", "presented"),
        ("secret_hash", hash_token("a guessed secret"), "conflict", "not authenticated"),
        ("run.to.status", "succeeded", "refused", "back to queued"),
        ("attempt.to.status", "lost", "refused", "back to claimed"),
        ("attempt.to.session_id", "kept", "refused", "pristine again"),
        ("attempt.to.lease_generation", 1, "refused", "pristine again"),
        ("attempt.to.started_at", "2000-01-01T00:00:00+00:00", "refused", "pristine again"),
        ("attempt.to.error", "forged", "refused", "may not change error"),
        ("lease.to.release_reason", "completed", "refused", "released for handed_back"),
        ("lease.to.version", 1, "refused", "version one step up"),
        ("lease.to.expires_at", "2999-01-01T00:00:00+00:00", "refused", "may not change expires"),
        ("event.data.session_id", "another", "refused", "names the session"),
        ("event.data.cause", "x" * 501, "refused", "at most 500"),
        ("event.data.evidence", "worker_abandoned", "refused", "may not change evidence"),
    ],
)
def test_forged_hand_backs_are_refused_and_change_nothing(
    started: Started,
    role_connection: Connection,
    path: str,
    value: Any,
    outcome: str,
    detail: str,
) -> None:
    before = started.env.dump()
    item = _forge(started.release_item(now_of(role_connection)), path, value)
    ((_, got, message),) = call(role_connection, "ql3_ingress_apply", [item])
    assert (got, message and detail in message) == (outcome, True), message
    assert started.env.dump() == before


def test_a_completed_attempt_cannot_be_handed_back(
    started: Started, role_connection: Connection
) -> None:
    assert started.worker.complete(started.fence).ok
    before = started.env.dump()
    item = started.release_item(now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None
    assert started.env.dump() == before


# --- the claim's locks --------------------------------------------------------------------------


def _row_locked(pg_database_url: str, table: str, key: str) -> bool:
    with connect(pg_database_url) as other:
        other.autocommit = False
        try:
            other.execute(f"SELECT 1 FROM {table} WHERE id = %s FOR UPDATE NOWAIT", (key,))
        except errors.LockNotAvailable:
            return True
        finally:
            other.rollback()
    return False


def test_the_claim_lock_locks_the_session_and_its_candidates(
    queued: Queued, role_connection: Connection, pg_database_url: str, ingress_url: str
) -> None:
    env = queued.env
    env.admission.submit("not-served")
    answer = claim_lock(role_connection, queued.worker, ["t", "not-served", "unknown"], 8)
    assert answer["session"]["id"] == queued.worker.session_id
    assert answer["in_flight"] == 1
    assert answer["gate"]["open"] is True
    assert [c["attempt"]["id"] for c in answer["candidates"]] == [queued.attempt_id]
    assert answer["in_flight_by_task"] == {"t": 1}
    assert _row_locked(pg_database_url, "worker_sessions", queued.worker.session_id)
    assert _row_locked(pg_database_url, "run_attempts", queued.attempt_id)
    assert _row_locked(pg_database_url, "runs", queued.run_id)
    # Another session's claim meanwhile skips what this one locked.
    other = register(env, "w2")
    with connect(ingress_url) as second:
        second.autocommit = False
        found = claim_lock(second, other, ["t"], 8)
        assert found["candidates"] == [] and found["session"]["id"] == other.session_id
        second.rollback()
    role_connection.rollback()
    assert not _row_locked(pg_database_url, "run_attempts", queued.attempt_id)


def test_the_claim_lock_locks_nothing_for_a_wrong_secret_or_a_closed_gate(
    queued: Queued, role_connection: Connection, pg_database_url: str
) -> None:
    answer = claim_lock(role_connection, queued.worker, ["t"], 8, secret="a guessed secret")
    assert (answer["session"], answer["in_flight"], answer["candidates"]) == (None, 0, [])
    assert not _row_locked(pg_database_url, "worker_sessions", queued.worker.session_id)
    assert not _row_locked(pg_database_url, "run_attempts", queued.attempt_id)
    role_connection.rollback()
    set_gate(queued.env.admin, open=False, reason="runtime recovery failed")
    answer = claim_lock(role_connection, queued.worker, ["t"], 8)
    assert answer["gate"] == {
        "open": False,
        "reason": "runtime recovery failed",
        "changed_at": answer["gate"]["changed_at"],
    }
    assert answer["candidates"] == [] and answer["session"] is not None
    assert not _row_locked(pg_database_url, "run_attempts", queued.attempt_id)
    role_connection.rollback()
    for limit in (0, 257):
        with pytest.raises(psycopg.Error) as raised:
            claim_lock(role_connection, queued.worker, ["t"], limit)
        assert raised.value.sqlstate == "Q3R01"
        role_connection.rollback()


# --- a failing completion that retries on error (ADR 0013) ----------------------------------------

RETRY_ON_ERROR = RetryPolicy(
    retry_on_error=True,
    max_attempts=3,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=1_000, cap_ms=10_000),
)


def started_with(env: Env, policy: RetryPolicy | None) -> Started:
    run_id = env.admission.submit("t", {"x": 1}, policy)
    worker = register(env)
    (fence,) = worker.take_all()
    return Started(env=env, worker=worker, run_id=run_id, fence=fence)


def failed_item(started: Started, now: str, *, retry: bool, due: str | None) -> dict[str, Any]:
    """A failing completion as the ingress store sends it: to ``retry_wait`` due at ``due``,
    or to ``failed``."""
    item = started.complete_item(now)
    item["attempt"]["to"]["status"] = "failed"
    item["attempt"]["to"]["error"] = "boom"
    data: dict[str, Any] = {"error": "boom", "cause": "error", "retry": retry}
    if retry:
        item["run"]["to"] = {"status": "retry_wait", "next_attempt_at": due, "updated_at": now}
        data.update({"next_attempt_at_ms": 0, "next_attempt": 2})
    else:
        item["run"]["to"] = {"status": "failed", "error": "boom", "updated_at": now}
        data["reason"] = "no_policy"
    item["event"]["type"] = "attempt_failed"
    item["event"]["data"] = data
    return item


def test_a_failure_the_stored_policy_retries_goes_to_retry_wait(
    env: Env, role_connection: Connection
) -> None:
    started = started_with(env, RETRY_ON_ERROR)
    now = now_of(role_connection)
    item = failed_item(started, now, retry=True, due=later(now, seconds=1))
    assert call(role_connection, "ql3_ingress_apply", [item]) == [(1, "ok", None)]
    assert run_status(env, started.run_id) == "retry_wait"
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(started.run_id)
    assert run is not None and run.next_attempt_at_ms is not None


@pytest.mark.parametrize(
    ("policy", "retry", "due", "changes", "detail"),
    [
        # the Run's stored policy does not retry on error
        (None, True, {"seconds": 1}, {}, "does not retry"),
        (
            RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT),
            True,
            {"seconds": 1},
            {},
            "does not retry",
        ),
        (evolve(RETRY_ON_ERROR, max_attempts=1), True, {"seconds": 1}, {}, "does not retry"),
        # the due time is past the backoff cap, or before now
        (RETRY_ON_ERROR, True, {"seconds": 11}, {}, "backoff cap"),
        (RETRY_ON_ERROR, True, {"seconds": -60}, {}, "backoff cap"),
        (RETRY_ON_ERROR, True, None, {}, "backoff cap"),
        # the event says otherwise, or a plain failure sets a due time
        (RETRY_ON_ERROR, True, {"seconds": 1}, {"event.data.retry": False}, "whether it is"),
        (None, False, None, {"event.data.retry": True}, "whether it is"),
        (None, False, None, {"event.data.extra": 1}, "may not change extra"),
        (
            None,
            False,
            None,
            {"run.to.next_attempt_at": "2999-01-01T00:00:00+00:00"},
            "only a retry",
        ),
        (RETRY_ON_ERROR, True, {"seconds": 1}, {"run.to.output": {"x": 1}}, "no output"),
        (RETRY_ON_ERROR, True, {"seconds": 1}, {"attempt.to.status": "succeeded"}, "complete"),
    ],
)
def test_forged_retries_are_refused_and_change_nothing(
    env: Env,
    role_connection: Connection,
    policy: RetryPolicy | None,
    retry: bool,
    due: dict[str, float] | None,
    changes: dict[str, Any],
    detail: str,
) -> None:
    started = started_with(env, policy)
    before = env.dump()
    now = now_of(role_connection)
    item = failed_item(
        started, now, retry=retry, due=later(now, **due) if due is not None else None
    )
    for path, value in changes.items():
        item = _forge(item, path, value)
    ((_, got, message),) = call(role_connection, "ql3_ingress_apply", [item])
    assert got == "refused"
    assert message is not None and detail in message
    assert env.dump() == before
