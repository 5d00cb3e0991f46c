"""Units of work inside a transaction the caller owns: admission in the application's own
transaction (ADR 0009).

The caller passes a SQLAlchemy ``Connection`` or ``Session``, or a psycopg connection, in an
open (or about to open) transaction on the runtime's database. The Runs and their events are
written in that transaction and the unit of work neither commits nor rolls back: they commit or
roll back with the caller's own writes. The dispatch wake-up is the ``NOTIFY`` of the admission
statement, which PostgreSQL delivers only when that transaction commits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Connection

from ql3.adapters.postgres import queries
from ql3.adapters.postgres.results import fetched_rows
from ql3.adapters.postgres.store import PostgresStore, PostgresUnitOfWork
from ql3.adapters.sql.schema import EpochMillis
from ql3.domain.errors import ConcurrencyConflict, Error

T = TypeVar("T")


class UnsupportedTransaction(Error, TypeError):
    """What the caller passed is not a transaction this store can write in."""


def _is_session(value: object) -> bool:
    return type(value).__module__.startswith("sqlalchemy.orm") and callable(
        getattr(value, "connection", None)
    )


def caller_unit_of_work(store: PostgresStore, transaction: object) -> PostgresUnitOfWork:
    """A unit of work writing in ``transaction`` (a SQLAlchemy ``Connection`` or ``Session``,
    or a psycopg connection); commit and rollback stay the caller's."""
    if _is_session(transaction):
        transaction = transaction.connection()  # type: ignore[attr-defined]
    if isinstance(transaction, Connection):
        if transaction.dialect.name != "postgresql" or transaction.dialect.driver != "psycopg":
            raise UnsupportedTransaction(
                "the caller's connection must be a postgresql+psycopg connection, "
                f"not {transaction.dialect.name}+{transaction.dialect.driver}"
            )
        if transaction.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
            raise UnsupportedTransaction("the caller's connection is in autocommit mode")
        return CallerConnectionUnitOfWork(store, transaction)
    if isinstance(transaction, psycopg.Connection):
        if transaction.autocommit:
            raise UnsupportedTransaction("the caller's psycopg connection is in autocommit mode")
        if transaction.info.transaction_status is psycopg.pq.TransactionStatus.INERROR:
            raise UnsupportedTransaction("the caller's transaction has failed; roll it back")
        return CallerPsycopgUnitOfWork(store, transaction)
    raise UnsupportedTransaction(
        "a caller's transaction is a SQLAlchemy Connection or Session or a psycopg connection, "
        f"not {type(transaction).__name__}"
    )


class CallerConnectionUnitOfWork(PostgresUnitOfWork):
    """The store's unit of work on the caller's SQLAlchemy connection, in its transaction."""

    def __init__(self, store: PostgresStore, connection: Connection) -> None:
        super().__init__(store)
        self._given = connection

    def __enter__(self) -> CallerConnectionUnitOfWork:
        if self._connection is not None:
            raise RuntimeError("this unit of work is already in use")
        self._connection = self._given
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Neither rollback nor close: the transaction and the connection are the caller's. A
        # refused write left nothing behind (it ran under a savepoint).
        self._connection = None

    def commit(self) -> None:
        """Nothing to do here: the caller's commit is the one that counts."""
        if self._broken is not None:
            raise ConcurrencyConflict(f"not written: {self._broken}")


class CallerPsycopgUnitOfWork(CallerConnectionUnitOfWork):
    """The same on a bare psycopg connection: the admission statements are plain SQL on the
    driver, so no SQLAlchemy connection is wrapped around the caller's (SQLAlchemy would roll
    back a connection it did not open when it lets go of it)."""

    def __init__(self, store: PostgresStore, connection: psycopg.Connection[Any]) -> None:
        PostgresUnitOfWork.__init__(self, store)
        self._driver = connection
        self._entered = False

    def __enter__(self) -> CallerPsycopgUnitOfWork:
        if self._entered:
            raise RuntimeError("this unit of work is already in use")
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered = False

    def now_ms(self) -> int:
        dialect = self._store.engine.dialect
        compiled = queries.now_statement(self.clock_offset_ms).compile(dialect=dialect)
        with self._driver.cursor() as cursor:
            cursor.execute(str(compiled), compiled.params)
            row = cursor.fetchone()
        value = EpochMillis().process_result_value(row[0] if row else None, dialect)
        if value is None:
            raise RuntimeError("the database did not tell its time")
        return value

    def atomically(self, body: Callable[[], T]) -> T:
        # Inside the caller's transaction (now_ms opened it if it was idle) this is a savepoint.
        with self._driver.transaction():
            return body()

    def execute_pipelined(
        self, statements: Sequence[tuple[str, dict[str, Any]]], label: str
    ) -> list[list[dict[str, Any]]]:
        answers: list[list[dict[str, Any]]] = []
        for sql, params in statements:
            with self._driver.cursor(row_factory=dict_row) as cursor:
                try:
                    cursor.execute(sql, params)
                except psycopg.errors.IntegrityError as error:
                    raise ConcurrencyConflict(f"{label}: {error}") from error
                answers.append(fetched_rows(cursor))
        return answers

    def execute_savepointed(
        self, sql: str, params: dict[str, Any], label: str
    ) -> list[dict[str, Any]]:
        return self.atomically(lambda: self.execute_pipelined([(sql, params)], label)[0])
