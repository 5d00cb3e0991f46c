"""Unit tests of the pure Run / Attempt / DispatchLease transitions."""

from __future__ import annotations

import pytest
from attrs import evolve

from domain.errors import (
    FenceReason,
    FenceRejected,
    InvalidAdmission,
    InvalidRetryPolicy,
    InvalidTransition,
    SessionRejected,
)
from domain.events import EventType
from domain.fence import LeaseFence, check_fence, check_holder, hash_token, secrets_match
from domain.model import (
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    NotRunningEvidence,
    ReleaseReason,
    RunStatus,
    SessionStatus,
)
from domain.policy import Backoff, RetryPolicy, Safety
from domain.transitions import (
    abandon,
    accept,
    activate,
    admit,
    cancel,
    complete,
    create_first_attempt,
    grant_lease,
    mark_lost,
    mark_running,
    renew,
)
from tests.domain.builders import (
    NOW,
    OTHER_TOKEN,
    TOKEN,
    TTL,
    accepted,
    offered,
    queued,
    running,
    session,
    started,
)

# --- admit --------------------------------------------------------------------------------------


def test_admit_with_attempt_id_is_queued_with_pristine_attempt_1() -> None:
    policy = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)
    change = admit(run_id="r", attempt_id="a", task="t", input={"k": 1}, policy=policy, now_ms=5)
    assert change.run.status is RunStatus.QUEUED
    assert change.run.attempt_count == 1
    assert change.run.policy == policy
    assert change.lease is None
    (attempt,) = change.attempts
    assert attempt.number == 1
    assert attempt.status is AttemptStatus.CLAIMED
    assert attempt.is_pristine
    assert change.event.type is EventType.RUN_ADMITTED
    assert change.event.attempt_id == "a"
    assert change.event.at_ms == 5


def test_admit_without_attempt_id_stays_created_without_attempt() -> None:
    change = admit(run_id="r", attempt_id=None, task="t", input=None, policy=None, now_ms=5)
    assert change.run.status is RunStatus.CREATED
    assert change.run.attempt_count == 0
    assert change.attempts == ()
    assert change.event.type is EventType.RUN_ADMITTED
    assert change.event.attempt_id is None


@pytest.mark.parametrize("task", ["", " t", "t ", "x" * 201])
def test_admit_refuses_invalid_task_names(task: str) -> None:
    with pytest.raises(InvalidAdmission):
        admit(run_id="r", attempt_id="a", task=task, input=None, policy=None, now_ms=0)


@pytest.mark.parametrize(("run_id", "attempt_id"), [("", "a"), ("r", "")])
def test_admit_refuses_empty_ids(run_id: str, attempt_id: str) -> None:
    with pytest.raises(InvalidAdmission):
        admit(run_id=run_id, attempt_id=attempt_id, task="t", input=None, policy=None, now_ms=0)


def test_admit_refuses_a_policy_that_is_not_a_retry_policy() -> None:
    with pytest.raises(InvalidAdmission):
        admit(
            run_id="r", attempt_id="a", task="t", input=None,
            policy={"retry_on_lost": True},  # type: ignore[arg-type]
            now_ms=0,
        )


@pytest.mark.parametrize(
    "build",
    [
        lambda: RetryPolicy(max_attempts=0),
        lambda: RetryPolicy(max_attempts=1001),
        lambda: Backoff(initial_ms=-1),
        lambda: Backoff(multiplier=0.5),
        lambda: Backoff(initial_ms=10, cap_ms=5),
        lambda: Backoff(jitter=1.5),
        lambda: Backoff(jitter=-0.1),
    ],
)
def test_invalid_policies_raise_invalid_retry_policy(build) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRetryPolicy):
        build()


def test_create_first_attempt_queues_a_created_run() -> None:
    run = admit(run_id="r", attempt_id=None, task="t", input=None, policy=None, now_ms=1).run
    change = create_first_attempt(run, "a1", 7)
    assert change.run.status is RunStatus.QUEUED
    assert change.run.attempt_count == 1
    (attempt,) = change.attempts
    assert attempt.is_pristine and attempt.number == 1 and attempt.id == "a1"
    assert change.event.type is EventType.ATTEMPT_CREATED
    with pytest.raises(InvalidTransition):
        create_first_attempt(change.run, "a2", 8)


# --- grant_lease --------------------------------------------------------------------------------


