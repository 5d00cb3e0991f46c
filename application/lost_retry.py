"""Lost retry (ADR 0002, decision 3): settle ``lost`` Runs with the domain's retry decision, and
turn due ``retry_wait`` Runs (lost, or failed and retried on error, ADR 0013) into a fresh
Attempt N+1."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ql3.application.budgets import validate_page_size
from ql3.application.diagnosis import CandidateFailed
from ql3.application.ports import (
    NO_METRICS,
    Identities,
    LostRetryCandidateSource,
    Metrics,
    RunCandidate,
    Snapshot,
    UnitOfWork,
    UnitOfWorkFactory,
)
from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import AttemptStatus
from ql3.domain.retry import (
    is_due_retry,
    is_lost_retry_candidate,
    settle_lost_run,
    start_next_attempt,
)


@dataclass(frozen=True, slots=True)
class LostRetryReport:
    failed: int = 0
    retries_scheduled: int = 0
    attempts_created: int = 0
    moved_on: int = 0
    has_more: bool = False

    @property
    def changed(self) -> int:
        return self.failed + self.retries_scheduled + self.attempts_created

    def counts(self) -> dict[str, int]:
        return {
            "failed": self.failed,
            "retries_scheduled": self.retries_scheduled,
            "attempts_created": self.attempts_created,
            "moved_on": self.moved_on,
            "has_more": int(self.has_more),
        }


class LostRetry:
    """One bounded page of lost Runs (oldest first), then one of due retries. One short
    transaction per candidate, the Attempt's advisory lock before the row locks.

    Fail closed: any error (database, lock, state, persistence) propagates and ends the step at
    that candidate, named by :class:`CandidateFailed`. A broken head candidate is never
    skipped to go on with later ones; only an operator's quarantine takes it out (ADR 0010)."""

    STEP_NAME = "lost_retry"

    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        source: LostRetryCandidateSource,
        identities: Identities,
        page_size: int | None = None,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self._uow_factory = uow_factory
        self._source = source
        self._identities = identities
        self._page_size = validate_page_size(page_size)
        self._metrics = metrics

    @property
    def page_size(self) -> int:
        return self._page_size

    def run_once(self, page_size: int | None = None) -> LostRetryReport:
        limit = validate_page_size(page_size, default=self._page_size)
        failed = scheduled = created = moved_on = 0
        lost = self._source.lost_runs(limit)
        for candidate in lost.items:
            with self._failing_on(candidate), self._uow_factory() as uow:
                event = settle_lost_candidate(uow, candidate)
            if event is not None:
                self._metrics.committed((event,))
            outcome = event.type if event is not None else None
            if outcome is EventType.RUN_FAILED:
                failed += 1
            elif outcome is EventType.RETRY_SCHEDULED:
                scheduled += 1
            else:
                moved_on += 1
        due = self._source.due_retries(limit)
        for candidate in due.items:
            with self._failing_on(candidate), self._uow_factory() as uow:
                started = start_due_retry(uow, candidate, self._identities)
            if started:
                created += 1
            else:
                moved_on += 1
        return LostRetryReport(
            failed=failed,
            retries_scheduled=scheduled,
            attempts_created=created,
            moved_on=moved_on,
            has_more=lost.has_more or due.has_more,
        )


    @contextmanager
    def _failing_on(self, candidate: RunCandidate) -> Iterator[None]:
        """Any error of the block names ``candidate`` (:class:`CandidateFailed`)."""
        try:
            yield
        except Exception as error:
            raise CandidateFailed(
                self.STEP_NAME, candidate.run_id, candidate.attempt_id, error
            ) from error


def _lock_candidate(uow: UnitOfWork, candidate: RunCandidate) -> Snapshot | None:
    snapshot = (
        uow.runs.lock_attempt(candidate.attempt_id)
        if candidate.attempt_id is not None
        else uow.runs.lock_run(candidate.run_id)
    )
    if snapshot is None or snapshot.run.id != candidate.run_id:
        return None
    return snapshot


def settle_lost_candidate(uow: UnitOfWork, candidate: RunCandidate) -> RunEvent | None:
    """Settle one ``lost`` Run inside ``uow`` and commit; returns the event written, or None
    when the Run, re-checked under the locks, is no longer a candidate."""
    snapshot = _lock_candidate(uow, candidate)
    if (
        snapshot is None
        or snapshot.attempt is None
        or not is_lost_retry_candidate(snapshot.run)
        or snapshot.attempt.status is not AttemptStatus.LOST
        or snapshot.attempt.number != snapshot.run.attempt_count
    ):
        # Another replica settled it first, or a newer Attempt exists.
        return None
    change = settle_lost_run(run=snapshot.run, lost_attempt=snapshot.attempt, now_ms=uow.now_ms())
    uow.runs.apply(snapshot, change)
    uow.commit()
    return change.event


def start_due_retry(uow: UnitOfWork, candidate: RunCandidate, identities: Identities) -> bool:
    """Create Attempt N+1 for one due ``retry_wait`` Run inside ``uow`` and commit."""
    snapshot = _lock_candidate(uow, candidate)
    if snapshot is None:
        return False
    run = snapshot.run
    now_ms = uow.now_ms()
    if not is_due_retry(run, now_ms) or (
        snapshot.attempt is not None and snapshot.attempt.number != run.attempt_count
    ):
        return False
    change = start_next_attempt(run=run, attempt_id=identities.new_id(), now_ms=now_ms)
    uow.runs.apply(snapshot, change)
    uow.commit()
    return True
