"""The trigger schedule step on every store: firings on the store's clock, catch-up policies,
pause/resume/delete, the unique firing key, and exactly-once firing with concurrent replicas."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from attrs import evolve

from ql3.adapters.cron import CroniterCalendar
from ql3.application.identities import RandomIdentities
from ql3.application.triggers import TriggerDefinition, TriggerSchedule, UnknownTrigger
from ql3.domain.errors import ConcurrencyConflict, InvalidTransition, InvalidTrigger
from ql3.domain.events import EventType
from ql3.domain.model import RunOwner, RunStatus
from ql3.domain.policy import RetryPolicy, Safety
from ql3.domain.transitions import admit
from ql3.domain.triggers import MISFIRE_GRACE_MS, CatchUp, Trigger, TriggerFiring, TriggerStatus
from tests.scheduling_support import Runtime, runtime

SECOND = 1_000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
SAFE = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)


def _every(
    rt: Runtime,
    name: str,
    every_ms: int,
    *,
    catch_up: CatchUp = CatchUp.SKIP,
    limit: int = 10,
    **template: Any,
) -> Trigger:
    return rt.triggers.add(
        TriggerDefinition(
            name=name,
            task=template.pop("task", "mail"),
            every_ms=every_ms,
            catch_up=catch_up,
            catch_up_limit=limit,
            **template,
        )
    )


def _firings(rt: Runtime, trigger_id: str) -> list[TriggerFiring]:
    with rt.store.unit_of_work() as uow:
        return sorted(uow.triggers.firings_of(trigger_id, 1000), key=lambda f: f.scheduled_at_ms)


def _trigger(rt: Runtime, trigger_id: str) -> Trigger:
    with rt.store.unit_of_work() as uow:
        trigger = uow.triggers.get(trigger_id)
    assert trigger is not None
    return trigger


def test_an_interval_trigger_fires_each_scheduled_time_once_with_its_template(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    trigger = _every(rt, "report", MINUTE, input={"to": "ops"}, policy=SAFE)
    assert trigger.next_fire_at_ms == trigger.created_at_ms + MINUTE
    step = rt.container.core.trigger_schedule()

    assert step.run_once().due == 0  # not due before its time
    advance(MINUTE)
    report = step.run_once()
    assert (report.due, report.fired, report.runs_admitted, report.missed) == (1, 1, 1, 0)
    assert step.run_once().due == 0  # the same scheduled time never fires twice

    (firing,) = _firings(rt, trigger.id)
    assert firing.scheduled_at_ms == trigger.next_fire_at_ms
    run = rt.run(firing.run_id)
    assert (run.task, run.input, run.policy, run.owner) == ("mail", {"to": "ops"}, SAFE,
                                                            RunOwner.RUNTIME)
    assert run.status is RunStatus.QUEUED
    with store.unit_of_work() as uow:
        (admitted,) = uow.runs.events_of(run.id)
    assert admitted.event.type is EventType.RUN_ADMITTED
    assert admitted.event.data["trigger"] == "report"
    assert admitted.event.data["scheduled_at_ms"] == firing.scheduled_at_ms
    after = _trigger(rt, trigger.id)
    assert after.next_fire_at_ms == trigger.next_fire_at_ms + MINUTE
    assert after.last_fired_at_ms == firing.scheduled_at_ms
    assert after.version == trigger.version + 1

    advance(MINUTE)
    assert step.run_once().runs_admitted == 1
    assert [f.scheduled_at_ms for f in _firings(rt, trigger.id)] == [
        trigger.next_fire_at_ms,
        trigger.next_fire_at_ms + MINUTE,
    ]


@pytest.mark.parametrize(
    ("catch_up", "limit", "late_ms", "fired_hours", "missed"),
    [
        (CatchUp.SKIP, 10, 10 * MINUTE, [], 3),
        (CatchUp.SKIP, 10, MISFIRE_GRACE_MS // 2, [3], 2),
        (CatchUp.ONE, 10, 10 * MINUTE, [3], 2),
        (CatchUp.ALL, 10, 10 * MINUTE, [1, 2, 3], 0),
        (CatchUp.ALL, 2, 10 * MINUTE, [2, 3], 1),
    ],
    ids=["skip-late", "skip-on-time", "one", "all", "all-bounded"],
)
def test_missed_firings_follow_the_catch_up_policy(
    store: Any,
    advance: Callable[[int], None],
    catch_up: CatchUp,
    limit: int,
    late_ms: int,
    fired_hours: list[int],
    missed: int,
) -> None:
    rt = runtime(store, advance)
    trigger = _every(rt, "hourly", HOUR, catch_up=catch_up, limit=limit)
    start = trigger.created_at_ms
    advance(3 * HOUR + late_ms)  # the scheduler was away: three scheduled times passed

    report = rt.container.core.trigger_schedule().run_once()

    assert report.runs_admitted == len(fired_hours)
    assert report.missed == missed
    assert [f.scheduled_at_ms for f in _firings(rt, trigger.id)] == [
        start + h * HOUR for h in fired_hours
    ]
    assert _trigger(rt, trigger.id).next_fire_at_ms == start + 4 * HOUR
    advance(HOUR - late_ms)  # the next scheduled time, on time
    assert rt.container.core.trigger_schedule().run_once().runs_admitted == 1


def test_a_cron_trigger_fires_on_its_calendar(store: Any, advance: Callable[[int], None]) -> None:
    rt = runtime(store, advance)
    trigger = rt.triggers.add(
        TriggerDefinition(name="five", task="mail", cron="*/5 * * * *", catch_up=CatchUp.ALL)
    )
    first = trigger.next_fire_at_ms
    assert first % (5 * MINUTE) == 0 and 0 < first - trigger.created_at_ms <= 5 * MINUTE
    advance(first - rt.now_ms() + 11 * MINUTE)

    report = rt.container.core.trigger_schedule().run_once()

    assert report.runs_admitted == 3
    assert [f.scheduled_at_ms for f in _firings(rt, trigger.id)] == [
        first,
        first + 5 * MINUTE,
        first + 10 * MINUTE,
    ]
    assert _trigger(rt, trigger.id).next_fire_at_ms == first + 15 * MINUTE


def test_a_paused_trigger_does_not_fire_and_resumes_without_catching_up(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    trigger = _every(rt, "tick", MINUTE, catch_up=CatchUp.ALL)
    paused = rt.triggers.pause("tick")
    assert paused.status is TriggerStatus.PAUSED
    with pytest.raises(InvalidTransition):
        rt.triggers.pause("tick")
    advance(5 * MINUTE + SECOND)
    assert rt.container.core.trigger_schedule().run_once().due == 0

    resumed = rt.triggers.resume("tick")

    now = rt.now_ms()
    assert resumed.status is TriggerStatus.ACTIVE
    assert now < resumed.next_fire_at_ms <= now + MINUTE
    assert (resumed.next_fire_at_ms - trigger.next_fire_at_ms) % MINUTE == 0  # same phase
    assert rt.container.core.trigger_schedule().run_once().due == 0
    advance(MINUTE)
    assert rt.container.core.trigger_schedule().run_once().runs_admitted == 1


def test_a_deleted_trigger_never_fires_keeps_its_history_and_frees_its_name(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    old = _every(rt, "tick", MINUTE)
    advance(MINUTE)
    assert rt.container.core.trigger_schedule().run_once().runs_admitted == 1

    deleted = rt.triggers.delete("tick")

    assert deleted.status is TriggerStatus.DELETED
    assert rt.triggers.list_triggers() == []
    assert [t.id for t in rt.triggers.list_triggers(include_deleted=True)] == [old.id]
    with pytest.raises(UnknownTrigger):
        rt.triggers.resume("tick")
    advance(5 * MINUTE)
    assert rt.container.core.trigger_schedule().run_once().due == 0
    assert len(_firings(rt, old.id)) == 1
    new = _every(rt, "tick", HOUR)
    assert new.id != old.id
    assert [t.id for t in rt.triggers.list_triggers()] == [new.id]


@pytest.mark.parametrize(
    "definition",
    [
        TriggerDefinition(name="x", task="mail"),
        TriggerDefinition(name="x", task="mail", every_ms=MINUTE, cron="* * * * *"),
        TriggerDefinition(name="x", task="mail", every_ms=10),
        TriggerDefinition(name="x", task="mail", cron="0 0 30 2 *"),
        TriggerDefinition(name="x", task="mail", cron="every minute"),
        TriggerDefinition(name=" x", task="mail", every_ms=MINUTE),
        TriggerDefinition(name="x", task="", every_ms=MINUTE),
        TriggerDefinition(name="x", task="mail", every_ms=MINUTE, catch_up_limit=65),
    ],
    ids=["no-schedule", "both", "too-fast", "never-fires", "bad-cron", "padded-name",
         "no-task", "limit"],
)
def test_bad_definitions_are_refused_and_write_nothing(
    store: Any, advance: Callable[[int], None], definition: TriggerDefinition
) -> None:
    rt = runtime(store, advance)
    with pytest.raises(InvalidTrigger):
        rt.triggers.add(definition)
    assert rt.triggers.list_triggers(include_deleted=True) == []


def test_a_live_name_is_unique(store: Any, advance: Callable[[int], None]) -> None:
    rt = runtime(store, advance)
    first = _every(rt, "tick", MINUTE)
    with pytest.raises(InvalidTrigger, match="already exists"):
        _every(rt, "tick", HOUR)
    clash = Trigger(
        id="other",
        name="tick",
        task="mail",
        every_ms=MINUTE,
        next_fire_at_ms=first.next_fire_at_ms,
        created_at_ms=first.created_at_ms,
        updated_at_ms=first.created_at_ms,
    )
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.triggers.add(clash)  # the store refuses it too, not only the service
    assert [t.id for t in rt.triggers.list_triggers()] == [first.id]


def test_the_firing_key_is_unique_and_trigger_writes_are_compare_and_set(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    trigger = _every(rt, "tick", MINUTE)
    advance(MINUTE)
    assert rt.container.core.trigger_schedule().run_once().runs_admitted == 1
    (firing,) = _firings(rt, trigger.id)
    other_run = rt.container.core.admission().submit("mail")
    again = TriggerFiring(
        trigger_id=trigger.id,
        scheduled_at_ms=firing.scheduled_at_ms,
        run_id=other_run,
        fired_at_ms=firing.fired_at_ms,
    )
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.triggers.record_firing(again)
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.triggers.update(trigger, trigger)  # the version read is stale
    assert _firings(rt, trigger.id) == [firing]
    # A firing refused by the key takes its Run with it: nothing of the transaction stays.
    late = admit(run_id="late", attempt_id="late-a1", task="mail", input=None, policy=None,
                 now_ms=firing.fired_at_ms)
    with store.unit_of_work() as uow:
        uow.runs.add(late)
        with pytest.raises(ConcurrencyConflict):
            uow.triggers.record_firing(evolve(again, run_id="late"))
    with store.unit_of_work() as uow:
        assert uow.runs.get_run("late") is None


def _replica_store(store: Any, request: pytest.FixtureRequest) -> Any:
    """PostgreSQL: a store of its own (engine, pool) on the same database, as another replica
    has. Stores whose transactions hold the whole database are shared by the threads."""
    if not type(store).__module__.startswith("ql3.adapters.postgres."):
        return store
    from ql3.adapters.postgres.store import PostgresStore

    replica = PostgresStore.from_url(request.getfixturevalue("pg_database_url"), pool_size=2)
    replica.testing_advance_clock(store.clock_offset_ms)
    request.addfinalizer(replica.close)
    return replica


def test_concurrent_replicas_admit_each_firing_exactly_once(
    store: Any, advance: Callable[[int], None], request: pytest.FixtureRequest
) -> None:
    rt = runtime(store, advance)
    triggers = [
        _every(rt, f"t{i}", SECOND, catch_up=CatchUp.ALL, limit=64) for i in range(6)
    ]
    advance(20 * SECOND)  # twenty scheduled times due for each trigger
    replicas = 4
    stores = [_replica_store(store, request) for _ in range(replicas)]
    steps = [
        TriggerSchedule(s.unit_of_work, s, CroniterCalendar(), RandomIdentities(), page_size=4)
        for s in stores
    ]
    barrier = threading.Barrier(replicas)
    admitted = [0] * replicas
    errors: list[BaseException] = []

    def replica(index: int) -> None:
        try:
            barrier.wait()
            for _ in range(3):
                admitted[index] += steps[index].run_once().runs_admitted
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    # PostgreSQL's clock keeps moving while the replicas run: later scheduled times may come
    # due too. Every scheduled time is admitted once, none is skipped, none twice.
    run_ids = []
    for trigger in triggers:
        scheduled = [f.scheduled_at_ms for f in _firings(rt, trigger.id)]
        assert len(scheduled) >= 20
        assert scheduled == [trigger.next_fire_at_ms + k * SECOND for k in range(len(scheduled))]
        run_ids += [f.run_id for f in _firings(rt, trigger.id)]
    assert sum(admitted) == len(run_ids) == len(set(run_ids))
    with store.unit_of_work() as uow:
        runs = uow.runs.list_runs(None, 10_000)
    assert sorted(r.id for r in runs) == sorted(run_ids)
