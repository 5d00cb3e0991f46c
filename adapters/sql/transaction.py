"""What the shared SQL repositories need from a store's unit of work.

Both SQL stores' units of work provide it (one connection in one transaction); repositories
written against it (:mod:`ql3.adapters.sql.triggers`, :mod:`ql3.adapters.sql.workflows`,
:mod:`ql3.adapters.sql.repositories`) run unchanged on either. A unit of work that only reads (the
worker ingress's) is a :class:`SqlReader`. :class:`ConnectionTransaction` is how both stores
provide it on their one connection."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql import Executable

from ql3.domain.errors import ConcurrencyConflict

T = TypeVar("T")


class SqlReader(Protocol):
    def execute(self, statement: Executable) -> Any:
        """Run a statement and return its result."""


class SqlTransaction(SqlReader, Protocol):
    def write(self, statement: Executable, what: str) -> int:
        """Run a write and return the rows it touched; integrity violations are raised as
        ``ConcurrencyConflict``."""

    def compare_and_set(self, statement: Executable, what: str) -> None:
        """Run a write that must touch exactly one row, else ``ConcurrencyConflict``."""

    def atomically(self, body: Callable[[], T]) -> T:
        """Run ``body`` under a savepoint: all of it or none of it, the transaction usable."""


@contextmanager
def conflicts_translated(what: str) -> Iterator[None]:
    """Unique, exclusion, check, not-null and foreign-key violations are concurrency conflicts."""
    try:
        yield
    except IntegrityError as error:
        raise ConcurrencyConflict(f"{what}: {error.orig}") from error


class ConnectionTransaction:
    """:class:`SqlTransaction` on one SQLAlchemy connection in one transaction, which the unit of
    work deriving from this opens as ``_connection`` (None outside its ``with`` block)."""

    _connection: Connection | None

    @property
    def connection(self) -> Connection:
        if self._connection is None:
            raise RuntimeError("use the unit of work inside its `with` block")
        return self._connection

    def execute(self, statement: Executable) -> Any:
        return self.connection.execute(statement)

    def write(self, statement: Executable, what: str) -> int:
        """Execute a write and return how many rows it touched; violations are conflicts."""
        with conflicts_translated(what):
            result = self.connection.execute(statement)
        return int(getattr(result, "rowcount", 0))

    def compare_and_set(self, statement: Executable, what: str) -> None:
        if self.write(statement, what) != 1:
            raise ConcurrencyConflict(f"{what} changed since it was read")

    def atomically(self, body: Callable[[], T]) -> T:
        """Run a multi-statement write under a savepoint: all of it or none of it."""
        savepoint = self.connection.begin_nested()
        try:
            result = body()
        except BaseException:
            if savepoint.is_active:
                savepoint.rollback()
            raise
        savepoint.commit()
        return result
