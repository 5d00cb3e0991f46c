"""A failing completion goes through the one retry decision (ADR 0013): ``running ->
retry_wait`` with a due time when the policy retries on error, ``running -> failed`` otherwise;
an execution timeout is a failure of cause ``timeout``; retry on error is refused for work that
is not idempotent or deduplicated."""

from __future__ import annotations

import pytest
from attrs import evolve

from ql3.domain.errors import InvalidAdmission, InvalidRetryPolicy
from ql3.domain.events import EventType
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety, policy_from_document
from ql3.domain.retry import start_next_attempt, timed_out_error
from ql3.domain.states import RUN_EDGES
from ql3.domain.transitions import claim, complete
from tests.domain.builders import NOW, TTL, running, session

ON_ERROR = RetryPolicy(
    retry_on_error=True,
    max_attempts=3,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=1_000, multiplier=2.0, cap_ms=10_000),
)


def _fail(policy: RetryPolicy | None, *, timed_out: bool = False, now_ms: int = NOW + 50):  # type: ignore[no-untyped-def]
    run, attempt, lease, fence = running(policy=policy)
    return complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=False,
                    output=None, error="boom", now_ms=now_ms, timed_out=timed_out)


def test_a_failed_attempt_waits_for_its_retry_when_the_policy_retries_on_error() -> None:
    change = _fail(ON_ERROR)
    assert change.run.status is RunStatus.RETRY_WAIT
    assert change.run.next_attempt_at_ms == NOW + 50 + 1_000
    assert change.run.error is None and change.run.output is None
    (attempt,) = change.attempts
    assert attempt.status is AttemptStatus.FAILED and attempt.error == "boom"
    assert change.lease is not None and change.lease.status is LeaseStatus.RELEASED
    assert change.lease.release_reason is ReleaseReason.COMPLETED
    assert change.event.type is EventType.ATTEMPT_FAILED
    assert change.event.data == {
        "error": "boom",
        "cause": "error",
        "retry": True,
        "next_attempt_at_ms": NOW + 1_050,
        "next_attempt": 2,
    }
    assert RunStatus.RETRY_WAIT in RUN_EDGES[RunStatus.RUNNING]


def test_the_next_attempt_is_made_when_due_by_the_lost_retry_machinery() -> None:
    waiting = _fail(ON_ERROR).run
    change = start_next_attempt(run=waiting, attempt_id="a2", now_ms=NOW + 1_050)
    assert change.run.status is RunStatus.QUEUED and change.run.attempt_count == 2
    (fresh,) = change.attempts
    assert fresh.number == 2 and fresh.is_pristine


@pytest.mark.parametrize(
    ("policy", "reason"),
    [
        (None, "no_policy"),
        (RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT),
         "retry_on_error_disabled"),
        (evolve(ON_ERROR, max_attempts=1), "max_attempts_too_low"),
    ],
)
def test_without_a_retry_the_run_fails_as_before(policy: RetryPolicy | None, reason: str) -> None:
    change = _fail(policy)
    assert change.run.status is RunStatus.FAILED
    assert change.run.error == "boom" and change.run.next_attempt_at_ms is None
    assert change.event.type is EventType.ATTEMPT_FAILED
    assert change.event.data == {"error": "boom", "cause": "error", "retry": False,
                                 "reason": reason}


def test_the_last_attempt_fails_the_run_with_attempts_exhausted() -> None:
    run, attempt, lease, fence = running(policy=ON_ERROR)
    third = evolve(attempt, number=3)
    change = complete(run=evolve(run, attempt_count=3), attempt=third, lease=lease, fence=fence,
                      succeeded=False, output=None, error="boom", now_ms=NOW + 1)
    assert change.run.status is RunStatus.FAILED
    assert change.event.data["reason"] == "attempts_exhausted"


def test_a_timeout_is_a_failure_of_cause_timeout_and_follows_retry_on_error() -> None:
    assert timed_out_error(2_000) == "timed out after 2.0 s"
    run, attempt, lease, fence = running(policy=ON_ERROR)
    change = complete(run=evolve(run, timeout_ms=2_000), attempt=attempt, lease=lease,
                      fence=fence, succeeded=False, output=None, error="stopped", now_ms=NOW + 1,
                      timed_out=True)
    assert change.run.status is RunStatus.RETRY_WAIT
    assert change.attempts[0].error == "timed out after 2.0 s"
    assert change.event.data["error"] == "timed out after 2.0 s"
    assert change.event.data["cause"] == "timeout" and change.event.data["retry"] is True
    failed = _fail(None, timed_out=True)
    assert failed.run.status is RunStatus.FAILED
    assert failed.event.data["cause"] == "timeout"


def test_a_success_cannot_be_a_timeout() -> None:
    run, attempt, lease, fence = running(policy=ON_ERROR)
    with pytest.raises(InvalidAdmission):
        complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=True,
                 output=1, error=None, now_ms=NOW + 1, timed_out=True)


@pytest.mark.parametrize("safety", [None, Safety.UNSAFE])
def test_retry_on_error_is_refused_for_work_that_is_not_safe_to_repeat(
    safety: Safety | None,
) -> None:
    with pytest.raises(InvalidRetryPolicy, match="retry on error"):
        RetryPolicy(retry_on_error=True, max_attempts=3, safety=safety)
    with pytest.raises(InvalidRetryPolicy):
        policy_from_document({"retry_on_error": True, "max_attempts": 3,
                              "safety": safety.value if safety else None})
    with pytest.raises(InvalidRetryPolicy):
        evolve(ON_ERROR, safety=safety)


def test_an_unsafe_run_is_never_retried_on_error() -> None:
    unsafe = RetryPolicy(retry_on_lost=True, max_attempts=5, safety=Safety.UNSAFE)
    change = _fail(unsafe)
    assert change.run.status is RunStatus.FAILED
    assert change.event.data["reason"] == "retry_on_error_disabled"


def test_a_retried_run_is_claimed_again_with_the_next_lease_generation() -> None:
    run, attempt, lease, fence = running(policy=ON_ERROR)
    failed = complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=False,
                      output=None, error="boom", now_ms=NOW + 1)
    due = failed.run.next_attempt_at_ms
    assert due is not None
    queued = start_next_attempt(run=failed.run, attempt_id="a2", now_ms=due)
    again = claim(run=queued.run, attempt=queued.attempts[0], previous_lease=failed.lease,
                  session=session(), token_hash="0" * 64, ttl_ms=TTL, now_ms=due)
    assert again.lease is not None and again.lease.generation == lease.generation + 1
    assert again.run.status is RunStatus.RUNNING


def test_the_timeout_error_names_the_timeout() -> None:
    assert timed_out_error(2_500) == "timed out after 2.5 s"
    assert timed_out_error(50) == "timed out after 0.05 s"
    assert timed_out_error(1_234) == "timed out after 1.234 s"


def test_a_timeout_is_bounded_at_admission() -> None:
    from ql3.domain.model import MAX_TIMEOUT_MS
    from ql3.domain.transitions import admit

    run = admit(run_id="r", attempt_id="a", task="t", input=None, policy=None, now_ms=1,
                timeout_ms=MAX_TIMEOUT_MS).run
    assert run.timeout_ms == MAX_TIMEOUT_MS
    with pytest.raises(InvalidAdmission):
        admit(run_id="r", attempt_id="a", task="t", input=None, policy=None, now_ms=1,
              timeout_ms=MAX_TIMEOUT_MS + 1)
