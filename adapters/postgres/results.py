"""The rows of a statement run on a psycopg cursor, read without SQLAlchemy.

Nothing here needs SQLAlchemy: ``ql3 submit`` (:mod:`ql3.adapters.postgres.submit`) reads its rows
the same way as the store's hot paths (:mod:`ql3.adapters.postgres.store`)."""

from __future__ import annotations

from typing import Any

from psycopg import Cursor
from psycopg.pq import ExecStatus

_RETURNS_ROWS = (ExecStatus.TUPLES_OK, ExecStatus.SINGLE_TUPLE)


def fetched_rows(cursor: Cursor[Any]) -> list[Any]:
    """The rows of the cursor's last statement; none for a command that returns none.

    Asked of the result's status rather than of ``cursor.description``, which builds a column
    object per column of the result for the asking, dozens per row of the store's lock
    statements."""
    result = cursor.pgresult
    if result is None or (result.status not in _RETURNS_ROWS and not result.nfields):
        return []
    return cursor.fetchall()
