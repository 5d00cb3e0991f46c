"""The claim protocol (ADR 0007): the dispatch gate, the claim's candidate index, and the new
release reason and event types.

- ``dispatch_gate``: one row shared by every replica, inserted here (open).
- ``ix_runs_claimable`` replaces ``ix_runs_queued``, and ``ix_run_attempts_handed_back`` is new:
  a claim reads the oldest few pristine Attempts of each of its tasks from them and no more
  (see ``adapters/sql/schema.py``).
- ``ck_run_dispatch_leases_release_reason`` takes ``handed_back``; ``ck_run_events_type`` takes
  ``attempt_started`` and ``attempt_released``.

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: 0004_dispatch_gate
Revises: 0003_triggers_workflows
Create Date: 2026-08-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_dispatch_gate"
down_revision = "0003_triggers_workflows"
branch_labels = None
depends_on = None

_EVENT_TYPES_BEFORE = (
    "type IN ('run_admitted', 'attempt_created', 'attempt_offered', 'attempt_accepted',"
    " 'attempt_activated', 'attempt_running', 'attempt_succeeded', 'attempt_failed',"
    " 'attempt_lost', 'retry_scheduled', 'run_failed', 'run_cancelled',"
    " 'evidence_recorded', 'workflow_started', 'workflow_succeeded')"
)
_EVENT_TYPES_AFTER = (
    "type IN ('run_admitted', 'attempt_created', 'attempt_offered', 'attempt_accepted',"
    " 'attempt_activated', 'attempt_running', 'attempt_started', 'attempt_released',"
    " 'attempt_succeeded', 'attempt_failed', 'attempt_lost', 'retry_scheduled', 'run_failed',"
    " 'run_cancelled', 'evidence_recorded', 'workflow_started', 'workflow_succeeded')"
)
_RELEASE_REASONS_BEFORE = (
    "release_reason IS NULL OR release_reason IN ('completed', 'lease_expired',"
    " 'cancelled', 'abandoned')"
)
_RELEASE_REASONS_AFTER = (
    "release_reason IS NULL OR release_reason IN ('completed', 'lease_expired',"
    " 'cancelled', 'abandoned', 'handed_back')"
)


def upgrade() -> None:
    op.drop_constraint(op.f("ck_run_events_type"), "run_events", type_="check")
    op.create_check_constraint(op.f("ck_run_events_type"), "run_events", _EVENT_TYPES_AFTER)
    op.drop_constraint(
        op.f("ck_run_dispatch_leases_release_reason"), "run_dispatch_leases", type_="check"
    )
    op.create_check_constraint(
        op.f("ck_run_dispatch_leases_release_reason"),
        "run_dispatch_leases",
        _RELEASE_REASONS_AFTER,
    )

    op.drop_index(op.f("ix_runs_queued"), table_name="runs")
    op.create_index(
        op.f("ix_runs_claimable"),
        "runs",
        ["task", "updated_at", "id"],
        postgresql_where=sa.text("status IN ('queued')"),
    )
    op.create_index(
        op.f("ix_run_attempts_handed_back"),
        "run_attempts",
        ["created_at", "run_id"],
        postgresql_where=sa.text(
            "status = 'claimed' AND session_id IS NULL AND updated_at > created_at"
        ),
    )

    op.create_table(
        "dispatch_gate",
        sa.Column("id", sa.SmallInteger(), nullable=False),
        sa.Column("open", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dispatch_gate")),
        sa.CheckConstraint("id = 1", name=op.f("ck_dispatch_gate_one_row")),
    )
    op.execute("INSERT INTO dispatch_gate (id, open) VALUES (1, true)")


def downgrade() -> None:
    op.drop_table("dispatch_gate")

    op.drop_index(op.f("ix_run_attempts_handed_back"), table_name="run_attempts")
    op.drop_index(op.f("ix_runs_claimable"), table_name="runs")
    op.create_index(
        op.f("ix_runs_queued"),
        "runs",
        ["task", "id"],
        postgresql_where=sa.text("status = 'queued'"),
    )

    # What only the claim protocol writes is rewritten (a hand-back becomes the abandonment it
    # was under the offer protocol) or deleted, so that the narrower checks hold again.
    op.execute(
        "UPDATE run_dispatch_leases SET release_reason = 'abandoned'"
        " WHERE release_reason = 'handed_back'"
    )
    op.drop_constraint(
        op.f("ck_run_dispatch_leases_release_reason"), "run_dispatch_leases", type_="check"
    )
    op.create_check_constraint(
        op.f("ck_run_dispatch_leases_release_reason"),
        "run_dispatch_leases",
        _RELEASE_REASONS_BEFORE,
    )
    op.execute("DELETE FROM run_events WHERE type IN ('attempt_started', 'attempt_released')")
    op.drop_constraint(op.f("ck_run_events_type"), "run_events", type_="check")
    op.create_check_constraint(op.f("ck_run_events_type"), "run_events", _EVENT_TYPES_BEFORE)
