"""Schedules declared in code (ADR 0021), on every store: ``runtime.start()`` records each as
the trigger ``code:NAME``; two replicas that start together make one trigger, and it fires once
per scheduled time however many replicas run the cadence; a restart changes nothing; a changed
declaration updates it; a schedule no longer declared is paused (and says so in the log); an
operator's triggers are left alone."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ql3
from ql3 import InvalidAdmission, Schedule, TaskRegistry
from ql3.application.triggers import TriggerDefinition
from ql3.bootstrap.producer import Producer
from ql3.domain.errors import InvalidTrigger
from ql3.domain.triggers import TriggerStatus
from ql3.runtime import Runtime as ApiRuntime
from tests.scheduling_support import runtime


def _registry(every: float | None = 60, cron: str | None = None) -> TaskRegistry:
    tasks = TaskRegistry()

    @tasks.task(safety="idempotent")
    def t(payload: Any) -> Any:
        return payload

    if every is not None or cron is not None:
        tasks.schedule("tick", t, every=every, cron=cron, input={"from": "code"})
    return tasks


class _Replica(ApiRuntime):
    """The embedding API on a shared store, as one more process of the application."""

    profile = "test"


def _replica(store: Any, tasks: TaskRegistry) -> _Replica:
    return _Replica(Producer(store), tasks)


def _firings(rt: Any, name: str) -> list[int]:
    return sorted(f.scheduled_at_ms for f in rt.triggers.firings(name, 100))


def test_a_declared_schedule_fires_once_per_slot_across_replicas_and_survives_a_restart(
    store: Any, advance: Callable[[int], None], caplog: pytest.LogCaptureFixture
) -> None:
    first, second = runtime(store, advance), runtime(store, advance)
    first.triggers.add(TriggerDefinition(name="manual", task="t", every_ms=60_000))
    declared = [_replica(store, _registry()).declare_schedules() for _ in range(2)]
    assert [d.created for d in declared] == [("code:tick",), ()]
    trigger = first.triggers.get("code:tick")
    assert (trigger.task, trigger.input, trigger.every_ms) == ("t", {"from": "code"}, 60_000)
    assert trigger.policy is not None and trigger.policy.safety is not None

    for _ in range(3):
        advance(60_000)
        first.cycle()
        second.cycle()
    slots = _firings(first, "code:tick")
    assert len(slots) == 3 and len(set(slots)) == 3

    # A restart with the same declaration writes nothing; the trigger fires on in phase.
    before = first.triggers.get("code:tick")
    again = _replica(store, _registry()).declare_schedules()
    assert (again.created, again.updated, again.paused) == ((), (), ())
    assert first.triggers.get("code:tick") == before
    advance(60_000)
    second.cycle()
    assert len(_firings(first, "code:tick")) == 4

    # A changed declaration updates it; the new interval starts from now.
    now = first.now_ms()
    changed = _replica(store, _registry(every=120)).declare_schedules()
    assert changed.updated == ("code:tick",)
    trigger = first.triggers.get("code:tick")
    assert trigger.every_ms == 120_000
    assert now + 120_000 <= trigger.next_fire_at_ms <= first.now_ms() + 120_000

    # No longer declared: paused, with a log line; the operator's trigger is left alone.
    with caplog.at_level(logging.WARNING, logger="ql3"):
        gone = _replica(store, _registry(every=None)).declare_schedules()
    assert gone.paused == ("code:tick",)
    assert "trigger code:tick is no longer declared in code: paused" in caplog.text
    assert first.triggers.get("code:tick").status is TriggerStatus.PAUSED
    assert first.triggers.get("manual").status is TriggerStatus.ACTIVE
    advance(600_000)
    first.cycle()
    assert len(_firings(first, "code:tick")) == 4

    # Declared again: active from its next scheduled time after now (not caught up).
    back = _replica(store, _registry(every=None, cron="*/5 * * * *")).declare_schedules()
    assert back.updated == ("code:tick",)
    trigger = first.triggers.get("code:tick")
    assert (trigger.status, trigger.cron, trigger.every_ms) == (TriggerStatus.ACTIVE,
                                                                "*/5 * * * *", None)
    assert trigger.next_fire_at_ms > first.now_ms()


def test_operators_may_not_take_a_declared_name_and_bad_declarations_are_refused(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    with pytest.raises(InvalidTrigger, match="declares in code"):
        rt.triggers.add(TriggerDefinition(name="code:x", task="t", every_ms=60_000))
    with pytest.raises(InvalidTrigger, match="not valid"):
        _replica(store, _registry(every=None, cron="61 * * * *")).declare_schedules()
    assert rt.triggers.list_triggers() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of cron= and every="),
        ({"every": 5, "cron": "* * * * *"}, "exactly one"),
        ({"every": 0.5}, "every= is a number of seconds"),
        ({"every": "5"}, "every= is a number of seconds"),
        ({"every": 5, "catch_up": "sometimes"}, "catch_up is one of"),
        ({"every": 5, "catch_up_limit": 0}, "catch_up_limit"),
        ({"every": 5, "input": {1, 2}}, "not JSON"),
    ],
)
def test_a_bad_schedule_is_refused_at_declaration(kwargs: dict[str, Any], message: str) -> None:
    tasks = _registry(every=None)
    with pytest.raises(InvalidAdmission, match=message):
        tasks.schedule("s", "t", **kwargs)
    with pytest.raises(InvalidAdmission, match="no task"):
        tasks.schedule("s", "nope", every=5)


def test_the_decorator_declares_a_schedule_and_the_in_memory_runtime_fires_it() -> None:
    tasks = TaskRegistry()

    @tasks.task(schedule=Schedule(every=300, input={"n": 1}))
    def sweep(payload: Any) -> Any:
        return payload

    @tasks.task(schedule="0 3 * * *")
    def nightly(payload: Any) -> Any:
        return "done"

    assert [s.name for s in tasks.schedules()] == ["nightly", "sweep"]
    with ql3.testing.in_memory(tasks) as rt:
        assert rt.run_due() == 0
        rt.advance(300)
        assert rt.run_due() == 1
        (run,) = rt.runs()
        assert (run.task, run.output, run.succeeded) == ("sweep", {"n": 1}, True)


def test_an_edge_runtime_sleeps_until_its_declared_schedule_fires(tmp_path: Path) -> None:
    tasks = TaskRegistry()

    @tasks.task(schedule=Schedule(every=1))
    def beat(payload: Any) -> Any:
        return "beat"

    with ql3.edge(str(tmp_path / "edge.sqlite"), tasks=tasks) as rt:
        rt.start()  # the trigger is recorded before the runner boots and plans its sleep
        with rt.store.unit_of_work() as uow:
            assert [t.name for t in uow.triggers.list_triggers()] == ["code:beat"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with rt.store.unit_of_work() as uow:
                runs = [r for r in uow.runs.list_runs(None, 100) if r.task == "beat"]
            if any(r.output == "beat" for r in runs):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the declared schedule never fired on Edge")
