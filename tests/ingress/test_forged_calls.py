"""Calls of the ingress functions made by hand as the ingress role, as a compromised ingress
could make them: only a worker's transition under its live fence gets through; everything else
is answered ``conflict`` or ``refused`` and changes nothing."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import errors
from psycopg.types.json import Jsonb

from adapters.postgres.queries import ADVISORY_LOCK_NAMESPACE
from domain.fence import LeaseFence, hash_token
from tests.ingress.support import Env, Worker, expire_lease, register
from tests.postgres_server import connect

Outcome = tuple[int, str, str | None]


@pytest.fixture
def role_connection(ingress_url: str) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    """A connection as the ingress role, in a transaction (the "now" of an item must be a time
    observed in the transaction that writes it)."""
    with connect(ingress_url) as connection:
        connection.autocommit = False
        yield connection
        connection.rollback()


def now_of(connection: psycopg.Connection[tuple[Any, ...]]) -> str:
    found = connection.execute(
        "SELECT date_trunc('milliseconds', statement_timestamp())"
    ).fetchone()
    assert found is not None
    return str(found[0].isoformat())


def call(
    connection: psycopg.Connection[tuple[Any, ...]], function: str, items: Any
) -> list[Outcome]:
    found = connection.execute(
        f"SELECT item, outcome, detail FROM {function}(%s) ORDER BY item", [Jsonb(items)]
    ).fetchall()
    connection.commit()
    return [(int(item), str(outcome), detail) for item, outcome, detail in found]


@dataclass
class Started:
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


@pytest.fixture
def started(env: Env) -> Started:
    """A Run whose Attempt a worker accepted and started (``running``) through the ingress."""
    run_id = env.admission.submit("t", {"x": 1})
    worker = register(env)
    env.dispatch.run_once()
    (fence,) = worker.take_all()
    worker.start(fence)
    return Started(env=env, worker=worker, run_id=run_id, fence=fence)


def run_status(env: Env, run_id: str) -> str:
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
    assert run is not None
    return run.status.value


def test_a_well_formed_completion_under_the_live_fence_goes_through(
    started: Started, role_connection: psycopg.Connection[tuple[Any, ...]]
) -> None:
    item = started.complete_item(now_of(role_connection))
    assert call(role_connection, "ql3_ingress_apply", [item]) == [(1, "ok", None)]
    assert run_status(started.env, started.run_id) == "succeeded"
    # The same call again: the lease is released now.
    item = started.complete_item(now_of(role_connection))
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None


def _forge(item: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    forged = copy.deepcopy(item)
    *parents, last = path.split(".")
    target = forged
    for key in parents:
        target = target[key]
    target[last] = value
    return forged


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
        ("event.attempt_id", "another", "refused", "event belongs"),
        ("run.to.input", {"rewritten": True}, "refused", "may not change input"),
        ("attempt.to.worker_id", "someone-else", "refused", "may not change worker_id"),
        ("lease.to.holder_session_id", "x", "refused", "may not change holder_session_id"),
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
    role_connection: psycopg.Connection[tuple[Any, ...]],
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
    started: Started, role_connection: psycopg.Connection[tuple[Any, ...]]
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
    started: Started, role_connection: psycopg.Connection[tuple[Any, ...]]
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
    started: Started, role_connection: psycopg.Connection[tuple[Any, ...]]
) -> None:
    other = register(started.env, "w2")
    before = started.env.dump()
    item = started.complete_item(now_of(role_connection))
    item = _forge(
        _forge(item, "session_id", other.session_id), "secret_hash", hash_token(other.secret)
    )
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None and "another session" in detail
    assert started.env.dump() == before


def test_a_queued_run_cannot_be_marked_succeeded(
    started: Started, role_connection: psycopg.Connection[tuple[Any, ...]]
) -> None:
    queued_run = started.env.admission.submit("never-offered")
    with started.env.admin.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(queued_run)
    before = started.env.dump()
    item = started.complete_item(now_of(role_connection))
    item.update(run_id=queued_run, attempt_id=attempt.id)
    item["event"]["attempt_id"] = attempt.id
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "conflict" and detail is not None and "holds no lease" in detail
    assert started.env.dump() == before


def test_an_accepted_attempt_cannot_skip_the_start_barrier(
    env: Env, role_connection: psycopg.Connection[tuple[Any, ...]]
) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    env.dispatch.run_once()
    (fence,) = worker.take_all()  # accepted, not activated
    state = Started(env=env, worker=worker, run_id=run_id, fence=fence)
    item = state.complete_item(now_of(role_connection))
    item["run"]["status"] = "dispatching"
    item["attempt"]["status"] = "claimed"
    before = env.dump()
    ((_, outcome, detail),) = call(role_connection, "ql3_ingress_apply", [item])
    assert outcome == "refused" and detail is not None and "complete takes" in detail
    assert env.dump() == before


def test_renewals_move_forward_by_at_most_a_day_and_answer_per_item(
    started: Started, role_connection: psycopg.Connection[tuple[Any, ...]]
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
    later = str(row[0])
    items = [
        started.renew_item(later, token_hash=hash_token("forged")),
        started.renew_item(later),
    ]
    outcomes = call(role_connection, "ql3_ingress_renew", items)
    assert [(i, o) for i, o, _ in outcomes] == [(1, "conflict"), (2, "ok")]
    with started.env.admin.unit_of_work() as uow:
        (renewed,) = uow.runs.leases_of(started.run_id)
        events = uow.runs.events_of(started.run_id)
    assert renewed.expires_at_ms > lease.expires_at_ms
    assert renewed.version == lease.version
    assert len(events) == len(before["run_events"])  # a renewal writes no event


def test_malformed_calls_fail_as_a_whole(
    started: Started, role_connection: psycopg.Connection[tuple[Any, ...]]
) -> None:
    for items in ({"not": "an array"}, [], [{}] * 257):
        with pytest.raises(psycopg.Error) as raised:
            call(role_connection, "ql3_ingress_apply", items)
        assert raised.value.sqlstate == "Q3R01"
        role_connection.rollback()
    ((_, outcome, _),) = call(role_connection, "ql3_ingress_apply", [{"event": {}}])
    assert outcome == "refused"


def test_the_functions_wait_for_the_attempts_advisory_lock(
    started: Started, pg_database_url: str, role_connection: psycopg.Connection[tuple[Any, ...]]
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
    env: Env, role_connection: psycopg.Connection[tuple[Any, ...]]
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
