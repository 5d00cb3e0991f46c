"""Ports: what the application needs from a store, typed in domain terms.

Every store (memory, PostgreSQL, SQLite) implements all of them. A :class:`UnitOfWork` is one
transaction: leaving its ``with`` block without :meth:`UnitOfWork.commit` rolls everything back.
Writes are compare-and-set against the ``before`` values the transaction locked; a write that
matches no row raises :class:`ql3.domain.errors.ConcurrencyConflict`, never succeeds silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

# The page budgets are the ports' too (every page a port reads is bounded by them).
from ql3.application.budgets import DEFAULT_PAGE_SIZE as DEFAULT_PAGE_SIZE
from ql3.application.budgets import HARD_PAGE_CAP as HARD_PAGE_CAP

if TYPE_CHECKING:
    # Annotations only: a submit imports the ports without the domain's triggers, workflows
    # and credentials (ADR 0009).
    from ql3.domain.credentials import CredentialEvent, WorkerCredential
    from ql3.domain.dispatch import TaskLimit
    from ql3.domain.events import RunEvent
    from ql3.domain.model import (
        Attempt,
        AttemptStatus,
        DispatchLease,
        Run,
        RunStatus,
        StopReport,
        WorkerSession,
    )
    from ql3.domain.transitions import Change
    from ql3.domain.triggers import FireSchedule, Trigger, TriggerFiring
    from ql3.domain.workflows import WorkflowStep

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One bounded page of candidates, read with ``limit + 1`` to learn ``has_more``.

    ``observed_at_ms`` is the store's clock when the page was read (``statement_timestamp()``).
    """

    items: tuple[T, ...]
    has_more: bool
    observed_at_ms: int


@dataclass(frozen=True, slots=True)
class RecoveryCandidate:
    """A runtime-owned Attempt whose lease is missing or expired. ``resolvable`` is the source's
    view (never started, or not-running evidence exists); the resolution re-checks everything
    under the locks."""

    run_id: str
    attempt_id: str
    attempt_status: AttemptStatus
    lease_expires_at_ms: int | None
    resolvable: bool


@dataclass(frozen=True, slots=True)
class RunCandidate:
    """A Run picked by a source, with its current (latest) Attempt, if it has one."""

    run_id: str
    attempt_id: str | None
    since_ms: int


@dataclass(frozen=True, slots=True)
class DueTrigger:
    """An active trigger whose next scheduled firing the store's clock reached."""

    trigger_id: str
    next_fire_at_ms: int


@dataclass(frozen=True, slots=True)
class SessionCapacity:
    session: WorkerSession
    in_flight: int

    @property
    def free(self) -> int:
        return max(0, self.session.capacity - self.in_flight)


@dataclass(frozen=True, slots=True)
class StepFailure:
    """The candidate a runtime recovery or lost-retry step failed on, cycle after cycle, of
    any replica (ADR 0010): ``since_ms`` is the first of those failures by the store's clock,
    ``cycles`` how many there were in a row, ``error`` the latest one."""

    step: str
    run_id: str
    attempt_id: str | None
    error: str
    since_ms: int
    cycles: int


@dataclass(frozen=True, slots=True)
class DispatchGate:
    """Whether claims may grant work (ADR 0007). Closed while the most recent runtime recovery
    or lost-retry step of any replica failed and none has succeeded since; ``reason`` says which
    step failed and how, ``failure`` on which candidate when the failure had one."""

    open: bool
    reason: str | None = None
    changed_at_ms: int | None = None
    failure: StepFailure | None = None

    def may_open(self, closed_before_ms: int | None) -> bool:
        """Whether step 5 of a cycle that began at ``closed_before_ms`` (the store's clock)
        opens this gate: only a closed gate that has not changed since the cycle began, so a
        failure another replica reported meanwhile keeps it closed (ADR 0007). None: no
        recovery step began the cycle (Standalone, Edge), and a closed gate opens. A closed
        gate without its time (a row written before it was recorded) opens too."""
        if self.open:
            return False
        if closed_before_ms is None or self.changed_at_ms is None:
            return True
        return self.changed_at_ms < closed_before_ms


