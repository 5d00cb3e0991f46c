"""Task attempt admission: offer queued Attempts to worker sessions with free capacity."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from application.budgets import validate_page_size
from application.ports import DispatchSource, QueuedAttempt, UnitOfWorkFactory
from domain.errors import ConcurrencyConflict, InvalidTransition, SessionRejected
from domain.model import AttemptStatus, RunStatus
from domain.transitions import grant_lease


@dataclass(frozen=True, slots=True)
class DispatchReport:
    offered: int = 0
    sessions: int = 0
    queued_seen: int = 0
    skipped: int = 0

    def counts(self) -> dict[str, int]:
        return {
            "offered": self.offered,
            "sessions": self.sessions,
            "queued_seen": self.queued_seen,
            "skipped": self.skipped,
        }


class TaskAttemptAdmission:
    """Offers queued Attempts to active sessions that take the task and have free capacity.

    Bounded per cycle (``page_size`` per task), fair across tasks (round robin over the tasks
    that have queued work), and generation-bound: each offer is a new lease generation. A
    session whose heartbeat is older than ``max_silence_ms`` gets no new offers."""

    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        source: DispatchSource,
        lease_ttl_ms: int,
        max_silence_ms: int,
        page_size: int | None = None,
    ) -> None:
        if lease_ttl_ms <= 0 or max_silence_ms <= 0:
            raise ValueError("lease ttl and session silence window must be positive")
        self._uow_factory = uow_factory
        self._source = source
        self._lease_ttl_ms = lease_ttl_ms
        self._max_silence_ms = max_silence_ms
        self._page_size = validate_page_size(page_size)

    def run_once(self) -> DispatchReport:
        sessions = [s for s in self._source.available_sessions(self._max_silence_ms) if s.free > 0]
        if not sessions:
            return DispatchReport()
        tasks = sorted({t for s in sessions for t in s.session.tasks})
        page = self._source.queued_attempts(self._page_size, tasks)
        by_task: dict[str, deque[QueuedAttempt]] = {}
        for item in page.items:
            by_task.setdefault(item.task, deque()).append(item)
        free = {s.session.id: s.free for s in sessions}
        offered = skipped = 0
        rotation = deque(sorted(by_task))
        turn = 0
        budget = self._page_size
        while rotation and offered < budget:
            task = rotation.popleft()
            queue = by_task[task]
            item = queue.popleft()
            takers = [
                s.session for s in sessions if task in s.session.tasks and free[s.session.id] > 0
            ]
            if takers:
                # Spread offers: start from a different session on each turn.
                session = takers[turn % len(takers)]
                turn += 1
                if self._offer(item, session.id):
                    offered += 1
                    free[session.id] -= 1
                else:
                    skipped += 1
                if queue:
                    rotation.append(task)
        return DispatchReport(
            offered=offered, sessions=len(sessions), queued_seen=len(page.items), skipped=skipped
        )

    def _offer(self, item: QueuedAttempt, session_id: str) -> bool:
        with self._uow_factory() as uow:
            snapshot = uow.runs.lock_attempt(item.attempt_id)
            session = uow.sessions.get(session_id)
            if (
                snapshot is None
                or snapshot.attempt is None
                or session is None
                or snapshot.run.status is not RunStatus.QUEUED
                or snapshot.attempt.status is not AttemptStatus.CLAIMED
                or not snapshot.attempt.is_pristine
            ):
                return False
            try:
                change = grant_lease(
                    run=snapshot.run,
                    attempt=snapshot.attempt,
                    previous_lease=snapshot.lease,
                    session=session,
                    ttl_ms=self._lease_ttl_ms,
                    now_ms=uow.now_ms(),
                )
                uow.runs.apply(snapshot, change)
            except (SessionRejected, InvalidTransition, ConcurrencyConflict):
                return False
            uow.commit()
            return True
