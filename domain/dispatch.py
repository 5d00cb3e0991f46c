"""Which claimable Attempts a claim takes: fair across tasks, highest priority first within a
task, never past a task's limit (ADR 0003, ADR 0007, ADR 0014)."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ql3.domain.errors import DomainError

T = TypeVar("T")

# The most Attempts a limit lets run at once; a bigger number is a typo, not a limit.
MAX_TASK_LIMIT = 1_000_000


class InvalidTaskLimit(DomainError):
    """A task limit is not acceptable (empty task name, a count out of bounds)."""


@dataclass(frozen=True, slots=True)
class TaskLimit:
    """At most ``max_running`` Attempts of ``task`` hold a ``leased`` lease at once, across
    the cluster; 0 stops the task's claims. ``updated_at_ms``: when it was last set, by the
    store's clock."""

    task: str
    max_running: int
    updated_at_ms: int


def task_limit(task: str, max_running: int, *, now_ms: int) -> TaskLimit:
    """A limit to record, or :class:`InvalidTaskLimit`."""
    if not isinstance(task, str) or not task or task.strip() != task:
        raise InvalidTaskLimit(f"a task limit needs a task name without padding, got {task!r}")
    if (
        isinstance(max_running, bool)
        or not isinstance(max_running, int)
        or not 0 <= max_running <= MAX_TASK_LIMIT
    ):
        raise InvalidTaskLimit(f"a task limit must be an integer within 0..{MAX_TASK_LIMIT}")
    return TaskLimit(task=task, max_running=max_running, updated_at_ms=now_ms)


def _tie_break(observed_at_ms: int, task: str) -> bytes:
    """A hash that changes with the store's clock, so no task name is always served last."""
    return hashlib.sha256(f"{observed_at_ms}:{task}".encode()).digest()[:8]


def free_slots(limits: Mapping[str, int], in_flight: Mapping[str, int]) -> dict[str, int]:
    """How many more Attempts of each limited task may be granted: its limit less those in
    flight, never below 0. A task without a limit is not named."""
    return {task: max(0, limit - in_flight.get(task, 0)) for task, limit in limits.items()}


def fair_pick(
    candidates: Sequence[T],
    *,
    task_of: Callable[[T], str],
    queued_at_of: Callable[[T], int],
    priority_of: Callable[[T], int],
    in_flight: Mapping[str, int],
    count: int,
    observed_at_ms: int,
    limits: Mapping[str, int] | None = None,
) -> list[T]:
    """Up to ``count`` candidates, one at a time.

    Within a task, the highest priority first, then the oldest queued (``candidates`` keep
    their order among equals). Across tasks, each pick goes to the task with the fewest
    Attempts in flight (those already in flight plus those picked so far); among those, to the
    task whose next candidate has the highest priority, then the oldest, then
    :func:`_tie_break`. A flood of one task never starves another, however many tasks there are
    and whatever their priorities. A task named in ``limits`` gets no more than its limit less
    its Attempts in flight (:func:`free_slots`)."""
    by_task: dict[str, deque[T]] = {}
    for candidate in sorted(candidates, key=lambda c: (-priority_of(c), queued_at_of(c))):
        by_task.setdefault(task_of(candidate), deque()).append(candidate)
    free = free_slots(limits or {}, in_flight)
    for task, room in free.items():
        queue = by_task.get(task)
        while queue and len(queue) > room:
            queue.pop()
    load = dict(in_flight)
    picked: list[T] = []
    while len(picked) < count:
        ready = [task for task, queue in by_task.items() if queue]
        if not ready:
            break
        task = min(
            ready,
            key=lambda t: (
                load.get(t, 0),
                -priority_of(by_task[t][0]),
                queued_at_of(by_task[t][0]),
                _tie_break(observed_at_ms, t),
            ),
        )
        picked.append(by_task[task].popleft())
        load[task] = load.get(task, 0) + 1
    return picked