OPEN_GATE = DispatchGate(open=True)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A Run locked for change, with its current Attempt and that Attempt's lease (or the Run's
    latest lease when the Attempt has none)."""

    run: Run
    attempt: Attempt | None
    lease: DispatchLease | None


@dataclass(frozen=True, slots=True)
class ClaimLock:
    """What one claim decides from, read in one step of its transaction: the claiming session
    locked with the number of ``leased`` leases it holds, the dispatch gate, and the pristine
    Attempts of ``queued`` Runs of its tasks, locked as :meth:`RunRepository.lock_attempt`
    locks them (rows another transaction holds are skipped), highest priority first, then
    oldest first within each task, with how many Attempts of each of those tasks are in flight
    (fair share), and the limit of each limited task named (ADR 0014: read under a lock the
    claims of every replica take, so that what is in flight of that task cannot grow until
    this transaction ends)."""

    capacity: SessionCapacity | None
    gate: DispatchGate
    candidates: tuple[Snapshot, ...]
    in_flight_by_task: Mapping[str, int]
    observed_at_ms: int
    limits: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    sequence: int
    event: RunEvent


class RunRepository(Protocol):
    """Runs, Attempts, leases and events inside one transaction (admission and dispatch)."""

    def add(self, change: Change) -> None:
        """Insert a newly admitted Run, its Attempts and its event."""

    def add_many(self, changes: Sequence[Change]) -> None:
        """:meth:`add` for a batch of newly admitted Runs, all of them or none (one statement
        per batch where the store can)."""

    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None:
        """Take the Attempt's advisory lock, then row locks on Run, Attempt and lease.

        With ``skip_locked`` it returns None at once when another transaction holds the
        Attempt's advisory lock (another replica is resolving that candidate)."""

    def lock_attempts(self, attempt_ids: Sequence[str]) -> Sequence[Snapshot | None]:
        """:meth:`lock_attempt` (waiting for each lock) for every id, one after the other in
        the order given; one answer per id. Callers sort the ids, so that concurrent batches
        take their locks in one order and cannot deadlock."""

    def lock_run(self, run_id: str) -> Snapshot | None:
        """Lock a Run the same way, through its current Attempt when it has one."""

    def apply(self, before: Snapshot, change: Change) -> None:
        """Persist ``change`` as compare-and-set writes against ``before`` and append its one
        event. Raises ``ConcurrencyConflict`` when any write matches no row."""

    def apply_many(self, writes: Sequence[tuple[Snapshot, Change]]) -> None:
        """:meth:`apply` for every ``(before, change)`` in order, all of them or none. A change
        may start from the result of an earlier one of the same Run. Raises
        ``ConcurrencyConflict`` when any write matches no row; the unit of work must then be
        rolled back."""

    def lock_for_claim(
        self, session_id: str, tasks: Sequence[str], limit_per_task: int
    ) -> ClaimLock:
        """Lock the session row (two claims of one session count its capacity one after the
        other), read the dispatch gate and, while it is open, lock up to ``limit_per_task``
        claimable Attempts of each task named, skipping those another transaction holds. With
        the gate closed no Attempt is locked. The limits of the limited tasks named are locked
        too, after the session and in task order, before their Attempts in flight are counted:
        claims of a limited task are counted one after the other across every replica."""

    def task_limits(self) -> Sequence[TaskLimit]:
        """Every task limit recorded, by task name."""

    def set_task_limit(self, limit: TaskLimit) -> None:
        """Record ``limit``, replacing the task's limit if it has one."""

    def clear_task_limit(self, task: str) -> bool:
        """Remove the task's limit; whether it had one."""

    def renew_lease(self, before: DispatchLease, after: DispatchLease) -> None:
        """Move only ``expires_at``; compare-and-set on generation, version, status, token hash
        and ``expires_at`` still in the future by the store's clock. No event: not a state
        change."""

    def get_run(self, run_id: str) -> Run | None: ...

    def get_attempt(self, attempt_id: str) -> Attempt | None: ...

    def attempts_of(self, run_id: str) -> Sequence[Attempt]: ...

    def leases_of(self, run_id: str) -> Sequence[DispatchLease]: ...

    def events_of(self, run_id: str) -> Sequence[StoredEvent]: ...

    def list_runs(self, status: RunStatus | None, limit: int) -> Sequence[Run]: ...

    def unfinished_with_keys(self, keys: Sequence[str]) -> Mapping[str, str]:
        """The ids of the unfinished (non-terminal) Runs holding any of these unique keys, by
        key (ADR 0015). At most one unfinished Run holds a key: the stores refuse a second."""


