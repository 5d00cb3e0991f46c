"""The worker commands through the ingress role, on the claim protocol (ADR 0007): the same
behaviour as over the runtime's own store, every write through the fenced functions, in few
round trips; stale fences are rejected and change nothing; input PostgreSQL cannot store is an
admission error, not a store error."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from attrs import evolve
from sqlalchemy import event

from ql3.adapters.postgres.ingress import IngressNotPermitted
from ql3.adapters.postgres.queries import ADVISORY_LOCK_NAMESPACE
from ql3.application.worker_commands import (
    Abandonment,
    BatchAnswer,
    BatchOutcome,
    ClaimAnswer,
    Completion,
    NoGrant,
    Rejection,
    SessionUnauthorized,
    UnknownSession,
)
from ql3.domain.errors import ConcurrencyConflict, FenceReason, InvalidAdmission, SessionRejected
from ql3.domain.fence import LeaseFence, hash_token
from ql3.domain.model import (
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunStatus,
    SessionStatus,
)
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from ql3.domain.transitions import claim, complete
from tests.ingress.support import (
    LEASE_TTL_MS,
    Env,
    Worker,
    expire_lease,
    register,
    set_gate,
)
from tests.postgres_server import connect


def run_state(env: Env, run_id: str) -> tuple[RunStatus, list[AttemptStatus], list[str]]:
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        assert run is not None
        attempts = [a.status for a in uow.runs.attempts_of(run_id)]
        events = [e.event.type.value for e in uow.runs.events_of(run_id)]
    return run.status, attempts, events


def held_by(env: Env, session_id: str) -> tuple[str, ...]:
    with env.admin.unit_of_work() as uow:
        return tuple(uow.sessions.held_by(session_id))


class Statements:
    """The statements and commits the ingress store sends, as the driver sees them."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.commits = 0

    def functions(self) -> list[str]:
        """Each statement named by the ingress function it calls, or ``select``."""
        named = []
        for statement in self.sent:
            called = [word for word in statement.split() if word.startswith("ql3_ingress_")]
            named.append(called[0].split("(")[0] if called else statement.split()[0].lower())
        return named


@pytest.fixture
def statements(env: Env) -> Iterator[Statements]:
    seen = Statements()
    engine = env.ingress.engine

    def on_execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.sent.append(statement)

    def on_commit(conn: Any) -> None:
        seen.commits += 1

    event.listen(engine, "before_cursor_execute", on_execute)
    event.listen(engine, "commit", on_commit)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)
        event.remove(engine, "commit", on_commit)


# --- the claim ------------------------------------------------------------------------------------


def test_the_worker_protocol_end_to_end(env: Env) -> None:
    run_id = env.admission.submit("t", {"n": 2})
    worker = register(env)
    answer = worker.claim(limit=4)
    assert answer.status is SessionStatus.ACTIVE and answer.no_grant is None
    (grant,) = answer.grants
    assert (grant.run_id, grant.task, grant.input, grant.generation, grant.version) == (
        run_id,
        "t",
        {"n": 2},
        1,
        1,
    )
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        (attempt,) = uow.runs.attempts_of(run_id)
        (lease,) = uow.runs.leases_of(run_id)
    assert run is not None and run.status is RunStatus.RUNNING
    assert (attempt.status, attempt.session_id, attempt.worker_id) == (
        AttemptStatus.RUNNING,
        worker.session_id,
        "w1",
    )
    assert attempt.offered_at_ms == attempt.accepted_at_ms == attempt.started_at_ms
    assert attempt.started_at_ms is not None and attempt.started_at_ms >= answer.now_ms
    assert grant.expires_at_ms == attempt.started_at_ms + LEASE_TTL_MS
    assert (lease.status, lease.holder_session_id, lease.token_hash, lease.expires_at_ms) == (
        LeaseStatus.LEASED,
        worker.session_id,
        hash_token(grant.token),
        grant.expires_at_ms,
    )
    assert held_by(env, worker.session_id) == (grant.attempt_id,)
    renewed = worker.renew(grant.fence)
    assert renewed.outcome is BatchOutcome.RENEWED
    assert renewed.expires_at_ms is not None and renewed.expires_at_ms >= lease.expires_at_ms
    assert worker.complete(grant.fence, output={"r": [1, None]}).outcome is BatchOutcome.SUCCEEDED
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        (lease,) = uow.runs.leases_of(run_id)
    assert run is not None and run.status is RunStatus.SUCCEEDED
    assert run.output == {"r": [1, None]}
    assert (lease.status, lease.version, lease.release_reason) == (
        LeaseStatus.RELEASED,
        2,
        ReleaseReason.COMPLETED,
    )
    assert run_state(env, run_id)[2] == ["run_admitted", "attempt_started", "attempt_succeeded"]


