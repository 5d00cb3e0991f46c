"""The in-memory store: every port of :mod:`ql3.application.ports` on dicts of frozen domain values.

A unit of work holds the store's lock for its whole duration, so transactions are serial (the
strongest isolation there is) and safe across threads. It works on a copy-on-write overlay of the
committed state: the first write copies the dicts (shallow copies suffice, the values are
immutable), :meth:`MemoryUnitOfWork.commit` swaps the overlay in, leaving without a commit drops
it. Every write is a compare-and-set against the ``before`` values, and what the PostgreSQL
schema enforces with foreign keys, CHECKs and partial unique indexes is checked on every write, so
that the two stores refuse the same things with the same error:
:class:`~ql3.domain.errors.ConcurrencyConflict`.

A write is all-or-nothing: when any of its checks fails, nothing of it reaches the overlay.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import TYPE_CHECKING

from attrs import evolve

from ql3.adapters.batches import OneAtATime
from ql3.adapters.memory import browse, scheduling
from ql3.adapters.memory.clock import FakeClock
from ql3.adapters.memory.credentials import MemoryCredentialRepository
from ql3.adapters.memory.history import MemoryHistoryRepository
from ql3.adapters.memory.state import State
from ql3.application.budgets import check_page_limit
from ql3.application.console import (
    Count,
    FinishedBucket,
    RunCursor,
    RunFilter,
    RunOrder,
    RunPage,
)
from ql3.application.ports import (
    ClaimLock,
    CredentialRepository,
    DispatchGate,
    DispatchGateRepository,
    DueTrigger,
    EvidenceRepository,
    EvidenceWaits,
    HistoryRepository,
    NodeCycle,
    OperationsView,
    Page,
    QueueDepth,
    RecoveryCandidate,
    RunCandidate,
    RunRepository,
    SessionCapacity,
    Snapshot,
    StoredEvent,
    TriggerRepository,
    WorkerSessionRegistry,
    WorkflowRepository,
    no_connection_hold,
)
from ql3.domain.dispatch import TaskLimit
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.events import EventType
from ql3.domain.guards import CLAIMABLE_RUN, LEASE_LIVE, fence_matches, holds
from ql3.domain.model import (
    Attempt,
    DispatchLease,
    LeaseStatus,
    Run,
    RunOwner,
    RunStatus,
    StopReport,
    WorkerSession,
)
from ql3.domain.recovery import find_not_running_evidence, is_recovery_candidate, is_resolvable
from ql3.domain.retry import is_due_retry, is_lost_retry_candidate
from ql3.domain.states import (
    NON_TERMINAL_ATTEMPT_STATUSES,
    OPEN_SESSION_STATUSES,
)
from ql3.domain.transitions import Change

if TYPE_CHECKING:
    from ql3.application.ports import SchedulerStore, SchedulerUnitOfWork

SinceOf = Callable[[Run], int]


@dataclass
class _Writes:
    """The rows one write will insert or replace, checked before any of them is installed."""

    run: Run | None = None
    attempts: dict[str, Attempt] = field(default_factory=dict)
    new_attempt_ids: set[str] = field(default_factory=set)
    lease: DispatchLease | None = None

    def run_ids(self) -> set[str]:
        ids = {a.run_id for a in self.attempts.values()}
        if self.run is not None:
            ids.add(self.run.id)
        if self.lease is not None:
            ids.add(self.lease.run_id)
        return ids


def _conflict(message: str) -> ConcurrencyConflict:
    return ConcurrencyConflict(message)


def _check_invariants(state: State, writes: _Writes, change: Change) -> None:
    """What the PostgreSQL schema enforces with foreign keys, CHECKs and partial unique indexes,
    on the state after ``writes``."""
    run_ids = writes.run_ids() | {change.event.run_id}
    for run_id in run_ids:
        if run_id not in state.runs and (writes.run is None or writes.run.id != run_id):
            raise _conflict(f"run {run_id} does not exist")
    lease = writes.lease
    if lease is not None:
        if lease.attempt_id not in state.attempts and lease.attempt_id not in writes.attempts:
            raise _conflict(f"attempt {lease.attempt_id} of lease {lease.run_id} does not exist")
        if (lease.status is LeaseStatus.LEASED) != (lease.release_reason is None):
            raise _conflict(f"lease {lease.run_id}/{lease.generation}: reason iff released")
    for run_id in sorted(run_ids):
        attempts = {a.id: a for a in state.attempts_of(run_id)}
        attempts.update({a.id: a for a in writes.attempts.values() if a.run_id == run_id})
        numbers = [a.number for a in attempts.values()]
        if len(numbers) != len(set(numbers)):
            raise _conflict(f"run {run_id} would have two attempts with the same number")
        active = [a.id for a in attempts.values() if a.status in NON_TERMINAL_ATTEMPT_STATUSES]
        if len(active) > 1:
            raise _conflict(f"run {run_id} would have more than one non-terminal attempt")
        leases = {lease.generation: lease for lease in state.leases_of(run_id)}
        if writes.lease is not None and writes.lease.run_id == run_id:
            leases[writes.lease.generation] = writes.lease
        leased = [g for g, lease in leases.items() if lease.status is LeaseStatus.LEASED]
        if len(leased) > 1:
            raise _conflict(f"run {run_id} would hold more than one leased lease")


def _check_unique_key(state: State, run: Run) -> None:
    """At most one unfinished Run per unique key (ADR 0015)."""
    if run.unique_key is None or run.status.is_terminal:
        return
    holder = state.unique_keys.get(run.unique_key)
    if holder is not None and holder != run.id:
        raise _conflict(f"an unfinished run holds the unique key of run {run.id}")


def _check_attempt_insert(state: State, attempt: Attempt, writes: _Writes) -> None:
    if attempt.id in state.attempts or attempt.id in writes.attempts:
        raise _conflict(f"attempt {attempt.id} already exists")


def _check_lease_insert(state: State, lease: DispatchLease) -> None:
    if (lease.run_id, lease.generation) in state.leases:
        raise _conflict(f"lease {lease.run_id}/{lease.generation} already exists")


def _install(state: State, writes: _Writes, change: Change) -> None:
    """Write checked rows and append the change's event. ``state`` must be writable."""
    if writes.run is not None:
        state.runs[writes.run.id] = writes.run
        unique_key = writes.run.unique_key
        if unique_key is not None:
            if not writes.run.status.is_terminal:
                state.unique_keys[unique_key] = writes.run.id
            elif state.unique_keys.get(unique_key) == writes.run.id:
                del state.unique_keys[unique_key]
    touched_runs: set[str] = set()
    for attempt in writes.attempts.values():
        state.attempts[attempt.id] = attempt
        if attempt.id in writes.new_attempt_ids:
            touched_runs.add(attempt.run_id)
            state.run_attempts[attempt.run_id] = (
                *state.run_attempts.get(attempt.run_id, ()),
                attempt.id,
            )
    for run_id in touched_runs:
        state.run_attempts[run_id] = tuple(
            sorted(state.run_attempts[run_id], key=lambda a: state.attempts[a].number)
        )
    lease = writes.lease
    if lease is not None:
        key = (lease.run_id, lease.generation)
        if key not in state.leases:
            state.run_leases[lease.run_id] = tuple(
                sorted((*state.run_leases.get(lease.run_id, ()), lease.generation))
            )
        state.leases[key] = lease
    state.last_sequence += 1
    stored = StoredEvent(sequence=state.last_sequence, event=change.event)
    run_id = change.event.run_id
    state.events[run_id] = (*state.events.get(run_id, ()), stored)