class WorkerSessionRegistry(Protocol):
    def get(self, session_id: str) -> WorkerSession | None: ...

    def open_sessions_of(self, worker_id: str) -> Sequence[WorkerSession]:
        """Active or draining sessions of a worker id, locked for update."""

    def add(self, session: WorkerSession) -> None: ...

    def update(self, before: WorkerSession, after: WorkerSession) -> None:
        """Compare-and-set on the session's status."""

    def held_by(self, session_id: str) -> Sequence[str]:
        """The ids of the Attempts whose ``leased`` lease this session holds, sorted."""


class EvidenceRepository(Protocol):
    def record(self, report: StopReport) -> None: ...

    def reports_for(self, attempt_id: str) -> Sequence[StopReport]: ...


class TriggerRepository(Protocol):
    """Triggers and their firings inside one transaction."""

    def add(self, trigger: Trigger) -> None:
        """Insert a new trigger; a name held by a trigger that is not deleted is a
        ``ConcurrencyConflict``."""

    def get(self, trigger_id: str) -> Trigger | None: ...

    def find(self, name: str, *, lock: bool = False) -> Trigger | None:
        """The trigger of that name that is not deleted, locked for update with ``lock``."""

    def lock(self, trigger_id: str, *, skip_locked: bool = False) -> Trigger | None:
        """The trigger row locked for update; with ``skip_locked`` None at once when another
        transaction holds it (another replica is firing it)."""

    def update(self, before: Trigger, after: Trigger) -> None:
        """Compare-and-set on the version read."""

    def list_triggers(self, *, include_deleted: bool = False) -> Sequence[Trigger]:
        """By name, then id."""

    def record_firing(self, firing: TriggerFiring) -> None:
        """Insert a firing. Its key (trigger id, scheduled time) is unique: a second firing of
        the same scheduled time is a ``ConcurrencyConflict``."""

    def firings_of(self, trigger_id: str, limit: int) -> Sequence[TriggerFiring]:
        """The most recent firings first."""


class WorkflowRepository(Protocol):
    """The steps of workflow aggregate Runs inside one transaction."""

    def add_steps(self, steps: Sequence[WorkflowStep]) -> None:
        """Insert the steps of a newly admitted workflow (its aggregate Run is added first)."""

    def steps_of(self, workflow_run_id: str, *, lock: bool = False) -> Sequence[WorkflowStep]:
        """The workflow's steps by position, locked for update with ``lock``."""

    def update_step(self, before: WorkflowStep, after: WorkflowStep) -> None:
        """Compare-and-set on the step's status and run id."""

    def step_of_run(self, run_id: str) -> WorkflowStep | None:
        """The step whose Run this is, if it is a workflow step's Run."""

    def list_workflows(self, status: RunStatus | None, limit: int) -> Sequence[Run]:
        """Workflow aggregate Runs (of ``status``), the most recently admitted first."""


@dataclass(frozen=True, slots=True)
class PruneMark:
    """A position in the order a prune picks finished Runs: their last change, then their id."""

    finished_at_ms: int
    run_id: str


@dataclass(frozen=True, slots=True)
class PrunableRun:
    """A top-level finished Run a prune picked, with the step Runs pruned with it (a workflow
    aggregate's; none for any other Run)."""

    run_id: str
    finished_at_ms: int
    step_run_ids: tuple[str, ...] = ()

    @property
    def runs(self) -> int:
        return 1 + len(self.step_run_ids)

    @property
    def mark(self) -> PruneMark:
        return PruneMark(finished_at_ms=self.finished_at_ms, run_id=self.run_id)


