"""One group of tests per rule, driven through the real application services over the memory
store: rules 1 to 5 are the decisions of docs/adr/0002-cluster-runtime-recovery.md (ADR-0232);
rule 6 is docs/adr/0007-claim-protocol.md's hand-back: a Run without a policy never fails
without having run."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

import ql3.adapters.memory.store as memory_store
from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.application.budgets import InvalidPageSize
from ql3.application.diagnosis import CandidateFailed
from ql3.application.lost_retry import LostRetry
from ql3.application.ports import NO_METRICS
from ql3.application.recovery import RuntimeRecovery
from ql3.application.scheduler import (
    ClusterSchedulerCoordinator,
    ClusterSchedulerLifecycle,
    CycleSummary,
    SchedulerCoordinator,
)
from ql3.application.worker_commands import BatchOutcome, NoGrant, Rejection
from ql3.bootstrap import cluster
from ql3.domain.fence import LeaseFence
from ql3.domain.model import AttemptStatus, EvidenceKind, LeaseStatus, ReleaseReason, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.application.support import (
    LEASE_TTL_MS,
    Services,
    Worker,
    build_services,
    current_attempt,
    register,
    run_view,
    store_view,
)

SAFE_NO_WAIT = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT,
                           backoff=Backoff(initial_ms=0, cap_ms=0))


def _dispatched(svc: Services, count: int, *, policy: RetryPolicy | None = None,
                worker_id: str = "w1", gone: bool = False) -> tuple[Worker, list[str]]:
    """``count`` Runs claimed (so started) by one worker; ``gone``: the worker then closes its
    session, which is not-running evidence for recovery once the leases expire."""
    run_ids = [svc.admission.submit("t", policy=policy) for _ in range(count)]
    worker = register(svc, worker_id, capacity=max(count, 1))
    assert len(worker.take_all(limit=max(count, 1))) == count
    if gone:
        svc.workers.close(worker.session_id, worker.secret)
    return worker, run_ids


def _fence_of(worker: Worker, svc: Services, run_id: str) -> LeaseFence:
    return worker.fences[current_attempt(svc.store, run_id).id]


# === Rule 1: continuous runtime recovery ==========================================================


def test_rule_1_continuous_runtime_recovery_reads_a_bounded_page() -> None:
    svc = build_services()
    _dispatched(svc, 70, gone=True)
    svc.clock.advance(LEASE_TTL_MS + 1)
    page = svc.store.recovery_candidates(16)
    assert (len(page.items), page.has_more) == (16, True)
    page = svc.store.recovery_candidates(64)
    assert (len(page.items), page.has_more) == (64, True)
    with pytest.raises(ValueError):
        svc.store.recovery_candidates(65)
    with pytest.raises(InvalidPageSize):
        RuntimeRecovery(svc.store.unit_of_work, svc.store, page_size=65)
    report = svc.recovery.run_once()  # default page: 16
    assert (report.examined, report.recovered, report.has_more) == (16, 16, True)
    report = svc.recovery.run_once(64)
    assert (report.examined, report.recovered, report.has_more) == (54, 54, False)


def test_rule_1_continuous_runtime_recovery_only_expired_non_pristine_candidates() -> None:
    svc = build_services()
    pristine = svc.admission.submit("no-worker-takes-this")
    _, (live_run,) = _dispatched(svc, 1, gone=True)
    assert svc.store.recovery_candidates(16).items == ()
    assert current_attempt(svc.store, pristine).is_pristine
    svc.clock.advance(LEASE_TTL_MS + 1)
    items = svc.store.recovery_candidates(16).items
    assert [c.run_id for c in items] == [live_run]
    assert items[0].resolvable
    report = svc.recovery.run_once()
    assert report.recovered == 1
    assert current_attempt(svc.store, live_run).status is AttemptStatus.LOST
    assert svc.store.recovery_candidates(16).items == ()


def test_rule_1_continuous_runtime_recovery_fails_closed_without_evidence() -> None:
    svc = build_services()
    worker, _ = _dispatched(svc, 1)  # claimed, so started; the session stays open
    svc.clock.advance(LEASE_TTL_MS + 1)
    before = store_view(svc.store, [worker.session_id])
    for _ in range(3):  # tried again every cycle, and each time left as it is
        summary = svc.coordinator.run_cycle()
        assert summary.ok
        assert summary.step("runtime_recovery").counts["awaiting_evidence"] == 1
    assert store_view(svc.store, [worker.session_id]) == before


def test_rule_1_continuous_runtime_recovery_unresolved_candidates_do_not_starve_others() -> None:
    svc = build_services()
    _, stuck_runs = _dispatched(svc, 64, worker_id="stuck")  # open session: no evidence
    svc.clock.advance(1_000)
    _, (resolvable,) = _dispatched(svc, 1, worker_id="other", gone=True)
    svc.clock.advance(LEASE_TTL_MS + 1)
    summary = svc.coordinator.run_cycle()
    assert summary.ok
    counts = summary.step("runtime_recovery").counts
    assert counts["examined"] == 16 and counts["recovered"] == 1
    assert current_attempt(svc.store, resolvable).status is AttemptStatus.LOST
    assert all(
        current_attempt(svc.store, r).status is AttemptStatus.RUNNING for r in stuck_runs
    )


def test_rule_1_continuous_runtime_recovery_happens_without_a_restart() -> None:
    svc = build_services()
    container = cluster.build(store=svc.store)
    coordinator = container.coordinator()
    _, (run_id,) = _dispatched(svc, 1, gone=True)
    svc.clock.advance(LEASE_TTL_MS + 1)
    summary = coordinator.run_cycle()
    assert summary.ok
    assert summary.step("runtime_recovery").counts["recovered"] == 1
    assert run_view(svc.store, run_id).run.status is RunStatus.FAILED  # no policy


# === Rule 2: atomic lost + lease release ==========================================================


def _break_event_append(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event append inside the store's write raises after the lease row was written."""

    def refuse(*_args: object, **_kwargs: object) -> object:
        raise RuntimeError("injected failure while appending the event")

    monkeypatch.setattr(memory_store, "StoredEvent", refuse)


