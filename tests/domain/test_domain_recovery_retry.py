"""Recovery resolution, not-running evidence, the retry decision and the lost-retry builder,
backoff and sessions."""

from __future__ import annotations

import pytest
from attrs import evolve

from ql3.domain.errors import InvalidAdmission, InvalidTransition, NotDue
from ql3.domain.events import EventType
from ql3.domain.model import (
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    NotRunningEvidence,
    ReleaseReason,
    RunOwner,
    RunStatus,
    SessionStatus,
    StopReport,
)
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from ql3.domain.recovery import (
    RecoveryHold,
    find_not_running_evidence,
    is_recovery_candidate,
    resolve_recovery,
)
from ql3.domain.retry import (
    FailureReason,
    RetryCause,
    decide_retry,
    settle_lost_run,
    start_next_attempt,
)
from ql3.domain.sessions import close, drain, heartbeat, register_session
from ql3.domain.transitions import mark_lost
from tests.domain.builders import (
    NOW,
    TTL,
    legacy_offered,
    legacy_started,
    queued,
    running,
    session,
)

EXPIRED = NOW + 10 * TTL


def _evidence(kind: EvidenceKind, attempt_id: str) -> NotRunningEvidence:
    return NotRunningEvidence(attempt_id=attempt_id, kind=kind, observed_at_ms=NOW + 5,
                              detail=f"{kind.value} detail")


# --- resolve_recovery ---------------------------------------------------------------------------


def test_expired_claimed_attempt_becomes_lost_and_its_lease_is_released() -> None:
    run, attempt, lease, _ = legacy_offered()
    resolution = resolve_recovery(run=run, attempt=attempt, lease=lease, evidence=None,
                                  now_ms=EXPIRED)
    assert resolution.recovered and resolution.hold is None
    change = resolution.change
    assert change is not None
    assert change.run.status is RunStatus.LOST
    assert change.attempts[0].status is AttemptStatus.LOST
    assert change.lease is not None
    assert change.lease.status is LeaseStatus.RELEASED
    assert change.lease.version == lease.version + 1
    assert change.lease.generation == lease.generation
    assert change.lease.release_reason is ReleaseReason.LEASE_EXPIRED
    assert change.attempts[0].lease_version == lease.version + 1
    assert change.event.type is EventType.ATTEMPT_LOST
    assert change.event.data["release_reason"] == "lease_expired"
    assert change.event.data["lease_version"] == lease.version + 1


@pytest.mark.parametrize("build", [legacy_started, running])
def test_expired_started_attempt_without_evidence_is_held(build) -> None:  # type: ignore[no-untyped-def]
    run, attempt, lease, _ = build()
    resolution = resolve_recovery(run=run, attempt=attempt, lease=lease, evidence=None,
                                  now_ms=EXPIRED)
    assert resolution.change is None
    assert resolution.hold is RecoveryHold.AWAITING_EVIDENCE


@pytest.mark.parametrize("kind", list(EvidenceKind))
@pytest.mark.parametrize("build", [legacy_started, running])
def test_expired_started_attempt_with_evidence_is_lost(build, kind: EvidenceKind) -> None:  # type: ignore[no-untyped-def]
    run, attempt, lease, _ = build()
    resolution = resolve_recovery(run=run, attempt=attempt, lease=lease,
                                  evidence=_evidence(kind, attempt.id), now_ms=EXPIRED)
    change = resolution.change
    assert change is not None
    assert change.attempts[0].status is AttemptStatus.LOST
    assert change.attempts[0].lost_evidence is kind
    assert change.event.data["evidence"] == kind.value
    assert change.event.data["evidence_detail"] == f"{kind.value} detail"
    assert change.event.data["previous_status"] == attempt.status.value
    assert change.lease is not None and change.lease.version == lease.version + 1


def test_live_lease_is_held_as_lease_live() -> None:
    run, attempt, lease, _ = running()
    resolution = resolve_recovery(run=run, attempt=attempt, lease=lease,
                                  evidence=_evidence(EvidenceKind.SESSION_CLOSED, attempt.id),
                                  now_ms=NOW + 10)
    assert resolution.change is None
    assert resolution.hold is RecoveryHold.LEASE_LIVE