@dataclass(frozen=True, slots=True)
class PrunedRows:
    """How many rows of each kind a prune removed (or, in a dry run, would remove)."""

    runs: int = 0
    attempts: int = 0
    leases: int = 0
    events: int = 0
    stop_reports: int = 0
    trigger_firings: int = 0
    workflow_steps: int = 0

    def __add__(self, other: PrunedRows) -> PrunedRows:
        return PrunedRows(
            runs=self.runs + other.runs,
            attempts=self.attempts + other.attempts,
            leases=self.leases + other.leases,
            events=self.events + other.events,
            stop_reports=self.stop_reports + other.stop_reports,
            trigger_firings=self.trigger_firings + other.trigger_firings,
            workflow_steps=self.workflow_steps + other.workflow_steps,
        )

    def as_dict(self) -> dict[str, int]:
        return {
            "runs": self.runs,
            "attempts": self.attempts,
            "leases": self.leases,
            "events": self.events,
            "stop_reports": self.stop_reports,
            "trigger_firings": self.trigger_firings,
            "workflow_steps": self.workflow_steps,
        }


class HistoryRepository(Protocol):
    """Finished history inside one transaction: what a prune picks, counts and deletes
    (ADR 0016). Nothing here touches a Run that is not finished."""

    def prunable(
        self, finished_before_ms: int, limit: int, after: PruneMark | None = None
    ) -> Sequence[PrunableRun]:
        """Up to ``limit`` top-level Runs that :func:`ql3.domain.history.is_prunable` says a prune
        with this cutoff deletes, oldest last change first (then by id), after ``after``; each
        workflow aggregate with its step Runs. The Runs picked are locked for deletion; a Run
        another transaction holds is skipped, never waited for (PostgreSQL: ``FOR UPDATE SKIP
        LOCKED``). The pick reads an index of finished Runs, not the table."""

    def count(self, picked: Sequence[PrunableRun]) -> PrunedRows:
        """What :meth:`delete` would remove for these Runs; nothing is written."""

    def delete(self, picked: Sequence[PrunableRun]) -> PrunedRows:
        """Delete these Runs and their step Runs with every row that references them: stop
        reports, events, leases, Attempts, trigger firings, workflow steps. Raises
        ``ConcurrencyConflict`` when a row another writer added meanwhile still references one
        of them; the unit of work must then be rolled back."""


class AdmissionRuns(Protocol):
    """What admitting Runs needs of the Runs of a unit of work (every :class:`RunRepository`
    has it)."""

    def unfinished_with_keys(self, keys: Sequence[str]) -> Mapping[str, str]: ...

    def add_many(self, changes: Sequence[Change]) -> None: ...


class AdmissionUnitOfWork(Protocol):
    """What admitting Runs needs of a unit of work: every :class:`UnitOfWork`, and the
    submit-only stores of ``ql3 submit``, which offer nothing else (ADR 0009)."""

    @property
    def runs(self) -> AdmissionRuns: ...

    def now_ms(self) -> int: ...

    def commit(self) -> None: ...

    def __enter__(self) -> AdmissionUnitOfWork: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class AdmissionUnitOfWorkFactory(Protocol):
    def __call__(self) -> AdmissionUnitOfWork: ...


class UnitOfWork(Protocol):
    """One transaction. Rolls back unless :meth:`commit` was called."""

    runs: RunRepository
    sessions: WorkerSessionRegistry
    evidence: EvidenceRepository

    def now_ms(self) -> int:
        """The store's clock, observed inside this transaction."""

    def commit(self) -> None: ...

    def __enter__(self) -> UnitOfWork: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


class UnitOfWorkFactory(Protocol):
    def __call__(self) -> UnitOfWork: ...


class ConnectionHold(Protocol):
    """A scope in which the units of work one thread opens, one after the other, run on one
    connection, each still in its own transaction (a store without connections ignores it)."""

    def __call__(self) -> AbstractContextManager[None]: ...


def no_connection_hold() -> AbstractContextManager[None]:
    """The :class:`ConnectionHold` of a store that keeps no connection between transactions."""
    return nullcontext()