def test_rule_2_atomic_lost_and_lease_release_roll_back_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    svc = build_services()
    worker, (run_id,) = _dispatched(svc, 1, gone=True)
    svc.clock.advance(LEASE_TTL_MS + 1)
    before = store_view(svc.store, [worker.session_id])
    with monkeypatch.context() as patch:
        _break_event_append(patch)
        with pytest.raises(CandidateFailed, match="injected") as failed:
            svc.recovery.run_once()
        assert isinstance(failed.value.__cause__, RuntimeError)
        assert (failed.value.candidate.step, failed.value.candidate.run_id) == (
            "runtime_recovery",
            run_id,
        )
        summary = svc.coordinator.run_cycle()
        assert summary.aborted_at == "runtime_recovery"
    assert store_view(svc.store, [worker.session_id]) == before
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.RUNNING
    assert view.attempts[0].status is AttemptStatus.RUNNING
    assert view.leases[0].status is LeaseStatus.LEASED
    assert view.leases[0].version == 1


def test_rule_2_atomic_lost_and_lease_release_together_then_old_fence_is_void() -> None:
    svc = build_services()
    worker, (run_id,) = _dispatched(svc, 1, gone=True)
    fence = _fence_of(worker, svc, run_id)
    svc.clock.advance(LEASE_TTL_MS + 1)
    assert svc.recovery.run_once().recovered == 1
    view = run_view(svc.store, run_id)
    (lease,) = view.leases
    assert view.run.status is RunStatus.LOST
    assert view.attempts[0].status is AttemptStatus.LOST
    assert lease.status is LeaseStatus.RELEASED
    assert lease.version == fence.version + 1
    assert lease.release_reason is ReleaseReason.LEASE_EXPIRED
    assert view.attempts[0].lease_version == lease.version
    assert [e[1] for e in view.events][-1] == "attempt_lost"
    # The old worker comes back with a fresh session of another id: its fence is void.
    back = register(svc, "w1")
    before = store_view(svc.store, [worker.session_id, back.session_id])
    for result in (back.renew(fence), back.complete(fence), back.release(fence)):
        assert result.rejection is Rejection.FENCE
    assert store_view(svc.store, [worker.session_id, back.session_id]) == before


