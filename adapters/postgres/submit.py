"""The submit-only Cluster store of ``ql3 submit``: admission on the psycopg driver alone.

A submit from the command line imports, connects, admits and exits; SQLAlchemy's import alone
takes half of what the whole may take (ADR 0009). This store offers what admission needs of a
unit of work and nothing else (:class:`ql3.application.ports.AdmissionUnitOfWork`): the store's
clock, the unfinished Runs holding unique keys, and the batch insert of admitted Runs. It runs
the statements :class:`ql3.adapters.postgres.store.PostgresStore` runs, as generated text
(:mod:`ql3.adapters.sql.submit_sql`), with the same rows
(:mod:`ql3.adapters.postgres.admission_batch`), under a savepoint, and the admission is
:func:`ql3.application.admission.admit_requests`, as everywhere. The dispatch wake-up is the
statement's ``NOTIFY``, delivered when the transaction commits.

A unique, check or foreign-key violation is a :class:`~ql3.domain.errors.ConcurrencyConflict`; any
other driver error is raised as the driver's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ql3.adapters.postgres.admission_batch import add_many_statement
from ql3.adapters.postgres.results import fetched_rows
from ql3.adapters.sql import submit_sql
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.transitions import Change

_SAVEPOINT = "ql3_admission"


def libpq_url(url: str) -> str:
    """A ``postgresql+psycopg://`` URL as libpq reads it (``postgresql://``; its query
    parameters are libpq's connection parameters, as the SQLAlchemy dialect passes them)."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url[len(prefix) :]
    raise ValueError("the database URL must start with postgresql+psycopg:// or postgresql://")


class PostgresSubmitUnitOfWork:
    """One connection in one READ COMMITTED transaction; rolled back unless committed."""

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._connection: psycopg.Connection[dict[str, Any]] | None = None
        self._broken: str | None = None
        self.runs = PostgresSubmitRuns(self)

    def __enter__(self) -> PostgresSubmitUnitOfWork:
        if self._connection is not None:
            raise RuntimeError("this unit of work is already in use")
        self._connection = psycopg.connect(self._conninfo, row_factory=dict_row)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                connection.rollback()
            finally:
                connection.close()

    @property
    def connection(self) -> psycopg.Connection[dict[str, Any]]:
        if self._connection is None:
            raise RuntimeError("use the unit of work inside its `with` block")
        return self._connection

    def rows(self, sql: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Plain SQL in this transaction (the driver begins it with the first statement)."""
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            return fetched_rows(cursor)

    def now_ms(self) -> int:
        (row,) = self.rows(submit_sql.POSTGRES_NOW, {"clock_offset_ms": 0})
        return int(row["now_ms"])

    def under_savepoint(self, sql: str, params: Mapping[str, Any], what: str) -> dict[str, Any]:
        """One statement under a savepoint: a refused one leaves nothing of itself behind and
        the transaction usable."""
        self.rows(f"SAVEPOINT {_SAVEPOINT}", {})
        try:
            (result,) = self.rows(sql, params)
        except psycopg.errors.IntegrityError as error:
            self.rows(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}", {})
            raise ConcurrencyConflict(f"{what}: {error}") from error
        self.rows(f"RELEASE SAVEPOINT {_SAVEPOINT}", {})
        return result

    def break_transaction(self, reason: str) -> None:
        self._broken = reason

    def commit(self) -> None:
        if self._broken is not None:
            raise ConcurrencyConflict(f"not committed: {self._broken}")
        self.connection.commit()


class PostgresSubmitRuns:
    """The Runs of admission: :class:`ql3.application.ports.AdmissionRuns`."""

    def __init__(self, uow: PostgresSubmitUnitOfWork) -> None:
        self._uow = uow

    def unfinished_with_keys(self, keys: Sequence[str]) -> Mapping[str, str]:
        if not keys:
            return {}
        names = [f"key_{index}" for index in range(len(keys))]
        sql = submit_sql.POSTGRES_UNFINISHED_WITH_KEYS.format(
            keys=", ".join(f"%({name})s" for name in names)
        )
        found = self._uow.rows(sql, dict(zip(names, keys, strict=True)))
        return {str(row["unique_key"]): str(row["id"]) for row in found}

    def add_many(self, changes: Sequence[Change]) -> None:
        """As :meth:`ql3.adapters.postgres.store.PostgresRunRepository.add_many`: one statement
        under a savepoint, all or none; it notifies the dispatch channel when a Run is queued."""
        if not changes:
            return
        batch = add_many_statement(changes)
        what = f"{len(changes)} admitted runs"
        result = self._uow.under_savepoint(submit_sql.POSTGRES_ADD_MANY, batch.params, what)
        if not batch.all_written(result):
            self._uow.break_transaction(f"{what} were not all written")
            raise ConcurrencyConflict(f"{what} were not all written")


class PostgresSubmitStore:
    """Units of work for admission on the database of ``url``, one connection each."""

    def __init__(self, url: str) -> None:
        self._conninfo = libpq_url(url)

    def unit_of_work(self) -> PostgresSubmitUnitOfWork:
        return PostgresSubmitUnitOfWork(self._conninfo)

    def close(self) -> None:
        """Nothing stays open between units of work."""
