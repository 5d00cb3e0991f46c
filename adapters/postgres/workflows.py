"""Workflows on PostgreSQL: the shared SQL repository (:mod:`ql3.adapters.sql.workflows`) and the
frontier's candidate page, read in one statement on the database's clock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import Select

from ql3.adapters.postgres.queries import store_now
from ql3.adapters.sql.workflows import SqlWorkflowRepository, workflow_candidates_query
from ql3.application.ports import HARD_PAGE_CAP, Page, RunCandidate

if TYPE_CHECKING:
    from ql3.adapters.postgres.store import PostgresStore

__all__ = ["SqlWorkflowRepository", "workflow_candidates", "workflow_candidates_statement"]


def workflow_candidates_statement(limit: int, clock_offset_ms: int = 0) -> Select:
    return workflow_candidates_query(limit, store_now(clock_offset_ms))


def workflow_candidates(store: PostgresStore, limit: int) -> Page[RunCandidate]:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= HARD_PAGE_CAP:
        raise ValueError(f"limit must be an integer within 1..{HARD_PAGE_CAP}, got {limit!r}")
    statement = workflow_candidates_statement(limit, store.clock_offset_ms)
    with store.engine.connect() as connection:
        result = connection.execute(statement).mappings().all()
        connection.rollback()
    observed_at = int(result[0]["observed_at"])
    items = tuple(
        RunCandidate(run_id=row["run_id"], attempt_id=None, since_ms=int(row["since"]))
        for row in result
        if row["run_id"] is not None
    )
    return Page(items=items[:limit], has_more=len(items) > limit, observed_at_ms=observed_at)