def test_rule_2_atomic_lost_and_lease_release_old_worker_with_open_session() -> None:
    svc = build_services()
    worker, (run_id,) = _dispatched(svc, 1)
    fence = _fence_of(worker, svc, run_id)
    svc.workers.attest_stopped(fence.attempt_id, "host powered off")  # the session stays open
    svc.clock.advance(LEASE_TTL_MS + 1)
    assert svc.recovery.run_once().recovered == 1
    assert current_attempt(svc.store, run_id).lost_evidence is EvidenceKind.OPERATOR_ATTESTED
    before = store_view(svc.store, [worker.session_id])
    results = [worker.renew(fence), worker.complete(fence), worker.release(fence),
               worker.abandon(fence, "late")]
    assert [r.rejection for r in results] == [Rejection.FENCE] * 4
    assert worker.claim(limit=1, held=[]).released == ()  # a lost Attempt is not handed back
    assert store_view(svc.store, [worker.session_id]) == before


# === Rule 3: lost retry only when declared safe ===================================================


@pytest.mark.parametrize("safety", [Safety.IDEMPOTENT, Safety.DEDUPLICATED])
def test_rule_3_lost_retry_only_when_declared_safe_creates_attempt_n_plus_1(
    safety: Safety,
) -> None:
    svc = build_services()
    policy = RetryPolicy(retry_on_lost=True, max_attempts=2, safety=safety,
                         backoff=Backoff(initial_ms=5_000, cap_ms=5_000))
    _, (run_id,) = _dispatched(svc, 1, policy=policy, gone=True)
    svc.clock.advance(LEASE_TTL_MS + 1)
    svc.recovery.run_once()
    report = svc.lost_retry.run_once()
    assert report.retries_scheduled == 1
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.RETRY_WAIT
    due = view.run.next_attempt_at_ms
    assert due == svc.clock.now_ms() + 5_000
    svc.clock.set(due - 1)
    assert svc.lost_retry.run_once().attempts_created == 0
    assert run_view(svc.store, run_id).run.status is RunStatus.RETRY_WAIT
    svc.clock.set(due)
    assert svc.lost_retry.run_once().attempts_created == 1
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.QUEUED
    assert [(a.number, a.status) for a in view.attempts] == [
        (1, AttemptStatus.LOST), (2, AttemptStatus.CLAIMED)
    ]
    assert view.attempts[1].is_pristine
    assert view.attempts[1].lease_version is None
    assert view.leases[0].status is LeaseStatus.RELEASED
    # The second loss exhausts max_attempts=2: failed.
    again = register(svc, "w2")
    (grant,) = again.grants()
    assert (grant.run_id, grant.attempt_number, grant.generation) == (run_id, 2, 2)
    svc.workers.close(again.session_id, again.secret)
    svc.clock.advance(LEASE_TTL_MS + 1)
    svc.coordinator.run_cycle()
    assert run_view(svc.store, run_id).run.status is RunStatus.FAILED


@pytest.mark.parametrize(
    ("policy", "reason"),
    [
        (None, "no_policy"),
        (RetryPolicy(retry_on_lost=False, max_attempts=3, safety=Safety.IDEMPOTENT),
         "retry_on_lost_disabled"),
        (RetryPolicy(retry_on_lost=True, max_attempts=1, safety=Safety.IDEMPOTENT),
         "max_attempts_too_low"),
        (RetryPolicy(retry_on_lost=True, max_attempts=3, safety=None), "safety_undeclared"),
        (RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.UNSAFE), "unsafe"),
    ],
)
def test_rule_3_lost_retry_only_when_declared_safe_otherwise_failed(
    policy: RetryPolicy | None, reason: str
) -> None:
    svc = build_services()
    _, (run_id,) = _dispatched(svc, 1, policy=policy, gone=True)
    svc.clock.advance(LEASE_TTL_MS + 1)
    summary = svc.coordinator.run_cycle()
    assert summary.step("lost_retry").counts["failed"] == 1
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.FAILED
    assert view.events[-1][1] == "run_failed"
    assert view.events[-1][3]["reason"] == reason
    assert len(view.attempts) == 1


