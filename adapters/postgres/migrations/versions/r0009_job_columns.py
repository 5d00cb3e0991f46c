"""Job semantics: the columns and table that retries on error and execution timeouts
(ADR 0013), priorities and per-task limits (ADR 0014) and unique submissions (ADR 0015) keep
their state in.

- ``runs.retry_on_error`` (nullable: NULL, as on every Run admitted before, is false),
  ``runs.timeout_ms``, ``runs.priority`` (``NOT NULL DEFAULT 0``, a constant default: no table
  rewrite), ``runs.unique_key``;
- ``task_limits``: a task's limit on the Attempts running at once, cluster-wide.

Indexes that use these columns come with the revisions that read them.

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: 0009_job_columns
Revises: 0008_run_finished
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009_job_columns"
down_revision = "0008_run_finished"
branch_labels = None
depends_on = None

MIN_PRIORITY = -1_000_000
MAX_PRIORITY = 1_000_000


def upgrade() -> None:
    op.add_column("runs", sa.Column("retry_on_error", sa.Boolean(), nullable=True))
    op.add_column("runs", sa.Column("timeout_ms", sa.BigInteger(), nullable=True))
    op.add_column(
        "runs",
        sa.Column("priority", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column("runs", sa.Column("unique_key", sa.Text(), nullable=True))
    op.create_check_constraint(
        op.f("ck_runs_timeout_ms"), "runs", "timeout_ms IS NULL OR timeout_ms >= 1"
    )
    op.create_check_constraint(
        op.f("ck_runs_priority"), "runs", f"priority BETWEEN {MIN_PRIORITY} AND {MAX_PRIORITY}"
    )
    op.create_table(
        "task_limits",
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("max_running", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("task", name=op.f("pk_task_limits")),
        sa.CheckConstraint("max_running >= 0", name=op.f("ck_task_limits_max_running")),
    )


def downgrade() -> None:
    op.drop_table("task_limits")
    for name in ("priority", "timeout_ms"):
        op.drop_constraint(op.f(f"ck_runs_{name}"), "runs", type_="check")
    for column in (
        "unique_key",
        "priority",
        "timeout_ms",
        "retry_on_error",
    ):
        op.drop_column("runs", column)
