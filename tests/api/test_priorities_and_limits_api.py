"""``priority=`` at submit and the task limits of the Python API (ADR 0014), on the in-memory
runtime: declared limits are recorded when the runtime starts, and set, listed and cleared."""

from __future__ import annotations

import pytest

from ql3 import MAX_PRIORITY, InvalidAdmission, InvalidTaskLimit, Submission, TaskRegistry
from ql3.testing import in_memory


def test_runs_execute_highest_priority_first() -> None:
    tasks = TaskRegistry()
    seen: list[str] = []

    @tasks.task
    def note(payload: str) -> None:
        seen.append(payload)

    rt = in_memory(tasks)
    try:
        rt.submit(note, "plain")
        rt.submit(note, "urgent", priority=MAX_PRIORITY)
        rt.submit_many([Submission(note, "soon", priority=5), (note, "also plain")])
        rt.run_due()
        assert seen[:2] == ["urgent", "soon"]
        assert sorted(seen[2:]) == ["also plain", "plain"]  # same priority, same clock
        with pytest.raises(InvalidAdmission):
            rt.submit(note, "x", priority=MAX_PRIORITY + 1)
    finally:
        rt.close()


def test_declared_limits_are_recorded_at_start_and_kept_by_operators() -> None:
    tasks = TaskRegistry()

    @tasks.task(limit=2)
    def resize() -> None: ...

    rt = in_memory(tasks)
    try:
        rt.start()
        assert [(x.task, x.max_running) for x in rt.task_limits()] == [("resize", 2)]
        rt.set_task_limit("mail", 0)
        assert [(x.task, x.max_running) for x in rt.task_limits()] == [
            ("mail", 0),
            ("resize", 2),
        ]
        assert rt.clear_task_limit("mail") is True
        assert rt.clear_task_limit("mail") is False
        with pytest.raises(InvalidTaskLimit):
            rt.set_task_limit("mail", -1)
    finally:
        rt.close()