def test_pristine_and_workflow_owned_attempts_are_not_candidates() -> None:
    run, attempt = queued()
    resolution = resolve_recovery(run=run, attempt=attempt, lease=None, evidence=None,
                                  now_ms=EXPIRED)
    assert resolution.hold is RecoveryHold.NOT_A_CANDIDATE
    run, attempt, lease, _ = legacy_offered(owner=RunOwner.WORKFLOW)
    assert not is_recovery_candidate(run, attempt, lease, EXPIRED)
    resolution = resolve_recovery(run=run, attempt=attempt, lease=lease, evidence=None,
                                  now_ms=EXPIRED)
    assert resolution.change is None
    assert resolution.hold is RecoveryHold.NOT_A_CANDIDATE


def test_terminal_attempts_are_not_candidates() -> None:
    run, attempt, lease, _ = running()
    done = evolve(attempt, status=AttemptStatus.SUCCEEDED)
    assert not is_recovery_candidate(evolve(run, status=RunStatus.SUCCEEDED), done, lease,
                                     EXPIRED)


def test_missing_lease_is_lost_without_inventing_a_release() -> None:
    run, attempt, _, _ = legacy_offered()
    resolution = resolve_recovery(run=run, attempt=attempt, lease=None, evidence=None,
                                  now_ms=NOW + 1)
    change = resolution.change
    assert change is not None
    assert change.lease is None
    assert change.attempts[0].status is AttemptStatus.LOST
    assert change.attempts[0].lease_version == attempt.lease_version
    assert "release_reason" not in change.event.data
    assert "lease_version" not in change.event.data


def test_started_attempt_with_missing_lease_still_needs_evidence() -> None:
    run, attempt, _, _ = running()
    resolution = resolve_recovery(run=run, attempt=attempt, lease=None, evidence=None,
                                  now_ms=NOW + 1)
    assert resolution.hold is RecoveryHold.AWAITING_EVIDENCE


# --- find_not_running_evidence ------------------------------------------------------------------


def test_stop_reports_come_first_earliest_first() -> None:
    _, attempt, _, _ = running()
    reports = [
        StopReport(attempt_id=attempt.id, kind=EvidenceKind.OPERATOR_ATTESTED,
                   reported_at_ms=NOW + 9, detail="op"),
        StopReport(attempt_id=attempt.id, kind=EvidenceKind.WORKER_ABANDONED,
                   reported_at_ms=NOW + 4, detail="w"),
        StopReport(attempt_id="other", kind=EvidenceKind.OPERATOR_ATTESTED, reported_at_ms=1),
    ]
    closed = session(status=SessionStatus.CLOSED, closed_at_ms=2)
    evidence = find_not_running_evidence(attempt, closed, reports)
    assert evidence is not None
    assert (evidence.kind, evidence.observed_at_ms, evidence.detail) == (
        EvidenceKind.WORKER_ABANDONED, NOW + 4, "w"
    )


def test_a_stop_report_from_before_the_current_start_is_no_evidence() -> None:
    """Attested while pristine (or before a hand-back), then claimed and started again under
    the same id: the old report says nothing about what runs now."""
    _, pristine = queued()
    attested = StopReport(attempt_id=pristine.id, kind=EvidenceKind.OPERATOR_ATTESTED,
                          reported_at_ms=NOW - 1, detail="before the claim")
    run, started, lease, _ = running()
    assert started.id == pristine.id and started.started_at_ms == NOW
    assert find_not_running_evidence(started, session(), [attested]) is None
    resolution = resolve_recovery(
        run=run, attempt=started, lease=lease, evidence=None, now_ms=EXPIRED
    )
    assert resolution.hold is RecoveryHold.AWAITING_EVIDENCE
    again = evolve(attested, reported_at_ms=NOW)
    evidence = find_not_running_evidence(started, session(), [attested, again])
    assert evidence is not None and evidence.observed_at_ms == NOW


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (SessionStatus.CLOSED, EvidenceKind.SESSION_CLOSED),
        (SessionStatus.REPLACED, EvidenceKind.SESSION_REPLACED),
        (SessionStatus.ACTIVE, None),
        (SessionStatus.DRAINING, None),
    ],
)
def test_session_status_as_evidence(status: SessionStatus, kind: EvidenceKind | None) -> None:
    _, attempt, _, _ = running()
    evidence = find_not_running_evidence(attempt, session(status=status, closed_at_ms=77), [])
    assert (evidence.kind if evidence else None) is kind
    if evidence is not None:
        assert evidence.observed_at_ms == 77


