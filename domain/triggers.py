"""Triggers: Runs admitted on a schedule (a fixed interval or a cron expression).

A trigger carries a Run template (task, input, retry policy) and the scheduled time of its next
firing. Each firing is identified by (trigger id, scheduled time): the stores keep that key unique,
so a firing is admitted at most once however many scheduler replicas see it due.

When the scheduler was away for a while, several scheduled times may have passed. Only the latest
of them is the trigger's current slot; the earlier ones were missed. The trigger's ``catch_up``
decides what happens:

- ``skip``: missed firings are dropped; the current slot fires only if it is on time, that is
  less than :data:`MISFIRE_GRACE_MS` late.
- ``one``: one firing (for the current slot) stands for everything that was missed.
- ``all``: every missed firing is admitted, oldest first, up to ``catch_up_limit`` (the most
  recent ones are kept).

Cron arithmetic is not done here: a :class:`FireSchedule` (an adapter implements it for cron
expressions) tells the fire times. :class:`IntervalSchedule` is the pure one for intervals.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

from attrs import evolve, field, frozen, validators

from ql3.domain.errors import InvalidTransition, InvalidTrigger, NotDue
from ql3.domain.model import JsonValue, RunOwner
from ql3.domain.policy import RetryPolicy
from ql3.domain.transitions import MAX_TASK_NAME_LENGTH, Change, admit

MAX_TRIGGER_NAME_LENGTH = 200
MIN_INTERVAL_MS = 1_000
MAX_INTERVAL_MS = 366 * 24 * 3_600_000
DEFAULT_CATCH_UP_LIMIT = 10
MAX_CATCH_UP_LIMIT = 64
MISFIRE_GRACE_MS = 60_000
# Missed fire times are counted (for reports) up to this many; past it the count saturates.
MAX_COUNTED_MISSED = 1_000


class CatchUp(enum.Enum):
    """What a trigger does with firings missed while no scheduler ran."""

    SKIP = "skip"
    ONE = "one"
    ALL = "all"


class TriggerStatus(enum.Enum):
    ACTIVE = "active"
    PAUSED = "paused"
    DELETED = "deleted"


class FireSchedule(Protocol):
    """The fire times of a trigger, in epoch milliseconds."""

    def next_after(self, t_ms: int) -> int:
        """The first fire time strictly after ``t_ms``."""
        ...

    def latest_at_or_before(self, t_ms: int) -> int | None:
        """The last fire time at or before ``t_ms``, if there is one."""
        ...


@frozen(kw_only=True)
class IntervalSchedule:
    """Fire times ``anchor + n * every`` for every integer ``n``."""

    anchor_ms: int
    every_ms: int = field(validator=validators.ge(1))

    def next_after(self, t_ms: int) -> int:
        return self.anchor_ms + ((t_ms - self.anchor_ms) // self.every_ms + 1) * self.every_ms

    def latest_at_or_before(self, t_ms: int) -> int | None:
        return self.anchor_ms + ((t_ms - self.anchor_ms) // self.every_ms) * self.every_ms


def _name(_instance: object, _attribute: object, value: str) -> None:
    if not value or len(value) > MAX_TRIGGER_NAME_LENGTH or value.strip() != value:
        raise InvalidTrigger(
            f"trigger name must be 1..{MAX_TRIGGER_NAME_LENGTH} characters, without padding"
        )


@frozen(kw_only=True)
class Trigger:
    """A schedule and the template of the Runs it admits.

    Exactly one of ``every_ms`` and ``cron`` is set. ``next_fire_at_ms`` is the scheduled time
    of the next firing; ``version`` grows with every change and fences concurrent writers."""

    id: str
    name: str = field(validator=_name)
    task: str
    input: JsonValue = None
    policy: RetryPolicy | None = None
    every_ms: int | None = None
    cron: str | None = None
    catch_up: CatchUp = CatchUp.SKIP
    catch_up_limit: int = DEFAULT_CATCH_UP_LIMIT
    status: TriggerStatus = TriggerStatus.ACTIVE
    next_fire_at_ms: int
    last_fired_at_ms: int | None = None
    version: int = field(default=1, validator=validators.ge(1))
    created_at_ms: int
    updated_at_ms: int

    def __attrs_post_init__(self) -> None:
        if (self.every_ms is None) == (self.cron is None):
            raise InvalidTrigger("a trigger has either an interval or a cron expression")
        if self.every_ms is not None and not MIN_INTERVAL_MS <= self.every_ms <= MAX_INTERVAL_MS:
            raise InvalidTrigger(
                f"interval must be within {MIN_INTERVAL_MS // 1000}.."
                f"{MAX_INTERVAL_MS // 1000} seconds"
            )
        if self.cron is not None and (not self.cron.strip() or len(self.cron) > 200):
            raise InvalidTrigger("cron expression must be 1..200 characters")
        if not 1 <= self.catch_up_limit <= MAX_CATCH_UP_LIMIT:
            raise InvalidTrigger(f"catch-up limit must be within 1..{MAX_CATCH_UP_LIMIT}")
        if (
            not self.task
            or len(self.task) > MAX_TASK_NAME_LENGTH
            or self.task.strip() != self.task
        ):
            raise InvalidTrigger(
                f"task name must be 1..{MAX_TASK_NAME_LENGTH} characters, without padding"
            )
        if self.policy is not None and not isinstance(self.policy, RetryPolicy):
            raise InvalidTrigger("policy must be a RetryPolicy")


@frozen(kw_only=True)
class TriggerFiring:
    """One admitted firing: the unique key (trigger, scheduled time) and the Run it admitted."""

    trigger_id: str
    scheduled_at_ms: int
    run_id: str
    fired_at_ms: int


def define_trigger(
    *,
    trigger_id: str,
    name: str,
    task: str,
    input: JsonValue,
    policy: RetryPolicy | None,
    every_ms: int | None,
    cron: str | None,
    catch_up: CatchUp,
    catch_up_limit: int,
    first_fire_at_ms: int,
    now_ms: int,
) -> Trigger:
    """A new active trigger whose first firing is scheduled at ``first_fire_at_ms``."""
    if first_fire_at_ms <= now_ms:
        raise InvalidTrigger("the first firing must be scheduled after now")
    return Trigger(
        id=trigger_id,
        name=name,
        task=task,
        input=input,
        policy=policy,
        every_ms=every_ms,
        cron=cron,
        catch_up=catch_up,
        catch_up_limit=catch_up_limit,
        status=TriggerStatus.ACTIVE,
        next_fire_at_ms=first_fire_at_ms,
        created_at_ms=now_ms,
        updated_at_ms=now_ms,
    )


def interval_schedule(trigger: Trigger) -> IntervalSchedule:
    """An interval trigger's fire times, in phase with its next scheduled firing."""
    if trigger.every_ms is None:
        raise InvalidTrigger(f"trigger {trigger.name} has no interval")
    return IntervalSchedule(anchor_ms=trigger.next_fire_at_ms, every_ms=trigger.every_ms)


