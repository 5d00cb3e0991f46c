"""The worker SDK: a session with the ingress, N execution slots in child processes, claims
that start work in one call (ADR 0007), background renewals, self-fencing and drain. See
:mod:`.runtime`.

Names are imported lazily: a slot's child process (:mod:`.slot_main`) loads this package and
should not pay for the HTTP client."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "IngressClient": "adapters.worker.client",
    "IngressRefused": "adapters.worker.client",
    "IngressUnavailable": "adapters.worker.client",
    "Worker": "adapters.worker.runtime",
    "WorkerFailed": "adapters.worker.settings",
    "WorkerSettings": "adapters.worker.settings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