def test_grant_lease_first_generation_version_1_token_unbound() -> None:
    run, attempt = queued()
    change = grant_lease(
        run=run, attempt=attempt, previous_lease=None, session=session(), ttl_ms=TTL, now_ms=NOW
    )
    lease = change.lease
    assert lease is not None
    assert (lease.generation, lease.version, lease.status) == (1, 1, LeaseStatus.LEASED)
    assert lease.token_hash is None
    assert lease.holder_session_id == "s1"
    assert lease.expires_at_ms == NOW + TTL
    assert change.run.status is RunStatus.DISPATCHING
    (new_attempt,) = change.attempts
    assert new_attempt.status is AttemptStatus.CLAIMED
    assert (new_attempt.session_id, new_attempt.worker_id) == ("s1", "w1")
    assert (new_attempt.lease_generation, new_attempt.lease_version) == (1, 1)
    assert new_attempt.offered_at_ms == NOW
    assert not new_attempt.is_pristine
    assert change.event.type is EventType.ATTEMPT_OFFERED
    assert change.event.data["generation"] == 1


def test_grant_lease_numbers_generations_after_a_released_previous_lease() -> None:
    _, _, old = offered()
    released = evolve(old, generation=3, version=2, status=LeaseStatus.RELEASED)
    run, attempt = queued()
    change = grant_lease(
        run=run, attempt=attempt, previous_lease=released, session=session(), ttl_ms=TTL,
        now_ms=NOW,
    )
    assert change.lease is not None
    assert change.lease.generation == 4
    assert change.lease.version == 1


def test_grant_lease_refusals() -> None:
    run, _, lease = offered()
    fresh_run, fresh_attempt = queued()
    with pytest.raises(InvalidTransition):  # run not queued
        grant_lease(run=run, attempt=fresh_attempt, previous_lease=None, session=session(),
                    ttl_ms=TTL, now_ms=NOW)
    with pytest.raises(InvalidTransition):  # attempt not pristine
        grant_lease(run=fresh_run, attempt=evolve(fresh_attempt, offered_at_ms=1),
                    previous_lease=None, session=session(), ttl_ms=TTL, now_ms=NOW)
    for status in (SessionStatus.DRAINING, SessionStatus.CLOSED, SessionStatus.REPLACED):
        with pytest.raises(SessionRejected):
            grant_lease(run=fresh_run, attempt=fresh_attempt, previous_lease=None,
                        session=session(status=status), ttl_ms=TTL, now_ms=NOW)
    with pytest.raises(SessionRejected):
        grant_lease(run=fresh_run, attempt=fresh_attempt, previous_lease=None,
                    session=session(tasks=("other",)), ttl_ms=TTL, now_ms=NOW)
    with pytest.raises(InvalidTransition):  # the previous lease is still leased
        grant_lease(run=fresh_run, attempt=fresh_attempt, previous_lease=lease,
                    session=session(), ttl_ms=TTL, now_ms=NOW)


# --- accept -------------------------------------------------------------------------------------


def test_accept_binds_the_token_hash_and_keeps_the_version() -> None:
    run, attempt, lease = offered()
    change = accept(run=run, attempt=attempt, lease=lease, session_id="s1", generation=1,
                    version=1, token_hash=hash_token(TOKEN), ttl_ms=TTL, now_ms=NOW + 10)
    assert change.lease is not None
    assert change.lease.token_hash == hash_token(TOKEN)
    assert change.lease.token_hash != TOKEN
    assert change.lease.version == 1
    assert change.lease.expires_at_ms == NOW + 10 + TTL
    assert change.run == run
    assert change.attempts[0].accepted_at_ms == NOW + 10
    assert change.attempts[0].status is AttemptStatus.CLAIMED
    assert change.event.type is EventType.ATTEMPT_ACCEPTED


def _accept(run, attempt, lease, *, token=TOKEN, session_id="s1", now=NOW + 20, **kw):  # type: ignore[no-untyped-def]
    return accept(run=run, attempt=attempt, lease=lease, session_id=session_id,
                  generation=kw.get("generation", lease.generation),
                  version=kw.get("version", lease.version), token_hash=hash_token(token),
                  ttl_ms=TTL, now_ms=now)


def test_accept_again_with_the_same_token_is_already_accepted() -> None:
    run, attempt, lease, _ = accepted()
    with pytest.raises(InvalidTransition) as raised:
        _accept(run, attempt, lease)
    assert "already accepted" in str(raised.value)


