"""The worker commands through the ingress role: the same behaviour as over the runtime's own
store, every write through the fenced functions; stale fences are rejected and change nothing."""

from __future__ import annotations

import threading

import pytest
from attrs import evolve

from adapters.postgres.ingress import IngressNotPermitted
from adapters.postgres.queries import ADVISORY_LOCK_NAMESPACE
from application.worker_commands import (
    Abandonment,
    Completion,
    Rejection,
    SessionUnauthorized,
    StartStage,
    UnknownSession,
)
from domain.errors import ConcurrencyConflict, FenceReason, FenceRejected, SessionRejected
from domain.fence import LeaseFence
from domain.model import (
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunStatus,
    SessionStatus,
)
from domain.transitions import activate, complete
from tests.ingress.support import LEASE_TTL_MS, Env, expire_lease, register
from tests.postgres_server import connect


def run_state(env: Env, run_id: str) -> tuple[RunStatus, list[AttemptStatus], list[str]]:
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        assert run is not None
        attempts = [a.status for a in uow.runs.attempts_of(run_id)]
        events = [e.event.type.value for e in uow.runs.events_of(run_id)]
    return run.status, attempts, events


def test_the_worker_protocol_end_to_end(env: Env) -> None:
    run_id = env.admission.submit("t", {"n": 2})
    worker = register(env)
    assert worker.offers() == []
    assert env.dispatch.run_once().offered == 1
    (offer,) = worker.offers()
    assert (offer.run_id, offer.task, offer.input, offer.generation, offer.version) == (
        run_id,
        "t",
        {"n": 2},
        1,
        1,
    )
    fence = worker.accept(offer)
    assert worker.offers() == []  # an accepted offer is no longer open
    env.workers.activate(worker.session_id, worker.secret, fence)
    assert run_state(env, run_id)[0] is RunStatus.RUNNING
    env.workers.mark_running(worker.session_id, worker.secret, fence)
    with env.admin.unit_of_work() as uow:
        (before,) = uow.runs.leases_of(run_id)
    expires = env.workers.renew(worker.session_id, worker.secret, fence)
    assert expires >= before.expires_at_ms
    events = run_state(env, run_id)[2]
    env.workers.complete(
        worker.session_id, worker.secret, fence, succeeded=True, output={"r": [1, None]}
    )
    with env.admin.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        (attempt,) = uow.runs.attempts_of(run_id)
        (lease,) = uow.runs.leases_of(run_id)
        session = uow.sessions.get(worker.session_id)
    assert run is not None and run.status is RunStatus.SUCCEEDED
    assert run.output == {"r": [1, None]}
    assert attempt.status is AttemptStatus.SUCCEEDED and attempt.lease_version == 2
    assert (lease.status, lease.version, lease.release_reason) == (
        LeaseStatus.RELEASED,
        2,
        ReleaseReason.COMPLETED,
    )
    assert session is not None and session.status is SessionStatus.ACTIVE
    assert events == [  # the renewal wrote no event
        "run_admitted",
        "attempt_offered",
        "attempt_accepted",
        "attempt_activated",
        "attempt_running",
    ]
    assert run_state(env, run_id)[2] == [*events, "attempt_succeeded"]


def test_a_failed_completion_fails_the_run(env: Env) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    env.dispatch.run_once()
    (fence,) = worker.take_all()
    worker.start(fence)
    env.workers.complete(worker.session_id, worker.secret, fence, succeeded=False, error="bad")
    status, attempts, events = run_state(env, run_id)
    assert (status, attempts, events[-1]) == (
        RunStatus.FAILED,
        [AttemptStatus.FAILED],
        "attempt_failed",
    )