# --- firing -------------------------------------------------------------------------------------


@frozen(kw_only=True)
class FiringPlan:
    """What a due trigger does now: the scheduled times to admit (oldest first), how many due
    times are dropped, and the scheduled time of the following firing (after now)."""

    fire_at_ms: tuple[int, ...]
    missed: int
    next_fire_at_ms: int


def _count_due(schedule: FireSchedule, first: int, last: int) -> int:
    """How many fire times lie in ``[first, last]`` (``first`` is one), saturating."""
    if isinstance(schedule, IntervalSchedule):
        return min((last - first) // schedule.every_ms + 1, MAX_COUNTED_MISSED + 1)
    count, current = 1, first
    while count <= MAX_COUNTED_MISSED:
        current = schedule.next_after(current)
        if current > last:
            break
        count += 1
    return count


def plan_firings(trigger: Trigger, schedule: FireSchedule, now_ms: int) -> FiringPlan:
    """Decide, at the store's clock, which scheduled times of a due trigger fire now."""
    if trigger.status is not TriggerStatus.ACTIVE:
        raise InvalidTransition("trigger", trigger.id, trigger.status.value, "fire")
    first = trigger.next_fire_at_ms
    if first > now_ms:
        raise NotDue(f"trigger {trigger.name} is due at {first}, now {now_ms}")
    latest = schedule.latest_at_or_before(now_ms)
    if latest is None or latest < first:
        latest = first
    due = _count_due(schedule, first, latest)
    fire: list[int]
    if trigger.catch_up is CatchUp.SKIP:
        fire = [latest] if now_ms - latest < MISFIRE_GRACE_MS else []
    elif trigger.catch_up is CatchUp.ONE:
        fire = [latest]
    else:
        fire = [latest]
        while len(fire) < trigger.catch_up_limit:
            previous = schedule.latest_at_or_before(fire[-1] - 1)
            if previous is None or previous < first:
                break
            fire.append(previous)
        fire.reverse()
    following = schedule.next_after(latest)
    if following <= now_ms:  # a schedule that does not move forward would fire forever
        raise InvalidTrigger(f"trigger {trigger.name}: schedule does not advance past {latest}")
    return FiringPlan(
        fire_at_ms=tuple(fire), missed=max(0, due - len(fire)), next_fire_at_ms=following
    )


@frozen(kw_only=True)
class TriggerFired:
    """The trigger after firing, and for each firing the admitted Run and its firing record."""

    trigger: Trigger
    admissions: tuple[Change, ...]
    firings: tuple[TriggerFiring, ...]


def fire(
    *,
    trigger: Trigger,
    plan: FiringPlan,
    ids: Sequence[tuple[str, str]],
    now_ms: int,
) -> TriggerFired:
    """Admit one ``queued`` Run from the template for each planned time (``ids`` holds a run id
    and an attempt id for each), and move the trigger to its following firing."""
    if trigger.status is not TriggerStatus.ACTIVE:
        raise InvalidTransition("trigger", trigger.id, trigger.status.value, "fire")
    if len(ids) != len(plan.fire_at_ms):
        raise InvalidTrigger("one run id and attempt id are needed per firing")
    admissions: list[Change] = []
    firings: list[TriggerFiring] = []
    for scheduled_at, (run_id, attempt_id) in zip(plan.fire_at_ms, ids, strict=True):
        change = admit(
            run_id=run_id,
            attempt_id=attempt_id,
            task=trigger.task,
            input=trigger.input,
            policy=trigger.policy,
            owner=RunOwner.RUNTIME,
            now_ms=now_ms,
        )
        data: dict[str, JsonValue] = {
            **change.event.data,
            "trigger_id": trigger.id,
            "trigger": trigger.name,
            "scheduled_at_ms": scheduled_at,
        }
        admissions.append(evolve(change, event=evolve(change.event, data=data)))
        firings.append(
            TriggerFiring(
                trigger_id=trigger.id,
                scheduled_at_ms=scheduled_at,
                run_id=run_id,
                fired_at_ms=now_ms,
            )
        )
    after = evolve(
        trigger,
        next_fire_at_ms=plan.next_fire_at_ms,
        last_fired_at_ms=plan.fire_at_ms[-1] if plan.fire_at_ms else trigger.last_fired_at_ms,
        version=trigger.version + 1,
        updated_at_ms=now_ms,
    )
    return TriggerFired(trigger=after, admissions=tuple(admissions), firings=tuple(firings))


# --- operator changes ---------------------------------------------------------------------------


def pause_trigger(trigger: Trigger, now_ms: int) -> Trigger:
    """No firing while paused; firings that fall in the pause are never caught up."""
    if trigger.status is not TriggerStatus.ACTIVE:
        raise InvalidTransition("trigger", trigger.name, trigger.status.value, "be paused")
    return evolve(
        trigger, status=TriggerStatus.PAUSED, version=trigger.version + 1, updated_at_ms=now_ms
    )


def resume_trigger(trigger: Trigger, schedule: FireSchedule, now_ms: int) -> Trigger:
    """Active again from the first scheduled time after now."""
    if trigger.status is not TriggerStatus.PAUSED:
        raise InvalidTransition("trigger", trigger.name, trigger.status.value, "be resumed")
    return evolve(
        trigger,
        status=TriggerStatus.ACTIVE,
        next_fire_at_ms=schedule.next_after(now_ms),
        version=trigger.version + 1,
        updated_at_ms=now_ms,
    )


def delete_trigger(trigger: Trigger, now_ms: int) -> Trigger:
    """Deleted triggers never fire again; their firings stay as history and their name is
    free for a new trigger."""
    if trigger.status is TriggerStatus.DELETED:
        raise InvalidTransition("trigger", trigger.name, trigger.status.value, "be deleted")
    return evolve(
        trigger, status=TriggerStatus.DELETED, version=trigger.version + 1, updated_at_ms=now_ms
    )



# --- triggers declared in code ---------------------------------------------------------------

# The names of the triggers an application's code declares (``TaskRegistry.schedule``) start
# with this; an operator's triggers may not, so a start of the runtime knows which are its own.
DECLARED_PREFIX = "code:"


def is_declared(trigger: Trigger) -> bool:
    """A trigger the application's code declared (and a runtime's start keeps up to date)."""
    return trigger.name.startswith(DECLARED_PREFIX)


def redefine_trigger(
    trigger: Trigger,
    *,
    task: str,
    input: JsonValue,
    policy: RetryPolicy | None,
    every_ms: int | None,
    cron: str | None,
    catch_up: CatchUp,
    catch_up_limit: int,
    schedule: FireSchedule,
    now_ms: int,
) -> Trigger | None:
    """A declared trigger made to match its declaration again, active; None when it matches
    already. Its next firing moves only when its schedule changed or it was paused: then it is
    the first scheduled time after now (a paused trigger is not caught up, as on resume)."""
    if trigger.status is TriggerStatus.DELETED:
        raise InvalidTransition("trigger", trigger.name, trigger.status.value, "be redefined")
    template = (task, input, policy, every_ms, cron, catch_up, catch_up_limit)
    current = (
        trigger.task,
        trigger.input,
        trigger.policy,
        trigger.every_ms,
        trigger.cron,
        trigger.catch_up,
        trigger.catch_up_limit,
    )
    if template == current and trigger.status is TriggerStatus.ACTIVE:
        return None
    moved = (every_ms, cron) != (trigger.every_ms, trigger.cron)
    restart = moved or trigger.status is not TriggerStatus.ACTIVE
    return evolve(
        trigger,
        task=task,
        input=input,
        policy=policy,
        every_ms=every_ms,
        cron=cron,
        catch_up=catch_up,
        catch_up_limit=catch_up_limit,
        status=TriggerStatus.ACTIVE,
        next_fire_at_ms=schedule.next_after(now_ms) if restart else trigger.next_fire_at_ms,
        version=trigger.version + 1,
        updated_at_ms=now_ms,
    )
