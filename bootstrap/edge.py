"""The Edge profile: the Standalone shape with smaller page budgets, for small devices.

Like Standalone it never builds the Cluster's runtime recovery or lost retry steps and never
loads the PostgreSQL adapter."""

from __future__ import annotations

from typing import Any

from dependency_injector import containers, providers

from adapters.memory import MemoryStore
from application.ports import RuntimeStore
from application.startup import StartupRecovery
from bootstrap.core import DEFAULTS, RuntimeCoreContainer

EDGE_DEFAULTS: dict[str, object] = {
    **DEFAULTS,
    "startup_page_size": 8,
    "dispatch_page_size": 4,
}


class EdgeContainer(containers.DeclarativeContainer):
    config = providers.Configuration()
    store = providers.Singleton(MemoryStore)
    core = providers.Container(RuntimeCoreContainer, config=config, store=store)
    startup_recovery = providers.Singleton(
        StartupRecovery,
        uow_factory=store.provided.unit_of_work,
        source=store,
        identities=core.identities,
        page_size=config.startup_page_size,
    )


def build(store: RuntimeStore | None = None, **settings: Any) -> EdgeContainer:
    container = EdgeContainer()
    container.config.from_dict({**EDGE_DEFAULTS, **settings})
    if store is not None:
        container.store.override(providers.Object(store))
    return container
