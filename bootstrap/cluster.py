"""The Cluster profile: state in PostgreSQL, several scheduler replicas, remote workers.

Runtime recovery and lost retry run in front of the scheduler, in the one cadence driven by
:class:`ClusterSchedulerLifecycle`. This is the only composition root that loads the PostgreSQL
adapter."""

from __future__ import annotations

from typing import Any

from dependency_injector import containers, providers

from ql3.application.lost_retry import LostRetry
from ql3.application.ports import NO_METRICS, Metrics, SchedulerStore
from ql3.application.recovery import RuntimeRecovery
from ql3.application.scheduler import ClusterSchedulerCoordinator, ClusterSchedulerLifecycle
from ql3.application.startup import StartupRecovery
from ql3.bootstrap.core import DEFAULTS, RuntimeCoreContainer
from ql3.bootstrap.producer import open_postgres_store

CLUSTER_DEFAULTS: dict[str, object] = {
    **DEFAULTS,
    "recovery_page_size": 16,
    # Recovery transactions one replica runs at once; each holds one pooled connection. More
    # is not faster: the transactions share one interpreter lock and the database's cores
    # (ADR 0006 has the measurements).
    "recovery_concurrency": 3,
    "lost_retry_page_size": 16,
    "startup_page_size": 64,
    "pool_size": 5,
}


class ClusterContainer(containers.DeclarativeContainer):
    config = providers.Configuration()
    store = providers.Singleton(open_postgres_store, config.database_url, config.pool_size)
    core = providers.Container(RuntimeCoreContainer, config=config, store=store)
    # What the scheduler steps count (ADR 0010); a node exports them.
    metrics: providers.Provider[Metrics] = providers.Object(NO_METRICS)

    runtime_recovery = providers.Singleton(
        RuntimeRecovery,
        uow_factory=store.provided.unit_of_work,
        source=store,
        page_size=config.recovery_page_size,
        concurrency=config.recovery_concurrency,
        metrics=metrics,
        hold=store.provided.holding_connection,
    )
    lost_retry = providers.Singleton(
        LostRetry,
        uow_factory=store.provided.unit_of_work,
        source=store,
        identities=core.identities,
        page_size=config.lost_retry_page_size,
        metrics=metrics,
    )
    startup_recovery = providers.Singleton(
        StartupRecovery,
        uow_factory=store.provided.unit_of_work,
        source=store,
        identities=core.identities,
        page_size=config.startup_page_size,
    )
    coordinator = providers.Singleton(
        ClusterSchedulerCoordinator,
        runtime_recovery=runtime_recovery,
        lost_retry=lost_retry,
        inner=core.scheduler,
        gate=core.dispatch_gate,
        metrics=metrics,
    )
    lifecycle = providers.Singleton(
        ClusterSchedulerLifecycle,
        coordinator=coordinator,
        cadence_s=config.cadence_s,
    )


def build(store: SchedulerStore | None = None, **settings: Any) -> ClusterContainer:
    """A Cluster container. ``database_url`` is required unless a ``store`` is given (tests)."""
    container = ClusterContainer()
    container.config.from_dict({**CLUSTER_DEFAULTS, **settings})
    if store is not None:
        container.store.override(providers.Object(store))
    return container
