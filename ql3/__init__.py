"""QL3 runtime's Python API: declare tasks with their policy, build a profile's runtime from
settings, submit (in the application's own transaction too), read, wait for and cancel runs,
prune finished ones.

Everything an application needs is importable from here; nothing is built at import time, and
importing this package loads no web framework (ADR 0009). See ``docs/api.md``."""

from __future__ import annotations

from typing import Any

from adapters.execution import TaskContext
from application.admission import UnknownRun
from application.history import InvalidBatchSize, InvalidDuration, PruneReport
from application.tasks import InvalidInput, TaskDefinition, TaskRegistry, UnknownTask
from domain.dispatch import InvalidTaskLimit, TaskLimit
from domain.errors import DomainError, InvalidAdmission, InvalidRetryPolicy, InvalidTransition
from domain.model import MAX_PRIORITY, MIN_PRIORITY, RunStatus
from domain.policy import Backoff, RetryPolicy, Safety
from ql3.profiles import ClusterRuntime, StandaloneRuntime
from ql3.runtime import (
    RunInfo,
    Runtime,
    Submission,
    Submitted,
    UnsupportedTransaction,
    WaitTimeout,
)

__all__ = [
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "Backoff",
    "ClusterRuntime",
    "DomainError",
    "InvalidAdmission",
    "InvalidBatchSize",
    "InvalidDuration",
    "InvalidInput",
    "InvalidRetryPolicy",
    "InvalidTaskLimit",
    "InvalidTransition",
    "PruneReport",
    "RetryPolicy",
    "RunInfo",
    "RunStatus",
    "Runtime",
    "Safety",
    "StandaloneRuntime",
    "Submission",
    "Submitted",
    "TaskContext",
    "TaskDefinition",
    "TaskLimit",
    "TaskRegistry",
    "UnknownRun",
    "UnknownTask",
    "UnsupportedTransaction",
    "WaitTimeout",
    "cluster",
    "edge",
    "standalone",
]


def cluster(
    database_url: str, *, tasks: TaskRegistry | None = None, **settings: Any
) -> ClusterRuntime:
    """The Cluster runtime on PostgreSQL (``postgresql+psycopg://...``). ``settings`` are those
    of ``bootstrap.node`` (``cadence_s``, ``lease_ttl_s``, ``pool_size``,
    ``ingress_database_url``, ...). The store is opened now; nothing runs until ``start()``."""
    return ClusterRuntime(database_url, tasks, settings)


def standalone(
    database_path: str, *, tasks: TaskRegistry | None = None, **settings: Any
) -> StandaloneRuntime:
    """The Standalone runtime on a SQLite file (created when missing). ``settings`` are those
    of ``bootstrap.standalone`` (``capacity``, ``lease_ttl_s``, ...)."""
    return StandaloneRuntime(database_path, tasks, settings)


def edge(
    database_path: str, *, tasks: TaskRegistry | None = None, **settings: Any
) -> StandaloneRuntime:
    """The Edge runtime: Standalone with smaller budgets and no resident wake-ups."""
    return StandaloneRuntime(database_path, tasks, settings, edge=True)