def test_rule_3_lost_retry_only_when_declared_safe_exhausted_is_failed() -> None:
    svc = build_services()
    _, (run_id,) = _dispatched(svc, 1, policy=SAFE_NO_WAIT)
    for number in (2, 3, None):
        worker = register(svc, "w1")  # replaces the session that holds the Attempt: evidence
        svc.clock.advance(LEASE_TTL_MS + 1)
        svc.coordinator.run_cycle()  # lost -> retry_wait -> queued, while attempts are left
        assert [g.attempt_number for g in worker.grants()] == ([number] if number else [])
    view = run_view(svc.store, run_id)
    assert view.run.status is RunStatus.FAILED
    assert [a.number for a in view.attempts] == [1, 2, 3]
    assert view.events[-1][3]["reason"] == "attempts_exhausted"


def test_rule_3_lost_retry_only_when_declared_safe_broken_head_stops_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    svc = build_services()
    worker, lost_runs = _dispatched(svc, 2, policy=SAFE_NO_WAIT, gone=True)
    svc.clock.advance(LEASE_TTL_MS + 1)
    assert svc.recovery.run_once().recovered == 2
    waiting = svc.admission.submit("t")  # queued work a claim would take
    other = register(svc, "w2")
    head, second = (c.run_id for c in svc.store.lost_runs(16).items)
    assert {head, second} == set(lost_runs)
    original = memory_store.MemoryRunRepository.apply

    def apply(self, before, change):  # type: ignore[no-untyped-def]
        if before.run.id == head:
            raise RuntimeError("broken head candidate")
        return original(self, before, change)

    monkeypatch.setattr(memory_store.MemoryRunRepository, "apply", apply)
    before = store_view(svc.store, [worker.session_id])
    summary = svc.coordinator.run_cycle()
    assert summary.aborted_at == "lost_retry"
    assert [s.name for s in summary.steps] == ["runtime_recovery", "lost_retry"]
    assert store_view(svc.store, [worker.session_id]) == before
    assert run_view(svc.store, second).run.status is RunStatus.LOST
    # No new work is dispatched while lease authority is unknown: the gate is closed.
    refused = other.claim(limit=4)
    assert (refused.grants, refused.no_grant) == ((), NoGrant.GATE_CLOSED)
    assert refused.detail is not None and "broken head candidate" in refused.detail
    assert run_view(svc.store, waiting).run.status is RunStatus.QUEUED
    with pytest.raises(CandidateFailed, match="broken head") as failed:
        svc.lost_retry.run_once()
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert (failed.value.candidate.step, failed.value.candidate.run_id) == ("lost_retry", head)
    assert run_view(svc.store, second).run.status is RunStatus.LOST
    monkeypatch.undo()
    svc.clock.advance(1)  # the next cycle begins after the close (ADR 0007)
    summary = svc.coordinator.run_cycle()
    assert summary.ok
    assert summary.step("task_attempt_admission").counts["gate_opened"] == 1
    assert run_view(svc.store, second).run.status is RunStatus.QUEUED
    granted = {g.run_id for g in other.grants()}
    assert granted == {*lost_runs, waiting}


# === Rule 4: one cadence, fixed order =============================================================


@dataclass
class RecordingStep:
    name: str
    calls: list[str]
    fail: bool = False
    counts_: Mapping[str, int] = field(default_factory=dict)
    observed_at_ms: int | None = None

    def run_once(self, cycle_started_at_ms: int | None = None) -> RecordingStep:
        self.calls.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        return self

    def counts(self) -> Mapping[str, int]:
        return {"ran": 1}


@dataclass
class RecordingGate:
    closed: list[str] = field(default_factory=list)

    def close(self, reason: str, candidate: object = None) -> None:
        self.closed.append(reason)


def _recording(
    fail: str | None = None,
) -> tuple[ClusterSchedulerCoordinator, list[str], RecordingGate]:
    calls: list[str] = []
    names = ClusterSchedulerCoordinator.STEP_NAMES
    step = {n: RecordingStep(n, calls, fail=(n == fail)) for n in names}
    inner = SchedulerCoordinator(
        trigger_schedule=step["trigger_schedule"],
        workflow_frontier=step["workflow_frontier"],
        task_attempt_admission=step["task_attempt_admission"],
    )
    gate = RecordingGate()
    return ClusterSchedulerCoordinator(
        runtime_recovery=step["runtime_recovery"],
        lost_retry=step["lost_retry"],
        inner=inner,
        gate=gate,
    ), calls, gate


