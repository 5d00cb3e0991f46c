"""Running task code: the task mapping an application exposes, and how a task is called.

Shared by every executor (the remote worker and the Standalone/Edge in-process pool), so a
task behaves the same wherever it runs."""

from ql3.adapters.execution.app import (
    AppLoadError,
    TaskContext,
    TaskMapping,
    describe_failure,
    invoke_task,
    is_async_task,
    load_app,
    run_awaitable,
)

__all__ = [
    "AppLoadError",
    "TaskContext",
    "TaskMapping",
    "describe_failure",
    "invoke_task",
    "is_async_task",
    "load_app",
    "run_awaitable",
]
