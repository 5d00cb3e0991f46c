"""Shared helpers for the application and rule tests: the services wired directly over a
``MemoryStore`` (the same graph ``bootstrap.cluster`` declares), deterministic identities, a
worker driver and a full, port-level picture of the store used for before/after comparisons."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from adapters.memory import FakeClock, MemoryStore
from application.admission import Admission
from application.dispatch import TaskAttemptAdmission
from application.lost_retry import LostRetry
from application.recovery import RuntimeRecovery
from application.scheduler import (
    ClusterSchedulerCoordinator,
    NoTriggerSchedule,
    NoWorkflowFrontier,
    SchedulerCoordinator,
)
from application.startup import StartupRecovery
from application.worker_commands import Offer, SessionGrant, WorkerCommands
from domain.fence import LeaseFence
from domain.model import Attempt, DispatchLease, Run, StopReport, WorkerSession

LEASE_TTL_MS = 30_000
SILENCE_MS = 60_000


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
    dispatch: TaskAttemptAdmission
    recovery: RuntimeRecovery
    lost_retry: LostRetry
    inner: SchedulerCoordinator
    coordinator: ClusterSchedulerCoordinator
    startup: StartupRecovery


def build_services(
    store: MemoryStore | None = None,
    *,
    lease_ttl_ms: int = LEASE_TTL_MS,
    silence_ms: int = SILENCE_MS,
    page_size: int | None = None,
    dispatch_page_size: int | None = None,
) -> Services:
    if store is None:
        store = MemoryStore(FakeClock())
    identities = CountingIdentities()
    uow = store.unit_of_work
    dispatch = TaskAttemptAdmission(
        uow, store, lease_ttl_ms=lease_ttl_ms, max_silence_ms=silence_ms,
        page_size=dispatch_page_size,
    )
    recovery = RuntimeRecovery(uow, store, page_size=page_size)
    lost_retry = LostRetry(uow, store, identities, page_size=page_size)
    inner = SchedulerCoordinator(
        trigger_schedule=NoTriggerSchedule(),
        workflow_frontier=NoWorkflowFrontier(),
        task_attempt_admission=dispatch,
    )
    return Services(
        clock=store.clock,
        store=store,
        identities=identities,
        admission=Admission(uow, identities),
        workers=WorkerCommands(uow, identities, lease_ttl_ms=lease_ttl_ms),
        dispatch=dispatch,
        recovery=recovery,
        lost_retry=lost_retry,
        inner=inner,
        coordinator=ClusterSchedulerCoordinator(
            runtime_recovery=recovery, lost_retry=lost_retry, inner=inner
        ),
        startup=StartupRecovery(uow, store, identities, page_size=page_size),
    )


@dataclass
class Worker:
    """A worker process as the tests drive it: one session and the fences it holds."""

    services: Services
    grant: SessionGrant
    fences: dict[str, LeaseFence] = field(default_factory=dict)

    @property
    def session_id(self) -> str:
        return self.grant.session_id

    @property
    def secret(self) -> str:
        return self.grant.secret

    def offers(self) -> list[Offer]:
        return self.services.workers.heartbeat(self.session_id, self.secret)

    def accept(self, offer: Offer, token: str | None = None) -> LeaseFence:
        token = token or f"token-{offer.attempt_id}-{offer.generation}".ljust(24, "t")
        self.services.workers.accept(
            self.session_id, self.secret, offer.attempt_id, offer.generation, offer.version, token
        )
        fence = LeaseFence(
            attempt_id=offer.attempt_id,
            generation=offer.generation,
            version=offer.version,
            token=token,
        )
        self.fences[offer.attempt_id] = fence
        return fence

    def take_all(self) -> list[LeaseFence]:
        return [self.accept(offer) for offer in self.offers()]

    def start(self, fence: LeaseFence, *, running: bool = True) -> None:
        self.services.workers.activate(self.session_id, self.secret, fence)
        if running:
            self.services.workers.mark_running(self.session_id, self.secret, fence)


def register(services: Services, worker_id: str = "w1", tasks: Iterable[str] = ("t",),
             capacity: int = 4) -> Worker:
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