def test_rule_4_one_cadence_fixed_order() -> None:
    coordinator, calls, gate = _recording()
    summary = coordinator.run_cycle()
    expected = ["runtime_recovery", "lost_retry", "trigger_schedule", "workflow_frontier",
                "task_attempt_admission"]
    assert calls == expected
    assert [s.name for s in summary.steps] == expected
    assert summary.ok and all(s.counts == {"ran": 1} for s in summary.steps)
    assert gate.closed == []


@pytest.mark.parametrize(
    ("failing", "closes_the_gate"),
    [("runtime_recovery", True), ("lost_retry", True), ("trigger_schedule", False),
     ("workflow_frontier", False)],
)
def test_rule_4_one_cadence_fixed_order_aborts_after_a_failure(
    failing: str, closes_the_gate: bool
) -> None:
    coordinator, calls, gate = _recording(fail=failing)
    summary = coordinator.run_cycle()
    order = list(ClusterSchedulerCoordinator.STEP_NAMES)
    assert calls == order[: order.index(failing) + 1]
    assert summary.aborted_at == failing
    assert not summary.ok
    step = summary.step(failing)
    assert step is not None and step.error == f"RuntimeError: {failing} failed"
    for later in order[order.index(failing) + 1:]:
        assert summary.step(later) is None
    # Only a failure that leaves lease authority unknown stops dispatch beyond this cycle.
    expected = [f"{failing} failed: RuntimeError: {failing} failed"] if closes_the_gate else []
    assert gate.closed == expected


def test_rule_4_one_cadence_fixed_order_cluster_container_wiring() -> None:
    clock = FakeClock()
    store = MemoryStore(clock)
    container = cluster.build(store=store)
    coordinator = container.coordinator()
    assert isinstance(coordinator, ClusterSchedulerCoordinator)
    assert container.coordinator() is coordinator
    assert container.lifecycle() is container.lifecycle()
    run_id = container.core.admission().submit("t")
    workers = container.core.worker_commands()
    grant = workers.register("w1", 1, ["t"])
    summary = coordinator.run_cycle()
    assert [s.name for s in summary.steps] == list(ClusterSchedulerCoordinator.STEP_NAMES)
    step = summary.step("task_attempt_admission")
    assert step is not None and step.counts == {"gate_opened": 0}
    answer = workers.claim(grant.session_id, grant.secret, limit=1)
    assert [g.run_id for g in answer.grants] == [run_id]


def test_rule_4_coordinator_holds_only_its_collaborators() -> None:
    svc = build_services()
    coordinator = svc.coordinator
    assert not hasattr(coordinator, "__dict__")
    slots = [s for cls in type(coordinator).__mro__ for s in getattr(cls, "__slots__", ())]
    assert sorted(slots) == ["_gate", "_inner", "_lost_retry", "_metrics", "_recovery"]
    values = [getattr(coordinator, s) for s in slots]
    assert {id(v) for v in values} == {
        id(svc.recovery), id(svc.lost_retry), id(svc.inner), id(svc.gate), id(NO_METRICS)
    }
    forbidden = (type(threading.Lock()), type(threading.RLock()), threading.Thread,
                 threading.Timer, threading.Condition, threading.Event, dict, list, set)
    for value in values:
        assert not isinstance(value, forbidden)
        name = type(value).__name__
        assert not name.endswith(("Pool", "Connection", "Cursor", "Engine", "Timer", "Thread"))
    with pytest.raises(AttributeError):
        coordinator.per_run_state = {}  # type: ignore[attr-defined]


class BlockingCoordinator:
    """Counts cycles and concurrency; the first ``block`` cycles wait for ``release``."""

    def __init__(self, block: int = 1) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.started = 0
        self.finished = 0
        self.concurrent = 0
        self.max_concurrent = 0
        self._lock = threading.Lock()
        self._block = block

    def run_cycle(self) -> CycleSummary:
        with self._lock:
            self.started += 1
            self.concurrent += 1
            self.max_concurrent = max(self.max_concurrent, self.concurrent)
            number = self.started
        self.entered.set()
        if number <= self._block:
            assert self.release.wait(10), "test never released the cycle"
        else:
            time.sleep(0.005)
        with self._lock:
            self.concurrent -= 1
            self.finished += 1
        return CycleSummary(steps=())


