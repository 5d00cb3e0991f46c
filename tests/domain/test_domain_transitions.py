"""Unit tests of the pure Run / Attempt / DispatchLease transitions."""

from __future__ import annotations

import pytest
from attrs import evolve

from ql3.domain.errors import (
    FenceReason,
    FenceRejected,
    InvalidAdmission,
    InvalidRetryPolicy,
    InvalidTransition,
    SessionRejected,
)
from ql3.domain.events import EventType
from ql3.domain.fence import check_fence, check_holder, hash_token, secrets_match
from ql3.domain.model import (
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    NotRunningEvidence,
    ReleaseReason,
    RunStatus,
    SessionStatus,
)
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from ql3.domain.transitions import (
    abandon,
    admit,
    cancel,
    claim,
    complete,
    create_first_attempt,
    mark_lost,
    release,
    renew,
)
from tests.domain.builders import (
    NOW,
    OTHER_TOKEN,
    TOKEN,
    TTL,
    legacy_offered,
    legacy_started,
    queued,
    running,
    session,
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


@pytest.mark.parametrize("task", ["", " t", "t ", "x" * 201, "a\x00b"])
def test_admit_refuses_invalid_task_names(task: str) -> None:
    with pytest.raises(InvalidAdmission):
        admit(run_id="r", attempt_id="a", task=task, input=None, policy=None, now_ms=0)


@pytest.mark.parametrize(
    "value", ["\x00", ["ok", "a\x00"], {"k\x00": 1}, {"k": {"n": "\x00"}}]
)
def test_nul_characters_are_refused_in_inputs_and_outputs(value: object) -> None:
    with pytest.raises(InvalidAdmission):
        admit(run_id="r", attempt_id="a", task="t", input=value,  # type: ignore[arg-type]
              policy=None, now_ms=NOW)
    run, attempt, lease, fence = running()
    with pytest.raises(InvalidAdmission):
        complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=True,
                 output=value, error=None, now_ms=NOW + 1)  # type: ignore[arg-type]


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


# --- claim --------------------------------------------------------------------------------------


def _claim(run, attempt, *, previous=None, sess=None, now=NOW):  # type: ignore[no-untyped-def]
    return claim(run=run, attempt=attempt, previous_lease=previous, session=sess or session(),
                 token_hash=hash_token(TOKEN), ttl_ms=TTL, now_ms=now)


def test_claim_starts_a_queued_run_under_a_new_lease_in_one_change() -> None:
    run, attempt = queued()
    change = _claim(run, attempt)
    lease = change.lease
    assert lease is not None
    assert (lease.generation, lease.version, lease.status) == (1, 1, LeaseStatus.LEASED)
    assert lease.token_hash == hash_token(TOKEN) and lease.token_hash != TOKEN
    assert lease.holder_session_id == "s1"
    assert lease.expires_at_ms == NOW + TTL
    assert change.run.status is RunStatus.RUNNING
    (new_attempt,) = change.attempts
    assert new_attempt.status is AttemptStatus.RUNNING
    assert new_attempt.status.is_started
    assert (new_attempt.session_id, new_attempt.worker_id) == ("s1", "w1")
    assert (new_attempt.lease_generation, new_attempt.lease_version) == (1, 1)
    assert new_attempt.offered_at_ms == new_attempt.started_at_ms == NOW
    assert not new_attempt.is_pristine
    assert change.event.type is EventType.ATTEMPT_STARTED
    assert change.event.data == {"session_id": "s1", "worker_id": "w1", "generation": 1}


def test_claim_numbers_generations_after_a_released_previous_lease() -> None:
    _, _, old, _ = running()
    released = evolve(old, generation=3, version=2, status=LeaseStatus.RELEASED)
    run, attempt = queued()
    change = _claim(run, attempt, previous=released)
    assert change.lease is not None
    assert (change.lease.generation, change.lease.version) == (4, 1)


def test_claim_refusals() -> None:
    run, _, lease, _ = running()
    fresh_run, fresh_attempt = queued()
    with pytest.raises(InvalidTransition):  # run not queued
        _claim(run, fresh_attempt)
    with pytest.raises(InvalidTransition):  # attempt not pristine
        _claim(fresh_run, evolve(fresh_attempt, offered_at_ms=1))
    offered_run, offered_attempt, _, _ = legacy_offered()
    with pytest.raises(InvalidTransition):  # offered under the old protocol
        _claim(offered_run, offered_attempt)
    for status in (SessionStatus.DRAINING, SessionStatus.CLOSED, SessionStatus.REPLACED):
        with pytest.raises(SessionRejected):
            _claim(fresh_run, fresh_attempt, sess=session(status=status))
    with pytest.raises(SessionRejected):
        _claim(fresh_run, fresh_attempt, sess=session(tasks=("other",)))
    with pytest.raises(InvalidTransition):  # the previous lease is still leased
        _claim(fresh_run, fresh_attempt, previous=lease)


