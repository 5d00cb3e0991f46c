"""``fair_pick`` (ADR 0007, ADR 0014): the fewest in flight first across tasks, the highest
priority then the oldest within a task and between equally loaded tasks, never past a limit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ql3.application.tasks import TaskRegistry
from ql3.domain.dispatch import MAX_TASK_LIMIT, InvalidTaskLimit, fair_pick, free_slots, task_limit
from ql3.domain.errors import DomainError


@dataclass(frozen=True)
class C:
    name: str
    task: str
    at: int
    priority: int = 0


def pick(candidates: list[C], count: int, **kwargs: object) -> list[str]:
    chosen = fair_pick(
        candidates,
        task_of=lambda c: c.task,
        queued_at_of=lambda c: c.at,
        priority_of=lambda c: c.priority,
        in_flight=kwargs.pop("in_flight", {}),  # type: ignore[arg-type]
        count=count,
        observed_at_ms=0,
        limits=kwargs.pop("limits", None),  # type: ignore[arg-type]
    )
    return [c.name for c in chosen]


def test_within_a_task_the_highest_priority_first_then_the_oldest() -> None:
    queue = [C("old", "t", 1), C("urgent", "t", 5, 3), C("young", "t", 9), C("later", "t", 7, 3)]
    assert pick(queue, 4) == ["urgent", "later", "old", "young"]


def test_the_fewest_in_flight_first_whatever_the_priorities() -> None:
    queue = [C("a1", "a", 1, 9), C("a2", "a", 2, 9), C("b1", "b", 3, 0)]
    assert pick(queue, 2) == ["a1", "b1"]
    assert pick(queue, 1, in_flight={"a": 1}) == ["b1"]


def test_between_equally_loaded_tasks_the_higher_priority_head_then_the_older() -> None:
    assert pick([C("a1", "a", 1, 0), C("b1", "b", 5, 2)], 1) == ["b1"]
    assert pick([C("a1", "a", 1, 0), C("b1", "b", 5, 0)], 1) == ["a1"]


def test_a_limit_caps_a_task_and_leaves_the_others() -> None:
    queue = [C(f"a{i}", "a", i) for i in range(5)] + [C("b1", "b", 9)]
    assert pick(queue, 6, limits={"a": 3}, in_flight={"a": 1}) == ["b1", "a0", "a1"]
    assert pick(queue, 6, limits={"a": 0}) == ["b1"]
    assert pick(queue, 6, limits={"a": 2}, in_flight={"a": 5}) == ["b1"]
    assert free_slots({"a": 2, "b": 4}, {"a": 5, "b": 1}) == {"a": 0, "b": 3}


@pytest.mark.parametrize("bad", [-1, MAX_TASK_LIMIT + 1, True, 1.5, "3"])
def test_a_limit_out_of_bounds_is_refused(bad: object) -> None:
    with pytest.raises(InvalidTaskLimit):
        task_limit("t", bad, now_ms=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", " t", "t "])
def test_a_limit_needs_a_task_name(name: str) -> None:
    with pytest.raises(InvalidTaskLimit):
        task_limit(name, 1, now_ms=0)


def test_a_task_declares_its_limit() -> None:
    tasks = TaskRegistry()

    @tasks.task(limit=2)
    def resize() -> None: ...

    @tasks.task
    def mail() -> None: ...

    assert tasks.limits() == {"resize": 2}
    assert tasks.definition("resize").limit == 2
    with pytest.raises(DomainError):
        tasks.task(name="bad", limit=-1)(lambda: None)