def test_a_claim_is_bounded_by_the_session_capacity_and_fair_across_tasks(env: Env) -> None:
    for i in range(4):
        env.admission.submit("a", {"i": i})
    env.admission.submit("b")
    worker = register(env, tasks=("a", "b", "c"), capacity=3)
    first = worker.claim(limit=2)
    assert sorted(g.task for g in first.grants) == ["a", "b"]  # one of each before a second a
    second = worker.claim(limit=16)
    assert [g.task for g in second.grants] == ["a"]  # the one slot left
    assert [g.input for g in second.grants] == [{"i": 1}]  # oldest first within the task
    before = env.dump()
    full = worker.claim(limit=16)
    assert (full.grants, full.no_grant) == ((), NoGrant.NO_CAPACITY)
    assert env.dump() == before
    assert len(held_by(env, worker.session_id)) == 3


def test_a_closed_gate_grants_nothing_and_says_why(env: Env) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    set_gate(env.admin, open=False, reason="runtime recovery failed: boom")
    assert env.ingress.dispatch_gate().open is False
    before = env.dump()
    answer = worker.claim(limit=4)
    assert answer.grants == ()
    assert (answer.no_grant, answer.detail) == (
        NoGrant.GATE_CLOSED,
        "runtime recovery failed: boom",
    )
    assert env.dump() == before
    set_gate(env.admin, open=True)
    gate = env.ingress.dispatch_gate()
    assert gate.open and gate.reason is None and gate.changed_at_ms is not None
    assert [g.run_id for g in worker.claim(limit=4).grants] == [run_id]


def test_nothing_queued_and_a_draining_session(env: Env) -> None:
    worker = register(env)
    assert worker.claim(limit=4).no_grant is NoGrant.NOTHING_QUEUED
    env.admission.submit("other-task")
    assert worker.claim(limit=4).no_grant is NoGrant.NOTHING_QUEUED
    env.admission.submit("t")
    env.workers.drain(worker.session_id, worker.secret)
    answer = worker.claim(limit=4)
    assert (answer.grants, answer.no_grant) == ((), NoGrant.SESSION_NOT_ACTIVE)
    assert answer.status is SessionStatus.DRAINING


