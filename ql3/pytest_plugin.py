"""pytest fixtures for an application's tests on the in-memory runtime.

Not registered globally: enable it in the application's ``conftest.py`` with
``pytest_plugins = ["ql3.pytest_plugin"]`` and define a ``ql3_tasks`` fixture that returns the
application's :class:`~ql3.TaskRegistry`. Then a test asks for ``ql3_runtime`` (a fresh
:class:`~ql3.testing.InMemoryRuntime` per test, closed after it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ql3.application.tasks import TaskRegistry
from ql3.testing import InMemoryRuntime, in_memory


@pytest.fixture
def ql3_tasks() -> TaskRegistry:
    """The application's task registry; override this fixture in your conftest."""
    raise pytest.UsageError(
        "define a `ql3_tasks` fixture returning your TaskRegistry to use `ql3_runtime`"
    )


@pytest.fixture
def ql3_lease_ttl_s() -> float:
    """The lease TTL of the in-memory runtime (seconds); override to change it."""
    return 30.0


@pytest.fixture
def ql3_runtime(ql3_tasks: TaskRegistry, ql3_lease_ttl_s: float) -> Iterator[InMemoryRuntime]:
    """A fresh in-memory runtime on the application's tasks, with its own fake clock."""
    runtime = in_memory(ql3_tasks, lease_ttl_s=ql3_lease_ttl_s)
    try:
        yield runtime
    finally:
        runtime.close()
