"""Admission and the worker protocol, end to end on the memory store."""

from __future__ import annotations

import pytest
from attrs import evolve

from ql3.application.admission import AdmissionRequest, UnknownRun
from ql3.application.budgets import InvalidPageSize, validate_page_size
from ql3.application.worker_commands import (
    BatchOutcome,
    ItemResult,
    NoGrant,
    PollAnswer,
    Rejection,
    SessionUnauthorized,
    UnknownAttempt,
    UnknownSession,
)
from ql3.domain.errors import (
    FenceReason,
    InvalidAdmission,
    InvalidRetryPolicy,
    InvalidTransition,
    SessionRejected,
)
from ql3.domain.fence import LeaseFence, hash_token
from ql3.domain.model import (
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunStatus,
    SessionStatus,
)
from ql3.domain.policy import RetryPolicy, Safety
from tests.application.support import (
    LEASE_TTL_MS,
    Services,
    Worker,
    build_services,
    current_attempt,
    event_types,
    register,
    run_view,
    store_view,
)


@pytest.fixture
def svc() -> Services:
    return build_services()


# --- admission ----------------------------------------------------------------------------------


def test_submit_admits_a_queued_run_with_its_policy_snapshot(svc: Services) -> None:
    policy = RetryPolicy(retry_on_lost=True, max_attempts=2, safety=Safety.DEDUPLICATED)
    run_id = svc.admission.submit("t", {"x": 1}, policy)
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.QUEUED
    assert view.run.policy == policy
    assert view.run.input == {"x": 1}
    assert [a.number for a in view.attempts] == [1]
    assert view.attempts[0].is_pristine
    assert view.leases == ()
    assert [e[1] for e in view.events] == ["run_admitted"]


def test_submit_many_is_all_or_none(svc: Services) -> None:
    ids = svc.admission.submit_many([AdmissionRequest(task="a"), AdmissionRequest(task="b")])
    assert len(set(ids)) == 2
    before = store_view(svc.store)
    with pytest.raises(InvalidAdmission):
        svc.admission.submit_many(
            [AdmissionRequest(task="ok"), AdmissionRequest(task="ok2"), AdmissionRequest(task="")]
        )
    assert store_view(svc.store) == before
    assert len(before.runs) == 2


def test_submit_many_bounds(svc: Services) -> None:
    with pytest.raises(ValueError):
        svc.admission.submit_many([])


def test_invalid_policy_never_reaches_admission() -> None:
    with pytest.raises(InvalidRetryPolicy):
        RetryPolicy(max_attempts=0)


def test_cancel(svc: Services) -> None:
    run_id = svc.admission.submit("t")
    svc.admission.cancel(run_id, "no longer needed")
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.CANCELLED
    assert view.attempts[0].status is AttemptStatus.CANCELLED
    with pytest.raises(InvalidTransition):
        svc.admission.cancel(run_id)
    with pytest.raises(UnknownRun):
        svc.admission.cancel("nope")


def test_cancel_of_a_running_run_fences_out_the_worker(svc: Services) -> None:
    run_id = svc.admission.submit("t")
    worker = register(svc)
    (fence,) = worker.take_all()
    svc.admission.cancel(run_id)
    lease = run_view(svc.store, run_id).leases[0]
    assert lease.status is LeaseStatus.RELEASED
    assert lease.release_reason is ReleaseReason.CANCELLED
    before = store_view(svc.store, [worker.session_id])
    result = worker.complete(fence)  # the holder is told why: its run was cancelled
    assert (result.rejection, result.reason) == (Rejection.FENCE, FenceReason.CANCELLED.value)
    assert store_view(svc.store, [worker.session_id]) == before


# --- the worker protocol ------------------------------------------------------------------------


