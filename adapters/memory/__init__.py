"""The in-memory store: every port of :mod:`ql3.application.ports` on plain dicts of frozen domain
values, with a fake clock standing in for the database clock. Used by tests and as the reference
the other stores are compared with."""

from ql3.adapters.memory.clock import FakeClock
from ql3.adapters.memory.store import MemoryStore, MemoryUnitOfWork

__all__ = ["FakeClock", "MemoryStore", "MemoryUnitOfWork"]
