"""Retry: one pure, profile-neutral decision for an Attempt that ended without success (lost,
failed by its task, or stopped at its timeout), the settling of a ``lost`` Run, and the fresh
Attempt N+1 when a ``retry_wait`` Run is due (ADRs 0002 and 0013)."""

from __future__ import annotations

import enum

from attrs import evolve, frozen

from ql3.domain.change import Change
from ql3.domain.errors import InvalidTransition, NotDue
from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import Attempt, AttemptStatus, Run, RunOwner, RunStatus
from ql3.domain.policy import RETRYABLE_SAFETY, RetryPolicy, Safety
from ql3.domain.states import require_run_edge


class RetryCause(enum.Enum):
    """How an Attempt ended without success."""

    LOST = "lost"  # its lease authority was lost (recovery, or the worker's abandon report)
    ERROR = "error"  # its task failed (raised, or its slot died)
    TIMEOUT = "timeout"  # its task ran past the Run's timeout and was stopped


class FailureReason(enum.Enum):
    """Why a Run was failed instead of retried, in the order the rules are checked."""

    NO_POLICY = "no_policy"
    RETRY_ON_LOST_DISABLED = "retry_on_lost_disabled"
    RETRY_ON_ERROR_DISABLED = "retry_on_error_disabled"
    MAX_ATTEMPTS_TOO_LOW = "max_attempts_too_low"
    SAFETY_UNDECLARED = "safety_undeclared"
    UNSAFE = "unsafe"
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"


@frozen(kw_only=True)
class RetryDecision:
    failure: FailureReason | None
    next_attempt_at_ms: int | None

    @property
    def retry(self) -> bool:
        return self.failure is None


def retry_enabled(policy: RetryPolicy, cause: RetryCause) -> bool:
    """Whether the policy asks for a retry of an Attempt that ended for ``cause``: lost
    Attempts by ``retry_on_lost``, failed and timed-out ones by ``retry_on_error``."""
    return policy.retry_on_lost if cause is RetryCause.LOST else policy.retry_on_error


def decide_retry(
    *, run_id: str, policy: RetryPolicy | None, cause: RetryCause, attempt_number: int, now_ms: int
) -> RetryDecision:
    """Ordered rules: no policy, retry disabled for the cause, max attempts too low, safety
    undeclared or unsafe, attempts exhausted -> fail; only idempotent|deduplicated work with
    attempts left is retried, after the backoff that follows ``attempt_number``."""
    failure: FailureReason | None = None
    if policy is None:
        failure = FailureReason.NO_POLICY
    elif not retry_enabled(policy, cause):
        failure = (
            FailureReason.RETRY_ON_LOST_DISABLED
            if cause is RetryCause.LOST
            else FailureReason.RETRY_ON_ERROR_DISABLED
        )
    elif policy.max_attempts < 2:
        failure = FailureReason.MAX_ATTEMPTS_TOO_LOW
    elif policy.safety is None:
        failure = FailureReason.SAFETY_UNDECLARED
    elif policy.safety is Safety.UNSAFE or policy.safety not in RETRYABLE_SAFETY:
        failure = FailureReason.UNSAFE
    elif attempt_number >= policy.max_attempts:
        failure = FailureReason.ATTEMPTS_EXHAUSTED
    if failure is not None or policy is None:
        return RetryDecision(failure=failure, next_attempt_at_ms=None)
    delay = policy.backoff.delay_ms(run_id, attempt_number)
    return RetryDecision(failure=None, next_attempt_at_ms=now_ms + delay)


def timed_out_error(timeout_ms: int) -> str:
    """The error of an Attempt stopped at its Run's timeout: "timed out after 2.0 s" (tenths
    of a second, or every digit the timeout has)."""
    seconds = timeout_ms / 1000
    shown = f"{seconds:.1f}" if timeout_ms % 100 == 0 else f"{seconds:g}"
    return f"timed out after {shown} s"


def is_lost_retry_candidate(run: Run) -> bool:
    """A runtime-owned ``lost`` Run that is not quarantined (ADR 0010)."""
    return run.owner is RunOwner.RUNTIME and run.status is RunStatus.LOST and not run.is_quarantined