def test_worker_happy_path_end_to_end(svc: Services) -> None:
    run_id = svc.admission.submit("t", {"n": 2})
    worker = register(svc)
    assert svc.workers.poll(worker.session_id, worker.secret) == PollAnswer(
        now_ms=svc.clock.now_ms(), status=SessionStatus.ACTIVE
    )
    answer = worker.claim(limit=4)
    (grant,) = answer.grants
    attempt_id = current_attempt(svc.store, run_id).id
    assert (answer.now_ms, answer.completed, answer.released, answer.no_grant) == (
        svc.clock.now_ms(), (), (), None
    )
    assert (grant.run_id, grant.attempt_id, grant.attempt_number, grant.task, grant.input) == (
        run_id, attempt_id, 1, "t", {"n": 2}
    )
    assert (grant.generation, grant.version, grant.idempotency_key) == (1, 1, run_id)
    assert grant.expires_at_ms == svc.clock.now_ms() + LEASE_TTL_MS
    # The claim crossed the start barrier: the Attempt runs, under a lease bound to the token.
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.RUNNING
    attempt = view.attempts[0]
    assert attempt.status is AttemptStatus.RUNNING
    assert (attempt.session_id, attempt.lease_generation, attempt.lease_version) == (
        worker.session_id, 1, 1
    )
    assert attempt.started_at_ms == svc.clock.now_ms()
    (lease,) = view.leases
    assert lease.token_hash == hash_token(grant.token)
    assert (lease.status, lease.holder_session_id) == (LeaseStatus.LEASED, worker.session_id)
    again = worker.claim(limit=4)  # nothing else is queued: nothing is granted twice
    assert (again.grants, again.no_grant) == ((), NoGrant.NOTHING_QUEUED)
    svc.clock.advance(20_000)
    renewed = worker.renew(grant.fence)
    assert renewed.outcome is BatchOutcome.RENEWED
    assert renewed.expires_at_ms == svc.clock.now_ms() + LEASE_TTL_MS
    lease = run_view(svc.store, run_id).leases[0]
    assert (lease.version, lease.expires_at_ms) == (1, renewed.expires_at_ms)
    assert worker.complete(grant.fence, output={"r": 1}).outcome is BatchOutcome.SUCCEEDED
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.SUCCEEDED
    assert view.run.output == {"r": 1}
    assert view.attempts[0].status is AttemptStatus.SUCCEEDED
    assert view.leases[0].status is LeaseStatus.RELEASED
    assert view.leases[0].version == 2
    assert view.attempts[0].lease_version == 2
    assert [e[1] for e in view.events] == [
        "run_admitted", "attempt_started", "attempt_succeeded",
    ]


def test_renew_writes_no_event(svc: Services) -> None:
    run_id = svc.admission.submit("t")
    worker = register(svc)
    (fence,) = worker.take_all()
    before = event_types(svc.store, run_id)
    assert worker.renew(fence).ok
    assert event_types(svc.store, run_id) == before


def test_task_failure_fails_the_run(svc: Services) -> None:
    run_id = svc.admission.submit(
        "t", policy=RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)
    )
    worker = register(svc)
    (fence,) = worker.take_all()
    assert worker.complete(fence, succeeded=False, error="bad").outcome is BatchOutcome.FAILED
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.FAILED
    assert view.run.error == "bad"
    svc.coordinator.run_cycle()
    assert run_view(svc.store, run_id).run.status is RunStatus.FAILED  # not a lost retry


def test_new_session_of_the_same_worker_replaces_the_old_one_and_is_evidence(
    svc: Services,
) -> None:
    run_id = svc.admission.submit("t")
    old = register(svc, "w1")
    old.take_all()
    new = register(svc, "w1")
    assert new.grant.replaced_session_ids == (old.session_id,)
    with svc.store.unit_of_work() as uow:
        replaced = uow.sessions.get(old.session_id)
    assert replaced is not None and replaced.status is SessionStatus.REPLACED
    with pytest.raises(SessionRejected):
        svc.workers.poll(old.session_id, old.secret)
    with pytest.raises(SessionRejected):
        old.claim()
    # The lease is still live: nothing happens until it expires.
    svc.recovery.run_once()
    assert current_attempt(svc.store, run_id).status is AttemptStatus.RUNNING
    svc.clock.advance(LEASE_TTL_MS + 1)
    report = svc.recovery.run_once()
    assert report.recovered == 1
    attempt = current_attempt(svc.store, run_id)
    assert attempt.status is AttemptStatus.LOST
    assert attempt.lost_evidence is EvidenceKind.SESSION_REPLACED
    lost_event = run_view(svc.store, run_id).events[-1]
    assert lost_event[1] == "attempt_lost"
    assert lost_event[3]["evidence"] == "session_replaced"


