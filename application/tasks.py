"""Tasks declared with their retry policy: a registry an application builds at import time.

A :class:`TaskRegistry` is a mapping of task names to callables, so every executor that takes
today's ``MODULE:ATTR`` mapping takes a registry too. Each task may carry a policy template
(safety, retry on lost, retry on error, maximum attempts, backoff) and an execution timeout;
:meth:`TaskRegistry.request` snapshots them into the admission request, and a submit may give a
policy or a timeout of its own instead. What is admitted is the snapshot, as for any Run
(ADRs 0009 and 0013)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ql3.application.admission import AdmissionRequest
from ql3.domain.dispatch import task_limit
from ql3.domain.errors import InvalidAdmission
from ql3.domain.model import MAX_TIMEOUT_MS, JsonValue
from ql3.domain.policy import Backoff, RetryPolicy, Safety

if TYPE_CHECKING:
    # Loaded when a schedule is declared: a submit imports no trigger (ADR 0009).
    from ql3.domain.triggers import CatchUp

F = TypeVar("F", bound=Callable[..., Any])
# As ql3.domain.triggers.DEFAULT_CATCH_UP_LIMIT (checked there when a schedule is declared).
DEFAULT_CATCH_UP_LIMIT = 10


class UnknownTask(InvalidAdmission):
    """The registry declares no task of that name (or that function)."""


class InvalidInput(InvalidAdmission):
    """A run's input is not a JSON value."""


@dataclass(frozen=True, slots=True)
class TaskDefinition:
    """A declared task: its name, its code, and the policy and timeout each admission
    snapshots."""

    name: str
    fn: Callable[..., Any]
    policy: RetryPolicy | None
    timeout_ms: int | None = None
    # The most Attempts of the task running at once, cluster-wide (ADR 0014); None: no limit
    # declared.
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class Schedule:
    """When a task runs by itself: ``cron`` (five fields, UTC) or ``every`` (seconds or a
    ``timedelta``, at least 1 s), not both; each firing admits a run with ``input``.
    ``catch_up`` (``"skip"``, ``"one"``, ``"all"``) says what a firing missed while no
    scheduler ran does (ADR 0003). ``name`` defaults to the task's name."""

    cron: str | None = None
    every: float | dt.timedelta | None = None
    input: object = None
    catch_up: str = "skip"
    catch_up_limit: int = DEFAULT_CATCH_UP_LIMIT
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ScheduleDefinition:
    """A schedule declared in code, as the runtime records it: the trigger ``code:NAME``."""

    name: str
    task: str
    input: JsonValue
    policy: RetryPolicy | None
    every_ms: int | None
    cron: str | None
    catch_up: CatchUp
    catch_up_limit: int