def is_due_retry(run: Run, now_ms: int) -> bool:
    """A runtime-owned ``retry_wait`` Run, not quarantined, whose next Attempt is due."""
    return (
        run.owner is RunOwner.RUNTIME
        and run.status is RunStatus.RETRY_WAIT
        and not run.is_quarantined
        and run.next_attempt_at_ms is not None
        and run.next_attempt_at_ms <= now_ms
    )


def settle_lost_run(*, run: Run, lost_attempt: Attempt, now_ms: int) -> Change:
    """Apply the retry decision (cause ``lost``): ``lost`` -> ``failed`` or ``lost`` ->
    ``retry_wait``."""
    if not is_lost_retry_candidate(run):
        raise InvalidTransition("run", run.id, run.status.value, "settle a lost attempt")
    if (
        lost_attempt.run_id != run.id
        or lost_attempt.status is not AttemptStatus.LOST
        or lost_attempt.number != run.attempt_count
    ):
        raise InvalidTransition(
            "attempt", lost_attempt.id, lost_attempt.status.value, "decide a lost retry"
        )
    decision = decide_retry(
        run_id=run.id,
        policy=run.policy,
        cause=RetryCause.LOST,
        attempt_number=lost_attempt.number,
        now_ms=now_ms,
    )
    require_run_edge(
        run, RunStatus.FAILED if decision.failure else RunStatus.RETRY_WAIT, "settle a lost attempt"
    )
    if decision.failure is not None:
        new_run = evolve(
            run,
            status=RunStatus.FAILED,
            error=f"attempt {lost_attempt.number} lost: {decision.failure.value}",
            updated_at_ms=now_ms,
        )
        event = RunEvent(
            run_id=run.id,
            attempt_id=lost_attempt.id,
            type=EventType.RUN_FAILED,
            at_ms=now_ms,
            data={"reason": decision.failure.value, "lost_attempt": lost_attempt.number},
        )
    else:
        new_run = evolve(
            run,
            status=RunStatus.RETRY_WAIT,
            next_attempt_at_ms=decision.next_attempt_at_ms,
            updated_at_ms=now_ms,
        )
        event = RunEvent(
            run_id=run.id,
            attempt_id=lost_attempt.id,
            type=EventType.RETRY_SCHEDULED,
            at_ms=now_ms,
            data={
                "next_attempt_at_ms": decision.next_attempt_at_ms,
                "next_attempt": lost_attempt.number + 1,
            },
        )
    return Change(run=new_run, attempts=(), lease=None, event=event)


def start_next_attempt(*, run: Run, attempt_id: str, now_ms: int) -> Change:
    """When the store's clock reaches ``next_attempt_at_ms``: a fresh, unleased Attempt N+1 and
    the Run ``queued``. Nothing of the lost or failed Attempt is carried over."""
    if (
        run.status is not RunStatus.RETRY_WAIT
        or run.owner is not RunOwner.RUNTIME
        or run.is_quarantined
    ):
        raise InvalidTransition("run", run.id, run.status.value, "start its next attempt")
    require_run_edge(run, RunStatus.QUEUED, "start its next attempt")
    if run.next_attempt_at_ms is None or now_ms < run.next_attempt_at_ms:
        raise NotDue(f"run {run.id} is due at {run.next_attempt_at_ms}, now {now_ms}")
    number = run.attempt_count + 1
    attempt = Attempt(
        id=attempt_id,
        run_id=run.id,
        number=number,
        status=AttemptStatus.CLAIMED,
        created_at_ms=now_ms,
        updated_at_ms=now_ms,
    )
    new_run = evolve(
        run,
        status=RunStatus.QUEUED,
        attempt_count=number,
        next_attempt_at_ms=None,
        updated_at_ms=now_ms,
    )
    event = RunEvent(
        run_id=run.id,
        attempt_id=attempt.id,
        type=EventType.ATTEMPT_CREATED,
        at_ms=now_ms,
        data={"number": number},
    )
    return Change(run=new_run, attempts=(attempt,), lease=None, event=event)
