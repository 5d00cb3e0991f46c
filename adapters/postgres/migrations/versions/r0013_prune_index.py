"""Pruning finished history (ADR 0016): the two indexes a prune reads.

- ``ix_runs_finished``: the finished top-level Runs (``succeeded``, ``failed``, ``cancelled``; no
  workflow step's) by ``(updated_at, id)``. A prune's pick reads its page of the history from it
  under ``FOR UPDATE SKIP LOCKED``, instead of reading ``runs``.
- ``ix_run_dispatch_leases_attempt_id``: the foreign key of ``run_dispatch_leases.attempt_id``.
  Deleting an Attempt makes PostgreSQL look for leases that still reference it; without this
  index every deleted Attempt would read the whole lease table. Renewals change only
  ``expires_at``, which stays out of every index, so they remain HOT updates.

Both are built with ``CREATE INDEX`` inside the migration's transaction, which blocks writes to
the table while it builds; on a large history an operator who cannot afford that builds them
first with ``CREATE INDEX CONCURRENTLY`` under the same names and definitions, and this revision
then leaves them as they are (``IF NOT EXISTS``).

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: 0013_prune_index
Revises: 0012_unique_submissions
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013_prune_index"
down_revision = "0012_unique_submissions"
branch_labels = None
depends_on = None

# The terminal Run statuses of domain/model.py, as this revision wrote them.
_PRUNABLE_RUN = "status IN ('succeeded', 'failed', 'cancelled') AND parent_run_id IS NULL"


def upgrade() -> None:
    op.create_index(
        op.f("ix_runs_finished"),
        "runs",
        ["updated_at", "id"],
        postgresql_where=sa.text(_PRUNABLE_RUN),
        if_not_exists=True,
    )
    op.create_index(
        op.f("ix_run_dispatch_leases_attempt_id"),
        "run_dispatch_leases",
        ["attempt_id"],
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_run_dispatch_leases_attempt_id"), table_name="run_dispatch_leases")
    op.drop_index(op.f("ix_runs_finished"), table_name="runs")