def test_batches_answer_per_item_and_a_refused_item_changes_nothing(env: Env) -> None:
    run_ids = [env.admission.submit("t", {"i": i}) for i in range(3)]
    worker = register(env)
    env.dispatch.run_once()
    offers = worker.offers()
    assert len(offers) == 3
    fences = [
        LeaseFence(
            attempt_id=o.attempt_id,
            generation=o.generation,
            version=o.version,
            token=f"token-of-{o.attempt_id}".ljust(30, "x"),
        )
        for o in offers
    ]
    started = env.workers.start_many(worker.session_id, worker.secret, fences, StartStage.STARTED)
    assert [r.rejection for r in started.results] == [None, None, None]
    stale = evolve(fences[1], token="y" * 30)
    renewed = env.workers.renew_many(
        worker.session_id, worker.secret, [fences[0], stale, fences[2]]
    )
    assert [r.rejection for r in renewed.results] == [None, Rejection.FENCE, None]
    before = env.dump()
    refused = env.workers.complete_many(
        worker.session_id, worker.secret, [Completion(fence=stale, succeeded=True, output=1)]
    )
    assert refused.results[0].rejection is Rejection.FENCE
    assert env.dump() == before
    done = env.workers.complete_many(
        worker.session_id,
        worker.secret,
        [Completion(fence=f, succeeded=True, output=i) for i, f in enumerate(fences)],
    )
    assert all(r.ok for r in done.results)
    assert [run_state(env, r)[0] for r in run_ids] == [RunStatus.SUCCEEDED] * 3
    again = env.workers.complete_many(
        worker.session_id, worker.secret, [Completion(fence=fences[0], succeeded=True, output=0)]
    )
    assert again.results[0].outcome is not None
    assert again.results[0].outcome.value == "already_completed"


def test_a_new_session_of_the_same_worker_replaces_the_old_one(env: Env) -> None:
    run_id = env.admission.submit("t")
    old = register(env, "w1")
    env.dispatch.run_once()
    (fence,) = old.take_all()
    old.start(fence)
    new = register(env, "w1")
    assert new.grant.replaced_session_ids == (old.session_id,)
    with env.admin.unit_of_work() as uow:
        replaced = uow.sessions.get(old.session_id)
    assert replaced is not None and replaced.status is SessionStatus.REPLACED
    with pytest.raises(SessionRejected):
        old.offers()
    expire_lease(env.admin, run_id)
    assert env.recovery.run_once().recovered == 1
    with env.admin.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(run_id)
    assert attempt.lost_evidence is EvidenceKind.SESSION_REPLACED


def test_drain_and_close(env: Env) -> None:
    worker = register(env)
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
    worker = register(env)
    before = env.dump()
    with pytest.raises(SessionUnauthorized):
        env.workers.heartbeat(worker.session_id, "wrong-secret")
    with pytest.raises(UnknownSession):
        env.workers.heartbeat("no-such-session", worker.secret)
    assert env.dump() == before


def test_abandon_with_a_live_lease_is_lost_at_once(env: Env) -> None:
    run_id = env.admission.submit("t")
    worker = register(env)
    env.dispatch.run_once()
    (fence,) = worker.take_all()
    worker.start(fence)
    outcome = env.workers.abandon(worker.session_id, worker.secret, fence, "shutting down")
    assert outcome.outcome == "lost"
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
    env.dispatch.run_once()
    (fence,) = worker.take_all()
    worker.start(fence)
    expire_lease(env.admin, run_id)
    assert env.recovery.run_once().awaiting_evidence == 1  # fail closed without evidence
    answer = env.workers.abandon_many(
        worker.session_id, worker.secret, [Abandonment(fence=fence, detail="late")]
    )
    assert answer.results[0].outcome is not None
    assert answer.results[0].outcome.value == "recorded"
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