def test_reports_of_other_attempts_and_other_sessions_are_no_evidence() -> None:
    _, attempt, _, _ = running()
    other_report = StopReport(attempt_id="x", kind=EvidenceKind.WORKER_ABANDONED,
                              reported_at_ms=1)
    foreign = session(session_id="s9", status=SessionStatus.CLOSED, closed_at_ms=1)
    assert find_not_running_evidence(attempt, foreign, [other_report]) is None
    assert find_not_running_evidence(attempt, None, []) is None


# --- decide_retry -------------------------------------------------------------------------------


def _decide(
    policy: RetryPolicy | None, number: int = 1, cause: RetryCause = RetryCause.LOST
) -> FailureReason | None:
    return decide_retry(run_id="r", policy=policy, cause=cause, attempt_number=number,
                        now_ms=NOW).failure


SAFE = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)
SAFE_ON_ERROR = RetryPolicy(retry_on_error=True, max_attempts=3, safety=Safety.IDEMPOTENT)


def test_each_failure_rule() -> None:
    assert _decide(None) is FailureReason.NO_POLICY
    assert _decide(evolve(SAFE, retry_on_lost=False)) is FailureReason.RETRY_ON_LOST_DISABLED
    assert _decide(evolve(SAFE, max_attempts=1)) is FailureReason.MAX_ATTEMPTS_TOO_LOW
    assert _decide(evolve(SAFE, safety=None)) is FailureReason.SAFETY_UNDECLARED
    assert _decide(evolve(SAFE, safety=Safety.UNSAFE)) is FailureReason.UNSAFE
    assert _decide(SAFE, number=3) is FailureReason.ATTEMPTS_EXHAUSTED
    assert _decide(SAFE, number=4) is FailureReason.ATTEMPTS_EXHAUSTED


@pytest.mark.parametrize("cause", [RetryCause.ERROR, RetryCause.TIMEOUT])
def test_errors_and_timeouts_follow_retry_on_error(cause: RetryCause) -> None:
    assert _decide(None, cause=cause) is FailureReason.NO_POLICY
    assert _decide(SAFE, cause=cause) is FailureReason.RETRY_ON_ERROR_DISABLED
    assert _decide(SAFE_ON_ERROR, cause=cause) is None
    assert _decide(SAFE_ON_ERROR, number=2, cause=cause) is None
    assert _decide(SAFE_ON_ERROR, number=3, cause=cause) is FailureReason.ATTEMPTS_EXHAUSTED
    assert _decide(evolve(SAFE_ON_ERROR, max_attempts=1), cause=cause) is (
        FailureReason.MAX_ATTEMPTS_TOO_LOW
    )
    # retry on error does not retry a lost Attempt, nor retry on lost a failed one
    assert _decide(SAFE_ON_ERROR) is FailureReason.RETRY_ON_LOST_DISABLED


def test_the_order_of_the_rules_matters() -> None:
    unsafe_and_exhausted = evolve(SAFE, safety=Safety.UNSAFE)
    assert _decide(unsafe_and_exhausted, number=3) is FailureReason.UNSAFE
    undeclared_and_exhausted = evolve(SAFE, safety=None)
    assert _decide(undeclared_and_exhausted, number=3) is FailureReason.SAFETY_UNDECLARED
    disabled_low_unsafe = RetryPolicy(retry_on_lost=False, max_attempts=1, safety=Safety.UNSAFE)
    assert _decide(disabled_low_unsafe) is FailureReason.RETRY_ON_LOST_DISABLED
    low_and_unsafe = RetryPolicy(retry_on_lost=True, max_attempts=1, safety=Safety.UNSAFE)
    assert _decide(low_and_unsafe) is FailureReason.MAX_ATTEMPTS_TOO_LOW