def test_two_sessions_never_claim_the_same_attempt(env: Env) -> None:
    """The candidates one claim has locked are skipped by a concurrent one."""
    run_ids = {env.admission.submit("t", {"i": i}) for i in range(6)}
    workers = [register(env, f"w{i}", capacity=4) for i in range(3)]
    barrier = threading.Barrier(len(workers))
    granted: dict[str, list[str]] = {}

    def claim(worker: Worker) -> None:
        barrier.wait()
        granted[worker.session_id] = [g.run_id for g in worker.claim(limit=4).grants]

    threads = [threading.Thread(target=claim, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = [run_id for runs in granted.values() for run_id in runs]
    assert len(claimed) == len(set(claimed))  # no Attempt granted twice
    assert set(claimed) <= run_ids
    # Whatever a skipped claim missed is still queued and granted by the next one.
    for worker in workers:
        claimed.extend(g.run_id for g in worker.claim(limit=4).grants)
    assert sorted(claimed) == sorted(run_ids)


def test_a_claim_skips_what_other_transactions_hold_however_many(
    env: Env, pg_database_url: str
) -> None:
    """Candidates are read a page at a time: a claim gets past more held rows than one page."""
    submitted = [env.admission.submit("t", {"i": i}) for i in range(40)]
    with env.admin.unit_of_work() as uow:
        queued = [(run.updated_at_ms, run.id) for run in map(uow.runs.get_run, submitted) if run]
        run_ids = [run_id for _, run_id in sorted(queued)]  # the queue's order
        attempt_ids = [uow.runs.attempts_of(run_id)[0].id for run_id in run_ids]
    worker = register(env, capacity=8)
    holder = connect(pg_database_url)
    holder.autocommit = False
    try:
        # The 20 oldest row-locked (as another claim holds them), the next 10 advisory-locked
        # (as the runtime holds an Attempt it decides on).
        holder.execute("SELECT 1 FROM runs WHERE id = ANY(%s) FOR UPDATE", (run_ids[:20],))
        for attempt_id in attempt_ids[20:30]:
            holder.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                (ADVISORY_LOCK_NAMESPACE, attempt_id),
            )
        answer = worker.claim(limit=4)
        assert [g.run_id for g in answer.grants] == run_ids[30:34]
    finally:
        holder.rollback()
        holder.close()
    assert [g.run_id for g in worker.claim(limit=4).grants] == run_ids[:4]


def test_a_completion_and_the_next_claim_travel_in_one_call(
    env: Env, statements: Statements
) -> None:
    first_run = env.admission.submit("t", {"n": 1})
    second_run = env.admission.submit("t", {"n": 2})
    worker = register(env, capacity=1)
    (grant,) = worker.claim(limit=1).grants
    assert grant.run_id == first_run
    statements.sent.clear()
    statements.commits = 0
    done = Completion(fence=grant.fence, succeeded=True, output="ok")
    answer = worker.claim(limit=1, completions=[done], held=[])
    # The slot the completion freed is refilled in the same transaction.
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    assert [g.run_id for g in answer.grants] == [second_run]
    assert answer.released == ()
    assert run_state(env, first_run)[0] is RunStatus.SUCCEEDED
    assert run_state(env, second_run)[0] is RunStatus.RUNNING
    # Four statements and a commit: the session (with what it holds and the clock), the
    # completion's lock, the claim's locks, every write of the call.
    assert statements.functions() == [
        "select",
        "ql3_ingress_lock_attempts",
        "ql3_ingress_claim_lock",
        "ql3_ingress_apply",
    ]
    assert statements.commits == 1


def test_a_claim_without_completions_takes_three_statements(
    env: Env, statements: Statements
) -> None:
    for _ in range(3):
        env.admission.submit("t")
    worker = register(env)
    statements.sent.clear()
    assert len(worker.claim(limit=3).grants) == 3
    assert statements.functions() == ["select", "ql3_ingress_claim_lock", "ql3_ingress_apply"]


def test_the_held_statement_hands_back_what_the_worker_does_not_hold(env: Env) -> None:
    run_ids = [env.admission.submit("t", {"i": i}) for i in range(3)]
    worker = register(env, capacity=3)
    grants = worker.claim(limit=3).grants
    assert [g.run_id for g in grants] == run_ids
    kept, finished, lost_answer = grants
    # The worker runs `kept`, finished `finished` (its completion rides along) and never got
    # the answer that granted `lost_answer`.
    done = Completion(fence=finished.fence, succeeded=True)
    answer = worker.claim(limit=1, completions=[done], held=[kept.attempt_id])
    assert answer.released == (lost_answer.attempt_id,)
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    # The claim read the queue before this call's writes: the Run handed back is queued for
    # the next claim, under lease generation 2.
    assert answer.no_grant is NoGrant.NOTHING_QUEUED
    (again,) = worker.claim(limit=2, held=[kept.attempt_id]).grants
    assert (again.attempt_id, again.generation) == (lost_answer.attempt_id, 2)
    assert run_state(env, lost_answer.run_id) == (
        RunStatus.RUNNING,
        [AttemptStatus.RUNNING],
        ["run_admitted", "attempt_started", "attempt_released", "attempt_started"],
    )
    with env.admin.unit_of_work() as uow:
        old, new = uow.runs.leases_of(lost_answer.run_id)
        events = uow.runs.events_of(lost_answer.run_id)
    assert (old.status, old.version, old.release_reason) == (
        LeaseStatus.RELEASED,
        2,
        ReleaseReason.HANDED_BACK,
    )
    assert (new.generation, new.status) == (2, LeaseStatus.LEASED)
    assert events[2].event.data["cause"] == "not_held"
    # The old fence is refused; nothing of `kept` changed.
    stale = worker.complete(lost_answer.fence)
    assert stale.rejection is Rejection.FENCE
    assert run_state(env, kept.run_id)[0] is RunStatus.RUNNING


def test_an_offer_left_by_the_offer_protocol_is_handed_back_when_not_held(env: Env) -> None:
    """An Attempt offered under ADR 0005 (claimed, its lease bound to no token) and named by
    the session's leases goes back to queued when the worker does not hold it."""
    run_id = env.admission.submit("t")
    worker = register(env)
    with env.admin.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(run_id)
    keys = {"run": run_id, "attempt": attempt.id, "session": worker.session_id}
    with env.admin.engine.begin() as connection:
        for statement in (
            "UPDATE runs SET status = 'dispatching' WHERE id = %(run)s",
            "UPDATE run_attempts SET session_id = %(session)s, worker_id = 'w1',"
            " lease_generation = 1, lease_version = 1, offered_at = statement_timestamp()"
            " WHERE id = %(attempt)s",
            "INSERT INTO run_dispatch_leases (run_id, generation, attempt_id, version, status,"
            " holder_session_id, token_hash, expires_at, granted_at)"
            " VALUES (%(run)s, 1, %(attempt)s, 1, 'leased', %(session)s, NULL,"
            " statement_timestamp() + interval '30 seconds', statement_timestamp())",
        ):
            connection.exec_driver_sql(statement, keys)
    answer = worker.claim(limit=0, held=[])
    assert answer.released == (attempt.id,)
    status, attempts, events = run_state(env, run_id)
    assert (status, attempts, events[-1]) == (
        RunStatus.QUEUED,
        [AttemptStatus.CLAIMED],
        "attempt_released",
    )
    (grant,) = worker.claim(limit=1).grants
    assert (grant.attempt_id, grant.generation) == (attempt.id, 2)


def test_a_hand_back_notifies_dispatch(env: Env, pg_database_url: str) -> None:
    env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    with connect(pg_database_url) as listener:
        listener.autocommit = True
        listener.execute("LISTEN ql3_dispatch")
        assert worker.release(fence).outcome is BatchOutcome.RELEASED
        notices = list(listener.notifies(timeout=2, stop_after=1))
    assert [n.channel for n in notices] == ["ql3_dispatch"]


def test_release_hands_back_a_started_attempt_even_after_expiry(env: Env) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    expire_lease(env.admin, run_id)
    # A stale version or another token is refused and changes nothing.
    before = env.dump()
    for stale in (evolve(fence, version=2), evolve(fence, token="x" * 30)):
        assert worker.release(stale).rejection is Rejection.FENCE
    assert env.dump() == before
    result = worker.release(fence, cause="slot failed to start")
    assert result.outcome is BatchOutcome.RELEASED
    status, attempts, events = run_state(env, run_id)
    assert (status, attempts, events[-1]) == (
        RunStatus.QUEUED,
        [AttemptStatus.CLAIMED],
        "attempt_released",
    )
    with env.admin.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(run_id)
        (lease,) = uow.runs.leases_of(run_id)
        (last,) = uow.runs.events_of(run_id)[-1:]
    assert attempt.is_pristine and attempt.lease_version is None
    assert (lease.status, lease.version, lease.release_reason) == (
        LeaseStatus.RELEASED,
        2,
        ReleaseReason.HANDED_BACK,
    )
    assert last.event.data["cause"] == "slot failed to start"
    assert worker.release(fence).rejection is not None  # a second time: nothing held


# --- fenced batches -----------------------------------------------------------------------------


def test_a_failed_completion_fails_the_run(env: Env) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    assert worker.complete(fence, succeeded=False, error="bad").outcome is BatchOutcome.FAILED
    status, attempts, events = run_state(env, run_id)
    assert (status, attempts, events[-1]) == (
        RunStatus.FAILED,
        [AttemptStatus.FAILED],
        "attempt_failed",
    )


def test_a_failed_completion_that_retries_on_error_waits_for_its_next_attempt(
    env: Env,
) -> None:
    policy = RetryPolicy(
        retry_on_error=True,
        max_attempts=2,
        safety=Safety.DEDUPLICATED,
        backoff=Backoff(initial_ms=1_000, cap_ms=1_000),
    )
    run_id = env.admission.submit("t", None, policy, timeout_ms=1_500)
    worker = register(env)
    (grant,) = worker.claim(1).grants
    assert grant.timeout_ms == 1_500
    result = worker.complete(grant.fence, succeeded=False, error="bad")
    assert result.outcome is BatchOutcome.FAILED
    status, attempts, events = run_state(env, run_id)
    assert (status, attempts, events[-1]) == (
        RunStatus.RETRY_WAIT,
        [AttemptStatus.FAILED],
        "attempt_failed",
    )
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        (event,) = [e.event for e in uow.runs.events_of(run_id)][-1:]
    assert run is not None and run.next_attempt_at_ms == event.at_ms + 1_000
    assert event.data["retry"] is True and event.data["next_attempt"] == 2


def test_batches_answer_per_item_and_a_refused_item_changes_nothing(
    env: Env, statements: Statements
) -> None:
    run_ids = [env.admission.submit("t", {"i": i}) for i in range(3)]
    worker = register(env)
    fences = worker.take_all()
    assert len(fences) == 3
    stale = evolve(fences[1], token="y" * 30)
    statements.sent.clear()
    renewed = env.workers.renew_many(
        worker.session_id, worker.secret, [fences[0], stale, fences[2]]
    )
    assert [r.rejection for r in renewed.results] == [None, Rejection.FENCE, None]
    # One statement locks the batch, one renews what the domain allowed.
    assert statements.functions() == ["select", "ql3_ingress_lock_attempts", "ql3_ingress_renew"]
    before = env.dump()
    refused = env.workers.complete_many(
        worker.session_id, worker.secret, [Completion(fence=stale, succeeded=True, output=1)]
    )
    assert refused.results[0].rejection is Rejection.FENCE
    assert env.dump() == before
    statements.sent.clear()
    done = env.workers.complete_many(
        worker.session_id,
        worker.secret,
        [Completion(fence=f, succeeded=True, output=i) for i, f in enumerate(fences)],
    )
    assert all(r.ok for r in done.results)
    assert statements.functions() == ["select", "ql3_ingress_lock_attempts", "ql3_ingress_apply"]
    assert [run_state(env, r)[0] for r in run_ids] == [RunStatus.SUCCEEDED] * 3
    again = env.workers.complete_many(
        worker.session_id, worker.secret, [Completion(fence=fences[0], succeeded=True, output=0)]
    )
    assert again.results[0].outcome is BatchOutcome.ALREADY_COMPLETED


def test_a_new_session_of_the_same_worker_replaces_the_old_one(env: Env) -> None:
    run_id = env.admission.submit("t")
    old = register(env, "w1")
    old.take_all()
    new = register(env, "w1")
    assert new.grant.replaced_session_ids == (old.session_id,)
    with env.admin.unit_of_work() as uow:
        replaced = uow.sessions.get(old.session_id)
    assert replaced is not None and replaced.status is SessionStatus.REPLACED
    with pytest.raises(SessionRejected):
        old.claim(limit=1)
    expire_lease(env.admin, run_id)
    assert env.recovery.run_once().recovered == 1
    with env.admin.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(run_id)
    assert attempt.lost_evidence is EvidenceKind.SESSION_REPLACED


def test_poll_drain_and_close(env: Env) -> None:
    worker = register(env)
    polled = env.workers.poll(worker.session_id, worker.secret)
    assert polled.status is SessionStatus.ACTIVE and polled.now_ms > 0
    env.workers.drain(worker.session_id, worker.secret)
    assert env.workers.poll(worker.session_id, worker.secret).status is SessionStatus.DRAINING
    env.workers.close(worker.session_id, worker.secret)
    with pytest.raises(SessionRejected):
        env.workers.close(worker.session_id, worker.secret)
    with env.admin.unit_of_work() as uow:
        session = uow.sessions.get(worker.session_id)
    assert session is not None and session.status is SessionStatus.CLOSED
    assert session.closed_at_ms is not None


def test_bad_secret_and_unknown_session(env: Env) -> None:
    env.admission.submit("t")
    worker = register(env)
    before = env.dump()
    with pytest.raises(SessionUnauthorized):
        env.workers.claim(worker.session_id, "wrong-secret", limit=1)
    with pytest.raises(UnknownSession):
        env.workers.poll("no-such-session", worker.secret)
    assert env.dump() == before


def test_abandon_with_a_live_lease_is_lost_at_once(env: Env) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    assert worker.abandon(fence, "shutting down").outcome is BatchOutcome.LOST
    with env.admin.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(run_id)
        (lease,) = uow.runs.leases_of(run_id)
        last = uow.runs.events_of(run_id)[-1].event
    assert attempt.status is AttemptStatus.LOST
    assert attempt.lost_evidence is EvidenceKind.WORKER_ABANDONED
    assert (lease.status, lease.version, lease.release_reason) == (
        LeaseStatus.RELEASED,
        2,
        ReleaseReason.ABANDONED,
    )
    assert last.data["evidence"] == "worker_abandoned"


def test_abandon_after_expiry_is_evidence_for_recovery(env: Env) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    expire_lease(env.admin, run_id)
    assert env.recovery.run_once().awaiting_evidence == 1  # fail closed without evidence
    answer = env.workers.abandon_many(
        worker.session_id, worker.secret, [Abandonment(fence=fence, detail="late")]
    )
    assert answer.results[0].outcome is BatchOutcome.RECORDED
    status, attempts, events = run_state(env, run_id)
    assert (status, attempts, events[-1]) == (
        RunStatus.RUNNING,
        [AttemptStatus.RUNNING],
        "evidence_recorded",
    )
    with env.admin.unit_of_work() as uow:
        reports = uow.evidence.reports_for(fence.attempt_id)
    assert [(r.kind, r.detail) for r in reports] == [(EvidenceKind.WORKER_ABANDONED, "late")]
    assert env.recovery.run_once().recovered == 1
    with env.admin.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(run_id)
    assert attempt.lost_evidence is EvidenceKind.WORKER_ABANDONED


@pytest.mark.parametrize("command", ["renew", "complete", "abandon", "release"])
@pytest.mark.parametrize(
    ("mutation", "reason"),
    [
        ({"version": 2}, FenceReason.VERSION_MISMATCH),
        ({"generation": 2}, FenceReason.GENERATION_MISMATCH),
        ({"token": "x" * 30}, FenceReason.TOKEN_MISMATCH),
    ],
)
def test_stale_fences_are_rejected_and_change_nothing(
    env: Env, command: str, mutation: dict[str, Any], reason: FenceReason
) -> None:
    env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    stale = evolve(fence, **mutation)
    before = env.dump()
    result = getattr(worker, command)(stale)
    assert result.rejection is Rejection.FENCE
    assert result.reason == reason.value
    assert env.dump() == before


def test_expired_and_foreign_fences_are_rejected(env: Env) -> None:
    run_id = env.admission.submit("t")
    holder = register(env, "w1")
    other = register(env, "w2")
    (fence,) = holder.take_all()
    before = env.dump()
    for command in ("complete", "renew", "release", "abandon"):
        assert getattr(other, command)(fence).rejection is Rejection.FENCE
    assert env.dump() == before
    expire_lease(env.admin, run_id)
    before = env.dump()
    for command in ("complete", "renew"):
        result = getattr(holder, command)(fence)
        assert (result.rejection, result.reason) == (Rejection.FENCE, FenceReason.EXPIRED.value)
    assert env.dump() == before


def test_the_function_rechecks_under_its_locks(env: Env) -> None:
    """The ingress takes no row locks; a lease that expires between the read and the write is
    refused by the function, which changes nothing and leaves the transaction usable."""
    run_id = env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    with env.ingress.unit_of_work() as uow:
        session = uow.sessions.get(worker.session_id)
        snapshot = uow.runs.lock_attempt(fence.attempt_id)
        assert session is not None and snapshot is not None and snapshot.attempt is not None
        change = complete(
            run=snapshot.run,
            attempt=snapshot.attempt,
            lease=snapshot.lease,
            fence=fence,
            succeeded=True,
            output=None,
            error=None,
            now_ms=uow.now_ms(),
        )
        expire_lease(env.admin, run_id)  # no row lock held by the ingress: this does not wait
        before = env.dump()
        with pytest.raises(ConcurrencyConflict, match="expired"):
            uow.runs.apply(snapshot, change)
        assert uow.now_ms() > 0  # the transaction is still usable
        uow.commit()
    assert env.dump() == before


def test_a_gate_closed_between_the_claims_locks_and_its_writes_is_a_conflict(env: Env) -> None:
    env.admission.submit("t")
    worker = register(env)
    with env.ingress.unit_of_work() as uow:
        session = uow.sessions.get(worker.session_id)
        assert session is not None
        lock = uow.runs.lock_for_claim(session.id, session.tasks, 4)
        assert lock.gate.open and lock.capacity is not None
        (candidate,) = lock.candidates
        assert candidate.attempt is not None
        change = claim(
            run=candidate.run,
            attempt=candidate.attempt,
            previous_lease=candidate.lease,
            session=lock.capacity.session,
            token_hash=hash_token("t" * 30),
            ttl_ms=LEASE_TTL_MS,
            now_ms=lock.observed_at_ms,
        )
        set_gate(env.admin, open=False, reason="lost retry failed")  # the gate is only read
        before = env.dump()
        with pytest.raises(ConcurrencyConflict, match="dispatch gate is closed"):
            uow.runs.apply_many([(candidate, change)])
    assert env.dump() == before


def test_a_batch_refused_in_part_is_not_committed(env: Env) -> None:
    """apply_many is all or nothing: when the function refuses one item after writing another,
    the unit of work refuses to commit."""
    run_ids = [env.admission.submit("t") for _ in range(2)]
    worker = register(env)
    fences = worker.take_all()
    with env.ingress.unit_of_work() as uow:
        assert uow.sessions.get(worker.session_id) is not None
        ordered = sorted(fences, key=lambda f: f.attempt_id)
        snapshots = uow.runs.lock_attempts([f.attempt_id for f in ordered])
        now_ms = uow.now_ms()
        writes = []
        for snapshot, fence in zip(snapshots, ordered, strict=True):
            assert snapshot is not None and snapshot.attempt is not None
            change = complete(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=snapshot.lease,
                fence=fence,
                succeeded=True,
                output=None,
                error=None,
                now_ms=now_ms,
            )
            writes.append((snapshot, change))
        expire_lease(env.admin, writes[1][0].run.id)
        before = env.dump()
        with pytest.raises(ConcurrencyConflict, match="expired"):
            uow.runs.apply_many(writes)
        with pytest.raises(ConcurrencyConflict, match="not committed"):
            uow.commit()
    assert env.dump() == before
    assert [run_state(env, r)[0] for r in run_ids] == [RunStatus.RUNNING] * 2


def test_what_the_ingress_role_cannot_do(env: Env) -> None:
    env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    before = env.dump()
    with pytest.raises(IngressNotPermitted, match="operator_attested"):
        env.workers.attest_stopped(fence.attempt_id, "host powered off")
    store = env.ingress
    for source in (
        lambda: store.recovery_candidates(16),
        lambda: store.lost_runs(16),
        lambda: store.due_retries(16),
        lambda: store.orphaned_runs(16),
    ):
        with pytest.raises(IngressNotPermitted):
            source()
    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_attempt(fence.attempt_id)
        assert snapshot is not None and snapshot.attempt is not None
        with pytest.raises(IngressNotPermitted, match="read run events"):
            uow.runs.events_of(snapshot.run.id)
        with pytest.raises(IngressNotPermitted, match="lock runs"):
            uow.runs.lock_run(snapshot.run.id)
        # Without the holder's session read (and its secret checked) in this unit of work, the
        # store neither acts for it nor claims for it.
        with pytest.raises(IngressNotPermitted, match="credentials"):
            uow.runs.lock_for_claim(worker.session_id, ["t"], 4)
        change = complete(
            run=snapshot.run,
            attempt=snapshot.attempt,
            lease=snapshot.lease,
            fence=fence,
            succeeded=True,
            output=None,
            error=None,
            now_ms=uow.now_ms(),
        )
        with pytest.raises(IngressNotPermitted, match="credentials"):
            uow.runs.apply(snapshot, change)
    assert env.dump() == before


def test_lock_attempt_waits_for_the_advisory_lock_and_reads_after_it(
    env: Env, pg_database_url: str
) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    with env.ingress.unit_of_work() as uow:
        snapshot = uow.runs.lock_attempt(fence.attempt_id)
        assert snapshot is not None and snapshot.lease is not None
        first_expiry = snapshot.lease.expires_at_ms
    holder = connect(pg_database_url)
    holder.autocommit = False
    try:
        holder.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
            (ADVISORY_LOCK_NAMESPACE, fence.attempt_id),
        )
        holder.execute(
            "UPDATE run_dispatch_leases SET expires_at = expires_at + interval '7 seconds'"
            " WHERE run_id = %s",
            (run_id,),
        )
        with env.ingress.unit_of_work() as uow:
            assert uow.runs.lock_attempt(fence.attempt_id, skip_locked=True) is None
        release = threading.Timer(0.3, holder.commit)
        release.start()
        with env.ingress.unit_of_work() as uow:
            # A batch: the first Attempt is free, the second waits for the commit; each is
            # read after its own lock.
            other, snapshot = uow.runs.lock_attempts(["a-missing-attempt", fence.attempt_id])
            assert other is None
            assert snapshot is not None and snapshot.lease is not None
            assert snapshot.lease.expires_at_ms == first_expiry + 7_000  # read after the lock
        release.join()
    finally:
        holder.close()


