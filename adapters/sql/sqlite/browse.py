"""SQLite's spelling of the console's reads (ADR 0020): times are already integer epoch
milliseconds, and an input filter compares the input's top-level keys for equality (SQLite
has no JSON containment)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, func, type_coerce

from ql3.adapters.sql.schema import run_events, runs
from ql3.domain.model import JsonValue


def millis(column: ColumnElement[Any]) -> ColumnElement[int]:
    return type_coerce(column, BigInteger())


def _path(key: str) -> str:
    return "$." + json.dumps(key)


def contains(document: Mapping[str, JsonValue]) -> Sequence[ColumnElement[bool]]:
    clauses: list[ColumnElement[bool]] = []
    for key, value in document.items():
        found = func.json_extract(runs.c.input, _path(key))
        if value is None:
            clauses.append(func.json_type(runs.c.input, _path(key)) == "null")
        elif isinstance(value, bool):
            clauses.append(
                func.json_type(runs.c.input, _path(key)) == ("true" if value else "false")
            )
        elif isinstance(value, (int, float, str)):
            clauses.append(found == value)
        else:
            clauses.append(func.json(found) == func.json(json.dumps(value)))
    return clauses


def data_is(key: str, value: str) -> ColumnElement[bool]:
    return func.json_extract(run_events.c.data, _path(key)) == value