@pytest.mark.parametrize("safety", [Safety.IDEMPOTENT, Safety.DEDUPLICATED])
def test_safe_policies_with_attempts_left_retry_after_the_backoff(safety: Safety) -> None:
    policy = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=safety,
                         backoff=Backoff(initial_ms=500, multiplier=3.0, cap_ms=10_000))
    first = decide_retry(run_id="r", policy=policy, cause=RetryCause.LOST, attempt_number=1,
                         now_ms=NOW)
    second = decide_retry(run_id="r", policy=policy, cause=RetryCause.LOST, attempt_number=2,
                          now_ms=NOW)
    assert first.retry and first.next_attempt_at_ms == NOW + 500
    assert second.retry and second.next_attempt_at_ms == NOW + 1_500


# --- settle_lost_run / start_next_attempt -------------------------------------------------------


def _lost(policy: RetryPolicy | None):  # type: ignore[no-untyped-def]
    run, attempt, lease, _ = legacy_offered(policy=policy)
    change = mark_lost(run=run, attempt=attempt, lease=lease, evidence=None,
                       release_reason=ReleaseReason.LEASE_EXPIRED, now_ms=EXPIRED,
                       cause="lease_expired")
    return change.run, change.attempts[0]


def test_settle_lost_run_fails_without_a_safe_policy() -> None:
    run, attempt = _lost(None)
    change = settle_lost_run(run=run, lost_attempt=attempt, now_ms=EXPIRED + 1)
    assert change.run.status is RunStatus.FAILED
    assert change.run.error is not None and "no_policy" in change.run.error
    assert change.event.type is EventType.RUN_FAILED
    assert change.event.data["reason"] == "no_policy"
    assert change.attempts == () and change.lease is None


def test_settle_lost_run_schedules_a_retry_for_a_safe_policy() -> None:
    run, attempt = _lost(SAFE)
    change = settle_lost_run(run=run, lost_attempt=attempt, now_ms=EXPIRED + 1)
    assert change.run.status is RunStatus.RETRY_WAIT
    assert change.run.next_attempt_at_ms == EXPIRED + 1 + SAFE.backoff.delay_ms(run.id, 1)
    assert change.event.type is EventType.RETRY_SCHEDULED
    assert change.event.data["next_attempt"] == 2


def test_settle_lost_run_refuses_other_states() -> None:
    run, attempt = _lost(SAFE)
    with pytest.raises(InvalidTransition):
        settle_lost_run(run=evolve(run, status=RunStatus.RUNNING), lost_attempt=attempt,
                        now_ms=EXPIRED)
    with pytest.raises(InvalidTransition):
        settle_lost_run(run=run, lost_attempt=evolve(attempt, status=AttemptStatus.RUNNING),
                        now_ms=EXPIRED)
    with pytest.raises(InvalidTransition):
        settle_lost_run(run=evolve(run, attempt_count=2), lost_attempt=attempt, now_ms=EXPIRED)
    with pytest.raises(InvalidTransition):
        settle_lost_run(run=evolve(run, owner=RunOwner.WORKFLOW), lost_attempt=attempt,
                        now_ms=EXPIRED)


def test_start_next_attempt_is_fresh_and_due_only_at_next_attempt_at() -> None:
    run, attempt = _lost(SAFE)
    waiting = settle_lost_run(run=run, lost_attempt=attempt, now_ms=EXPIRED).run
    due = waiting.next_attempt_at_ms
    assert due is not None
    with pytest.raises(NotDue):
        start_next_attempt(run=waiting, attempt_id="a2", now_ms=due - 1)
    change = start_next_attempt(run=waiting, attempt_id="a2", now_ms=due)
    assert change.run.status is RunStatus.QUEUED
    assert change.run.attempt_count == 2
    assert change.run.next_attempt_at_ms is None
    (fresh,) = change.attempts
    assert fresh.number == 2 and fresh.id == "a2"
    assert fresh.is_pristine
    for name in ("session_id", "worker_id", "lease_generation", "lease_version",
                 "offered_at_ms", "accepted_at_ms", "started_at_ms", "finished_at_ms",
                 "lost_evidence", "error"):
        assert getattr(fresh, name) is None, name
    assert change.lease is None
    assert change.event.type is EventType.ATTEMPT_CREATED
    with pytest.raises(InvalidTransition):
        start_next_attempt(run=change.run, attempt_id="a3", now_ms=due)


