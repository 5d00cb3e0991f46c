"""Unique submissions (ADR 0015): while a Run is unfinished, no other Run holds its unique key.

- ``uq_runs_unique_key``: a partial unique index on ``runs(unique_key)`` over the Runs that
  hold a key and are not finished (the non-terminal statuses of ``ql3.domain.states``, spelled as
  the migration writes them). Admission reads a key through it, and the insert of a second
  replica that admits the same key at the same time waits for the first and is refused by it.

``runs.unique_key`` came with revision 0009 and is NULL on every Run admitted before, so the
index starts empty of conflicts.

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: 0012_unique_submissions
Revises: 0011_claim_priority_limits
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_unique_submissions"
down_revision = "0011_claim_priority_limits"
branch_labels = None
depends_on = None

UNFINISHED_KEYED_RUN = (
    "unique_key IS NOT NULL"
    " AND status IN ('created', 'queued', 'dispatching', 'running', 'lost', 'retry_wait')"
)


def upgrade() -> None:
    op.create_index(
        op.f("uq_runs_unique_key"),
        "runs",
        ["unique_key"],
        unique=True,
        postgresql_where=sa.text(UNFINISHED_KEYED_RUN),
    )


def downgrade() -> None:
    op.drop_index(op.f("uq_runs_unique_key"), table_name="runs")