@pytest.mark.parametrize("command", ["activate", "mark_running", "renew", "complete", "abandon"])
@pytest.mark.parametrize(
    ("mutation", "reason"),
    [
        ({"version": 2}, FenceReason.VERSION_MISMATCH),
        ({"generation": 2}, FenceReason.GENERATION_MISMATCH),
        ({"token": "x" * 30}, FenceReason.TOKEN_MISMATCH),
    ],
)
def test_stale_fences_are_rejected_and_change_nothing(
    env: Env, command: str, mutation: dict[str, object], reason: FenceReason
) -> None:
    env.admission.submit("t")
    worker = register(env)
    env.dispatch.run_once()
    (fence,) = worker.take_all()
    if command in ("mark_running", "complete"):
        env.workers.activate(worker.session_id, worker.secret, fence)
    stale = evolve(fence, **mutation)
    before = env.dump()
    call = getattr(env.workers, command)
    with pytest.raises(FenceRejected) as raised:
        if command == "complete":
            call(worker.session_id, worker.secret, stale, succeeded=True)
        elif command == "abandon":
            call(worker.session_id, worker.secret, stale, "x")
        else:
            call(worker.session_id, worker.secret, stale)
    assert raised.value.reason is reason
    assert env.dump() == before


def test_expired_and_foreign_fences_are_rejected(env: Env) -> None:
    run_id = env.admission.submit("t")
    owner = register(env, "w1")
    intruder = register(env, "w2")
    env.dispatch.run_once()
    holder, other = (owner, intruder) if owner.offers() else (intruder, owner)
    (fence,) = holder.take_all()
    before = env.dump()
    with pytest.raises(FenceRejected):
        env.workers.activate(other.session_id, other.secret, fence)
    assert env.dump() == before
    expire_lease(env.admin, run_id)
    before = env.dump()
    for call in (env.workers.activate, env.workers.renew):
        with pytest.raises(FenceRejected) as raised:
            call(holder.session_id, holder.secret, fence)
        assert raised.value.reason is FenceReason.EXPIRED
    assert env.dump() == before


def test_the_function_rechecks_under_its_locks(env: Env) -> None:
    """The ingress reads without row locks; a lease that expires between the read and the write
    is refused by the function, which changes nothing and leaves the transaction usable."""
    run_id = env.admission.submit("t")
    worker = register(env)
    env.dispatch.run_once()
    (fence,) = worker.take_all()
    with env.ingress.unit_of_work() as uow:
        session = uow.sessions.get(worker.session_id)
        snapshot = uow.runs.lock_attempt(fence.attempt_id)
        assert session is not None and snapshot is not None and snapshot.attempt is not None
        change = activate(
            run=snapshot.run,
            attempt=snapshot.attempt,
            lease=snapshot.lease,
            fence=fence,
            ttl_ms=LEASE_TTL_MS,
            now_ms=uow.now_ms(),
        )
        expire_lease(env.admin, run_id)  # no row lock held by the ingress: this does not wait
        before = env.dump()
        with pytest.raises(ConcurrencyConflict, match="expired"):
            uow.runs.apply(snapshot, change)
        assert uow.now_ms() > 0  # the transaction is still usable
        uow.commit()
    assert env.dump() == before


def test_what_the_ingress_role_cannot_do(env: Env) -> None:
    env.admission.submit("t")
    worker = register(env)
    env.dispatch.run_once()
    (fence,) = worker.take_all()
    worker.start(fence)
    before = env.dump()
    with pytest.raises(IngressNotPermitted, match="operator_attested"):
        env.workers.attest_stopped(fence.attempt_id, "host powered off")
    store = env.ingress
    for source in (
        lambda: store.recovery_candidates(16),
        lambda: store.lost_runs(16),
        lambda: store.due_retries(16),
        lambda: store.orphaned_runs(16),
        lambda: store.queued_attempts(16, ["t"]),
        lambda: store.available_sessions(1000),
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
        # store does not act for it.
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
    env.dispatch.run_once()
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
            snapshot = uow.runs.lock_attempt(fence.attempt_id)  # waits for the commit
            assert snapshot is not None and snapshot.lease is not None
            assert snapshot.lease.expires_at_ms == first_expiry + 7_000  # read after the lock
        release.join()
    finally:
        holder.close()