# --- input PostgreSQL cannot store ----------------------------------------------------------------

BAD_STRINGS = ["nul\x00byte", "lone\ud800surrogate"]


@pytest.mark.parametrize("bad", BAD_STRINGS)
def test_unstorable_ids_and_names_are_admission_errors(env: Env, bad: str) -> None:
    env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    before = env.dump()
    with pytest.raises(InvalidAdmission):
        env.workers.register(f"worker-{bad}", 2, ["t"])
    with pytest.raises(InvalidAdmission):
        env.workers.register("w9", 2, [f"task-{bad}"])
    with pytest.raises(InvalidAdmission):
        env.workers.poll(f"session-{bad}", worker.secret)
    with pytest.raises(InvalidAdmission):
        env.workers.claim(f"session-{bad}", worker.secret, limit=1)
    forged = LeaseFence(attempt_id=f"attempt-{bad}", generation=1, version=1, token=fence.token)
    for call in (
        lambda: env.workers.renew_many(worker.session_id, worker.secret, [forged]),
        lambda: env.workers.complete_many(
            worker.session_id, worker.secret, [Completion(fence=forged, succeeded=True)]
        ),
        lambda: env.workers.claim(
            worker.session_id,
            worker.secret,
            limit=1,
            completions=[Completion(fence=forged, succeeded=True)],
        ),
    ):
        with pytest.raises(InvalidAdmission):
            call()
    assert env.dump() == before


