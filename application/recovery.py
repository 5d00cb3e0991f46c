"""Runtime recovery (every cycle) and startup recovery (at boot): one resolution, two drivers."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from ql3.application.budgets import validate_page_size
from ql3.application.diagnosis import CandidateFailed
from ql3.application.ports import (
    NO_METRICS,
    ConnectionHold,
    Metrics,
    RecoveryCandidate,
    RecoveryCandidateSource,
    UnitOfWork,
    UnitOfWorkFactory,
    no_connection_hold,
)
from ql3.domain.recovery import RecoveryHold, find_not_running_evidence, resolve_recovery
from ql3.domain.transitions import Change

# Recovery transactions of one replica running at once (each on its own connection).
MAX_CONCURRENCY = 8


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """Counts of one recovery pass over one page."""

    examined: int = 0
    recovered: int = 0
    awaiting_evidence: int = 0
    lease_live: int = 0
    moved_on: int = 0
    has_more: bool = False
    observed_at_ms: int | None = None
    recovered_attempt_ids: tuple[str, ...] = field(default=())

    def counts(self) -> dict[str, int]:
        return {
            "examined": self.examined,
            "recovered": self.recovered,
            "awaiting_evidence": self.awaiting_evidence,
            "lease_live": self.lease_live,
            "moved_on": self.moved_on,
            "has_more": int(self.has_more),
        }


def recover_candidate(uow: UnitOfWork, attempt_id: str) -> RecoveryHold | None:
    """Resolve one candidate inside ``uow`` (locks first, then re-check, then write).

    Returns None when the Attempt was recovered, else the reason it stays as it is. The caller
    commits."""
    hold, _change = resolve_candidate(uow, attempt_id)
    return hold


def resolve_candidate(
    uow: UnitOfWork, attempt_id: str
) -> tuple[RecoveryHold | None, Change | None]:
    """:func:`recover_candidate`, with the change it applied (None when it held)."""
    # Another replica holding the candidate is resolving it: go on with the next one rather
    # than queue behind it (both would read the same page in the same order).
    snapshot = uow.runs.lock_attempt(attempt_id, skip_locked=True)
    if snapshot is None or snapshot.attempt is None:
        return RecoveryHold.NOT_A_CANDIDATE, None
    attempt = snapshot.attempt
    session = uow.sessions.get(attempt.session_id) if attempt.session_id else None
    evidence = find_not_running_evidence(attempt, session, uow.evidence.reports_for(attempt.id))
    resolution = resolve_recovery(
        run=snapshot.run,
        attempt=attempt,
        lease=snapshot.lease,
        evidence=evidence,
        now_ms=uow.now_ms(),
    )
    if resolution.change is None:
        return resolution.hold, None
    uow.runs.apply(snapshot, resolution.change)
    return None, resolution.change


class RuntimeRecovery:
    """ADR 0002, decisions 1 and 2: each cycle, one bounded page of expired candidates, each
    resolved in its own short transaction. No cursor or per-run state is kept between cycles.
    Any error ends the pass (fail closed) and names its candidate (:class:`CandidateFailed`);
    the next cycle starts again from the store's view."""

    STEP_NAME = "runtime_recovery"

    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        source: RecoveryCandidateSource,
        page_size: int | None = None,
        concurrency: int = 1,
        metrics: Metrics = NO_METRICS,
        hold: ConnectionHold = no_connection_hold,
    ) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise TypeError("concurrency must be an integer")
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ValueError(f"concurrency must be within 1..{MAX_CONCURRENCY}, got {concurrency}")
        self._uow_factory = uow_factory
        self._source = source
        self._page_size = validate_page_size(page_size)
        self._concurrency = concurrency
        self._metrics = metrics
        # Each thread of a pass resolves its candidates one after the other on one connection.
        self._hold = hold

    @property
    def page_size(self) -> int:
        return self._page_size

    def run_once(self, page_size: int | None = None) -> RecoveryReport:
        limit = validate_page_size(page_size, default=self._page_size)
        page = self._source.recovery_candidates(limit)
        tally = {hold: 0 for hold in RecoveryHold}
        recovered: list[str] = []
        for candidate, hold in zip(page.items, self._resolve_all(page.items), strict=True):
            if hold is None:
                recovered.append(candidate.attempt_id)
            else:
                tally[hold] += 1
        return RecoveryReport(
            examined=len(page.items),
            recovered=len(recovered),
            awaiting_evidence=tally[RecoveryHold.AWAITING_EVIDENCE],
            lease_live=tally[RecoveryHold.LEASE_LIVE],
            moved_on=tally[RecoveryHold.NOT_A_CANDIDATE],
            has_more=page.has_more,
            observed_at_ms=page.observed_at_ms,
            recovered_attempt_ids=tuple(recovered),
        )

    def _resolve_all(self, candidates: Sequence[RecoveryCandidate]) -> list[RecoveryHold | None]:
        """Each candidate in its own transaction; with ``concurrency`` > 1, that many at once:
        the calling thread and ``concurrency - 1`` threads of this pass each take the next
        candidate not yet taken, one after the other.

        The first error ends the pass: no candidate is started after it, the ones under way
        finish (each commits or rolls back on its own), and the error of the first candidate
        in page order that failed is raised."""
        if self._concurrency == 1 or len(candidates) < 2:
            with self._hold():
                return [self._resolve(candidate) for candidate in candidates]
        outcomes: list[RecoveryHold | None] = [None] * len(candidates)
        failures: list[tuple[int, BaseException]] = []
        taken = itertools.count()  # next() of a count is atomic: each index is taken once
        failed = threading.Event()

        def work() -> None:
            try:
                with self._hold():
                    while not failed.is_set():
                        index = next(taken)
                        if index >= len(candidates):
                            return
                        try:
                            outcomes[index] = self._resolve(candidates[index])
                        except BaseException as error:
                            failures.append((index, error))
                            failed.set()
                            return
            except BaseException as error:  # letting the held connection go failed
                failures.append((len(candidates), error))
                failed.set()

        helpers = [
            threading.Thread(target=work, name=f"ql3-recovery-{n}")
            for n in range(min(self._concurrency, len(candidates)) - 1)
        ]
        for helper in helpers:
            helper.start()
        try:
            work()
        finally:
            for helper in helpers:
                helper.join()
        if failures:
            raise min(failures, key=lambda failure: failure[0])[1]
        return outcomes

    def _resolve(self, candidate: RecoveryCandidate) -> RecoveryHold | None:
        try:
            with self._uow_factory() as uow:
                hold, change = resolve_candidate(uow, candidate.attempt_id)
                if change is not None:
                    uow.commit()
                    self._metrics.committed((change.event,))
                return hold
        except Exception as error:
            raise CandidateFailed(
                self.STEP_NAME, candidate.run_id, candidate.attempt_id, error
            ) from error
