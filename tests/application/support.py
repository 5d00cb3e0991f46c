"""Shared helpers for the application and rule tests: the services wired directly over a
``MemoryStore`` (the same graph ``ql3.bootstrap.cluster`` declares), deterministic identities, a
worker driver (claims, and every fenced command as a batch of one) and a full, port-level
picture of the store used for before/after comparisons."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.application.admission import Admission
from ql3.application.dispatch import DispatchGateStep
from ql3.application.lost_retry import LostRetry
from ql3.application.recovery import RuntimeRecovery
from ql3.application.scheduler import (
    ClusterSchedulerCoordinator,
    NoTriggerSchedule,
    NoWorkflowFrontier,
    SchedulerCoordinator,
)
from ql3.application.startup import StartupRecovery
from ql3.application.worker_commands import (
    Abandonment,
    BatchAnswer,
    ClaimAnswer,
    Completion,
    Grant,
    ItemResult,
    Release,
    SessionGrant,
    WorkerCommands,
)
from ql3.domain.fence import LeaseFence
from ql3.domain.model import Attempt, DispatchLease, JsonValue, Run, StopReport, WorkerSession

LEASE_TTL_MS = 30_000


class CountingIdentities:
    """Predictable ids (``id-1``, ``id-2`` ...) and secrets."""

    def __init__(self, prefix: str = "id") -> None:
        self._ids = itertools.count(1)
        self._secrets = itertools.count(1)
        self._prefix = prefix

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def new_secret(self) -> str:
        return f"secret-{next(self._secrets):04d}-" + "s" * 24


@dataclass
class Services:
    clock: FakeClock
    store: MemoryStore
    identities: CountingIdentities
    admission: Admission
    workers: WorkerCommands
    gate: DispatchGateStep
    recovery: RuntimeRecovery
    lost_retry: LostRetry
    inner: SchedulerCoordinator
    coordinator: ClusterSchedulerCoordinator
    startup: StartupRecovery


def build_services(
    store: MemoryStore | None = None,
    *,
    lease_ttl_ms: int = LEASE_TTL_MS,
    page_size: int | None = None,
) -> Services:
    if store is None:
        store = MemoryStore(FakeClock())
    identities = CountingIdentities()
    uow = store.unit_of_work
    gate = DispatchGateStep(uow, store)
    recovery = RuntimeRecovery(uow, store, page_size=page_size)
    lost_retry = LostRetry(uow, store, identities, page_size=page_size)
    inner = SchedulerCoordinator(
        trigger_schedule=NoTriggerSchedule(),
        workflow_frontier=NoWorkflowFrontier(),
        task_attempt_admission=gate,
    )
    return Services(
        clock=store.clock,
        store=store,
        identities=identities,
        admission=Admission(uow, identities),
        workers=WorkerCommands(uow, identities, lease_ttl_ms=lease_ttl_ms),
        gate=gate,
        recovery=recovery,
        lost_retry=lost_retry,
        inner=inner,
        coordinator=ClusterSchedulerCoordinator(
            runtime_recovery=recovery, lost_retry=lost_retry, inner=inner, gate=gate
        ),
        startup=StartupRecovery(uow, store, identities, page_size=page_size),
    )


class BatchesOfOne:
    """Every fenced command is a batch; these send a batch of one and return its one result.
    A test worker provides ``workers``, ``session_id`` and ``secret``."""

    workers: WorkerCommands
    session_id: str
    secret: str

    def complete(
        self,
        fence: LeaseFence,
        *,
        succeeded: bool = True,
        output: JsonValue = None,
        error: str | None = None,
    ) -> ItemResult:
        done = Completion(fence=fence, succeeded=succeeded, output=output, error=error)
        return only(self.workers.complete_many(self.session_id, self.secret, [done]))

    def renew(self, fence: LeaseFence) -> ItemResult:
        return only(self.workers.renew_many(self.session_id, self.secret, [fence]))

    def abandon(self, fence: LeaseFence, detail: str = "") -> ItemResult:
        stopped = Abandonment(fence=fence, detail=detail)
        return only(self.workers.abandon_many(self.session_id, self.secret, [stopped]))

    def release(self, fence: LeaseFence, cause: str = "not_started") -> ItemResult:
        back = Release(fence=fence, cause=cause)
        return only(self.workers.release_many(self.session_id, self.secret, [back]))


@dataclass
class Worker(BatchesOfOne):
    """A worker process as the tests drive it: one session and the fences it holds."""

    services: Services
    grant: SessionGrant
    fences: dict[str, LeaseFence] = field(default_factory=dict)

    @property
    def workers(self) -> WorkerCommands:  # type: ignore[override]
        return self.services.workers

    @property
    def session_id(self) -> str:
        return self.grant.session_id

    @property
    def secret(self) -> str:
        return self.grant.secret

    def claim(
        self,
        limit: int = 1,
        *,
        completions: tuple[Completion, ...] = (),
        held: list[str] | None = None,
    ) -> ClaimAnswer:
        """One claim call; the fences of its grants are kept."""
        answer = self.services.workers.claim(
            self.session_id, self.secret, limit=limit, completions=completions, held=held
        )
        for grant in answer.grants:
            self.fences[grant.attempt_id] = grant.fence
        return answer

    def grants(self, limit: int = 16) -> list[Grant]:
        return list(self.claim(limit).grants)

    def take_all(self, limit: int = 16) -> list[LeaseFence]:
        """Claim (and so start) as much as the session may take."""
        return [grant.fence for grant in self.grants(limit)]


def only(answer: BatchAnswer) -> ItemResult:
    """The one result of a batch of one."""
    (result,) = answer.results
    return result


def register(
    services: Services, worker_id: str = "w1", tasks: Iterable[str] = ("t",), capacity: int = 4
) -> Worker:
    grant = services.workers.register(worker_id, capacity, list(tasks))
    return Worker(services=services, grant=grant)


@dataclass(frozen=True)
class RunView:
    run: Run
    attempts: tuple[Attempt, ...]
    leases: tuple[DispatchLease, ...]
    events: tuple[tuple[int, str, str | None, dict[str, object]], ...]


def run_view(store: MemoryStore, run_id: str) -> RunView:
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        assert run is not None, f"run {run_id} not found"
        return RunView(
            run=run,
            attempts=tuple(uow.runs.attempts_of(run_id)),
            leases=tuple(uow.runs.leases_of(run_id)),
            events=tuple(
                (e.sequence, e.event.type.value, e.event.attempt_id, dict(e.event.data))
                for e in uow.runs.events_of(run_id)
            ),
        )


@dataclass(frozen=True)
class StoreView:
    runs: dict[str, RunView]
    sessions: dict[str, WorkerSession]
    reports: dict[str, tuple[StopReport, ...]]


def store_view(
    store: MemoryStore, session_ids: Iterable[str] = (), attempt_ids: Iterable[str] = ()
) -> StoreView:
    """Everything the ports show: every run with its attempts, leases and events, the named
    sessions and the stop reports of the named (and every known) attempt."""
    with store.unit_of_work() as uow:
        run_ids = [r.id for r in uow.runs.list_runs(None, 1_000_000)]
    runs = {rid: run_view(store, rid) for rid in run_ids}
    every_attempt = set(attempt_ids)
    for view in runs.values():
        every_attempt.update(a.id for a in view.attempts)
    with store.unit_of_work() as uow:
        sessions = {}
        for sid in session_ids:
            session = uow.sessions.get(sid)
            if session is not None:
                sessions[sid] = session
        reports = {aid: tuple(uow.evidence.reports_for(aid)) for aid in sorted(every_attempt)}
    return StoreView(runs=runs, sessions=sessions, reports=reports)


def event_types(store: MemoryStore, run_id: str) -> list[str]:
    return [e[1] for e in run_view(store, run_id).events]


def current_attempt(store: MemoryStore, run_id: str) -> Attempt:
    view = run_view(store, run_id)
    assert view.attempts, f"run {run_id} has no attempt"
    return view.attempts[-1]