def test_accept_with_another_token_is_a_token_mismatch() -> None:
    run, attempt, lease, _ = accepted()
    with pytest.raises(FenceRejected) as raised:
        _accept(run, attempt, lease, token=OTHER_TOKEN)
    assert raised.value.reason is FenceReason.TOKEN_MISMATCH


def test_accept_by_a_foreign_session_is_rejected() -> None:
    run, attempt, lease = offered()
    with pytest.raises(SessionRejected):
        _accept(run, attempt, lease, session_id="s2")


def test_accept_after_expiry_is_rejected_as_expired() -> None:
    run, attempt, lease = offered()
    with pytest.raises(FenceRejected) as raised:
        _accept(run, attempt, lease, now=lease.expires_at_ms)
    assert raised.value.reason is FenceReason.EXPIRED


def test_accept_with_wrong_generation_or_version_or_no_lease() -> None:
    run, attempt, lease = offered()
    with pytest.raises(FenceRejected) as raised:
        _accept(run, attempt, lease, generation=2)
    assert raised.value.reason is FenceReason.GENERATION_MISMATCH
    with pytest.raises(FenceRejected) as raised:
        _accept(run, attempt, lease, version=2)
    assert raised.value.reason is FenceReason.VERSION_MISMATCH
    with pytest.raises(FenceRejected) as raised:
        accept(run=run, attempt=attempt, lease=None, session_id="s1", generation=1, version=1,
               token_hash=hash_token(TOKEN), ttl_ms=TTL, now_ms=NOW)
    assert raised.value.reason is FenceReason.NO_LEASE


# --- activate, mark_running, renew ---------------------------------------------------------------


def test_activate_crosses_the_start_barrier() -> None:
    run, attempt, lease, fence = accepted()
    change = activate(run=run, attempt=attempt, lease=lease, fence=fence, ttl_ms=TTL,
                      now_ms=NOW + 50)
    assert change.run.status is RunStatus.RUNNING
    assert change.attempts[0].status is AttemptStatus.STARTING
    assert change.attempts[0].started_at_ms == NOW + 50
    assert change.lease is not None and change.lease.version == lease.version
    assert change.event.type is EventType.ATTEMPT_ACTIVATED


def test_activate_needs_an_accepted_offer_and_a_claimed_attempt() -> None:
    run, attempt, lease = offered()
    fence = LeaseFence(attempt_id=attempt.id, generation=1, version=1, token=TOKEN)
    with pytest.raises(FenceRejected) as raised:
        activate(run=run, attempt=attempt, lease=lease, fence=fence, ttl_ms=TTL, now_ms=NOW + 5)
    assert raised.value.reason is FenceReason.TOKEN_MISMATCH
    run, attempt, lease, fence = started()
    with pytest.raises(InvalidTransition):
        activate(run=run, attempt=attempt, lease=lease, fence=fence, ttl_ms=TTL, now_ms=NOW + 5)


def test_mark_running_from_starting_only() -> None:
    run, attempt, lease, fence = started()
    change = mark_running(run=run, attempt=attempt, lease=lease, fence=fence, now_ms=NOW + 9)
    assert change.attempts[0].status is AttemptStatus.RUNNING
    assert change.run.status is RunStatus.RUNNING
    assert change.event.type is EventType.ATTEMPT_RUNNING
    run, attempt, lease, fence = accepted()
    with pytest.raises(InvalidTransition):
        mark_running(run=run, attempt=attempt, lease=lease, fence=fence, now_ms=NOW + 9)


def test_renew_moves_only_expires_at() -> None:
    _, attempt, lease, fence = running()
    renewed = renew(attempt=attempt, lease=lease, fence=fence, ttl_ms=TTL, now_ms=NOW + 20_000)
    assert renewed.expires_at_ms == NOW + 20_000 + TTL
    assert renewed == evolve(lease, expires_at_ms=NOW + 20_000 + TTL)
    assert renewed.version == lease.version


