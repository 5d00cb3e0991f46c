"""The Edge profile: the Standalone shape for small devices, with smaller page budgets and no
resident wake-ups.

An idle Edge process makes no cycles at all: it sleeps until a submit pokes the database's wake
channel, a task it runs finishes or needs its lease renewed, or the next due time (a retry's
``next_attempt_at_ms``, a trigger's next firing, the boot's second recovery pass) arrives. Like
Standalone it never builds the Cluster's runtime recovery or lost retry steps and never loads
the PostgreSQL adapter."""

from __future__ import annotations

from typing import Any

from dependency_injector import providers

from ql3.application.ports import RuntimeStore
from ql3.bootstrap.standalone import STANDALONE_DEFAULTS, StandaloneContainer

EDGE_DEFAULTS: dict[str, object] = {
    **STANDALONE_DEFAULTS,
    "capacity": 2,
    "resident_cadence_s": None,
    "startup_page_size": 8,
    "due_retry_page_size": 4,
    "trigger_page_size": 4,
    "workflow_page_size": 4,
}


class EdgeContainer(StandaloneContainer):
    """Standalone's providers; only the settings differ (see ``EDGE_DEFAULTS``)."""


def build(store: RuntimeStore | None = None, **settings: Any) -> EdgeContainer:
    container = EdgeContainer()
    container.config.from_dict({**EDGE_DEFAULTS, **settings})
    if store is not None:
        container.store.override(providers.Object(store))
    return container