def json_input(value: object) -> JsonValue:
    """``value`` when it is a JSON value (what a JSON round trip keeps unchanged in meaning),
    else :class:`InvalidInput`. NaN and infinities are refused: JSON has none."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise InvalidInput(f"the input is not JSON: {error}") from None
    return value  # type: ignore[return-value]  # checked just above


def timeout_millis(timeout: float | None) -> int | None:
    """An execution timeout given in seconds, as the Run stores it (milliseconds); None: no
    timeout."""
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= MAX_TIMEOUT_MS / 1000
    ):
        raise InvalidAdmission(
            f"a timeout is a number of seconds within 0.001..{MAX_TIMEOUT_MS // 1000}"
        )
    return max(1, round(timeout * 1000))


def policy_template(
    *,
    safety: Safety | str | None = None,
    retry_on_lost: bool = False,
    retry_on_error: bool = False,
    max_attempts: int = 1,
    backoff: Backoff | None = None,
) -> RetryPolicy | None:
    """The policy of a task declaration; None (no policy: never retried) when nothing is
    declared."""
    declared = (
        safety is not None
        or retry_on_lost
        or retry_on_error
        or max_attempts != 1
        or backoff is not None
    )
    if not declared:
        return None
    try:
        chosen = Safety(safety) if safety is not None else None
    except ValueError:
        choices = ", ".join(s.value for s in Safety)
        raise InvalidAdmission(f"safety must be one of {choices}") from None
    return RetryPolicy(
        retry_on_lost=retry_on_lost,
        retry_on_error=retry_on_error,
        max_attempts=max_attempts,
        safety=chosen,
        backoff=backoff if backoff is not None else Backoff(),
    )


class TaskRegistry(Mapping[str, Callable[..., Any]]):
    """Task names mapped to their code, each with its policy template.

    Declare with the decorator::

        tasks = TaskRegistry()

        @tasks.task(safety="idempotent", retry_on_error=True, max_attempts=3, timeout=30)
        def resize(payload): ...

    The decorated function is returned unchanged."""

    def __init__(self) -> None:
        self._definitions: dict[str, TaskDefinition] = {}
        self._names: dict[int, str] = {}
        self._schedules: dict[str, ScheduleDefinition] = {}

    # --- declaring ------------------------------------------------------------------------------

    def task(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        safety: Safety | str | None = None,
        retry_on_lost: bool = False,
        retry_on_error: bool = False,
        max_attempts: int = 1,
        backoff: Backoff | None = None,
        policy: RetryPolicy | None = None,
        timeout: float | None = None,
        limit: int | None = None,
        schedule: Schedule | str | None = None,
    ) -> Any:
        """Declare a task (its name defaults to the function's). Give the template either as
        ``policy=`` or as its parts; a task declared with neither is admitted without a policy.
        ``retry_on_error`` retries an attempt whose task raised or timed out (only for
        ``idempotent`` or ``deduplicated`` tasks); ``timeout`` is the seconds an attempt may
        run before its worker stops it as a failure. ``limit``: the most Attempts of the task
        running at once across the cluster, recorded when the runtime starts (ADR 0014).
        ``schedule``: a :class:`Schedule` (or a cron expression) on which the task runs by
        itself, recorded as a trigger when the runtime starts (ADR 0021)."""
        if schedule is not None and not isinstance(schedule, Schedule | str):
            raise InvalidAdmission("schedule= is a ql3.Schedule or a cron expression")
        if policy is not None and (
            safety is not None
            or retry_on_lost
            or retry_on_error
            or max_attempts != 1
            or backoff is not None
        ):
            raise InvalidAdmission("give a task's policy either as policy= or as its parts")
        template = policy or policy_template(
            safety=safety,
            retry_on_lost=retry_on_lost,
            retry_on_error=retry_on_error,
            max_attempts=max_attempts,
            backoff=backoff,
        )
        timeout_ms = timeout_millis(timeout)

        def declare(function: F) -> F:
            definition = self.add(
                function, name=name, policy=template, timeout_ms=timeout_ms, limit=limit
            )
            if schedule is not None:
                chosen = Schedule(cron=schedule) if isinstance(schedule, str) else schedule
                self.schedule(
                    chosen.name or definition.name,
                    definition.name,
                    cron=chosen.cron,
                    every=chosen.every,
                    input=chosen.input,
                    catch_up=chosen.catch_up,
                    catch_up_limit=chosen.catch_up_limit,
                )
            return function

        return declare(fn) if fn is not None else declare

    def add(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        policy: RetryPolicy | None = None,
        timeout_ms: int | None = None,
        limit: int | None = None,
    ) -> TaskDefinition:
        """Declare ``fn`` without the decorator."""
        if not callable(fn):
            raise InvalidAdmission("a task must be callable")
        task_name = name if name is not None else getattr(fn, "__name__", "")
        if not task_name or task_name.strip() != task_name:
            raise InvalidAdmission(f"a task needs a name without padding, got {task_name!r}")
        if task_name in self._definitions:
            raise InvalidAdmission(f"task {task_name!r} is declared twice")
        if limit is not None:
            task_limit(task_name, limit, now_ms=0)  # refused here, at import, when out of bounds
        definition = TaskDefinition(
            name=task_name, fn=fn, policy=policy, timeout_ms=timeout_ms, limit=limit
        )
        self._definitions[task_name] = definition
        self._names.setdefault(id(fn), task_name)
        return definition

    def schedule(
        self,
        name: str,
        task: str | Callable[..., Any],
        *,
        cron: str | None = None,
        every: float | dt.timedelta | None = None,
        input: object = None,
        catch_up: str = "skip",
        catch_up_limit: int = DEFAULT_CATCH_UP_LIMIT,
        policy: RetryPolicy | None = None,
    ) -> ScheduleDefinition:
        """Declare that ``task`` (declared here) runs by itself on ``cron`` (five fields, UTC)
        or ``every`` (seconds or a ``timedelta``), not both. ``runtime.start()`` records it as
        the trigger ``code:NAME`` (created, or updated to match), fired once per scheduled
        time across all replicas; a ``code:`` trigger no longer declared is paused. ``policy``
        defaults to the task's template (ADR 0021)."""
        from ql3.domain.triggers import (
            MAX_CATCH_UP_LIMIT,
            MAX_INTERVAL_MS,
            MIN_INTERVAL_MS,
            CatchUp,
        )

        if not isinstance(name, str) or not name or name.strip() != name:
            raise InvalidAdmission(f"a schedule needs a name without padding, got {name!r}")
        if name in self._schedules:
            raise InvalidAdmission(f"schedule {name!r} is declared twice")
        definition = self.definition(task)
        if (cron is None) == (every is None):
            raise InvalidAdmission(f"schedule {name!r}: give exactly one of cron= and every=")
        every_ms: int | None = None
        if every is not None:
            seconds = (
                every.total_seconds()
                if isinstance(every, dt.timedelta)
                else every
                if isinstance(every, int | float) and not isinstance(every, bool)
                else None
            )
            if seconds is None or not MIN_INTERVAL_MS <= seconds * 1000 <= MAX_INTERVAL_MS:
                raise InvalidAdmission(
                    f"schedule {name!r}: every= is a number of seconds within "
                    f"{MIN_INTERVAL_MS // 1000}..{MAX_INTERVAL_MS // 1000}, or a timedelta"
                )
            every_ms = round(seconds * 1000)
        if cron is not None and (not isinstance(cron, str) or not cron.strip()):
            raise InvalidAdmission(f"schedule {name!r}: cron= is a cron expression")
        try:
            chosen = CatchUp(catch_up)
        except ValueError:
            choices = ", ".join(c.value for c in CatchUp)
            raise InvalidAdmission(f"schedule {name!r}: catch_up is one of {choices}") from None
        if isinstance(catch_up_limit, bool) or not 1 <= catch_up_limit <= MAX_CATCH_UP_LIMIT:
            raise InvalidAdmission(
                f"schedule {name!r}: catch_up_limit is within 1..{MAX_CATCH_UP_LIMIT}"
            )
        declared = ScheduleDefinition(
            name=name,
            task=definition.name,
            input=json_input(input),
            policy=policy if policy is not None else definition.policy,
            every_ms=every_ms,
            cron=cron,
            catch_up=chosen,
            catch_up_limit=catch_up_limit,
        )
        self._schedules[name] = declared
        return declared

    # --- reading --------------------------------------------------------------------------------

    def schedules(self) -> tuple[ScheduleDefinition, ...]:
        """The schedules declared, by name."""
        return tuple(self._schedules[name] for name in sorted(self._schedules))

    def definition(self, task: str | Callable[..., Any]) -> TaskDefinition:
        """The declaration of a task given by name or by its function."""
        if isinstance(task, str):
            found = self._definitions.get(task)
            if found is None:
                raise UnknownTask(f"no task {task!r} is declared (known: {self._known()})")
            return found
        name = self._names.get(id(task))
        if name is None or self._definitions[name].fn is not task:
            label = getattr(task, "__qualname__", repr(task))
            raise UnknownTask(f"{label} is not a declared task (known: {self._known()})")
        return self._definitions[name]

    def request(
        self,
        task: str | Callable[..., Any],
        input: object = None,
        *,
        policy: RetryPolicy | None = None,
        timeout_ms: int | None = None,
    ) -> AdmissionRequest:
        """What to admit: the task's name, its input checked as JSON, and the given policy and
        timeout or else the task's (the snapshot that counts)."""
        definition = self.definition(task)
        return AdmissionRequest(
            task=definition.name,
            input=json_input(input),
            policy=policy if policy is not None else definition.policy,
            timeout_ms=timeout_ms if timeout_ms is not None else definition.timeout_ms,
        )

    def limits(self) -> dict[str, int]:
        """The limits declared with the tasks, by task name."""
        return {
            name: definition.limit
            for name, definition in self._definitions.items()
            if definition.limit is not None
        }

    def _known(self) -> str:
        return ", ".join(sorted(self._definitions)) or "none"

    # --- the mapping every executor takes -----------------------------------------------------

    def __getitem__(self, name: str) -> Callable[..., Any]:
        return self._definitions[name].fn

    def __iter__(self) -> Iterator[str]:
        return iter(self._definitions)

    def __len__(self) -> int:
        return len(self._definitions)