def refused_as_bad_input(call: Callable[[], Any]) -> bool:
    """The call was refused as bad input: by the domain (an item rejected as invalid) or by the
    store (the whole call an admission error)."""
    try:
        answer = call()
    except InvalidAdmission:
        return True
    if isinstance(answer, ClaimAnswer):
        results = list(answer.completed)
    else:
        results = list(answer.results) if isinstance(answer, BatchAnswer) else [answer]
    return all(result.rejection is Rejection.INVALID for result in results)


@pytest.mark.parametrize("bad", BAD_STRINGS)
def test_unstorable_outputs_details_and_causes_are_admission_errors(env: Env, bad: str) -> None:
    env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    before = env.dump()
    for call in (
        lambda: worker.complete(fence, output={"text": bad}),
        lambda: worker.complete(fence, output={bad: 1}),
        lambda: worker.complete(fence, succeeded=False, error=bad),
        lambda: worker.abandon(fence, bad),
        lambda: worker.release(fence, cause=bad),
        lambda: worker.claim(
            limit=1, completions=[Completion(fence=fence, succeeded=True, output=bad)]
        ),
    ):
        assert refused_as_bad_input(call)
    assert env.dump() == before
    # Nothing was lost on the way: the Attempt is still the worker's to complete.
    assert worker.complete(fence).outcome is BatchOutcome.SUCCEEDED


def test_the_holder_of_a_cancelled_attempt_is_told_cancelled_and_nothing_is_written(
    env: Env,
) -> None:
    """The ingress role only reads: the reason ``cancelled`` is decided in Python from the
    lease it read (released for ``cancelled``), and no function is called to write (ADR 0017)."""
    run_id = env.admission.submit("t")
    worker = register(env)
    (fence,) = worker.take_all()
    assert env.admission.cancel(run_id) is RunStatus.RUNNING
    before = env.dump()
    failed = [Completion(fence=fence, succeeded=False)]
    results = [
        worker.renew(fence),
        worker.complete(fence, succeeded=True, output=1),
        worker.claim(0, completions=failed, held=[]).completed[0],
    ]
    for result in results:
        assert (result.rejection, result.reason) == (Rejection.FENCE, FenceReason.CANCELLED.value)
    assert worker.abandon(fence, "its run was cancelled").outcome is BatchOutcome.CANCELLED
    assert worker.release(fence).outcome is BatchOutcome.CANCELLED
    assert env.dump() == before
    assert run_state(env, run_id) == (
        RunStatus.CANCELLED,
        [AttemptStatus.CANCELLED],
        ["run_admitted", "attempt_started", "run_cancelled"],
    )