def test_renew_never_shortens_and_refuses_stale_fences_and_terminal_attempts() -> None:
    _, attempt, lease, fence = running()
    renewed = renew(attempt=attempt, lease=lease, fence=fence, ttl_ms=1, now_ms=NOW + 4)
    assert renewed.expires_at_ms == lease.expires_at_ms
    with pytest.raises(FenceRejected) as raised:
        renew(attempt=attempt, lease=lease, fence=evolve(fence, version=2), ttl_ms=TTL,
              now_ms=NOW + 4)
    assert raised.value.reason is FenceReason.VERSION_MISMATCH
    with pytest.raises(FenceRejected) as raised:
        renew(attempt=attempt, lease=lease, fence=fence, ttl_ms=TTL, now_ms=lease.expires_at_ms)
    assert raised.value.reason is FenceReason.EXPIRED
    with pytest.raises(InvalidTransition):
        renew(attempt=evolve(attempt, status=AttemptStatus.SUCCEEDED), lease=lease,
              fence=fence, ttl_ms=TTL, now_ms=NOW + 4)


# --- complete, abandon, mark_lost, cancel --------------------------------------------------------


@pytest.mark.parametrize("succeeded", [True, False])
def test_complete_releases_the_lease_with_reason_completed(succeeded: bool) -> None:
    run, attempt, lease, fence = running()
    change = complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=succeeded,
                      output={"ok": 1}, error="boom", now_ms=NOW + 100)
    released = change.lease
    assert released is not None
    assert released.status is LeaseStatus.RELEASED
    assert released.version == lease.version + 1
    assert released.release_reason is ReleaseReason.COMPLETED
    assert released.released_at_ms == NOW + 100
    new_attempt = change.attempts[0]
    assert new_attempt.lease_version == released.version
    assert new_attempt.finished_at_ms == NOW + 100
    if succeeded:
        assert change.run.status is RunStatus.SUCCEEDED
        assert new_attempt.status is AttemptStatus.SUCCEEDED
        assert change.run.output == {"ok": 1}
        assert change.event.type is EventType.ATTEMPT_SUCCEEDED
    else:
        assert change.run.status is RunStatus.FAILED
        assert new_attempt.status is AttemptStatus.FAILED
        assert change.run.error == "boom"
        assert change.event.type is EventType.ATTEMPT_FAILED


def test_complete_from_starting_is_allowed_and_from_claimed_refused() -> None:
    run, attempt, lease, fence = started()
    change = complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=True,
                      output=None, error=None, now_ms=NOW + 10)
    assert change.run.status is RunStatus.SUCCEEDED
    run, attempt, lease, fence = accepted()
    with pytest.raises(InvalidTransition):
        complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=True,
                 output=None, error=None, now_ms=NOW + 10)


def test_abandon_with_live_lease_loses_the_attempt_at_once() -> None:
    run, attempt, lease, fence = running()
    change = abandon(run=run, attempt=attempt, lease=lease, fence=fence, detail="oom",
                     now_ms=NOW + 30)
    assert change.run.status is RunStatus.LOST
    new_attempt = change.attempts[0]
    assert new_attempt.status is AttemptStatus.LOST
    assert new_attempt.lost_evidence is EvidenceKind.WORKER_ABANDONED
    assert change.lease is not None
    assert change.lease.status is LeaseStatus.RELEASED
    assert change.lease.release_reason is ReleaseReason.ABANDONED
    assert change.lease.version == lease.version + 1
    assert new_attempt.lease_version == lease.version + 1
    assert change.event.type is EventType.ATTEMPT_LOST
    assert change.event.data["evidence"] == "worker_abandoned"
    assert change.event.data["evidence_detail"] == "oom"


def test_abandon_with_a_stale_fence_is_rejected() -> None:
    run, attempt, lease, fence = running()
    with pytest.raises(FenceRejected) as raised:
        abandon(run=run, attempt=attempt, lease=lease, fence=evolve(fence, token=OTHER_TOKEN),
                detail="", now_ms=NOW + 30)
    assert raised.value.reason is FenceReason.TOKEN_MISMATCH


def test_mark_lost_of_a_started_attempt_needs_evidence() -> None:
    run, attempt, lease, _ = running()
    with pytest.raises(InvalidTransition):
        mark_lost(run=run, attempt=attempt, lease=lease, evidence=None,
                  release_reason=ReleaseReason.LEASE_EXPIRED, now_ms=NOW + TTL * 2, cause="x")


def test_mark_lost_of_a_claimed_attempt_without_evidence_releases_its_lease() -> None:
    run, attempt, lease, _ = accepted()
    change = mark_lost(run=run, attempt=attempt, lease=lease, evidence=None,
                       release_reason=ReleaseReason.LEASE_EXPIRED, now_ms=NOW + TTL * 2,
                       cause="lease_expired")
    assert change.attempts[0].status is AttemptStatus.LOST
    assert change.lease is not None and change.lease.version == lease.version + 1
    assert "evidence" not in change.event.data


