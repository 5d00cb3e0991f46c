"""PostgreSQL's spelling of the console's reads (ADR 0020): epoch milliseconds of a
``timestamptz``, JSONB containment (``@>``), and the planner's estimate of a count."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, Connection, Select, cast, func, literal
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ClauseElement, Executable

from ql3.adapters.sql.schema import run_events, runs
from ql3.domain.model import JsonValue


def millis(column: ColumnElement[Any]) -> ColumnElement[int]:
    return cast(func.floor(func.extract("epoch", column) * 1000), BigInteger())


def contains(document: Mapping[str, JsonValue]) -> Sequence[ColumnElement[bool]]:
    """``input @> document``: answered by a GIN index when one exists, else by the rows the
    other predicates leave."""
    return [runs.c.input.op("@>")(cast(literal(json.dumps(dict(document))), JSONB))]


class _Explain(Executable, ClauseElement):
    inherit_cache = False

    def __init__(self, statement: Select) -> None:
        self.statement = statement


@compiles(_Explain, "postgresql")
def _compile_explain(element: _Explain, compiler: Any, **kw: Any) -> str:
    return "EXPLAIN (FORMAT JSON) " + compiler.process(element.statement, **kw)


def estimate(connection: Connection, statement: Select) -> int | None:
    """The planner's row estimate for ``statement`` (nothing is executed)."""
    plan = connection.execute(_Explain(statement)).scalar_one()
    if isinstance(plan, str):
        plan = json.loads(plan)
    try:
        return int(plan[0]["Plan"]["Plan Rows"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def data_is(key: str, value: str) -> ColumnElement[bool]:
    return run_events.c.data.op("->>")(key) == value
