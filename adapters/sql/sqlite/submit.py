"""The submit-only Standalone/Edge store of ``ql3 submit``: admission on the ``sqlite3`` driver
alone, into an existing database of this schema version (ADR 0009).

It offers what admission needs of a unit of work and nothing else
(:class:`ql3.application.ports.AdmissionUnitOfWork`): one connection set up as the store sets up
its own (:func:`ql3.adapters.sql.sqlite.connection.connection_pragmas`), one ``BEGIN IMMEDIATE``
transaction, the host clock, the unfinished Runs holding unique keys, and the INSERTs of the
store (:mod:`ql3.adapters.sql.submit_sql`, generated from its statements) under a savepoint, with
the row values of :mod:`ql3.adapters.sql.rows`. Its commit pokes the database's wake channel, as the
store's does after an admission. A database that is missing or has another schema version is
left to :class:`ql3.adapters.sql.sqlite.store.SqliteStore`, which creates, upgrades or refuses
it."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from ql3.adapters.sql import rows, submit_sql
from ql3.adapters.sql.sqlite.connection import SCHEMA_VERSION, connection_pragmas, host_now_ms
from ql3.adapters.sql.sqlite.wake import poke, wake_path_for
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.transitions import Change

_SAVEPOINT = "ql3_admission"


def _bound(table: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """A row's values as the store binds them: JSON columns as JSON text, SQL NULL for None."""
    bound = dict(values)
    for column in submit_sql.SQLITE_JSON_COLUMNS[table]:
        if bound[column] is not None:
            bound[column] = json.dumps(bound[column])
    return bound


class SqliteSubmitUnitOfWork:
    """One ``BEGIN IMMEDIATE`` transaction on the store's connection; rolled back unless
    committed."""

    def __init__(self, store: SqliteSubmitStore) -> None:
        self._store = store
        self._open = False
        self._admitted = False
        self.runs = SqliteSubmitRuns(self)

    def __enter__(self) -> SqliteSubmitUnitOfWork:
        if self._open:
            raise RuntimeError("this unit of work is already in use")
        self._store.connection.execute("BEGIN IMMEDIATE")
        self._open, self._admitted = True, False
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._open:
            self._open = False
            self._store.connection.execute("ROLLBACK")

    def execute(self, sql: str, params: Mapping[str, Any] | Sequence[Any] = ()) -> sqlite3.Cursor:
        if not self._open:
            raise RuntimeError("use the unit of work inside its `with` block")
        return self._store.connection.execute(sql, params)

    def now_ms(self) -> int:
        if not self._open:
            raise RuntimeError("use the unit of work inside its `with` block")
        return host_now_ms()

    def insert_all(self, inserts: Sequence[tuple[str, Mapping[str, Any]]], what: str) -> None:
        """The INSERTs under a savepoint: all of them or none, the transaction usable."""
        self.execute(f"SAVEPOINT {_SAVEPOINT}")
        try:
            for table, values in inserts:
                self.execute(submit_sql.SQLITE_INSERTS[table], _bound(table, values))
        except sqlite3.IntegrityError as error:
            self.execute(f"ROLLBACK TO {_SAVEPOINT}")
            self.execute(f"RELEASE {_SAVEPOINT}")
            raise ConcurrencyConflict(f"{what}: {error}") from error
        self.execute(f"RELEASE {_SAVEPOINT}")
        self._admitted = True

    def commit(self) -> None:
        self.execute("COMMIT")
        self._open = False
        if self._admitted:
            self._admitted = False
            self._store.announce_work()


class SqliteSubmitRuns:
    """The Runs of admission: :class:`ql3.application.ports.AdmissionRuns`."""

    def __init__(self, uow: SqliteSubmitUnitOfWork) -> None:
        self._uow = uow

    def unfinished_with_keys(self, keys: Sequence[str]) -> Mapping[str, str]:
        if not keys:
            return {}
        sql = submit_sql.SQLITE_UNFINISHED_WITH_KEYS.format(keys=", ".join("?" for _ in keys))
        return {str(key): str(run_id) for key, run_id in self._uow.execute(sql, list(keys))}

    def add_many(self, changes: Sequence[Change]) -> None:
        """As the store's ``add_many``: each Run, its Attempts, its lease and its event, in
        order, under one savepoint."""
        if not changes:
            return
        inserts = [row for change in changes for row in rows.admitted_rows(change)]
        self._uow.insert_all(inserts, f"{len(changes)} admitted runs")


class SqliteSubmitStore:
    """Units of work for admission on one connection to the database file at ``path``."""

    def __init__(self, connection: sqlite3.Connection, path: str) -> None:
        self.connection = connection
        self.path = path

    @classmethod
    def open(
        cls, path: str, *, busy_timeout_s: float = 30.0, synchronous: str = "FULL"
    ) -> SqliteSubmitStore | None:
        """The store on an existing database of :data:`SCHEMA_VERSION`, else None (nothing
        is created or changed)."""
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"unknown synchronous mode {synchronous!r}")
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            return None
        # A file removed meanwhile is made again, empty: version 0, left to the store.
        connection = sqlite3.connect(
            path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            (version,) = connection.execute("PRAGMA user_version").fetchone()
            if version != SCHEMA_VERSION:
                connection.close()
                return None
            pragmas = connection_pragmas(
                busy_timeout_ms=max(0, round(busy_timeout_s * 1000)),
                synchronous=synchronous.upper(),
                wal=True,
            )
            for pragma in pragmas:
                connection.execute(pragma)
        except BaseException:
            connection.close()
            raise
        return cls(connection, path)

    def unit_of_work(self) -> SqliteSubmitUnitOfWork:
        return SqliteSubmitUnitOfWork(self)

    def announce_work(self) -> None:
        """Wake the process that executes work on this database, if one listens."""
        poke(wake_path_for(self.path))

    def close(self) -> None:
        self.connection.close()
