"""The one cadence in its fixed order on every store: runtime recovery -> lost retry -> trigger
schedule -> workflow frontier -> task attempt admission. Work due for recovery, retry and a
trigger in the same cycle is done in that order, and a failing recovery step means that no
trigger fires in that cycle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ql3.application.scheduler import ClusterSchedulerCoordinator
from ql3.application.triggers import TriggerDefinition
from ql3.domain.events import EventType
from ql3.domain.model import RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.scheduling_support import Runtime, WorkerDriver, runtime

MINUTE = 60_000
TTL_MS = 60_000
RETRY_DELAY_MS = 60_000
RETRY_SAFELY = RetryPolicy(
    retry_on_lost=True,
    max_attempts=3,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=RETRY_DELAY_MS, multiplier=1.0, cap_ms=RETRY_DELAY_MS),
)


def _events(rt: Runtime, run_id: str) -> list[tuple[int, EventType]]:
    with rt.store.unit_of_work() as uow:
        return [(e.sequence, e.event.type) for e in uow.runs.events_of(run_id)]


def _firings(rt: Runtime, trigger_id: str) -> list[str]:
    with rt.store.unit_of_work() as uow:
        return [f.run_id for f in uow.triggers.firings_of(trigger_id, 100)]


def test_recovery_and_retry_happen_before_a_trigger_fires_in_the_same_cycle(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_MS / 1000)
    admission = rt.container.core.admission()
    # "retry": lost once and due for its next Attempt RETRY_DELAY_MS from now.
    retry = admission.submit("t", None, RETRY_SAFELY)
    first = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)
    assert [g.run_id for g in first.claim_all()] == [retry]
    rt.workers.close(first.session_id, first.secret)  # evidence: the worker is gone
    advance(TTL_MS + 1_000)
    assert rt.container.runtime_recovery().run_once().recovered == 1
    assert rt.container.lost_retry().run_once().retries_scheduled == 1
    assert rt.run(retry).status is RunStatus.RETRY_WAIT
    # "expiring": claimed by a worker that is gone; its lease expires TTL_MS from now.
    expiring = admission.submit("t")
    second = WorkerDriver.register(rt.workers, "w2", ["t"], capacity=1)
    assert [g.run_id for g in second.claim_all()] == [expiring]
    rt.workers.close(second.session_id, second.secret)
    trigger = rt.triggers.add(TriggerDefinition(name="tick", task="mail", every_ms=MINUTE))
    advance(max(RETRY_DELAY_MS, TTL_MS, MINUTE) + 1_000)

    summary = rt.cycle()

    assert summary.ok
    assert [s.name for s in summary.steps] == list(ClusterSchedulerCoordinator.STEP_NAMES)
    assert summary.step("runtime_recovery").counts["recovered"] == 1
    assert summary.step("lost_retry").counts["attempts_created"] == 1
    assert summary.step("trigger_schedule").counts["runs_admitted"] == 1
    (fired_run,) = _firings(rt, trigger.id)
    lost_at = next(seq for seq, kind in _events(rt, expiring) if kind is EventType.ATTEMPT_LOST)
    settled_at = next(seq for seq, kind in _events(rt, expiring) if kind is EventType.RUN_FAILED)
    retried_at = max(seq for seq, kind in _events(rt, retry) if kind is EventType.ATTEMPT_CREATED)
    (admitted_at, _) = _events(rt, fired_run)[0]
    assert lost_at < settled_at < admitted_at
    assert retried_at < admitted_at
    assert rt.run(retry).status is RunStatus.QUEUED
    assert rt.run(expiring).status is RunStatus.FAILED  # no policy


def test_a_failing_recovery_step_means_no_trigger_fires_in_that_cycle(
    store: Any, advance: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = runtime(store, advance)
    trigger = rt.triggers.add(TriggerDefinition(name="tick", task="mail", every_ms=MINUTE))
    advance(MINUTE)

    def broken(limit: int) -> Any:
        raise RuntimeError("recovery source unavailable")

    monkeypatch.setattr(store, "recovery_candidates", broken)
    summary = rt.cycle()

    assert summary.aborted_at == "runtime_recovery"
    assert [s.name for s in summary.steps] == ["runtime_recovery"]
    assert _firings(rt, trigger.id) == []
    with store.unit_of_work() as uow:
        unchanged = uow.triggers.get(trigger.id)
    assert unchanged == trigger

    monkeypatch.undo()
    summary = rt.cycle()
    assert summary.ok
    assert len(_firings(rt, trigger.id)) == 1


def test_a_failing_lost_retry_step_also_stops_the_trigger_schedule(
    store: Any, advance: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = runtime(store, advance)
    trigger = rt.triggers.add(TriggerDefinition(name="tick", task="mail", every_ms=MINUTE))
    advance(MINUTE)

    def broken(limit: int) -> Any:
        raise RuntimeError("lost retry source unavailable")

    monkeypatch.setattr(store, "lost_runs", broken)
    summary = rt.cycle()

    assert summary.aborted_at == "lost_retry"
    assert _firings(rt, trigger.id) == []