def test_close_is_evidence_for_recovery(svc: Services) -> None:
    run_id = svc.admission.submit("t")
    worker = register(svc)
    worker.take_all()
    svc.workers.close(worker.session_id, worker.secret)
    with pytest.raises(SessionRejected):
        svc.workers.close(worker.session_id, worker.secret)
    svc.clock.advance(LEASE_TTL_MS + 1)
    assert svc.recovery.run_once().recovered == 1
    assert current_attempt(svc.store, run_id).lost_evidence is EvidenceKind.SESSION_CLOSED


def test_expired_running_attempt_without_evidence_stays(svc: Services) -> None:
    run_id = svc.admission.submit("t")
    worker = register(svc)
    worker.take_all()
    svc.clock.advance(LEASE_TTL_MS + 1)
    before = store_view(svc.store, [worker.session_id])
    report = svc.recovery.run_once()
    assert (report.examined, report.recovered, report.awaiting_evidence) == (1, 0, 1)
    assert store_view(svc.store, [worker.session_id]) == before
    assert current_attempt(svc.store, run_id).status is AttemptStatus.RUNNING


def test_abandon_with_a_live_lease_is_lost_at_once(svc: Services) -> None:
    run_id = svc.admission.submit("t")
    worker = register(svc)
    (fence,) = worker.take_all()
    assert worker.abandon(fence, "shutting down").outcome is BatchOutcome.LOST
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.LOST
    assert view.attempts[0].status is AttemptStatus.LOST
    assert view.leases[0].status is LeaseStatus.RELEASED
    assert view.leases[0].release_reason is ReleaseReason.ABANDONED
    assert view.events[-1][3]["evidence"] == "worker_abandoned"


def test_abandon_after_expiry_is_recorded_as_evidence(svc: Services) -> None:
    run_id = svc.admission.submit("t")
    worker = register(svc)
    (fence,) = worker.take_all()
    svc.clock.advance(LEASE_TTL_MS + 1)
    events_before = event_types(svc.store, run_id)
    assert worker.abandon(fence, "late").outcome is BatchOutcome.RECORDED
    assert event_types(svc.store, run_id) == [*events_before, "evidence_recorded"]
    with svc.store.unit_of_work() as uow:
        reports = uow.evidence.reports_for(fence.attempt_id)
    assert [r.kind for r in reports] == [EvidenceKind.WORKER_ABANDONED]
    assert current_attempt(svc.store, run_id).status is AttemptStatus.RUNNING
    assert svc.recovery.run_once().recovered == 1
    assert current_attempt(svc.store, run_id).lost_evidence is EvidenceKind.WORKER_ABANDONED


def test_attest_stopped_is_evidence(svc: Services) -> None:
    run_id = svc.admission.submit("t")
    worker = register(svc)
    (fence,) = worker.take_all()
    with pytest.raises(InvalidAdmission):
        svc.workers.attest_stopped(fence.attempt_id, "   ")
    with pytest.raises(UnknownAttempt):
        svc.workers.attest_stopped("nope", "gone")
    svc.workers.attest_stopped(fence.attempt_id, "host powered off")
    svc.clock.advance(LEASE_TTL_MS + 1)
    assert svc.recovery.run_once().recovered == 1
    attempt = current_attempt(svc.store, run_id)
    assert attempt.lost_evidence is EvidenceKind.OPERATOR_ATTESTED
    with pytest.raises(InvalidTransition):
        svc.workers.attest_stopped(attempt.id, "again")