# --- Backoff ------------------------------------------------------------------------------------


def test_backoff_is_exponential_and_capped() -> None:
    backoff = Backoff(initial_ms=100, multiplier=2.0, cap_ms=1_000)
    assert [backoff.delay_ms("r", n) for n in range(1, 7)] == [100, 200, 400, 800, 1000, 1000]
    assert backoff.delay_ms("r", 0) == 100


def test_backoff_jitter_is_deterministic_and_bounded() -> None:
    backoff = Backoff(initial_ms=1_000, multiplier=2.0, cap_ms=100_000, jitter=0.5)
    for n in range(1, 6):
        base = 1_000 * 2 ** (n - 1)
        for run_id in ("a", "b", "c"):
            value = backoff.delay_ms(run_id, n)
            assert value == backoff.delay_ms(run_id, n)
            assert base * 0.5 <= value <= base * 1.5
    values = {backoff.delay_ms(f"run-{i}", 1) for i in range(20)}
    assert len(values) > 1
    assert Backoff(initial_ms=1_000, cap_ms=1_000, jitter=1.0).delay_ms("x", 1) <= 1_000


def test_backoff_without_jitter_does_not_depend_on_the_run() -> None:
    backoff = Backoff(initial_ms=300, multiplier=1.5, cap_ms=10_000)
    assert {backoff.delay_ms(f"r{i}", 3) for i in range(10)} == {675}


def test_backoff_stays_at_the_cap_for_large_attempt_numbers() -> None:
    """max_attempts may be up to 1000: the delay before attempt 700 is the cap, not an
    OverflowError that would wedge the lost-retry step on its head candidate forever."""
    backoff = Backoff(initial_ms=1_000, multiplier=10.0, cap_ms=60_000)
    assert backoff.delay_ms("r", 700) == 60_000


# --- sessions -----------------------------------------------------------------------------------


def test_register_session_replaces_open_sessions_of_the_same_worker() -> None:
    old_active = session(session_id="s1")
    old_draining = session(session_id="s2", status=SessionStatus.DRAINING)
    other_worker = session(session_id="s3", worker_id="w2")
    closed = session(session_id="s4", status=SessionStatus.CLOSED, closed_at_ms=1)
    new, replaced = register_session(
        session_id="s5", worker_id="w1", capacity=3, tasks=["b", "a", "a"], secret_hash="h",
        existing=[old_active, old_draining, other_worker, closed], now_ms=NOW,
    )
    assert new.status is SessionStatus.ACTIVE
    assert new.tasks == ("a", "b")
    assert new.last_heartbeat_at_ms == NOW
    assert {s.id for s in replaced} == {"s1", "s2"}
    assert all(s.status is SessionStatus.REPLACED and s.closed_at_ms == NOW for s in replaced)


@pytest.mark.parametrize(
    ("worker_id", "capacity", "tasks"),
    [("", 1, ["t"]), ("w" * 201, 1, ["t"]), ("w", 0, ["t"]), ("w", 1025, ["t"]),
     ("w", 1, []), ("w", 1, [""])],
)
def test_register_session_validation(worker_id: str, capacity: int, tasks: list[str]) -> None:
    with pytest.raises(InvalidAdmission):
        register_session(session_id="s", worker_id=worker_id, capacity=capacity, tasks=tasks,
                         secret_hash="h", existing=[], now_ms=NOW)


def test_heartbeat_drain_close() -> None:
    active = session()
    beat = heartbeat(active, NOW + 100)
    assert beat.last_heartbeat_at_ms == NOW + 100
    assert heartbeat(beat, NOW).last_heartbeat_at_ms == NOW + 100  # never goes back
    drained = drain(beat, NOW + 200)
    assert drained.status is SessionStatus.DRAINING and not drained.accepts_work
    assert heartbeat(drained, NOW + 300).status is SessionStatus.DRAINING
    closed = close(drained, NOW + 400)
    assert closed.status is SessionStatus.CLOSED and closed.closed_at_ms == NOW + 400
    for transition in (heartbeat, drain, close):
        with pytest.raises(InvalidTransition):
            transition(closed, NOW + 500)
        with pytest.raises(InvalidTransition):
            transition(evolve(active, status=SessionStatus.REPLACED), NOW + 500)
