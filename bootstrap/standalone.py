"""The Standalone profile: one process, an embedded SQLite store, in-process execution.

The process (:class:`ql3.adapters.standalone.StandaloneRunner`) takes the database's exclusive lock,
runs startup recovery at boot with its own page budget and then one loop: the in-process pool
claims its work through the worker protocol (ADR 0007), and the cadence runs due retries and the
inner scheduler. It never builds the Cluster's runtime recovery or lost retry steps, nor loads
the PostgreSQL adapter.

``database_path`` None is a private in-memory database (tests and throw-away containers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dependency_injector import containers, providers

from ql3.adapters.sql.sqlite import SqliteStore
from ql3.adapters.sql.sqlite.wake import WakeListener
from ql3.adapters.standalone import (
    DatabaseLock,
    DueRetryStart,
    RunnerSettings,
    StandaloneCoordinator,
    StandaloneRunner,
)
from ql3.application.ports import RuntimeStore
from ql3.application.startup import StartupRecovery
from ql3.bootstrap.core import DEFAULTS, RuntimeCoreContainer

STANDALONE_DEFAULTS: dict[str, object] = {
    **DEFAULTS,
    "database_path": None,
    # One process renews its own leases; a short TTL keeps a restart after a crash quick (the
    # leases the crashed process held expire at most this long after its last renewal).
    "lease_ttl_s": 10.0,
    "startup_page_size": 64,
    "due_retry_page_size": 16,
    # The one executing process of a database, whichever profile runs it: a new process's
    # session replaces the previous one's (evidence that what it started no longer runs).
    "worker_id": "standalone",
    "capacity": 4,
    "resident_cadence_s": 1.0,
    "drain_timeout_s": 30.0,
    "busy_timeout_s": 30.0,
    "synchronous": "FULL",
}


def exclusive_access(database_path: str | None) -> DatabaseLock | None:
    return DatabaseLock(database_path) if database_path else None


def wake_opener(store: SqliteStore) -> Callable[[], WakeListener] | None:
    """How the runner opens the database's wake channel (None without one)."""
    path = store.wake_path
    if path is None:
        return None
    return lambda: WakeListener(path)


class StandaloneContainer(containers.DeclarativeContainer):
    config = providers.Configuration()
    store = providers.Singleton(
        SqliteStore,
        config.database_path,
        busy_timeout_s=config.busy_timeout_s,
        synchronous=config.synchronous,
    )
    core = providers.Container(RuntimeCoreContainer, config=config, store=store)
    startup_recovery = providers.Singleton(
        StartupRecovery,
        uow_factory=store.provided.unit_of_work,
        source=store,
        identities=core.identities,
        page_size=config.startup_page_size,
    )
    due_retries = providers.Singleton(
        DueRetryStart,
        uow_factory=store.provided.unit_of_work,
        source=store,
        identities=core.identities,
        page_size=config.due_retry_page_size,
    )
    coordinator = providers.Singleton(
        StandaloneCoordinator, due_retries=due_retries, inner=core.scheduler
    )
    runner_settings = providers.Singleton(
        RunnerSettings,
        worker_id=config.worker_id,
        capacity=config.capacity,
        resident_cadence_s=config.resident_cadence_s,
        drain_timeout_s=config.drain_timeout_s,
    )
    # Call with ``tasks=`` (the application's task mapping) and optionally ``emit=``.
    runner = providers.Factory(
        StandaloneRunner,
        commands=core.worker_commands,
        coordinator=coordinator,
        startup=startup_recovery,
        due_times=store,
        settings=runner_settings,
        exclusive=providers.Factory(exclusive_access, config.database_path),
        open_wake=providers.Callable(wake_opener, store),
    )


def build(store: RuntimeStore | None = None, **settings: Any) -> StandaloneContainer:
    container = StandaloneContainer()
    container.config.from_dict({**STANDALONE_DEFAULTS, **settings})
    if store is not None:
        container.store.override(providers.Object(store))
    return container
