"""The worker SDK: a session with the ingress, N execution slots in child processes, claims
that start work in one call (ADR 0007), background renewals, self-fencing and drain. See
:mod:`.runtime`.

Names are imported lazily: a slot's child process (:mod:`.slot_main`) loads this package and
should not pay for the HTTP client."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "IngressClient": "ql3.adapters.worker.client",
    "IngressRefused": "ql3.adapters.worker.client",
    "IngressUnavailable": "ql3.adapters.worker.client",
    "Worker": "ql3.adapters.worker.runtime",
    "WorkerFailed": "ql3.adapters.worker.settings",
    "WorkerSettings": "ql3.adapters.worker.settings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