# --- unit of work and repositories -------------------------------------------------------------


class MemoryUnitOfWork:
    """One serial transaction over a :class:`MemoryStore`. Rolls back unless committed."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self._entered = False
        self._base: State | None = None
        self._overlay: State | None = None
        self.runs: RunRepository = MemoryRunRepository(self)
        self.sessions: WorkerSessionRegistry = MemorySessionRegistry(self)
        self.evidence: EvidenceRepository = MemoryEvidenceRepository(self)
        self.triggers: TriggerRepository = scheduling.MemoryTriggerRepository(self)
        self.workflows: WorkflowRepository = scheduling.MemoryWorkflowRepository(self)
        self.gate: DispatchGateRepository = MemoryGateRepository(self)
        self.credentials: CredentialRepository = MemoryCredentialRepository(self)
        self.history: HistoryRepository = MemoryHistoryRepository(self)

    def __enter__(self) -> MemoryUnitOfWork:
        if self._entered:
            raise RuntimeError("this unit of work is already in use")
        self._base = self._store._begin(self)
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Whatever was not committed is dropped, on a normal exit and on an exception alike.
        self._overlay = None
        self._base = None
        self._entered = False
        self._store._end(self)

    def now_ms(self) -> int:
        return self._store.clock.now_ms()

    def commit(self) -> None:
        self._require_active()
        if self._overlay is not None:
            self._store._install(self._overlay)
            self._base = self._overlay
            self._overlay = None

    def read(self) -> State:
        """The state this transaction sees: its own writes over the committed state."""
        self._require_active()
        if self._overlay is not None:
            return self._overlay
        assert self._base is not None
        return self._base

    def write(self) -> State:
        """The overlay, copied from the committed state on the first write."""
        self._require_active()
        if self._overlay is None:
            assert self._base is not None
            self._overlay = self._base.copy()
        return self._overlay

    def _require_active(self) -> None:
        if not self._entered:
            raise RuntimeError("use the unit of work inside its `with` block")


class MemoryRunRepository(OneAtATime):
    def __init__(self, uow: MemoryUnitOfWork) -> None:
        self._uow = uow

    def add(self, change: Change) -> None:
        state = self._uow.read()
        if change.run.id in state.runs:
            raise _conflict(f"run {change.run.id} already exists")
        _check_unique_key(state, change.run)
        writes = _Writes(run=change.run)
        for attempt in change.attempts:
            _check_attempt_insert(state, attempt, writes)
            writes.attempts[attempt.id] = attempt
            writes.new_attempt_ids.add(attempt.id)
        if change.lease is not None:
            _check_lease_insert(state, change.lease)
            writes.lease = change.lease
        _check_invariants(state, writes, change)
        _install(self._uow.write(), writes, change)

    def add_many(self, changes: Sequence[Change]) -> None:
        state = self._uow.read()
        ids = [change.run.id for change in changes]
        if len(set(ids)) != len(ids) or any(run_id in state.runs for run_id in ids):
            raise _conflict("a run of the batch already exists")
        keys = [c.run.unique_key for c in changes if c.run.unique_key is not None]
        if len(set(keys)) != len(keys):
            raise _conflict("two runs of the batch hold one unique key")
        for change in changes:
            _check_unique_key(state, change.run)
        for change in changes:
            self.add(change)

    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None:
        # A memory transaction holds the store's lock for its whole life: never contended.
        state = self._uow.read()
        attempt = state.attempts.get(attempt_id)
        if attempt is None:
            return None
        run = state.runs.get(attempt.run_id)
        if run is None:
            return None
        return state.snapshot(run, attempt)

    def lock_for_claim(
        self, session_id: str, tasks: Sequence[str], limit_per_task: int
    ) -> ClaimLock:
        state = self._uow.read()
        now_ms = self._uow.now_ms()
        capacity = scheduling.session_capacity(state, session_id)
        candidates: list[Snapshot] = []
        in_flight: dict[str, int] = {}
        limits: dict[str, int] = {}
        if state.gate.open and capacity is not None:
            candidates = scheduling.claimable(state, tasks, limit_per_task)
            in_flight = scheduling.in_flight_by_task(
                state, sorted({s.run.task for s in candidates})
            )
            limits = {
                task: state.task_limits[task].max_running
                for task in sorted(set(tasks))
                if task in state.task_limits
            }
        return ClaimLock(
            capacity=capacity,
            gate=state.gate,
            candidates=tuple(candidates),
            in_flight_by_task=in_flight,
            observed_at_ms=now_ms,
            limits=limits,
        )

    def task_limits(self) -> Sequence[TaskLimit]:
        found = self._uow.read().task_limits
        return tuple(found[task] for task in sorted(found))

    def set_task_limit(self, limit: TaskLimit) -> None:
        self._uow.write().task_limits[limit.task] = limit

    def clear_task_limit(self, task: str) -> bool:
        if task not in self._uow.read().task_limits:
            return False
        del self._uow.write().task_limits[task]
        return True

    def lock_run(self, run_id: str) -> Snapshot | None:
        state = self._uow.read()
        run = state.runs.get(run_id)
        if run is None:
            return None
        return state.snapshot(run, state.latest_attempt(run_id))

    def apply(self, before: Snapshot, change: Change) -> None:
        state = self._uow.read()
        if change.run.id != before.run.id:
            raise ValueError(f"change of run {change.run.id} applied to run {before.run.id}")
        writes = _Writes()
        if change.run != before.run:
            stored_run = state.runs.get(before.run.id)
            if stored_run is None or not fence_matches("run", stored_run, before.run):
                raise _conflict(f"run {before.run.id} changed since it was read")
            writes.run = change.run
        for attempt in change.attempts:
            if before.attempt is not None and attempt.id == before.attempt.id:
                stored = state.attempts.get(attempt.id)
                if stored is None or not fence_matches("attempt", stored, before.attempt):
                    raise _conflict(f"attempt {attempt.id} changed since it was read")
            else:
                _check_attempt_insert(state, attempt, writes)
                writes.new_attempt_ids.add(attempt.id)
            writes.attempts[attempt.id] = attempt
        lease = change.lease
        if lease is not None:
            key = (lease.run_id, lease.generation)
            old = before.lease
            if old is not None and (old.run_id, old.generation) == key:
                if lease != old:
                    stored_lease = state.leases.get(key)
                    if stored_lease is None or not fence_matches("lease", stored_lease, old):
                        raise _conflict(f"lease {key[0]}/{key[1]} changed since it was read")
                    writes.lease = lease
            else:
                _check_lease_insert(state, lease)
                writes.lease = lease
        _check_invariants(state, writes, change)
        _install(self._uow.write(), writes, change)

    def renew_lease(self, before: DispatchLease, after: DispatchLease) -> None:
        if (after.run_id, after.generation) != (before.run_id, before.generation):
            raise ValueError("a renewal must name the same lease before and after")
        state = self._uow.read()
        key = (before.run_id, before.generation)
        stored = state.leases.get(key)
        if (
            stored is None
            or before.token_hash is None  # an offer not accepted yet has no fence to renew
            or not fence_matches("lease", stored, before)
            or not holds(LEASE_LIVE, {"lease": stored}, self._uow.now_ms())
        ):
            raise _conflict(f"lease {key[0]}/{key[1]} is no longer the live lease presented")
        self._uow.write().leases[key] = evolve(stored, expires_at_ms=after.expires_at_ms)

    def get_run(self, run_id: str) -> Run | None:
        return self._uow.read().runs.get(run_id)

    def get_attempt(self, attempt_id: str) -> Attempt | None:
        return self._uow.read().attempts.get(attempt_id)

    def attempts_of(self, run_id: str) -> Sequence[Attempt]:
        return self._uow.read().attempts_of(run_id)

    def leases_of(self, run_id: str) -> Sequence[DispatchLease]:
        return self._uow.read().leases_of(run_id)

    def events_of(self, run_id: str) -> Sequence[StoredEvent]:
        return self._uow.read().events.get(run_id, ())

    def unfinished_with_keys(self, keys: Sequence[str]) -> Mapping[str, str]:
        held = self._uow.read().unique_keys
        return {key: held[key] for key in keys if key in held}

    def list_runs(self, status: RunStatus | None, limit: int) -> Sequence[Run]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        runs = self._uow.read().runs.values()
        selected = [r for r in runs if status is None or r.status is status]
        selected.sort(key=lambda r: (r.created_at_ms, r.id))
        return tuple(selected[:limit])


class MemorySessionRegistry:
    def __init__(self, uow: MemoryUnitOfWork) -> None:
        self._uow = uow

    def get(self, session_id: str) -> WorkerSession | None:
        return self._uow.read().sessions.get(session_id)

    def open_sessions_of(self, worker_id: str) -> Sequence[WorkerSession]:
        return _open_sessions_of(self._uow.read().sessions.values(), worker_id)

    def add(self, session: WorkerSession) -> None:
        state = self._uow.read()
        if session.id in state.sessions:
            raise _conflict(f"session {session.id} already exists")
        self._check_one_open_per_worker(state, session)
        self._uow.write().sessions[session.id] = session

    def update(self, before: WorkerSession, after: WorkerSession) -> None:
        if after.id != before.id:
            raise ValueError("a session update must name the same session before and after")
        state = self._uow.read()
        stored = state.sessions.get(before.id)
        if stored is None or stored.status is not before.status:
            raise _conflict(f"session {before.id} changed since it was read")
        self._check_one_open_per_worker(state, after)
        self._uow.write().sessions[after.id] = after

    def held_by(self, session_id: str) -> Sequence[str]:
        state = self._uow.read()
        return tuple(
            sorted(
                lease.attempt_id
                for lease in state.leases.values()
                if lease.status is LeaseStatus.LEASED and lease.holder_session_id == session_id
            )
        )

    @staticmethod
    def _check_one_open_per_worker(state: State, session: WorkerSession) -> None:
        if session.status not in OPEN_SESSION_STATUSES:
            return
        others = [
            s
            for s in _open_sessions_of(state.sessions.values(), session.worker_id)
            if s.id != session.id
        ]
        if others:
            raise _conflict(
                f"worker {session.worker_id} already has an open session ({others[0].id})"
            )


def _open_sessions_of(
    sessions: Iterable[WorkerSession], worker_id: str
) -> tuple[WorkerSession, ...]:
    found = [s for s in sessions if s.worker_id == worker_id and s.status in OPEN_SESSION_STATUSES]
    return tuple(sorted(found, key=lambda s: s.id))


class MemoryGateRepository:
    def __init__(self, uow: MemoryUnitOfWork) -> None:
        self._uow = uow

    def get(self) -> DispatchGate:
        return self._uow.read().gate

    def set(self, gate: DispatchGate) -> None:
        self._uow.write().gate = gate

    def open(self, closed_before_ms: int | None, now_ms: int) -> bool:
        if not self._uow.read().gate.may_open(closed_before_ms):
            return False
        self._uow.write().gate = DispatchGate(open=True, changed_at_ms=now_ms)
        return True


class MemoryEvidenceRepository:
    def __init__(self, uow: MemoryUnitOfWork) -> None:
        self._uow = uow

    def record(self, report: StopReport) -> None:
        state = self._uow.write()
        state.reports[report.attempt_id] = (*state.reports.get(report.attempt_id, ()), report)

    def reports_for(self, attempt_id: str) -> Sequence[StopReport]:
        reports = self._uow.read().reports.get(attempt_id, ())
        return tuple(sorted(reports, key=lambda r: r.reported_at_ms))


# --- the store and its candidate sources -------------------------------------------------------


class MemoryStore:
    """Every port of the runtime in memory. ``clock`` is the store's (database) clock."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock if clock is not None else FakeClock()
        self._lock = threading.RLock()
        self._state = State()
        self._active: MemoryUnitOfWork | None = None
        self._closed = False
        self._nodes: dict[str, NodeCycle] = {}

    # transactions

    def unit_of_work(self) -> MemoryUnitOfWork:
        self._require_open()
        return MemoryUnitOfWork(self)

    def holding_connection(self) -> AbstractContextManager[None]:
        """The :class:`~ql3.application.ports.ConnectionHold` of a store without connections."""
        return no_connection_hold()

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def _begin(self, uow: MemoryUnitOfWork) -> State:
        self._lock.acquire()
        try:
            self._require_open()
            if self._active is not None:
                # Only this thread can hold the lock: a transaction nested in another one would
                # overwrite the outer one's commit (or deadlock on a real database).
                raise RuntimeError("a unit of work is already open on this store in this thread")
        except BaseException:
            self._lock.release()
            raise
        self._active = uow
        return self._state

    def _install(self, state: State) -> None:
        self._state = state

    def _end(self, uow: MemoryUnitOfWork) -> None:
        if self._active is uow:
            self._active = None
            self._lock.release()

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the store is closed")

    def _committed(self) -> tuple[State, int]:
        """The committed state and the clock, read together. Call with the lock held."""
        self._require_open()
        return self._state, self.clock.now_ms()

    # RecoveryCandidateSource

    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        check_page_limit(limit)
        with self._lock:
            state, now = self._committed()
            ranked = _ranked_recovery_candidates(state, now)
            items = tuple(candidate for _, candidate in ranked[: limit + 1])
            return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=now)

    # NodeRegistry and OperationsSource

    def record_node_cycle(self, cycle: NodeCycle) -> None:
        with self._lock:
            self._require_open()
            now = self.clock.now_ms()
            before = self._nodes.get(cycle.node_id)
            started = before.started_at_ms if before is not None else now
            self._nodes[cycle.node_id] = replace(cycle, started_at_ms=started, last_cycle_at_ms=now)

    def operations_view(self, limit: int) -> OperationsView:
        check_page_limit(limit)
        with self._lock:
            state, now = self._committed()
            queued: dict[str, list[int]] = {}
            for run in state.runs.values():
                if holds(CLAIMABLE_RUN, {"run": run}):
                    queued.setdefault(run.task, []).append(run.updated_at_ms)
            waiting = [
                c.lease_expires_at_ms
                if c.lease_expires_at_ms is not None
                else state.attempts[c.attempt_id].updated_at_ms
                for _, c in _ranked_recovery_candidates(state, now)
                if not c.resolvable
            ]
            sessions = sorted(
                (s for s in state.sessions.values() if s.status in OPEN_SESSION_STATUSES),
                key=lambda s: s.worker_id,
            )
            held: dict[str, int] = {}
            for lease in state.leases.values():
                if lease.status is LeaseStatus.LEASED:
                    held[lease.holder_session_id] = held.get(lease.holder_session_id, 0) + 1
            quarantined = sorted(
                (r for r in state.runs.values() if r.quarantine and not r.status.is_terminal),
                key=lambda r: (r.quarantine.since_ms if r.quarantine else 0, r.id),
            )
            return OperationsView(
                observed_at_ms=now,
                gate=state.gate,
                queues=tuple(
                    QueueDepth(task=task, queued=len(times), oldest_ms=min(times))
                    for task, times in sorted(queued.items())
                ),
                evidence=EvidenceWaits(
                    count=len(waiting), oldest_ms=min(waiting) if waiting else None
                ),
                sessions=tuple(
                    SessionCapacity(session=s, in_flight=held.get(s.id, 0)) for s in sessions
                ),
                quarantined=tuple(quarantined[:limit]),
                quarantined_count=len(quarantined),
                nodes=tuple(
                    sorted(
                        self._nodes.values(),
                        key=lambda n: (-(n.last_cycle_at_ms or 0), n.node_id),
                    )[:limit]
                ),
            )

    # RunBrowser: the console's reads (ADR 0020)

    def _snapshot(self) -> tuple[State, int]:
        with self._lock:
            return self._committed()

    def browse_runs(
        self, where: RunFilter, order: RunOrder, after: RunCursor | None, limit: int
    ) -> RunPage:
        state, now = self._snapshot()
        return browse.browse(state.runs.values(), now, where, order, after, limit)

    def count_runs(self, where: RunFilter, cap: int) -> Count:
        state, _ = self._snapshot()
        return browse.count(state.runs.values(), where, cap)

    def finished_between(
        self, since_ms: int, bucket_ms: int
    ) -> tuple[int, Sequence[FinishedBucket]]:
        state, now = self._snapshot()
        return now, browse.buckets(state.runs.values(), since_ms, bucket_ms)

    def finished_counts(self, since_ms: int) -> Mapping[tuple[str, str], int]:
        state, _ = self._snapshot()
        return browse.finished_counts(state.runs.values(), since_ms)

    def task_durations(self, since_ms: int, limit: int) -> Mapping[str, Sequence[int]]:
        state, _ = self._snapshot()

        def attempts_of(run_id: str) -> Sequence[Attempt]:
            return [state.attempts[i] for i in state.run_attempts.get(run_id, ())]

        return browse.durations(state.runs.values(), attempts_of, since_ms, limit)

    def status_counts(self, cap: int) -> Mapping[RunStatus, Count]:
        state, _ = self._snapshot()
        runs = list(state.runs.values())
        return {s: browse.count(runs, RunFilter(statuses=(s,)), cap) for s in RunStatus}

    def last_event_sequence(self) -> int:
        state, _ = self._snapshot()
        return state.last_sequence

    def runs_again_of(self, run_id: str, after_sequence: int) -> Sequence[str]:
        state, _ = self._snapshot()
        found = sorted(
            (stored.sequence, stored.event.run_id)
            for events in state.events.values()
            for stored in events
            if stored.sequence > after_sequence
            and stored.event.type is EventType.RUN_ADMITTED
            and stored.event.data.get("again_of") == run_id
        )
        return [found_id for _, found_id in found[:20]]

    # LostRetryCandidateSource

    def lost_runs(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        with self._lock:
            state, now = self._committed()
            runs = sorted(
                (r for r in state.runs.values() if is_lost_retry_candidate(r)),
                key=lambda r: (r.updated_at_ms, r.id),
            )
            return self._run_page(state, runs, limit, now, lambda r: r.updated_at_ms)

    def due_retries(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        with self._lock:
            state, now = self._committed()
            due = [r for r in state.runs.values() if is_due_retry(r, now)]
            due.sort(key=lambda r: (r.next_attempt_at_ms or 0, r.id))
            return self._run_page(state, due, limit, now, lambda r: r.next_attempt_at_ms or 0)

    # StartupCandidateSource

    def orphaned_runs(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        with self._lock:
            state, now = self._committed()
            orphans = sorted(
                (
                    r
                    for r in state.runs.values()
                    if r.owner is RunOwner.RUNTIME
                    and r.status is RunStatus.CREATED
                    and r.attempt_count == 0
                ),
                key=lambda r: (r.created_at_ms, r.id),
            )
            items = tuple(
                RunCandidate(run_id=r.id, attempt_id=None, since_ms=r.created_at_ms)
                for r in orphans[:limit]
            )
            return Page(items=items, has_more=len(orphans) > limit, observed_at_ms=now)

    # DispatchGateSource

    def dispatch_gate(self) -> DispatchGate:
        with self._lock:
            state, _ = self._committed()
            return state.gate

    # TriggerSource and WorkflowFrontierSource

    def due_triggers(self, limit: int) -> Page[DueTrigger]:
        check_page_limit(limit)
        with self._lock:
            state, now = self._committed()
            return scheduling.due_triggers(state, now, limit)

    def workflow_candidates(self, limit: int) -> Page[RunCandidate]:
        check_page_limit(limit)
        with self._lock:
            state, now = self._committed()
            return scheduling.workflow_candidates(state, now, limit)

    @staticmethod
    def _run_page(
        state: State,
        ordered: Sequence[Run],
        limit: int,
        now: int,
        since: SinceOf,
    ) -> Page[RunCandidate]:
        items: list[RunCandidate] = []
        for run in ordered[:limit]:
            latest = state.latest_attempt(run.id)
            items.append(
                RunCandidate(
                    run_id=run.id,
                    attempt_id=latest.id if latest is not None else None,
                    since_ms=since(run),
                )
            )
        return Page(items=tuple(items), has_more=len(ordered) > limit, observed_at_ms=now)


def _ranked_recovery_candidates(
    state: State, now: int
) -> list[tuple[tuple[int, int, int, str], RecoveryCandidate]]:
    """Every recovery candidate, in the order of the page (resolvable first, then by expiry)."""
    ranked: list[tuple[tuple[int, int, int, str], RecoveryCandidate]] = []
    for attempt in state.attempts.values():
        if attempt.status not in NON_TERMINAL_ATTEMPT_STATUSES:
            continue
        run = state.runs[attempt.run_id]
        lease = state.own_lease(attempt)
        if lease is not None and lease.attempt_id != attempt.id:
            lease = None
        if not is_recovery_candidate(run, attempt, lease, now):
            continue
        session = state.sessions.get(attempt.session_id) if attempt.session_id else None
        evidence = find_not_running_evidence(attempt, session, state.reports.get(attempt.id, ()))
        resolvable = is_resolvable(attempt, evidence)
        expires = lease.expires_at_ms if lease is not None else None
        key = (
            0 if resolvable else 1,
            0 if expires is None else 1,
            expires if expires is not None else 0,
            attempt.id,
        )
        candidate = RecoveryCandidate(
            run_id=run.id,
            attempt_id=attempt.id,
            attempt_status=attempt.status,
            lease_expires_at_ms=expires,
            resolvable=resolvable,
        )
        ranked.append((key, candidate))
    ranked.sort(key=lambda pair: pair[0])
    return ranked


if TYPE_CHECKING:

    def _conforms(
        store: MemoryStore, uow: MemoryUnitOfWork
    ) -> tuple[SchedulerStore, SchedulerUnitOfWork]:
        """Lets mypy check that the memory store implements the ports structurally."""
        return store, uow
