"""Triggers: the operator's commands and the trigger schedule step of the cadence.

The step reads one bounded page of due triggers (the store's clock decides what is due) and fires
each in its own short transaction: the trigger row is locked (a replica that finds it held moves
on), re-checked, and the admitted Runs, their firing records and the trigger's next scheduled time
commit together. The firing key (trigger id, scheduled time) is unique in every store, so a
firing is admitted exactly once whichever replica gets there first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    DECLARED_PREFIX,
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
    is_declared,
    pause_trigger,
    plan_firings,
    redefine_trigger,
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


@dataclass(frozen=True, slots=True)
class DeclaredTriggers:
    """What :meth:`Triggers.declare` changed, by trigger name."""

    created: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    paused: tuple[str, ...] = ()


class Triggers:
    """Add, list, pause, resume and delete triggers by name; record those declared in code."""

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
        """A new active trigger; its first firing is the first scheduled time after now. The
        names of the triggers declared in code (``code:...``) are refused here."""
        if definition.name.startswith(DECLARED_PREFIX):
            raise InvalidTrigger(
                f"trigger names starting with {DECLARED_PREFIX!r} are those of the schedules "
                "an application declares in code"
            )
        with self._uow_factory() as uow:
            if uow.triggers.find(definition.name) is not None:
                raise InvalidTrigger(f"a trigger named {definition.name!r} already exists")
            trigger = self._define(uow, definition)
            uow.triggers.add(trigger)
            uow.commit()
        return trigger

    def _schedule(self, definition: TriggerDefinition, now_ms: int) -> FireSchedule:
        """The fire times of a new (or newly scheduled) trigger, anchored at now."""
        if (definition.every_ms is None) == (definition.cron is None):
            raise InvalidTrigger("a trigger has either an interval or a cron expression")
        if definition.cron is not None:
            return self._calendar.schedule(definition.cron)
        assert definition.every_ms is not None
        if definition.every_ms < 1:
            raise InvalidTrigger("interval must be positive")
        return IntervalSchedule(anchor_ms=now_ms, every_ms=definition.every_ms)

    def _define(self, uow: SchedulerUnitOfWork, definition: TriggerDefinition) -> Trigger:
        now_ms = uow.now_ms()
        return define_trigger(
            trigger_id=self._identities.new_id(),
            name=definition.name,
            task=definition.task,
            input=definition.input,
            policy=definition.policy,
            every_ms=definition.every_ms,
            cron=definition.cron,
            catch_up=definition.catch_up,
            catch_up_limit=definition.catch_up_limit,
            first_fire_at_ms=self._schedule(definition, now_ms).next_after(now_ms),
            now_ms=now_ms,
        )

    def declare(self, definitions: Sequence[TriggerDefinition]) -> DeclaredTriggers:
        """Record the triggers an application's code declares (their names start with
        ``code:``): each is created, or made to match its declaration and active, each in a
        transaction of its own (a replica that starts at the same time finds it made). Every
        other ``code:`` trigger still active is paused: the code no longer declares it. The
        triggers an operator made are left alone."""
        names = [definition.name for definition in definitions]
        if len(set(names)) != len(names):
            raise InvalidTrigger("a schedule is declared twice")
        for definition in definitions:
            if not definition.name.startswith(DECLARED_PREFIX):
                raise InvalidTrigger(f"a declared trigger's name starts with {DECLARED_PREFIX!r}")
            self._schedule(definition, 0)  # a bad cron expression is refused before any write
        created: list[str] = []
        updated: list[str] = []
        for definition in definitions:
            for round_ in (1, 2):
                try:
                    outcome = self._declare_one(definition)
                except ConcurrencyConflict:  # another replica made or changed it meanwhile
                    if round_ == 2:
                        raise
                    continue
                if outcome == "created":
                    created.append(definition.name)
                elif outcome == "updated":
                    updated.append(definition.name)
                break
        paused: list[str] = []
        for trigger in self.list_triggers():
            if (
                is_declared(trigger)
                and trigger.name not in names
                and trigger.status is TriggerStatus.ACTIVE
            ):
                try:
                    self.pause(trigger.name)
                except (ConcurrencyConflict, UnknownTrigger, DomainError):
                    continue  # another replica paused or changed it meanwhile
                paused.append(trigger.name)
        return DeclaredTriggers(created=tuple(created), updated=tuple(updated),
                                paused=tuple(paused))

    def _declare_one(self, definition: TriggerDefinition) -> str:
        with self._uow_factory() as uow:
            found = uow.triggers.find(definition.name, lock=True)
            if found is None:
                uow.triggers.add(self._define(uow, definition))
                uow.commit()
                return "created"
            now_ms = uow.now_ms()
            after = redefine_trigger(
                found,
                task=definition.task,
                input=definition.input,
                policy=definition.policy,
                every_ms=definition.every_ms,
                cron=definition.cron,
                catch_up=definition.catch_up,
                catch_up_limit=definition.catch_up_limit,
                schedule=self._schedule(definition, now_ms),
                now_ms=now_ms,
            )
            if after is None:
                return "unchanged"
            uow.triggers.update(found, after)
            uow.commit()
            return "updated"

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
