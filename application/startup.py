"""Startup recovery: what a profile runs once at boot, before its scheduler starts."""

from __future__ import annotations

from dataclasses import dataclass

from application.budgets import validate_page_size
from application.lost_retry import LostRetry
from application.ports import Identities, StartupCandidateSource, UnitOfWorkFactory
from application.recovery import RuntimeRecovery
from domain.errors import InvalidTransition
from domain.transitions import create_first_attempt


@dataclass(frozen=True, slots=True)
class StartupReport:
    orphans_queued: int
    recovered: int
    awaiting_evidence: int
    lost_failed: int
    retries_scheduled: int
    attempts_created: int
    passes: int

    def counts(self) -> dict[str, int]:
        return {
            "orphans_queued": self.orphans_queued,
            "recovered": self.recovered,
            "awaiting_evidence": self.awaiting_evidence,
            "lost_failed": self.lost_failed,
            "retries_scheduled": self.retries_scheduled,
            "attempts_created": self.attempts_created,
            "passes": self.passes,
        }


class StartupRecovery:
    """At boot: give orphaned ``created`` Runs their first Attempt, then drain recovery and lost
    retry page by page with the profile's page budget. Uses the very same resolution as the
    runtime recovery, so the two can never disagree."""

    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        orphans: StartupCandidateSource,
        recovery: RuntimeRecovery,
        lost_retry: LostRetry,
        identities: Identities,
        page_size: int | None = None,
        max_passes: int = 10_000,
    ) -> None:
        self._uow_factory = uow_factory
        self._orphans = orphans
        self._recovery = recovery
        self._lost_retry = lost_retry
        self._identities = identities
        self._page_size = validate_page_size(page_size)
        self._max_passes = max_passes

    def run(self) -> StartupReport:
        orphans = self._queue_orphans()
        recovered = awaiting = failed = scheduled = created = passes = 0
        while passes < self._max_passes:
            passes += 1
            rec = self._recovery.run_once(self._page_size)
            retry = self._lost_retry.run_once(self._page_size)
            recovered += rec.recovered
            awaiting = rec.awaiting_evidence
            failed += retry.failed
            scheduled += retry.retries_scheduled
            created += retry.attempts_created
            progressed = rec.recovered + retry.changed
            more = rec.has_more or retry.has_more
            if not progressed or not more:
                break
        return StartupReport(
            orphans_queued=orphans,
            recovered=recovered,
            awaiting_evidence=awaiting,
            lost_failed=failed,
            retries_scheduled=scheduled,
            attempts_created=created,
            passes=passes,
        )

    def _queue_orphans(self) -> int:
        queued = 0
        for _ in range(self._max_passes):
            page = self._orphans.orphaned_runs(self._page_size)
            for candidate in page.items:
                with self._uow_factory() as uow:
                    snapshot = uow.runs.lock_run(candidate.run_id)
                    if snapshot is None or snapshot.attempt is not None:
                        continue
                    try:
                        change = create_first_attempt(
                            snapshot.run, self._identities.new_id(), uow.now_ms()
                        )
                    except InvalidTransition:
                        continue
                    uow.runs.apply(snapshot, change)
                    uow.commit()
                    queued += 1
            if not page.has_more or not page.items:
                break
        return queued

