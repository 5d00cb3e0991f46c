"""Triggers: the operator's commands and the trigger schedule step of the cadence.

The step reads one bounded page of due triggers (the store's clock decides what is due) and fires
each in its own short transaction: the trigger row is locked (a replica that finds it held moves
on), re-checked, and the admitted Runs, their firing records and the trigger's next scheduled time
commit together. The firing key (trigger id, scheduled time) is unique in every store, so a
firing is admitted exactly once whichever replica gets there first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ql3.application.budgets import validate_page_size
from ql3.application.ports import (
    CronCalendar,
    Identities,
    SchedulerUnitOfWork,
    SchedulerUnitOfWorkFactory,
    TriggerSource,
)
from ql3.domain.errors import ConcurrencyConflict, DomainError, Error, InvalidTrigger
from ql3.domain.model import JsonValue
from ql3.domain.policy import RetryPolicy
from ql3.domain.triggers import (
    DEFAULT_CATCH_UP_LIMIT,
    CatchUp,
    FireSchedule,
    FiringPlan,
    IntervalSchedule,
    Trigger,
    TriggerFiring,
    TriggerStatus,
    define_trigger,
    delete_trigger,
    fire,
    interval_schedule,
    pause_trigger,
    plan_firings,
    resume_trigger,
)

_Decide = Callable[[SchedulerUnitOfWork, Trigger], Trigger]


class UnknownTrigger(Error, LookupError):
    """No trigger (that is not deleted) with that name."""


def schedule_of(trigger: Trigger, calendar: CronCalendar) -> FireSchedule:
    """The fire times of a trigger: its cron expression's, or its interval's in phase with its
    next scheduled firing."""
    if trigger.cron is not None:
        return calendar.schedule(trigger.cron)
    return interval_schedule(trigger)


@dataclass(frozen=True, slots=True)
class TriggerDefinition:
    """What an operator declares. Exactly one of ``every_ms`` and ``cron``."""

    name: str
    task: str
    input: JsonValue = None
    policy: RetryPolicy | None = None
    every_ms: int | None = None
    cron: str | None = None
    catch_up: CatchUp = CatchUp.SKIP
    catch_up_limit: int = DEFAULT_CATCH_UP_LIMIT


class Triggers:
    """Add, list, pause, resume and delete triggers by name."""

    def __init__(
        self,
        uow_factory: SchedulerUnitOfWorkFactory,
        identities: Identities,
        calendar: CronCalendar,
    ) -> None:
        self._uow_factory = uow_factory
        self._identities = identities
        self._calendar = calendar

    def add(self, definition: TriggerDefinition) -> Trigger:
        """A new active trigger; its first firing is the first scheduled time after now."""
        if (definition.every_ms is None) == (definition.cron is None):
            raise InvalidTrigger("a trigger has either an interval or a cron expression")
        with self._uow_factory() as uow:
            now_ms = uow.now_ms()
            if uow.triggers.find(definition.name) is not None:
                raise InvalidTrigger(f"a trigger named {definition.name!r} already exists")
            schedule: FireSchedule
            if definition.cron is not None:
                schedule = self._calendar.schedule(definition.cron)
            else:
                assert definition.every_ms is not None
                if definition.every_ms < 1:
                    raise InvalidTrigger("interval must be positive")
                schedule = IntervalSchedule(anchor_ms=now_ms, every_ms=definition.every_ms)
            trigger = define_trigger(
                trigger_id=self._identities.new_id(),
                name=definition.name,
                task=definition.task,
                input=definition.input,
                policy=definition.policy,
                every_ms=definition.every_ms,
                cron=definition.cron,
                catch_up=definition.catch_up,
                catch_up_limit=definition.catch_up_limit,
                first_fire_at_ms=schedule.next_after(now_ms),
                now_ms=now_ms,
            )
            uow.triggers.add(trigger)
            uow.commit()
        return trigger

    def get(self, name: str) -> Trigger:
        with self._uow_factory() as uow:
            trigger = uow.triggers.find(name)
        if trigger is None:
            raise UnknownTrigger(name)
        return trigger

    def list_triggers(self, *, include_deleted: bool = False) -> list[Trigger]:
        with self._uow_factory() as uow:
            return list(uow.triggers.list_triggers(include_deleted=include_deleted))

    def firings(self, name: str, limit: int = 20) -> list[TriggerFiring]:
        with self._uow_factory() as uow:
            trigger = uow.triggers.find(name)
            if trigger is None:
                raise UnknownTrigger(name)
            return list(uow.triggers.firings_of(trigger.id, limit))

    def pause(self, name: str) -> Trigger:
        return self._change(name, lambda uow, t: pause_trigger(t, uow.now_ms()))

    def resume(self, name: str) -> Trigger:
        return self._change(
            name,
            lambda uow, t: resume_trigger(t, schedule_of(t, self._calendar), uow.now_ms()),
        )

    def delete(self, name: str) -> Trigger:
        return self._change(name, lambda uow, t: delete_trigger(t, uow.now_ms()))

    def _change(self, name: str, decide: _Decide) -> Trigger:
        with self._uow_factory() as uow:
            trigger = uow.triggers.find(name, lock=True)
            if trigger is None:
                raise UnknownTrigger(name)
            after = decide(uow, trigger)
            uow.triggers.update(trigger, after)
            uow.commit()
        return after


# --- the trigger schedule step -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TriggerScheduleReport:
    due: int = 0
    fired: int = 0
    runs_admitted: int = 0
    missed: int = 0
    moved_on: int = 0
    broken: int = 0
    has_more: bool = False

    def counts(self) -> dict[str, int]:
        return {
            "due": self.due,
            "fired": self.fired,
            "runs_admitted": self.runs_admitted,
            "missed": self.missed,
            "moved_on": self.moved_on,
            "broken": self.broken,
            "has_more": int(self.has_more),
        }


def fire_due_trigger(
    uow: SchedulerUnitOfWork, trigger_id: str, calendar: CronCalendar, identities: Identities
) -> FiringPlan | None:
    """Fire one due trigger inside ``uow`` and commit. None when another replica holds it or,
    re-checked under its lock, it is no longer due."""
    trigger = uow.triggers.lock(trigger_id, skip_locked=True)
    if trigger is None or trigger.status is not TriggerStatus.ACTIVE:
        return None
    now_ms = uow.now_ms()
    if trigger.next_fire_at_ms > now_ms:
        return None
    plan = plan_firings(trigger, schedule_of(trigger, calendar), now_ms)
    ids = [(identities.new_id(), identities.new_id()) for _ in plan.fire_at_ms]
    fired = fire(trigger=trigger, plan=plan, ids=ids, now_ms=now_ms)
    for change, firing in zip(fired.admissions, fired.firings, strict=True):
        uow.runs.add(change)
        uow.triggers.record_firing(firing)
    uow.triggers.update(trigger, fired.trigger)
    uow.commit()
    return plan


class TriggerSchedule:
    """The trigger schedule step: one bounded page of due triggers per cycle.

    A trigger that cannot fire (its schedule became invalid) or that another replica changed
    meanwhile is counted and passed over; it does not hold up the others. Store errors end the
    step (and so the cycle) like in every other step."""

    def __init__(
        self,
        uow_factory: SchedulerUnitOfWorkFactory,
        source: TriggerSource,
        calendar: CronCalendar,
        identities: Identities,
        page_size: int | None = None,
    ) -> None:
        self._uow_factory = uow_factory
        self._source = source
        self._calendar = calendar
        self._identities = identities
        self._page_size = validate_page_size(page_size)

    @property
    def page_size(self) -> int:
        return self._page_size

    def run_once(self, page_size: int | None = None) -> TriggerScheduleReport:
        limit = validate_page_size(page_size, default=self._page_size)
        page = self._source.due_triggers(limit)
        fired = admitted = missed = moved_on = broken = 0
        for due in page.items:
            try:
                with self._uow_factory() as uow:
                    plan = fire_due_trigger(uow, due.trigger_id, self._calendar, self._identities)
            except ConcurrencyConflict:
                moved_on += 1
                continue
            except DomainError:
                broken += 1
                continue
            if plan is None:
                moved_on += 1
                continue
            fired += 1
            admitted += len(plan.fire_at_ms)
            missed += plan.missed
        return TriggerScheduleReport(
            due=len(page.items),
            fired=fired,
            runs_admitted=admitted,
            missed=missed,
            moved_on=moved_on,
            broken=broken,
            has_more=page.has_more,
        )