def _wait_for(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


@pytest.fixture
def lifecycle_for() -> Iterator:  # type: ignore[type-arg]
    made: list[tuple[ClusterSchedulerLifecycle, BlockingCoordinator]] = []

    def make(coordinator: BlockingCoordinator,
             cadence_s: float = 3600.0) -> ClusterSchedulerLifecycle:
        lifecycle = ClusterSchedulerLifecycle(coordinator, cadence_s=cadence_s)
        made.append((lifecycle, coordinator))
        return lifecycle

    yield make
    for lifecycle, coordinator in made:
        coordinator.release.set()
        lifecycle.stop(timeout=5)


@pytest.mark.parametrize("wakes", [1, 5])
def test_rule_4_one_cadence_wakes_during_a_cycle_coalesce_into_one(lifecycle_for, wakes) -> None:  # type: ignore[no-untyped-def]
    coordinator = BlockingCoordinator(block=1)
    lifecycle = lifecycle_for(coordinator)
    lifecycle.start()
    lifecycle.wake()
    assert coordinator.entered.wait(5)
    for _ in range(wakes):
        lifecycle.wake()
    assert lifecycle.run_cycle_now() is None  # coalesced too, never a second cycle at once
    coordinator.release.set()
    assert _wait_for(lambda: coordinator.finished >= 2)
    time.sleep(0.2)
    assert coordinator.started == 2
    assert coordinator.max_concurrent == 1
    assert lifecycle.cycles == 2


def test_rule_4_one_cadence_never_two_cycles_at_once(lifecycle_for) -> None:  # type: ignore[no-untyped-def]
    coordinator = BlockingCoordinator(block=0)
    lifecycle = lifecycle_for(coordinator, cadence_s=0.001)
    lifecycle.start()
    def hammer() -> None:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            if lifecycle.run_cycle_now() is None:
                lifecycle.wake()
            time.sleep(0.001)

    callers = [threading.Thread(target=hammer) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    lifecycle.stop(timeout=5)
    assert coordinator.started >= 5
    assert coordinator.max_concurrent == 1


def test_rule_4_one_cadence_stop_waits_for_the_running_cycle(lifecycle_for) -> None:  # type: ignore[no-untyped-def]
    coordinator = BlockingCoordinator(block=1)
    lifecycle = lifecycle_for(coordinator)
    lifecycle.start()
    lifecycle.wake()
    assert coordinator.entered.wait(5)
    lifecycle.wake()  # a follow-up was requested, but stop comes first
    stopper = threading.Thread(target=lifecycle.stop)
    stopper.start()
    time.sleep(0.1)
    assert stopper.is_alive(), "stop() returned while a cycle was still running"
    coordinator.release.set()
    stopper.join(5)
    assert not stopper.is_alive()
    assert coordinator.finished == 1
    assert lifecycle.run_cycle_now() is None
    lifecycle.wake()
    time.sleep(0.1)
    assert coordinator.started == 1
    with pytest.raises(RuntimeError):
        lifecycle.start()


def test_rule_4_one_cadence_stop_waits_for_a_cycle_run_by_a_caller(lifecycle_for) -> None:  # type: ignore[no-untyped-def]
    """A cycle started with run_cycle_now() in another thread is still "the running cycle"."""
    coordinator = BlockingCoordinator(block=1)
    lifecycle = lifecycle_for(coordinator)
    lifecycle.start()
    caller = threading.Thread(target=lifecycle.run_cycle_now)
    caller.start()
    assert coordinator.entered.wait(5)
    stopper = threading.Thread(target=lifecycle.stop)
    stopper.start()
    stopper.join(0.3)
    still_waiting = stopper.is_alive()
    coordinator.release.set()
    caller.join(5)
    stopper.join(5)
    assert still_waiting, "stop() returned while a run_cycle_now() cycle was still running"


def test_rule_4_one_cadence_timer_drives_cycles(lifecycle_for) -> None:  # type: ignore[no-untyped-def]
    coordinator = BlockingCoordinator(block=0)
    lifecycle = lifecycle_for(coordinator, cadence_s=0.01)
    lifecycle.start()
    assert _wait_for(lambda: coordinator.finished >= 3)
    lifecycle.stop(timeout=5)
    done = coordinator.finished
    time.sleep(0.1)
    assert coordinator.finished == done
    assert coordinator.max_concurrent == 1


# === Rule 5: no wider footprint ===================================================================


def _scheduler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ql3-scheduler" and t.is_alive()]


def test_rule_5_no_wider_footprint_one_lifecycle_one_thread() -> None:
    svc = build_services()
    container = cluster.build(store=svc.store, cadence_s=3600.0)
    lifecycle = container.lifecycle()
    assert container.lifecycle() is lifecycle
    ours = set(threading.enumerate())
    lifecycle.start()
    lifecycle.start()  # idempotent: still one timer
    try:
        assert _wait_for(lambda: len(set(threading.enumerate()) - ours) == 1)
        new = set(threading.enumerate()) - ours
        assert [t.name for t in new] == ["ql3-scheduler"]
        # Recovery and lost retry run without creating threads of their own.
        _dispatched(svc, 3, policy=SAFE_NO_WAIT, gone=True)
        svc.clock.advance(LEASE_TTL_MS + 1)
        before = set(threading.enumerate())
        assert container.runtime_recovery().run_once().recovered == 3
        assert container.lost_retry().run_once().changed >= 3
        summary = lifecycle.run_cycle_now()
        assert summary is None or summary.ok
        assert set(threading.enumerate()) == before
    finally:
        lifecycle.stop(timeout=5)
    assert not [t for t in new if t.is_alive()]


CLUSTER_ONLY = (RuntimeRecovery, LostRetry, ClusterSchedulerCoordinator, ClusterSchedulerLifecycle)


LOCAL_PROFILES = ["standalone", "edge"]


def _profile(name: str) -> Any:
    """The profile's composition root, imported here: the cluster rules above do not need the
    SQLite adapter these profiles load."""
    return importlib.import_module(f"bootstrap.{name}")


@pytest.mark.parametrize("name", LOCAL_PROFILES)
def test_rule_5_no_wider_footprint_standalone_and_edge_declare_no_cluster_steps(name: str) -> None:
    from ql3.adapters.sql.sqlite import SqliteStore

    profile = _profile(name)
    container = profile.build()
    provided = []
    for provider in container.traverse():
        provides = getattr(provider, "provides", None)
        if isinstance(provides, type):
            provided.append(provides)
    assert SqliteStore in provided
    assert provided, "the walk found no providers"
    for cls in provided:
        assert not issubclass(cls, CLUSTER_ONLY), cls


@pytest.mark.parametrize("name", LOCAL_PROFILES)
def test_rule_5_no_wider_footprint_standalone_and_edge_build_no_cluster_objects(name: str) -> None:
    profile = _profile(name)
    store = MemoryStore(FakeClock())
    container = profile.build(store=store)
    built = [
        container.startup_recovery(),
        container.core.scheduler(),
        container.core.admission(),
        container.core.worker_commands(),
        container.core.dispatch_gate(),
    ]
    for obj in built:
        assert not isinstance(obj, CLUSTER_ONLY)
    assert container.store() is store
    run_id = container.core.admission().submit("t")
    assert run_view(store, run_id).run.status is RunStatus.QUEUED
    summary = container.core.scheduler().run_cycle()
    assert [s.name for s in summary.steps] == list(SchedulerCoordinator.STEP_NAMES)
    assert container.startup_recovery().run().pages == 1
    assert not _scheduler_threads()


def test_rule_5_no_wider_footprint_standalone_and_edge_never_load_postgres() -> None:
    script = textwrap.dedent(
        """
        import sys
        from ql3.bootstrap import edge, standalone
        for profile in (standalone, edge):
            container = profile.build()
            container.startup_recovery().run()
            container.core.scheduler().run_cycle()
            container.core.admission().submit("t")
            container.core.worker_commands()
        loaded = sorted(m for m in sys.modules
                        if m == "psycopg" or m.startswith(("psycopg.", "psycopg_",
                                                           "ql3.adapters.postgres")))
        print("LOADED:" + ",".join(loaded))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert result.returncode == 0, result.stderr
    assert "LOADED:\n" in result.stdout or result.stdout.strip() == "LOADED:"


# === Rule 6: a Run without a policy never fails without having run (ADR 0007) =================


def test_rule_6_a_run_without_a_policy_never_fails_without_having_run() -> None:
    svc = build_services()
    run_id = svc.admission.submit("t")  # no retry policy: a lost verdict would fail it
    worker = register(svc, capacity=1)
    lost_answer = svc.workers.claim(worker.session_id, worker.secret, limit=1)
    (never_received,) = lost_answer.grants  # the answer never reached the worker
    # The worker calls again within a third of the lease TTL, as it always does.
    svc.clock.advance(LEASE_TTL_MS // 3)
    svc.coordinator.run_cycle()
    assert run_view(svc.store, run_id).run.status is RunStatus.RUNNING
    # Its next call states what it holds: nothing. The Attempt is handed back.
    answer = worker.claim(limit=0, held=[])
    assert answer.released == (never_received.attempt_id,)
    assert run_view(svc.store, run_id).run.status is RunStatus.QUEUED
    # Claimed again (the next generation), it runs and succeeds.
    (grant,) = worker.grants(limit=1)
    assert (grant.attempt_id, grant.attempt_number, grant.generation) == (
        never_received.attempt_id, 1, 2
    )
    assert worker.complete(grant.fence, output="done").outcome is BatchOutcome.SUCCEEDED
    view = run_view(svc.store, run_id)
    assert (view.run.status, view.run.output) == (RunStatus.SUCCEEDED, "done")
    assert [e[1] for e in view.events] == [
        "run_admitted", "attempt_started", "attempt_released", "attempt_started",
        "attempt_succeeded",
    ]
    assert [a.status for a in view.attempts] == [AttemptStatus.SUCCEEDED]
    assert [(lease.generation, lease.release_reason) for lease in view.leases] == [
        (1, ReleaseReason.HANDED_BACK), (2, ReleaseReason.COMPLETED)
    ]
    # The grant that never arrived cannot act any more.
    assert worker.complete(never_received.fence).rejection is Rejection.FENCE


def test_rule_6_a_run_without_a_policy_handed_back_on_drain_runs_elsewhere() -> None:
    svc = build_services()
    run_id = svc.admission.submit("t")
    leaving = register(svc, "w1", capacity=1)
    (fence,) = leaving.take_all()
    svc.workers.drain(leaving.session_id, leaving.secret)
    assert leaving.release(fence, cause="draining").outcome is BatchOutcome.RELEASED
    svc.workers.close(leaving.session_id, leaving.secret)
    svc.clock.advance(LEASE_TTL_MS + 1)
    summary = svc.coordinator.run_cycle()  # a closed session is evidence, but nothing is held
    assert summary.step("runtime_recovery").counts["recovered"] == 0
    assert summary.step("lost_retry").counts["failed"] == 0
    staying = register(svc, "w2", capacity=1)
    (grant,) = staying.grants()
    assert staying.complete(grant.fence).outcome is BatchOutcome.SUCCEEDED
    kinds = [e[1] for e in run_view(svc.store, run_id).events]
    assert "attempt_lost" not in kinds and "run_failed" not in kinds
    assert run_view(svc.store, run_id).run.status is RunStatus.SUCCEEDED


def test_rule_6_a_lost_verdict_still_needs_evidence_or_an_abandon_report() -> None:
    """The hand-back is for what never began; an Attempt the worker did start and then lost
    still fails closed, as rule 1 says."""
    svc = build_services()
    run_id = svc.admission.submit("t")
    worker = register(svc, capacity=1)
    (fence,) = worker.take_all()
    assert worker.abandon(fence, "the task crashed").outcome is BatchOutcome.LOST
    svc.coordinator.run_cycle()
    assert run_view(svc.store, run_id).run.status is RunStatus.FAILED  # no policy: no retry
    assert worker.claim(limit=1, held=[]).released == ()