def test_mark_lost_ignores_a_lease_of_another_generation() -> None:
    run, attempt, lease, _ = accepted()
    other = evolve(lease, generation=lease.generation + 1)
    change = mark_lost(run=run, attempt=attempt, lease=other, evidence=None,
                       release_reason=ReleaseReason.LEASE_EXPIRED, now_ms=NOW + TTL * 2,
                       cause="lease_expired")
    assert change.lease is None
    assert change.attempts[0].lease_version == attempt.lease_version


def test_cancel_releases_the_live_lease_and_cancels_the_attempt() -> None:
    run, attempt, lease, _ = running()
    change = cancel(run=run, attempt=attempt, lease=lease, reason="op", now_ms=NOW + 40)
    assert change.run.status is RunStatus.CANCELLED
    assert change.attempts[0].status is AttemptStatus.CANCELLED
    assert change.lease is not None
    assert change.lease.release_reason is ReleaseReason.CANCELLED
    assert change.lease.version == lease.version + 1
    assert change.attempts[0].lease_version == lease.version + 1
    assert change.event.type is EventType.RUN_CANCELLED


def test_cancel_of_a_queued_run_and_of_a_terminal_run() -> None:
    run, attempt = queued()
    change = cancel(run=run, attempt=attempt, lease=None, reason="op", now_ms=NOW)
    assert change.run.status is RunStatus.CANCELLED
    assert change.lease is None
    assert change.attempts[0].status is AttemptStatus.CANCELLED
    with pytest.raises(InvalidTransition):
        cancel(run=change.run, attempt=change.attempts[0], lease=None, reason="x", now_ms=NOW)


def test_cancel_of_a_retry_wait_run_leaves_the_lost_attempt_alone() -> None:
    run, attempt = queued()
    lost_attempt = evolve(attempt, status=AttemptStatus.LOST)
    waiting = evolve(run, status=RunStatus.RETRY_WAIT, next_attempt_at_ms=NOW + 5)
    change = cancel(run=waiting, attempt=lost_attempt, lease=None, reason="op", now_ms=NOW)
    assert change.attempts == ()
    assert change.run.status is RunStatus.CANCELLED
    assert change.run.next_attempt_at_ms is None
    assert change.event.attempt_id == lost_attempt.id


# --- fence --------------------------------------------------------------------------------------


def test_check_fence_accepts_the_exact_live_lease() -> None:
    _, _, lease, fence = running()
    assert check_fence(lease, fence, NOW + 10) == lease
    assert check_holder(lease, fence) == lease


def test_check_fence_every_reason() -> None:
    _, _, lease, fence = running()
    now = NOW + 10
    cases = [
        (None, fence, FenceReason.NO_LEASE),
        (lease, evolve(fence, attempt_id="other"), FenceReason.ATTEMPT_MISMATCH),
        (lease, evolve(fence, generation=2), FenceReason.GENERATION_MISMATCH),
        (lease, evolve(fence, token=OTHER_TOKEN), FenceReason.TOKEN_MISMATCH),
        (evolve(lease, token_hash=None), fence, FenceReason.TOKEN_MISMATCH),
        (lease, evolve(fence, version=2), FenceReason.VERSION_MISMATCH),
        (evolve(lease, status=LeaseStatus.RELEASED), fence, FenceReason.RELEASED),
        (evolve(lease, expires_at_ms=now), fence, FenceReason.EXPIRED),
    ]
    seen = set()
    for candidate, presented, reason in cases:
        with pytest.raises(FenceRejected) as raised:
            check_fence(candidate, presented, now)
        assert raised.value.reason is reason, (presented, reason)
        assert raised.value.attempt_id == presented.attempt_id
        seen.add(reason)
    assert seen == set(FenceReason)


def test_token_hash_is_sha256_and_compared_in_constant_time() -> None:
    assert len(hash_token(TOKEN)) == 64
    assert secrets_match(TOKEN, hash_token(TOKEN))
    assert not secrets_match(OTHER_TOKEN, hash_token(TOKEN))


def test_not_running_evidence_as_data() -> None:
    evidence = NotRunningEvidence(attempt_id="a", kind=EvidenceKind.SESSION_CLOSED,
                                  observed_at_ms=3, detail="d")
    assert evidence.as_data() == {
        "evidence": "session_closed", "evidence_observed_at_ms": 3, "evidence_detail": "d"
    }
