"""The operator console (ADR 0020): the two indexes its pages read.

- ``ix_runs_status_created``: every Run by ``(status, created_at, id)``. The runs list of one
  status walks it from its keyset cursor, newest or oldest first, and the count of a status
  stops at its cap after that many index entries, however many finished Runs the table holds.
  It is partial on ``created_at IS NOT NULL``, true of every Run, which only the console's
  statements name: no other statement's plan can change for it.
- ``ix_runs_workflows``: the workflow aggregates (``owner = 'workflow'``) by
  ``(created_at, id)``, for the workflows page.

Both are built with ``CREATE INDEX`` inside the migration's transaction, which blocks writes to
the table while it builds; on a large history an operator who cannot afford that builds them
first with ``CREATE INDEX CONCURRENTLY`` under the same names and definitions, and this revision
then leaves them as they are (``IF NOT EXISTS``).

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: r0003_console_indexes
Revises: r0002_retry_on_error_safety
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0003_console_indexes"
down_revision = "r0002_retry_on_error_safety"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        op.f("ix_runs_status_created"),
        "runs",
        ["status", "created_at", "id"],
        # True of every Run: only the console's statements, which name it, use the index.
        postgresql_where=sa.text("created_at IS NOT NULL"),
        if_not_exists=True,
    )
    op.create_index(
        op.f("ix_runs_workflows"),
        "runs",
        ["created_at", "id"],
        postgresql_where=sa.text("owner = 'workflow'"),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_runs_workflows"), table_name="runs")
    op.drop_index(op.f("ix_runs_status_created"), table_name="runs")
