"""What the shared SQL repositories need from a store's unit of work.

Both SQL stores' units of work provide it (one connection in one transaction); repositories
written against it (:mod:`adapters.sql.triggers`, :mod:`adapters.sql.workflows`) run unchanged on
either."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sqlalchemy.sql import Executable

T = TypeVar("T")


class SqlTransaction(Protocol):
    def execute(self, statement: Executable) -> Any:
        """Run a statement and return its result."""

    def write(self, statement: Executable, what: str) -> int:
        """Run a write and return the rows it touched; integrity violations are raised as
        ``ConcurrencyConflict``."""

    def compare_and_set(self, statement: Executable, what: str) -> None:
        """Run a write that must touch exactly one row, else ``ConcurrencyConflict``."""

    def atomically(self, body: Callable[[], T]) -> T:
        """Run ``body`` under a savepoint: all of it or none of it, the transaction usable."""
