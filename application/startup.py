"""Startup recovery: what a profile runs once at boot, before its scheduler starts.

It drives the very same resolutions as the Cluster's runtime recovery and lost retry
(``recover_candidate``, ``settle_lost_candidate``, ``start_due_retry``), so the two can never
disagree, with the profile's own page budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ql3.application.budgets import validate_page_size
from ql3.application.lost_retry import settle_lost_candidate, start_due_retry
from ql3.application.ports import (
    Identities,
    LostRetryCandidateSource,
    RecoveryCandidateSource,
    StartupCandidateSource,
    UnitOfWorkFactory,
)
from ql3.application.recovery import recover_candidate
from ql3.domain.errors import InvalidTransition
from ql3.domain.events import EventType
from ql3.domain.recovery import RecoveryHold
from ql3.domain.transitions import create_first_attempt


@dataclass(frozen=True, slots=True)
class StartupReport:
    orphans_queued: int = 0
    recovered: int = 0
    awaiting_evidence: int = 0
    lost_failed: int = 0
    retries_scheduled: int = 0
    attempts_created: int = 0
    pages: int = 0

    def counts(self) -> dict[str, int]:
        return {
            "orphans_queued": self.orphans_queued,
            "recovered": self.recovered,
            "awaiting_evidence": self.awaiting_evidence,
            "lost_failed": self.lost_failed,
            "retries_scheduled": self.retries_scheduled,
            "attempts_created": self.attempts_created,
            "pages": self.pages,
        }


class StartupRecovery:
    """At boot: orphaned ``created`` Runs get their first Attempt; then expired candidates are
    resolved and lost Runs settled, page by page, until a page makes no progress."""

    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        source: StartupSourceLike,
        identities: Identities,
        page_size: int | None = None,
        max_pages: int = 100_000,
    ) -> None:
        self._uow_factory = uow_factory
        self._source = source
        self._identities = identities
        self._page_size = validate_page_size(page_size)
        self._max_pages = max_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    def run(self) -> StartupReport:
        counts = dict.fromkeys(StartupReport().counts(), 0)
        self._queue_orphans(counts)
        for _ in range(self._max_pages):
            counts["pages"] += 1
            if not self._one_page(counts):
                break
        return StartupReport(**counts)

    def _queue_orphans(self, counts: dict[str, int]) -> None:
        for _ in range(self._max_pages):
            page = self._source.orphaned_runs(self._page_size)
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
                    counts["orphans_queued"] += 1
            if not page.has_more or not page.items:
                return

    def _one_page(self, counts: dict[str, int]) -> bool:
        """One page of each kind; True while something changed and more may be waiting."""
        progressed = 0
        recovery = self._source.recovery_candidates(self._page_size)
        awaiting = 0
        for candidate in recovery.items:
            with self._uow_factory() as uow:
                hold = recover_candidate(uow, candidate.attempt_id)
                if hold is None:
                    uow.commit()
                    counts["recovered"] += 1
                    progressed += 1
                elif hold is RecoveryHold.AWAITING_EVIDENCE:
                    awaiting += 1
        counts["awaiting_evidence"] = awaiting
        lost = self._source.lost_runs(self._page_size)
        for run_candidate in lost.items:
            with self._uow_factory() as uow:
                settled = settle_lost_candidate(uow, run_candidate)
                outcome = settled.type if settled is not None else None
            if outcome is EventType.RUN_FAILED:
                counts["lost_failed"] += 1
                progressed += 1
            elif outcome is EventType.RETRY_SCHEDULED:
                counts["retries_scheduled"] += 1
                progressed += 1
        due = self._source.due_retries(self._page_size)
        for run_candidate in due.items:
            with self._uow_factory() as uow:
                if start_due_retry(uow, run_candidate, self._identities):
                    counts["attempts_created"] += 1
                    progressed += 1
        more = recovery.has_more or lost.has_more or due.has_more
        return bool(progressed) and more


class StartupSourceLike(
    StartupCandidateSource, RecoveryCandidateSource, LostRetryCandidateSource, Protocol
):
    """The candidate sources startup recovery reads."""
