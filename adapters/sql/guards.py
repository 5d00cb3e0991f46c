"""The domain's guards (:mod:`ql3.domain.guards`) rendered as SQL: the one place a guard becomes
a predicate, for every SQL store (ADR 0025).

- :func:`text` renders a guard as SQL text, for the hand-built statements of both stores and the
  PostgreSQL functions: ``aliases`` names the table alias of each entity (a policy's fields are
  columns of the Run's row), ``now`` the SQL of the store's clock; status sets are spelled
  ``IN (...)`` in their enum's declared order.
- :func:`core` renders it as a SQLAlchemy Core expression over the shared tables, for the Core
  statements both stores share, with a :class:`~ql3.adapters.sql.statements.Spelling`.
- :func:`fence_columns` is the compare-and-set of each table, from the domain's fence table.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, and_, false, or_, true

from ql3.domain.guards import (
    FENCES,
    All,
    Either,
    Field,
    Guard,
    Is,
    IsNull,
    Later,
    Now,
    OneOf,
)

E = TypeVar("E", bound=enum.Enum)


def in_declared_order(statuses: Iterable[E]) -> list[E]:
    """The members of a status set of :mod:`ql3.domain.states` in the order their enum declares
    them: one SQL spelling of a set, whatever order it iterates in (the order the migrations
    spell them in)."""
    members = list(statuses)
    if not members:
        return []
    declared = list(type(members[0]).__members__.values())
    return sorted(members, key=declared.index)


def literal(value: object) -> str:
    """A constant of a guard as SQL: a status by its stored name, a flag, a number."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, int):
        return str(value)
    text_value = str(value)
    if "'" in text_value:
        raise ValueError(f"not a plain constant: {text_value!r}")
    return f"'{text_value}'"


def one_of(column: str, values: frozenset[enum.Enum]) -> str:
    """``column IN (...)``, the members in their enum's declared order."""
    return f"{column} IN ({', '.join(literal(v) for v in in_declared_order(values))})"


def text(
    guard: Guard, aliases: Mapping[str, str | None], *, now: str | None = None
) -> str:
    """``guard`` as SQL text over the aliases of its entities (``None``: the bare column names,
    as in an index's predicate); ``now``: the store's clock."""

    def column(field: Field) -> str:
        alias = aliases[field.entity]
        return field.column if alias is None else f"{alias}.{field.column}"

    def operand(value: Field | Now) -> str:
        if isinstance(value, Now):
            if now is None:
                raise ValueError("this guard reads the store's clock: give now")
            return now
        return column(value)

    def render(part: Guard, nested: bool) -> str:
        if isinstance(part, All | Either):
            joiner = " AND " if isinstance(part, All) else " OR "
            inner = joiner.join(render(p, True) for p in part.parts)
            return f"({inner})" if nested and len(part.parts) > 1 else inner
        if isinstance(part, IsNull):
            return f"{column(part.field)} IS NULL"
        if isinstance(part, Is):
            if part.value is False:  # an unset flag is not set: NULL is false here
                return f"{column(part.field)} IS NOT TRUE"
            if part.value is True:
                return f"{column(part.field)} IS TRUE"
            return f"{column(part.field)} = {literal(part.value)}"
        if isinstance(part, OneOf):
            return one_of(column(part.field), part.values)
        sign = ">" if isinstance(part, Later) else "<="
        return f"{column(part.left)} {sign} {operand(part.right)}"

    return render(guard, False)


def core(
    guard: Guard,
    columns: Mapping[str, Any],
    *,
    now: ColumnElement[int] | int | None = None,
    spelling: Any,
) -> ColumnElement[bool]:
    """``guard`` as a Core expression: ``columns`` maps each entity to its table's (or alias's)
    column collection; ``spelling`` (:class:`~ql3.adapters.sql.statements.Spelling`) spells the
    status constants as each dialect's statements do."""

    def column(field: Field) -> Any:
        return columns[field.entity][field.column]

    def operand(value: Field | Now) -> Any:
        if isinstance(value, Now):
            if now is None:
                raise ValueError("this guard reads the store's clock: give now")
            return now
        return column(value)

    def render(part: Guard) -> ColumnElement[bool]:
        if isinstance(part, All):
            return and_(true(), *(render(p) for p in part.parts))
        if isinstance(part, Either):
            return or_(false(), *(render(p) for p in part.parts))
        if isinstance(part, IsNull):
            return column(part.field).is_(None)
        if isinstance(part, Is):
            if isinstance(part.value, bool):
                return column(part.field).is_not(not part.value)
            if isinstance(part.value, enum.Enum):
                return spelling.is_(column(part.field), part.value)
            return column(part.field) == part.value
        if isinstance(part, OneOf):
            return spelling.one_of(column(part.field), part.values)
        if isinstance(part, Later):
            return column(part.left) > operand(part.right)
        return column(part.left) <= operand(part.right)

    return render(guard)


ENTITIES = {"runs": "run", "run_attempts": "attempt", "run_dispatch_leases": "lease"}
"""The entity each table holds."""


def fence_columns(table: str) -> tuple[str, ...]:
    """The columns an update of ``table`` compares with what the transaction read
    (:data:`ql3.domain.guards.FENCES`)."""
    return FENCES[ENTITIES[table]]


def fence_values(table: str, read: Mapping[str, object]) -> dict[str, object]:
    """The fence of an update of ``table``: those columns' values in the row as read."""
    return {column: read[column] for column in fence_columns(table)}