class CredentialRepository(Protocol):
    """Worker credentials and their audit inside one transaction (ADR 0008). Cluster only:
    the memory and PostgreSQL runtime stores implement it."""

    def add(self, credential: WorkerCredential) -> None:
        """Insert a new credential; an id or secret hash already stored is a
        ``ConcurrencyConflict``."""

    def get(self, credential_id: str, *, lock: bool = False) -> WorkerCredential | None:
        """The credential, locked for update with ``lock`` (a revocation)."""

    def find_by_secret_hash(self, secret_hash: str) -> WorkerCredential | None:
        """The credential of that hash, locked for share: a revocation of it waits for the
        registration that uses it, and then sees its session."""

    def update(self, before: WorkerCredential, after: WorkerCredential) -> None:
        """Compare-and-set on the status read."""

    def list_credentials(self) -> Sequence[WorkerCredential]:
        """Every credential, by issue time then id."""

    def record(self, event: CredentialEvent) -> None:
        """Append an audit line."""

    def events_of(self, credential_id: str) -> Sequence[CredentialEvent]:
        """The credential's audit, oldest first."""

    def open_sessions_of(self, credential_id: str) -> Sequence[WorkerSession]:
        """Active or draining sessions registered with the credential, locked for update."""


class CredentialUnitOfWork(UnitOfWork, Protocol):
    """A transaction of a store that keeps worker credentials."""

    credentials: CredentialRepository

    def __enter__(self) -> CredentialUnitOfWork: ...


class CredentialUnitOfWorkFactory(Protocol):
    def __call__(self) -> CredentialUnitOfWork: ...


class DispatchGateRepository(Protocol):
    def get(self) -> DispatchGate:
        """The gate as this transaction sees it."""

    def set(self, gate: DispatchGate) -> None:
        """Replace the gate's state (one row for every replica of the store)."""

    def open(self, closed_before_ms: int | None, now_ms: int) -> bool:
        """Open the gate at ``now_ms`` if :meth:`DispatchGate.may_open` says so for the gate
        as stored: one compare-and-set, so a close that another transaction committed since
        the cycle began is never overwritten. True when this opened it."""


class SchedulerUnitOfWork(UnitOfWork, Protocol):
    """A transaction of a runtime store, with what the scheduler steps and the operators'
    commands need besides Runs, sessions and evidence: triggers, workflow steps, the
    dispatch gate and the finished history."""

    triggers: TriggerRepository
    workflows: WorkflowRepository
    gate: DispatchGateRepository
    history: HistoryRepository

    def __enter__(self) -> SchedulerUnitOfWork: ...


class SchedulerUnitOfWorkFactory(Protocol):
    def __call__(self) -> SchedulerUnitOfWork: ...


class RecoveryCandidateSource(Protocol):
    def recovery_candidates(self, limit: int) -> Page[RecoveryCandidate]:
        """One query: runtime-owned Runs in dispatching|running|lost whose non-pristine Attempt
        is claimed|starting|running and whose lease is missing or expired by the store's clock.
        Resolvable candidates come first, then by lease expiry. No cursor is kept."""


class LostRetryCandidateSource(Protocol):
    def lost_runs(self, limit: int) -> Page[RunCandidate]:
        """Runtime-owned ``lost`` Runs, oldest first."""

    def due_retries(self, limit: int) -> Page[RunCandidate]:
        """Runtime-owned ``retry_wait`` Runs whose ``next_attempt_at_ms`` the store's clock
        reached, earliest first."""


class StartupCandidateSource(Protocol):
    def orphaned_runs(self, limit: int) -> Page[RunCandidate]:
        """Runtime-owned ``created`` Runs without an Attempt (startup recovery only)."""


class DispatchGateSource(Protocol):
    def dispatch_gate(self) -> DispatchGate:
        """The gate as committed (one read, no transaction kept)."""


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """The ``queued`` Runs of one task and when the oldest of them was queued."""

    task: str
    queued: int
    oldest_ms: int


@dataclass(frozen=True, slots=True)
class EvidenceWaits:
    """Started Attempts whose lease expired, waiting for not-running evidence (fail closed);
    ``oldest_ms`` is the earliest expiry among them."""

    count: int
    oldest_ms: int | None


@dataclass(frozen=True, slots=True)
class NodeCycle:
    """A scheduler node's last cycle as it recorded it: when it ended (``last_cycle_at_ms``,
    the store's clock; None when recording), whether it succeeded or which step ended it, and
    how many cycles the node has run."""

    node_id: str
    ok: bool
    aborted_at: str | None
    cycles: int
    started_at_ms: int | None = None
    last_cycle_at_ms: int | None = None
    # The node lets workers register without a credential off a loopback address
    # (``--allow-anonymous-workers``, ADR 0008): ``ql3 status`` warns about it.
    anonymous_workers: bool = False


