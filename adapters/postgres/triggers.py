"""Triggers on PostgreSQL: the shared SQL repository (:mod:`ql3.adapters.sql.triggers`) and the
due-trigger page, read in one statement on the database's clock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import Select

from ql3.adapters.postgres.queries import store_now
from ql3.adapters.sql.triggers import SqlTriggerRepository, due_triggers_query
from ql3.application.ports import HARD_PAGE_CAP, DueTrigger, Page

if TYPE_CHECKING:
    from ql3.adapters.postgres.store import PostgresStore

__all__ = ["SqlTriggerRepository", "due_triggers", "due_triggers_statement"]


def due_triggers_statement(limit: int, clock_offset_ms: int = 0) -> Select:
    """Active triggers whose next firing the database clock reached (``ix_triggers_due``)."""
    return due_triggers_query(limit, store_now(clock_offset_ms))


def due_triggers(store: PostgresStore, limit: int) -> Page[DueTrigger]:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= HARD_PAGE_CAP:
        raise ValueError(f"limit must be an integer within 1..{HARD_PAGE_CAP}, got {limit!r}")
    statement = due_triggers_statement(limit, store.clock_offset_ms)
    with store.engine.connect() as connection:
        result = connection.execute(statement).mappings().all()
        connection.rollback()
    observed_at = int(result[0]["observed_at"])
    items = tuple(
        DueTrigger(trigger_id=row["trigger_id"], next_fire_at_ms=int(row["next_fire_at"]))
        for row in result
        if row["trigger_id"] is not None
    )
    return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=observed_at)