def test_bad_secret_and_unknown_session(svc: Services) -> None:
    svc.admission.submit("t")
    worker = register(svc)
    before = store_view(svc.store, [worker.session_id])
    with pytest.raises(SessionUnauthorized):
        svc.workers.poll(worker.session_id, "wrong-secret")
    with pytest.raises(SessionUnauthorized):
        svc.workers.claim(worker.session_id, "wrong-secret", limit=1)
    with pytest.raises(UnknownSession):
        svc.workers.poll("no-such-session", worker.secret)
    with pytest.raises(UnknownSession):
        svc.workers.claim("no-such-session", worker.secret, limit=1)
    with pytest.raises(SessionUnauthorized):
        svc.workers.close(worker.session_id, "wrong-secret")
    assert store_view(svc.store, [worker.session_id]) == before  # nothing was claimed


def _fenced_call(worker: Worker, command: str, fence: LeaseFence) -> ItemResult:
    if command == "complete":
        return worker.complete(fence)
    if command == "abandon":
        return worker.abandon(fence, "x")
    if command == "release":
        return worker.release(fence)
    return worker.renew(fence)


FENCED_COMMANDS = ["renew", "complete", "abandon", "release"]


@pytest.mark.parametrize("command", FENCED_COMMANDS)
@pytest.mark.parametrize(
    ("mutation", "reason"),
    [
        ({"version": 2}, FenceReason.VERSION_MISMATCH),
        ({"generation": 2}, FenceReason.GENERATION_MISMATCH),
        ({"token": "x" * 30}, FenceReason.TOKEN_MISMATCH),
    ],
)
def test_stale_fences_are_rejected_and_change_nothing(
    svc: Services, command: str, mutation: dict[str, object], reason: FenceReason
) -> None:
    svc.admission.submit("t")
    worker = register(svc)
    (fence,) = worker.take_all()
    stale = evolve(fence, **mutation)
    before = store_view(svc.store, [worker.session_id])
    result = _fenced_call(worker, command, stale)
    assert (result.outcome, result.rejection, result.reason) == (
        None, Rejection.FENCE, reason.value
    )
    assert store_view(svc.store, [worker.session_id]) == before


@pytest.mark.parametrize("command", FENCED_COMMANDS)
def test_another_sessions_fence_is_rejected(svc: Services, command: str) -> None:
    svc.admission.submit("t")
    owner = register(svc, "w1")
    intruder = register(svc, "w2")
    (fence,) = owner.take_all()
    assert intruder.take_all() == []
    before = store_view(svc.store, [owner.session_id, intruder.session_id])
    result = _fenced_call(intruder, command, fence)  # the right token, the wrong session
    assert result.rejection is Rejection.FENCE
    assert store_view(svc.store, [owner.session_id, intruder.session_id]) == before


def test_expired_fence_is_rejected_and_changes_nothing(svc: Services) -> None:
    svc.admission.submit("t")
    worker = register(svc)
    (fence,) = worker.take_all()
    svc.clock.advance(LEASE_TTL_MS + 5)
    before = store_view(svc.store, [worker.session_id])
    for command in ("renew", "complete"):
        result = _fenced_call(worker, command, fence)
        assert (result.rejection, result.reason) == (Rejection.FENCE, FenceReason.EXPIRED.value)
    assert store_view(svc.store, [worker.session_id]) == before


# --- page budgets -------------------------------------------------------------------------------


def test_validate_page_size() -> None:
    assert validate_page_size(None) == 16
    assert validate_page_size(None, default=8) == 8
    assert validate_page_size(1) == 1
    assert validate_page_size(64) == 64
    for bad in (0, 65, -1, True, 3.0, "16"):
        with pytest.raises(InvalidPageSize):
            validate_page_size(bad)  # type: ignore[arg-type]
