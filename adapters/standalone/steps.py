"""The Standalone and Edge cadence: due retries, then the inner scheduler.

Neither profile runs the Cluster's continuous runtime recovery: the one process that executes
work renews its own leases, so an Attempt it runs cannot expire under it unnoticed, and what a
crashed process left behind is settled by startup recovery at the next boot. What remains for
the cadence is starting the retries startup recovery scheduled once they are due, with the same
resolution the Cluster's lost retry uses (:func:`ql3.application.lost_retry.start_due_retry`)."""

from __future__ import annotations

from dataclasses import dataclass

from ql3.application.budgets import validate_page_size
from ql3.application.lost_retry import start_due_retry
from ql3.application.ports import Identities, LostRetryCandidateSource, UnitOfWorkFactory
from ql3.application.scheduler import CycleSummary, SchedulerCoordinator, run_steps


@dataclass(frozen=True, slots=True)
class DueRetryReport:
    attempts_created: int = 0
    moved_on: int = 0
    has_more: bool = False

    def counts(self) -> dict[str, int]:
        return {
            "attempts_created": self.attempts_created,
            "moved_on": self.moved_on,
            "has_more": int(self.has_more),
        }


class DueRetryStart:
    """One bounded page of due ``retry_wait`` Runs, each given its fresh Attempt N+1 in its own
    short transaction. Any error ends the step (fail closed)."""

    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        source: LostRetryCandidateSource,
        identities: Identities,
        page_size: int | None = None,
    ) -> None:
        self._uow_factory = uow_factory
        self._source = source
        self._identities = identities
        self._page_size = validate_page_size(page_size)

    @property
    def page_size(self) -> int:
        return self._page_size

    def run_once(self) -> DueRetryReport:
        page = self._source.due_retries(self._page_size)
        created = moved_on = 0
        for candidate in page.items:
            with self._uow_factory() as uow:
                if start_due_retry(uow, candidate, self._identities):
                    created += 1
                else:
                    moved_on += 1
        return DueRetryReport(attempts_created=created, moved_on=moved_on, has_more=page.has_more)


class StandaloneCoordinator:
    """due retries -> trigger schedule -> workflow frontier -> task attempt admission (the
    dispatch gate step: the process's own claims take the work, ADR 0007).

    Like every coordinator it owns no timer, pool or connection: the runner drives it."""

    STEP_NAMES = ("due_retries", *SchedulerCoordinator.STEP_NAMES)

    def __init__(self, due_retries: DueRetryStart, inner: SchedulerCoordinator) -> None:
        self._due_retries = due_retries
        self._inner = inner

    def run_cycle(self) -> CycleSummary:
        summary = run_steps((("due_retries", self._due_retries),))
        return summary.followed_by(self._inner.run_cycle()) if summary.ok else summary
