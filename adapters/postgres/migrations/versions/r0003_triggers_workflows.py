"""Triggers and workflows: triggers, trigger_firings, workflow_steps, and the two workflow event
types of run_events.

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: 0003_triggers_workflows
Revises: 0002_ingress
Create Date: 2026-08-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003_triggers_workflows"
down_revision = "0002_ingress"
branch_labels = None
depends_on = None

_EVENT_TYPES_BEFORE = (
    "type IN ('run_admitted', 'attempt_created', 'attempt_offered', 'attempt_accepted',"
    " 'attempt_activated', 'attempt_running', 'attempt_succeeded', 'attempt_failed',"
    " 'attempt_lost', 'retry_scheduled', 'run_failed', 'run_cancelled',"
    " 'evidence_recorded')"
)
_EVENT_TYPES_AFTER = (
    "type IN ('run_admitted', 'attempt_created', 'attempt_offered', 'attempt_accepted',"
    " 'attempt_activated', 'attempt_running', 'attempt_succeeded', 'attempt_failed',"
    " 'attempt_lost', 'retry_scheduled', 'run_failed', 'run_cancelled',"
    " 'evidence_recorded', 'workflow_started', 'workflow_succeeded')"
)


def _id() -> sa.Text:
    return sa.Text(collation="C")


def _time() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.drop_constraint(op.f("ck_run_events_type"), "run_events", type_="check")
    op.create_check_constraint(op.f("ck_run_events_type"), "run_events", _EVENT_TYPES_AFTER)

    op.create_table(
        "triggers",
        sa.Column("id", _id(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("input", postgresql.JSONB(), nullable=True),
        sa.Column("policy", postgresql.JSONB(), nullable=True),
        sa.Column("every_ms", sa.BigInteger(), nullable=True),
        sa.Column("cron", sa.Text(), nullable=True),
        sa.Column("catch_up", sa.Text(), nullable=False),
        sa.Column("catch_up_limit", sa.Integer(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("next_fire_at", _time(), nullable=False),
        sa.Column("last_fired_at", _time(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", _time(), nullable=False),
        sa.Column("updated_at", _time(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_triggers")),
        sa.CheckConstraint(
            "status IN ('active', 'paused', 'deleted')", name=op.f("ck_triggers_status")
        ),
        sa.CheckConstraint("catch_up IN ('skip', 'one', 'all')", name=op.f("ck_triggers_catch_up")),
        sa.CheckConstraint(
            "catch_up_limit BETWEEN 1 AND 64", name=op.f("ck_triggers_catch_up_limit")
        ),
        sa.CheckConstraint(
            "(every_ms IS NULL) <> (cron IS NULL)", name=op.f("ck_triggers_every_ms_or_cron")
        ),
        sa.CheckConstraint(
            "every_ms IS NULL OR every_ms >= 1000", name=op.f("ck_triggers_every_ms")
        ),
        sa.CheckConstraint("version >= 1", name=op.f("ck_triggers_version")),
        sa.CheckConstraint("name <> '' AND task <> ''", name=op.f("ck_triggers_not_empty")),
    )
    op.create_index(
        op.f("uq_triggers_live_name"),
        "triggers",
        ["name"],
        unique=True,
        postgresql_where=sa.text("status <> 'deleted'"),
    )
    op.create_index(
        op.f("ix_triggers_due"),
        "triggers",
        ["next_fire_at", "id"],
        postgresql_where=sa.text("status = 'active'"),
    )

    op.create_table(
        "trigger_firings",
        sa.Column("trigger_id", _id(), nullable=False),
        sa.Column("scheduled_at", _time(), nullable=False),
        sa.Column("run_id", _id(), nullable=False),
        sa.Column("fired_at", _time(), nullable=False),
        sa.PrimaryKeyConstraint("trigger_id", "scheduled_at", name=op.f("pk_trigger_firings")),
        sa.UniqueConstraint("run_id", name=op.f("uq_trigger_firings_run_id")),
        sa.ForeignKeyConstraint(
            ["trigger_id"], ["triggers.id"], name=op.f("fk_trigger_firings_trigger_id_triggers")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_trigger_firings_run_id_runs")
        ),
    )

    op.create_table(
        "workflow_steps",
        sa.Column("workflow_run_id", _id(), nullable=False),
        sa.Column("step_id", _id(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("input", postgresql.JSONB(), nullable=True),
        sa.Column("after_steps", postgresql.JSONB(), nullable=False),
        sa.Column("policy", postgresql.JSONB(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("run_id", _id(), nullable=True),
        sa.Column("updated_at", _time(), nullable=False),
        sa.PrimaryKeyConstraint("workflow_run_id", "step_id", name=op.f("pk_workflow_steps")),
        sa.UniqueConstraint(
            "workflow_run_id",
            "position",
            name=op.f("uq_workflow_steps_workflow_run_id_position"),
        ),
        sa.UniqueConstraint("run_id", name=op.f("uq_workflow_steps_run_id")),
        sa.CheckConstraint(
            "status IN ('pending', 'admitted', 'succeeded', 'failed', 'cancelled')",
            name=op.f("ck_workflow_steps_status"),
        ),
        sa.CheckConstraint("position >= 0", name=op.f("ck_workflow_steps_position")),
        sa.CheckConstraint(
            "(status = 'pending' AND run_id IS NULL)"
            " OR (status IN ('admitted', 'succeeded', 'failed') AND run_id IS NOT NULL)"
            " OR status = 'cancelled'",
            name=op.f("ck_workflow_steps_run_iff_admitted"),
        ),
        sa.ForeignKeyConstraint(
            ["workflow_run_id"],
            ["runs.id"],
            name=op.f("fk_workflow_steps_workflow_run_id_runs"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_workflow_steps_run_id_runs")
        ),
    )
    op.create_index(
        op.f("ix_workflow_steps_open"),
        "workflow_steps",
        ["workflow_run_id", "run_id"],
        postgresql_where=sa.text("status IN ('pending', 'admitted')"),
    )


def downgrade() -> None:
    op.drop_table("workflow_steps")
    op.drop_table("trigger_firings")
    op.drop_table("triggers")
    op.execute("DELETE FROM run_events WHERE type IN ('workflow_started', 'workflow_succeeded')")
    op.drop_constraint(op.f("ck_run_events_type"), "run_events", type_="check")
    op.create_check_constraint(op.f("ck_run_events_type"), "run_events", _EVENT_TYPES_BEFORE)
