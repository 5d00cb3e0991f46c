"""Which candidate a failing runtime recovery or lost-retry step is stuck on (ADR 0010).

Both steps fail closed (ADR 0002): the first error ends the step, and a broken head candidate
is never skipped. The steps raise :class:`CandidateFailed`, naming the candidate, so that the
cycle's summary, the dispatch gate and ``ql3 doctor`` can say which Run to look at, since when,
and an operator can decide to quarantine it."""

from __future__ import annotations

from dataclasses import dataclass

from ql3.application.ports import StepFailure

MAX_ERROR_LENGTH = 500


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True, slots=True)
class FailingCandidate:
    """The candidate a step's resolution raised on, and the error it raised."""

    step: str
    run_id: str
    attempt_id: str | None
    error: str


class CandidateFailed(Exception):
    """A step's resolution of one candidate raised ``__cause__``."""

    def __init__(self, step: str, run_id: str, attempt_id: str | None, error: BaseException):
        # The first line names the error; a driver's further lines (its SQL, a link) would
        # only crowd the gate and ``ql3 doctor``.
        first_line = (describe(error).splitlines() or [""])[0]
        self.candidate = FailingCandidate(
            step=step, run_id=run_id, attempt_id=attempt_id, error=first_line[:MAX_ERROR_LENGTH]
        )
        super().__init__(f"{step} failed on run {run_id}: {self.candidate.error}")


def next_failure(
    previous: StepFailure | None, failed: FailingCandidate | None, now_ms: int
) -> StepFailure | None:
    """The streak after one more failed cycle: carried on when the step failed on the same
    candidate as before, started anew otherwise; None for a failure without a candidate."""
    if failed is None:
        return None
    if previous is not None and (previous.step, previous.run_id, previous.attempt_id) == (
        failed.step,
        failed.run_id,
        failed.attempt_id,
    ):
        since_ms, cycles = previous.since_ms, previous.cycles + 1
    else:
        since_ms, cycles = now_ms, 1
    return StepFailure(
        step=failed.step,
        run_id=failed.run_id,
        attempt_id=failed.attempt_id,
        error=failed.error,
        since_ms=since_ms,
        cycles=cycles,
    )
