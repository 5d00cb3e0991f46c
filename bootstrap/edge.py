"""The Edge profile: the Standalone shape with smaller page budgets, for small devices.

Like Standalone it never builds the Cluster's runtime recovery or lost retry steps and never
loads the PostgreSQL adapter."""

from __future__ import annotations

from typing import Any

from dependency_injector import providers

from application.ports import RuntimeStore
from bootstrap.core import DEFAULTS
from bootstrap.standalone import StandaloneContainer

EDGE_DEFAULTS: dict[str, object] = {
    **DEFAULTS,
    "startup_page_size": 8,
    "dispatch_page_size": 4,
}


class EdgeContainer(StandaloneContainer):
    """Standalone's providers; only the page budgets differ (see ``EDGE_DEFAULTS``)."""


def build(store: RuntimeStore | None = None, **settings: Any) -> EdgeContainer:
    container = EdgeContainer()
    container.config.from_dict({**EDGE_DEFAULTS, **settings})
    if store is not None:
        container.store.override(providers.Object(store))
    return container