# --- release ------------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [running, legacy_offered, legacy_started])
def test_release_hands_an_unstarted_attempt_back_without_a_verdict(build) -> None:  # type: ignore[no-untyped-def]
    run, attempt, lease, _ = build()
    change = release(run=run, attempt=attempt, lease=lease, session_id="s1", cause="drain",
                     now_ms=NOW + 7)
    assert change.run.status is RunStatus.QUEUED
    (back,) = change.attempts
    assert back.is_pristine and back.id == attempt.id and back.number == attempt.number
    assert back.lost_evidence is None
    released = change.lease
    assert released is not None
    assert released.status is LeaseStatus.RELEASED
    assert released.release_reason is ReleaseReason.HANDED_BACK
    assert released.version == lease.version + 1
    assert change.event.type is EventType.ATTEMPT_RELEASED
    assert change.event.data["cause"] == "drain"
    assert change.event.data["previous_status"] == attempt.status.value
    # the Run can be claimed again, under the next generation
    again = _claim(change.run, back, previous=released, now=NOW + 8)
    assert again.lease is not None and again.lease.generation == lease.generation + 1


def test_release_of_an_expired_lease_is_allowed() -> None:
    run, attempt, lease, _ = running()
    change = release(run=run, attempt=attempt, lease=lease, session_id="s1", cause="x",
                     now_ms=lease.expires_at_ms + 1)
    assert change.run.status is RunStatus.QUEUED


def test_release_refusals() -> None:
    run, attempt, lease, _ = running()
    with pytest.raises(SessionRejected):
        release(run=run, attempt=attempt, lease=lease, session_id="s2", cause="x", now_ms=NOW)
    with pytest.raises(FenceRejected) as raised:
        release(run=run, attempt=attempt, lease=evolve(lease, status=LeaseStatus.RELEASED),
                session_id="s1", cause="x", now_ms=NOW)
    assert raised.value.reason is FenceReason.RELEASED
    with pytest.raises(FenceRejected) as raised:
        release(run=run, attempt=attempt, lease=None, session_id="s1", cause="x", now_ms=NOW)
    assert raised.value.reason is FenceReason.NO_LEASE
    done = complete(run=run, attempt=attempt, lease=lease, fence=running()[3], succeeded=True,
                    output=None, error=None, now_ms=NOW + 1)
    with pytest.raises(InvalidTransition):
        release(run=done.run, attempt=done.attempts[0], lease=lease, session_id="s1",
                cause="x", now_ms=NOW + 2)
    queued_run, queued_attempt = queued()
    with pytest.raises(InvalidTransition):
        release(run=queued_run, attempt=queued_attempt, lease=None, session_id="s1",
                cause="x", now_ms=NOW)


# --- renew --------------------------------------------------------------------------------------


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
    run, attempt, lease, fence = legacy_started()
    change = complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=True,
                      output=None, error=None, now_ms=NOW + 10)
    assert change.run.status is RunStatus.SUCCEEDED
    run, attempt, lease, fence = legacy_offered()
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
    run, attempt, lease, _ = legacy_offered()
    change = mark_lost(run=run, attempt=attempt, lease=lease, evidence=None,
                       release_reason=ReleaseReason.LEASE_EXPIRED, now_ms=NOW + TTL * 2,
                       cause="lease_expired")
    assert change.attempts[0].status is AttemptStatus.LOST
    assert change.lease is not None and change.lease.version == lease.version + 1
    assert "evidence" not in change.event.data


def test_mark_lost_ignores_a_lease_of_another_generation() -> None:
    run, attempt, lease, _ = legacy_offered()
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
        # released because its Run was cancelled: the holder is told so, whatever its version
        (
            evolve(lease, status=LeaseStatus.RELEASED, release_reason=ReleaseReason.CANCELLED),
            fence,
            FenceReason.CANCELLED,
        ),
        (
            evolve(
                lease,
                status=LeaseStatus.RELEASED,
                release_reason=ReleaseReason.CANCELLED,
                version=lease.version + 1,
            ),
            fence,
            FenceReason.CANCELLED,
        ),
        (
            evolve(lease, status=LeaseStatus.RELEASED, release_reason=ReleaseReason.CANCELLED),
            evolve(fence, token=OTHER_TOKEN),
            FenceReason.TOKEN_MISMATCH,
        ),
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
