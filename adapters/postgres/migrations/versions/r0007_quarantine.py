"""Operability (ADR 0010): an operator's quarantine of a Run, and the candidate a failing
runtime recovery or lost-retry step is stuck on.

- ``runs.quarantined_at`` and ``runs.quarantine_reason`` (nullable): recovery and lost retry
  pass over a quarantined Run; ``ix_runs_quarantined`` lists the few there are.
- ``dispatch_gate.failed_*`` (nullable): the step, Run, Attempt, error, first failure and number
  of failed cycles in a row of the candidate the closed gate is waiting on.
- ``ck_run_events_type`` takes ``run_quarantined`` and ``run_unquarantined``.
- ``scheduler_nodes``: each node's last cycle, its outcome, how many it ran, and whether it lets
  workers register anonymously.

Nothing here changes what the ingress role may do: it neither reads nor writes these columns.

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: 0007_quarantine
Revises: 0006_worker_credentials
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_quarantine"
down_revision = "0006_worker_credentials"
branch_labels = None
depends_on = None

_EVENT_TYPES_BEFORE = (
    "type IN ('run_admitted', 'attempt_created', 'attempt_offered', 'attempt_accepted',"
    " 'attempt_activated', 'attempt_running', 'attempt_started', 'attempt_released',"
    " 'attempt_succeeded', 'attempt_failed', 'attempt_lost', 'retry_scheduled', 'run_failed',"
    " 'run_cancelled', 'evidence_recorded', 'workflow_started', 'workflow_succeeded')"
)
_EVENT_TYPES_AFTER = (
    "type IN ('run_admitted', 'attempt_created', 'attempt_offered', 'attempt_accepted',"
    " 'attempt_activated', 'attempt_running', 'attempt_started', 'attempt_released',"
    " 'attempt_succeeded', 'attempt_failed', 'attempt_lost', 'retry_scheduled', 'run_failed',"
    " 'run_cancelled', 'evidence_recorded', 'workflow_started', 'workflow_succeeded',"
    " 'run_quarantined', 'run_unquarantined')"
)
_GATE_COLUMNS = (
    ("failed_step", sa.Text()),
    ("failed_run_id", sa.Text(collation="C")),
    ("failed_attempt_id", sa.Text(collation="C")),
    ("failed_error", sa.Text()),
    ("failed_since", sa.DateTime(timezone=True)),
    ("failed_cycles", sa.Integer()),
)


def upgrade() -> None:
    op.add_column("runs", sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("runs", sa.Column("quarantine_reason", sa.Text(), nullable=True))
    op.create_index(
        op.f("ix_runs_quarantined"),
        "runs",
        ["quarantined_at", "id"],
        postgresql_where=sa.text("quarantined_at IS NOT NULL"),
    )
    for name, kind in _GATE_COLUMNS:
        op.add_column("dispatch_gate", sa.Column(name, kind, nullable=True))
    op.drop_constraint(op.f("ck_run_events_type"), "run_events", type_="check")
    op.create_check_constraint(op.f("ck_run_events_type"), "run_events", _EVENT_TYPES_AFTER)
    op.create_table(
        "scheduler_nodes",
        sa.Column("id", sa.Text(collation="C"), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_cycle_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_ok", sa.Boolean(), nullable=False),
        sa.Column("aborted_at", sa.Text(), nullable=True),
        sa.Column("cycles", sa.BigInteger(), nullable=False),
        sa.Column(
            "anonymous_workers", sa.Boolean(), server_default=sa.false(), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scheduler_nodes")),
        sa.CheckConstraint("cycles >= 0", name=op.f("ck_scheduler_nodes_cycles")),
    )


def downgrade() -> None:
    op.drop_table("scheduler_nodes")
    op.execute("DELETE FROM run_events WHERE type IN ('run_quarantined', 'run_unquarantined')")
    op.drop_constraint(op.f("ck_run_events_type"), "run_events", type_="check")
    op.create_check_constraint(op.f("ck_run_events_type"), "run_events", _EVENT_TYPES_BEFORE)
    for name, _kind in reversed(_GATE_COLUMNS):
        op.drop_column("dispatch_gate", name)
    op.drop_index(op.f("ix_runs_quarantined"), table_name="runs")
    op.drop_column("runs", "quarantine_reason")
    op.drop_column("runs", "quarantined_at")
