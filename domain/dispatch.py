"""Which claimable Attempts a claim takes: fair across tasks (ADR 0003, ADR 0007)."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def _tie_break(observed_at_ms: int, task: str) -> bytes:
    """A hash that changes with the store's clock, so no task name is always served last."""
    return hashlib.sha256(f"{observed_at_ms}:{task}".encode()).digest()[:8]


def fair_pick(
    candidates: Sequence[T],
    *,
    task_of: Callable[[T], str],
    queued_at_of: Callable[[T], int],
    in_flight: Mapping[str, int],
    count: int,
    observed_at_ms: int,
) -> list[T]:
    """Up to ``count`` candidates, one at a time, each from the task with the fewest Attempts in
    flight (those already in flight plus those picked so far), the oldest queued head breaking
    ties, then :func:`_tie_break`. ``candidates`` are oldest first within each task. A flood of
    one task never starves another, however many tasks there are."""
    by_task: dict[str, deque[T]] = {}
    for candidate in candidates:
        by_task.setdefault(task_of(candidate), deque()).append(candidate)
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
                queued_at_of(by_task[t][0]),
                _tie_break(observed_at_ms, t),
            ),
        )
        picked.append(by_task[task].popleft())
        load[task] = load.get(task, 0) + 1
    return picked
