"""Per-task limits on the Attempts running at once, cluster-wide (ADR 0014): set by an operator
(``ql3 tasks limit``) or declared with the task and recorded when the runtime starts. Claims
read them under lock; nothing else does (the scheduler's cadence never reads them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ql3.application.ports import UnitOfWorkFactory
from ql3.domain.dispatch import TaskLimit, task_limit


class TaskLimits:
    def __init__(self, uow_factory: UnitOfWorkFactory) -> None:
        self._uow_factory = uow_factory

    def set(self, task: str, max_running: int) -> TaskLimit:
        """Record the task's limit (replacing the one it has), at the store's clock."""
        with self._uow_factory() as uow:
            limit = task_limit(task, max_running, now_ms=uow.now_ms())
            uow.runs.set_task_limit(limit)
            uow.commit()
        return limit

    def clear(self, task: str) -> bool:
        """Remove the task's limit; whether it had one."""
        with self._uow_factory() as uow:
            cleared = uow.runs.clear_task_limit(task)
            uow.commit()
        return cleared

    def all(self) -> Sequence[TaskLimit]:
        with self._uow_factory() as uow:
            return uow.runs.task_limits()

    def declare(self, declared: Mapping[str, int]) -> Sequence[TaskLimit]:
        """Record the limits declared with the tasks, in one transaction: each task's limit
        becomes its declared one (a task declared without a limit keeps what an operator set).
        Returns the limits it changed; a limit already as declared is not written again."""
        if not declared:
            return []
        with self._uow_factory() as uow:
            now_ms = uow.now_ms()
            wanted = [task_limit(task, declared[task], now_ms=now_ms) for task in sorted(declared)]
            recorded = {limit.task: limit.max_running for limit in uow.runs.task_limits()}
            changed = [limit for limit in wanted if recorded.get(limit.task) != limit.max_running]
            for limit in changed:
                uow.runs.set_task_limit(limit)
            uow.commit()
        return changed
