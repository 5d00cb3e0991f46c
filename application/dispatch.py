"""Task attempt admission: offer queued Attempts to worker sessions with free capacity."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from application.budgets import validate_page_size
from application.ports import QueuedAttempt, SchedulerUnitOfWorkFactory, TaskAdmissionSource
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


def _fair_share_key(
    task: str, head: QueuedAttempt, in_flight: Mapping[str, int], observed_at_ms: int
) -> tuple[int, int, bytes]:
    """Fewest in flight first, then the oldest queued head; tasks still tied are ordered by a
    hash that changes with the store's clock, so no name is always served last."""
    salt = hashlib.sha256(f"{observed_at_ms}:{task}".encode()).digest()[:8]
    return (in_flight.get(task, 0), head.queued_at_ms, salt)


class TaskAttemptAdmission:
    """Offers queued Attempts to active sessions that take the task and have free capacity.

    Bounded per cycle: at most ``page_size`` offers, from a page of at most ``page_size`` queued
    Attempts per task. Fair across tasks: each offer goes to the task with the fewest Attempts
    in flight (offered or executing, counted by the store and by this cycle's own offers), the
    oldest queued head breaking ties, so a flood of one task never starves another however
    many tasks there are. Generation-bound: each offer is a new lease generation, and the worker
    must present that generation with every command. A session whose heartbeat is older than
    ``max_silence_ms`` by the store's clock, or that has no free capacity, gets no new offers;
    both are re-checked under the session's row lock in the offer's own transaction, so
    concurrent replicas never offer a session more than its capacity."""

    def __init__(
        self,
        uow_factory: SchedulerUnitOfWorkFactory,
        source: TaskAdmissionSource,
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
        if not by_task:
            return DispatchReport(sessions=len(sessions))
        in_flight = dict(self._source.in_flight_by_task(sorted(by_task)))
        free = {s.session.id: s.free for s in sessions}
        # Decide every offer of the cycle first, then persist each session's offers in one
        # transaction.
        plan: dict[str, list[QueuedAttempt]] = {}
        planned = 0
        turn = 0
        while planned < self._page_size:
            takers_of = {
                task: [
                    s.session
                    for s in sessions
                    if task in s.session.tasks and free[s.session.id] > 0
                ]
                for task, queue in by_task.items()
                if queue
            }
            ready = [task for task, takers in takers_of.items() if takers]
            if not ready:
                break
            task = min(
                ready,
                key=lambda t: _fair_share_key(t, by_task[t][0], in_flight, page.observed_at_ms),
            )
            item = by_task[task].popleft()
            takers = takers_of[task]
            # Spread offers: start from a different session on each turn.
            session = takers[turn % len(takers)]
            turn += 1
            plan.setdefault(session.id, []).append(item)
            planned += 1
            free[session.id] -= 1
            in_flight[task] = in_flight.get(task, 0) + 1
        offered = sum(self._offer(session_id, items) for session_id, items in plan.items())
        return DispatchReport(
            offered=offered,
            sessions=len(sessions),
            queued_seen=len(page.items),
            skipped=planned - offered,
        )

    def _offer(self, session_id: str, items: list[QueuedAttempt]) -> int:
        """Offer ``items`` to one session in one transaction: the Attempts are locked (in id
        order), then the session; its capacity and heartbeat are re-checked under that lock, so
        concurrent replicas never offer a session more than its capacity. An Attempt that is no
        longer a pristine queued one is left alone. Returns how many were offered."""
        with self._uow_factory() as uow:
            ordered = sorted(items, key=lambda item: item.attempt_id)
            snapshots = uow.runs.lock_attempts([item.attempt_id for item in ordered])
            capacity = uow.capacity.lock(session_id)
            now_ms = uow.now_ms()
            if (
                capacity is None
                or capacity.session.last_heartbeat_at_ms <= now_ms - self._max_silence_ms
            ):
                return 0
            room = capacity.free
            writes = []
            for snapshot in snapshots:
                if room <= 0:
                    break
                if (
                    snapshot is None
                    or snapshot.attempt is None
                    or snapshot.run.status is not RunStatus.QUEUED
                    or snapshot.attempt.status is not AttemptStatus.CLAIMED
                    or not snapshot.attempt.is_pristine
                ):
                    continue
                try:
                    change = grant_lease(
                        run=snapshot.run,
                        attempt=snapshot.attempt,
                        previous_lease=snapshot.lease,
                        session=capacity.session,
                        ttl_ms=self._lease_ttl_ms,
                        now_ms=now_ms,
                    )
                except (SessionRejected, InvalidTransition):
                    continue
                writes.append((snapshot, change))
                room -= 1
            if not writes:
                return 0
            try:
                uow.runs.apply_many(writes)
            except ConcurrencyConflict:
                return 0
            uow.commit()
            return len(writes)
