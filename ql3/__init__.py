"""QL3 runtime's Python API: declare tasks with their policy, build a profile's runtime from
settings, submit (in the application's own transaction too), read, wait for and cancel runs,
prune finished ones.

Everything an application needs is importable from here; nothing is built at import time, and
importing this package loads no web framework (ADR 0009). See ``docs/api.md``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ql3 import testing
    from ql3.adapters.console.auth import ConsoleOperator, ConsoleRole, console_users
    from ql3.adapters.execution import TaskContext
    from ql3.application.admission import UnknownRun
    from ql3.application.history import InvalidBatchSize, InvalidDuration, PruneReport
    from ql3.application.tasks import (
        InvalidInput,
        Schedule,
        TaskDefinition,
        TaskRegistry,
        UnknownTask,
    )
    from ql3.application.workflows import UnknownWorkflow
    from ql3.domain.dispatch import InvalidTaskLimit, TaskLimit
    from ql3.domain.errors import (
        DomainError,
        Error,
        InvalidAdmission,
        InvalidRetryPolicy,
        InvalidTransition,
        InvalidWorkflow,
    )
    from ql3.domain.model import MAX_PRIORITY, MIN_PRIORITY, RunStatus
    from ql3.domain.policy import Backoff, RetryPolicy, Safety
    from ql3.domain.step_input import MAX_PARENT_OUTPUTS_BYTES
    from ql3.domain.workflows import StepInputTooLarge, StepStatus
    from ql3.profiles import ClusterRuntime, StandaloneRuntime
    from ql3.runtime import (
        RunInfo,
        Runtime,
        Submission,
        Submitted,
        UnsupportedTransaction,
        WaitTimeout,
    )
    from ql3.workflows import StepInfo, Workflow, WorkflowInfo

    __version__: str

# Each public name and the module that defines it. Nothing is imported until a name is first
# asked for: every module of the runtime lives below this package, and the command line, a
# worker's task slot or ``ql3 submit`` must not pay for the whole API when it imports one of them.
_EXPORTS: dict[str, str] = {
    "ConsoleOperator": "ql3.adapters.console.auth",
    "ConsoleRole": "ql3.adapters.console.auth",
    "console_users": "ql3.adapters.console.auth",
    "TaskContext": "ql3.adapters.execution",
    "UnknownRun": "ql3.application.admission",
    "InvalidBatchSize": "ql3.application.history",
    "InvalidDuration": "ql3.application.history",
    "PruneReport": "ql3.application.history",
    "InvalidInput": "ql3.application.tasks",
    "Schedule": "ql3.application.tasks",
    "TaskDefinition": "ql3.application.tasks",
    "TaskRegistry": "ql3.application.tasks",
    "UnknownTask": "ql3.application.tasks",
    "UnknownWorkflow": "ql3.application.workflows",
    "InvalidTaskLimit": "ql3.domain.dispatch",
    "TaskLimit": "ql3.domain.dispatch",
    "DomainError": "ql3.domain.errors",
    "Error": "ql3.domain.errors",
    "InvalidAdmission": "ql3.domain.errors",
    "InvalidRetryPolicy": "ql3.domain.errors",
    "InvalidTransition": "ql3.domain.errors",
    "InvalidWorkflow": "ql3.domain.errors",
    "MAX_PARENT_OUTPUTS_BYTES": "ql3.domain.step_input",
    "StepInputTooLarge": "ql3.domain.workflows",
    "StepStatus": "ql3.domain.workflows",
    "MAX_PRIORITY": "ql3.domain.model",
    "MIN_PRIORITY": "ql3.domain.model",
    "RunStatus": "ql3.domain.model",
    "Backoff": "ql3.domain.policy",
    "RetryPolicy": "ql3.domain.policy",
    "Safety": "ql3.domain.policy",
    "ClusterRuntime": "ql3.profiles",
    "StandaloneRuntime": "ql3.profiles",
    "RunInfo": "ql3.runtime",
    "Runtime": "ql3.runtime",
    "Submission": "ql3.runtime",
    "Submitted": "ql3.runtime",
    "UnsupportedTransaction": "ql3.runtime",
    "WaitTimeout": "ql3.runtime",
    "StepInfo": "ql3.workflows",
    "Workflow": "ql3.workflows",
    "WorkflowInfo": "ql3.workflows",
}

__all__ = [
    "MAX_PARENT_OUTPUTS_BYTES",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "Backoff",
    "ClusterRuntime",
    "ConsoleOperator",
    "ConsoleRole",
    "DomainError",
    "Error",
    "InvalidAdmission",
    "InvalidBatchSize",
    "InvalidDuration",
    "InvalidInput",
    "InvalidRetryPolicy",
    "InvalidTaskLimit",
    "InvalidTransition",
    "InvalidWorkflow",
    "PruneReport",
    "RetryPolicy",
    "RunInfo",
    "RunStatus",
    "Runtime",
    "Safety",
    "Schedule",
    "StandaloneRuntime",
    "StepInfo",
    "StepInputTooLarge",
    "StepStatus",
    "Submission",
    "Submitted",
    "TaskContext",
    "TaskDefinition",
    "TaskLimit",
    "TaskRegistry",
    "UnknownRun",
    "UnknownTask",
    "UnknownWorkflow",
    "UnsupportedTransaction",
    "WaitTimeout",
    "Workflow",
    "WorkflowInfo",
    "__version__",
    "cluster",
    "console_users",
    "edge",
    "standalone",
    "testing",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name == "testing":
        import importlib

        return importlib.import_module("ql3.testing")
    if name == "__version__":
        from importlib.metadata import version

        globals()["__version__"] = found = version("ql3-runtime")
        return found
    raise AttributeError(f"module 'ql3' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def cluster(
    database_url: str, *, tasks: TaskRegistry | None = None, **settings: Any
) -> ClusterRuntime:
    """The Cluster runtime on PostgreSQL (``postgresql+psycopg://...``). ``settings`` are those
    of ``ql3.bootstrap.node`` (``cadence_s``, ``lease_ttl_s``, ``pool_size``,
    ``ingress_database_url``, ...). The store is opened now; nothing runs until ``start()``."""
    from ql3.profiles import ClusterRuntime

    return ClusterRuntime(database_url, tasks, settings)


def standalone(
    database_path: str, *, tasks: TaskRegistry | None = None, **settings: Any
) -> StandaloneRuntime:
    """The Standalone runtime on a SQLite file (created when missing). ``settings`` are those
    of ``ql3.bootstrap.standalone`` (``capacity``, ``lease_ttl_s``, ...)."""
    from ql3.profiles import StandaloneRuntime

    return StandaloneRuntime(database_path, tasks, settings)


def edge(
    database_path: str, *, tasks: TaskRegistry | None = None, **settings: Any
) -> StandaloneRuntime:
    """The Edge runtime: Standalone with smaller budgets and no resident wake-ups."""
    from ql3.profiles import StandaloneRuntime

    return StandaloneRuntime(database_path, tasks, settings, edge=True)