class NodeRegistry(Protocol):
    def record_node_cycle(self, cycle: NodeCycle) -> None:
        """Replace the node's row (its start time is kept), in a transaction of its own."""


@dataclass(frozen=True, slots=True)
class OperationsView:
    """What ``ql3 status``, ``ql3 doctor`` and the metrics read, each part by a query whose
    cost follows the live work, never the finished history (ADR 0010). ``quarantined`` holds
    at most the limit asked for; ``quarantined_count`` counts them all."""

    observed_at_ms: int
    gate: DispatchGate
    queues: tuple[QueueDepth, ...]
    evidence: EvidenceWaits
    sessions: tuple[SessionCapacity, ...]
    quarantined: tuple[Run, ...]
    quarantined_count: int
    nodes: tuple[NodeCycle, ...] = ()


class OperationsSource(Protocol):
    def operations_view(self, limit: int) -> OperationsView:
        """One consistent read of the operations view, listing at most ``limit`` quarantined
        Runs (oldest quarantine first) and nodes (latest cycle first), and the open (active
        or draining) sessions."""


class TriggerSource(Protocol):
    def due_triggers(self, limit: int) -> Page[DueTrigger]:
        """Active triggers whose next firing the store's clock reached, earliest first."""


class WorkflowFrontierSource(Protocol):
    def workflow_candidates(self, limit: int) -> Page[RunCandidate]:
        """Workflow aggregate Runs the frontier has work for: not started yet, an admitted
        step whose Run finished, or finished with steps still pending or admitted but not
        started. Oldest first (by the aggregate's ``updated_at``)."""


class Metrics(Protocol):
    """What this process did, told as it happens (ADR 0010). An adapter counts it (Prometheus
    on a node); :data:`NO_METRICS` forgets it. Gauges of the store's state are no business of
    this port: they are read on scrape from :class:`OperationsSource`, never on the cadence."""

    def step_finished(self, step: str, outcome: str, seconds: float) -> None:
        """One step of a cycle: ``ok``, ``failed``, or ``skipped`` after an earlier failure."""

    def cycle_finished(self, ok: bool) -> None: ...

    def committed(self, events: Sequence[RunEvent]) -> None:
        """Events of changes this process committed (recovery, lost retry, worker commands)."""

    def fence_rejected(self, reason: str) -> None: ...

    def leases_renewed(self, count: int) -> None: ...

    def claim_answered(self, granted: int, no_grant: str | None) -> None: ...


class NoMetrics:
    """The metrics of a process that exports none."""

    def step_finished(self, step: str, outcome: str, seconds: float) -> None:
        return None

    def cycle_finished(self, ok: bool) -> None:
        return None

    def committed(self, events: Sequence[RunEvent]) -> None:
        return None

    def fence_rejected(self, reason: str) -> None:
        return None

    def leases_renewed(self, count: int) -> None:
        return None

    def claim_answered(self, granted: int, no_grant: str | None) -> None:
        return None


NO_METRICS: Metrics = NoMetrics()


class CronCalendar(Protocol):
    """Fire times of cron expressions (five fields, UTC)."""

    def schedule(self, expression: str) -> FireSchedule:
        """Raises ``InvalidTrigger`` for an expression that is malformed or never fires."""


class Identities(Protocol):
    """Where new identifiers and secrets come from."""

    def new_id(self) -> str: ...

    def new_secret(self) -> str:
        """A secret of at least 128 random bits."""


class RuntimeStore(
    RecoveryCandidateSource,
    LostRetryCandidateSource,
    StartupCandidateSource,
    DispatchGateSource,
    Protocol,
):
    """Everything a profile's composition root needs from one store."""

    def unit_of_work(self) -> UnitOfWork: ...

    def close(self) -> None: ...


class SchedulerStore(
    RuntimeStore, TriggerSource, WorkflowFrontierSource, OperationsSource, NodeRegistry, Protocol
):
    """A runtime store with everything the whole cadence needs, trigger schedule and workflow
    frontier included. Every store a profile runs on (memory, PostgreSQL, SQLite) implements it;
    the worker ingress's least-privilege store implements only :class:`RuntimeStore`."""

    def unit_of_work(self) -> SchedulerUnitOfWork: ...
