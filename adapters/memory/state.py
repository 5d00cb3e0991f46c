"""The memory store's state: its rows as frozen domain values in plain dicts, the reads every
repository of the store shares, and what its repositories need of a unit of work."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from ql3.application.ports import OPEN_GATE, DispatchGate, Snapshot, StoredEvent
from ql3.domain.credentials import CredentialEvent, WorkerCredential
from ql3.domain.dispatch import TaskLimit
from ql3.domain.model import Attempt, DispatchLease, Run, StopReport, WorkerSession
from ql3.domain.triggers import Trigger, TriggerFiring
from ql3.domain.workflows import WorkflowStep

LeaseKey = tuple[str, int]


@dataclass
class State:
    """Committed (or overlay) state. Values are frozen domain objects or tuples of them, so a
    shallow copy of each dict is an independent snapshot."""

    runs: dict[str, Run] = field(default_factory=dict)
    attempts: dict[str, Attempt] = field(default_factory=dict)
    # run id -> its attempt ids ordered by number
    run_attempts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    leases: dict[LeaseKey, DispatchLease] = field(default_factory=dict)
    # run id -> its lease generations in ascending order
    run_leases: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # run id -> its events ordered by sequence
    events: dict[str, tuple[StoredEvent, ...]] = field(default_factory=dict)
    last_sequence: int = 0
    sessions: dict[str, WorkerSession] = field(default_factory=dict)
    # attempt id -> its stop reports in the order they were recorded
    reports: dict[str, tuple[StopReport, ...]] = field(default_factory=dict)
    triggers: dict[str, Trigger] = field(default_factory=dict)
    # (trigger id, scheduled time) -> the firing: the unique firing key
    firings: dict[tuple[str, int], TriggerFiring] = field(default_factory=dict)
    # workflow run id -> its steps ordered by position
    workflow_steps: dict[str, tuple[WorkflowStep, ...]] = field(default_factory=dict)
    gate: DispatchGate = OPEN_GATE
    credentials: dict[str, WorkerCredential] = field(default_factory=dict)
    credential_events: tuple[CredentialEvent, ...] = ()
    # unique key -> the unfinished Run holding it (the partial unique index, ADR 0015)
    unique_keys: dict[str, str] = field(default_factory=dict)
    task_limits: dict[str, TaskLimit] = field(default_factory=dict)

    def copy(self) -> State:
        return replace(
            self,
            runs=dict(self.runs),
            unique_keys=dict(self.unique_keys),
            attempts=dict(self.attempts),
            run_attempts=dict(self.run_attempts),
            leases=dict(self.leases),
            run_leases=dict(self.run_leases),
            events=dict(self.events),
            sessions=dict(self.sessions),
            reports=dict(self.reports),
            triggers=dict(self.triggers),
            firings=dict(self.firings),
            workflow_steps=dict(self.workflow_steps),
            credentials=dict(self.credentials),
            task_limits=dict(self.task_limits),
        )

    # reads shared by the repositories and the sources

    def attempts_of(self, run_id: str) -> tuple[Attempt, ...]:
        return tuple(self.attempts[a] for a in self.run_attempts.get(run_id, ()))

    def latest_attempt(self, run_id: str) -> Attempt | None:
        ids = self.run_attempts.get(run_id, ())
        return self.attempts[ids[-1]] if ids else None

    def leases_of(self, run_id: str) -> tuple[DispatchLease, ...]:
        return tuple(self.leases[(run_id, g)] for g in self.run_leases.get(run_id, ()))

    def own_lease(self, attempt: Attempt) -> DispatchLease | None:
        """The lease of the Attempt's exact generation, if it exists."""
        if attempt.lease_generation is None:
            return None
        return self.leases.get((attempt.run_id, attempt.lease_generation))

    def snapshot(self, run: Run, attempt: Attempt | None) -> Snapshot:
        lease: DispatchLease | None
        if attempt is not None and attempt.lease_generation is not None:
            lease = self.own_lease(attempt)
        else:
            generations = self.run_leases.get(run.id, ())
            lease = self.leases[(run.id, generations[-1])] if generations else None
        return Snapshot(run=run, attempt=attempt, lease=lease)


class StateAccess(Protocol):
    """What a repository of the memory store needs of its unit of work: the state to read (the
    overlay of this transaction, or the committed state) and the overlay to write."""

    def read(self) -> State: ...

    def write(self) -> State: ...
