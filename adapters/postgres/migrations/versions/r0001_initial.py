"""Initial schema: runs, run_attempts, run_dispatch_leases, run_events, worker_sessions,
attempt_stop_reports.

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: 0001_initial
Revises:
Create Date: 2026-07-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def _id() -> sa.Text:
    return sa.Text(collation="C")


def _time() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", _id(), nullable=False),
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("owner", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("input", postgresql.JSONB(), nullable=True),
        sa.Column("output", postgresql.JSONB(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("has_policy", sa.Boolean(), nullable=False),
        sa.Column("retry_on_lost", sa.Boolean(), nullable=True),
        sa.Column("max_attempts", sa.Integer(), nullable=True),
        sa.Column("safety", sa.Text(), nullable=True),
        sa.Column("backoff_initial_ms", sa.BigInteger(), nullable=True),
        sa.Column("backoff_multiplier", sa.Double(), nullable=True),
        sa.Column("backoff_cap_ms", sa.BigInteger(), nullable=True),
        sa.Column("backoff_jitter", sa.Double(), nullable=True),
        sa.Column("attempt_count", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", _time(), nullable=True),
        sa.Column("parent_run_id", _id(), nullable=True),
        sa.Column("created_at", _time(), nullable=False),
        sa.Column("updated_at", _time(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.CheckConstraint("owner IN ('runtime', 'workflow')", name=op.f("ck_runs_owner")),
        sa.CheckConstraint(
            "status IN ('created', 'queued', 'dispatching', 'running', 'lost', 'retry_wait',"
            " 'succeeded', 'failed', 'cancelled')",
            name=op.f("ck_runs_status"),
        ),
        sa.CheckConstraint(
            "safety IS NULL OR safety IN ('idempotent', 'deduplicated', 'unsafe')",
            name=op.f("ck_runs_safety"),
        ),
        sa.CheckConstraint("attempt_count >= 0", name=op.f("ck_runs_attempt_count")),
        sa.CheckConstraint("max_attempts BETWEEN 1 AND 1000", name=op.f("ck_runs_max_attempts")),
        sa.CheckConstraint(
            "backoff_initial_ms >= 0 AND backoff_multiplier >= 1"
            " AND backoff_cap_ms >= backoff_initial_ms"
            " AND backoff_jitter >= 0 AND backoff_jitter <= 1",
            name=op.f("ck_runs_backoff"),
        ),
        sa.CheckConstraint(
            "(has_policy AND retry_on_lost IS NOT NULL AND max_attempts IS NOT NULL"
            " AND backoff_initial_ms IS NOT NULL AND backoff_multiplier IS NOT NULL"
            " AND backoff_cap_ms IS NOT NULL AND backoff_jitter IS NOT NULL)"
            " OR (NOT has_policy AND retry_on_lost IS NULL AND max_attempts IS NULL"
            " AND backoff_initial_ms IS NULL AND backoff_multiplier IS NULL"
            " AND backoff_cap_ms IS NULL AND backoff_jitter IS NULL AND safety IS NULL)",
            name=op.f("ck_runs_policy_iff_has_policy"),
        ),
        sa.CheckConstraint("task <> ''", name=op.f("ck_runs_task_not_empty")),
    )
    op.create_index(op.f("ix_runs_created_at"), "runs", ["created_at", "id"])
    op.create_index(
        op.f("ix_runs_lost"),
        "runs",
        ["updated_at", "id"],
        postgresql_where=sa.text("status = 'lost'"),
    )
    op.create_index(
        op.f("ix_runs_retry_wait"),
        "runs",
        ["next_attempt_at", "id"],
        postgresql_where=sa.text("status = 'retry_wait'"),
    )
    op.create_index(
        op.f("ix_runs_created"),
        "runs",
        ["created_at", "id"],
        postgresql_where=sa.text("status = 'created'"),
    )
    op.create_index(
        op.f("ix_runs_queued"),
        "runs",
        ["task", "id"],
        postgresql_where=sa.text("status = 'queued'"),
    )

    op.create_table(
        "run_attempts",
        sa.Column("id", _id(), nullable=False),
        sa.Column("run_id", _id(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("session_id", _id(), nullable=True),
        sa.Column("worker_id", _id(), nullable=True),
        sa.Column("lease_generation", sa.Integer(), nullable=True),
        sa.Column("lease_version", sa.Integer(), nullable=True),
        sa.Column("offered_at", _time(), nullable=True),
        sa.Column("accepted_at", _time(), nullable=True),
        sa.Column("started_at", _time(), nullable=True),
        sa.Column("finished_at", _time(), nullable=True),
        sa.Column("lost_evidence", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", _time(), nullable=False),
        sa.Column("updated_at", _time(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_attempts")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_attempts_run_id_runs")),
        sa.UniqueConstraint("run_id", "number", name=op.f("uq_run_attempts_run_id_number")),
        sa.CheckConstraint("number >= 1", name=op.f("ck_run_attempts_number")),
        sa.CheckConstraint(
            "status IN ('claimed', 'starting', 'running', 'succeeded', 'failed', 'lost',"
            " 'cancelled')",
            name=op.f("ck_run_attempts_status"),
        ),
        sa.CheckConstraint(
            "lost_evidence IS NULL OR lost_evidence IN ('session_closed', 'session_replaced',"
            " 'worker_abandoned', 'operator_attested')",
            name=op.f("ck_run_attempts_lost_evidence"),
        ),
        sa.CheckConstraint(
            "lease_generation IS NULL OR lease_generation >= 1",
            name=op.f("ck_run_attempts_lease_generation"),
        ),
        sa.CheckConstraint(
            "lease_version IS NULL OR lease_version >= 1",
            name=op.f("ck_run_attempts_lease_version"),
        ),
    )
    op.create_index(
        op.f("uq_run_attempts_one_active_per_run"),
        "run_attempts",
        ["run_id"],
        unique=True,
        postgresql_where=sa.text("status IN ('claimed', 'starting', 'running')"),
    )

    op.create_table(
        "run_dispatch_leases",
        sa.Column("run_id", _id(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("attempt_id", _id(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("holder_session_id", _id(), nullable=False),
        sa.Column("token_hash", sa.Text(), nullable=True),
        sa.Column("expires_at", _time(), nullable=False),
        sa.Column("granted_at", _time(), nullable=False),
        sa.Column("release_reason", sa.Text(), nullable=True),
        sa.Column("released_at", _time(), nullable=True),
        sa.PrimaryKeyConstraint("run_id", "generation", name=op.f("pk_run_dispatch_leases")),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_dispatch_leases_run_id_runs")
        ),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["run_attempts.id"],
            name=op.f("fk_run_dispatch_leases_attempt_id_run_attempts"),
        ),
        sa.CheckConstraint("generation >= 1", name=op.f("ck_run_dispatch_leases_generation")),
        sa.CheckConstraint("version >= 1", name=op.f("ck_run_dispatch_leases_version")),
        sa.CheckConstraint(
            "status IN ('leased', 'released')", name=op.f("ck_run_dispatch_leases_status")
        ),
        sa.CheckConstraint(
            "release_reason IS NULL OR release_reason IN ('completed', 'lease_expired',"
            " 'cancelled', 'abandoned')",
            name=op.f("ck_run_dispatch_leases_release_reason"),
        ),
        sa.CheckConstraint(
            "(status = 'leased') = (release_reason IS NULL)",
            name=op.f("ck_run_dispatch_leases_release_reason_iff_released"),
        ),
        # Renewals rewrite only expires_at; the free space lets them stay on the page (HOT).
        postgresql_with={"fillfactor": "70"},
    )
    op.create_index(
        op.f("uq_run_dispatch_leases_one_leased_per_run"),
        "run_dispatch_leases",
        ["run_id"],
        unique=True,
        postgresql_where=sa.text("status = 'leased'"),
    )
    op.create_index(
        op.f("ix_run_dispatch_leases_held"),
        "run_dispatch_leases",
        ["holder_session_id"],
        postgresql_where=sa.text("status = 'leased'"),
    )

    op.create_table(
        "run_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("run_id", _id(), nullable=False),
        sa.Column("attempt_id", _id(), nullable=True),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("at", _time(), nullable=False),
        sa.Column("data", postgresql.JSONB(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_events")),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_run_events_run_id_runs")),
        sa.CheckConstraint(
            "type IN ('run_admitted', 'attempt_created', 'attempt_offered', 'attempt_accepted',"
            " 'attempt_activated', 'attempt_running', 'attempt_succeeded', 'attempt_failed',"
            " 'attempt_lost', 'retry_scheduled', 'run_failed', 'run_cancelled',"
            " 'evidence_recorded')",
            name=op.f("ck_run_events_type"),
        ),
    )
    op.create_index(op.f("ix_run_events_run_id"), "run_events", ["run_id", "id"])

    op.create_table(
        "worker_sessions",
        sa.Column("id", _id(), nullable=False),
        sa.Column("worker_id", _id(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("capacity", sa.Integer(), nullable=False),
        sa.Column("tasks", postgresql.JSONB(), nullable=False),
        sa.Column("secret_hash", sa.Text(), nullable=False),
        sa.Column("registered_at", _time(), nullable=False),
        sa.Column("last_heartbeat_at", _time(), nullable=False),
        sa.Column("closed_at", _time(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_worker_sessions")),
        sa.CheckConstraint(
            "status IN ('active', 'draining', 'closed', 'replaced')",
            name=op.f("ck_worker_sessions_status"),
        ),
        sa.CheckConstraint("capacity >= 1", name=op.f("ck_worker_sessions_capacity")),
    )
    op.create_index(
        op.f("uq_worker_sessions_one_open_per_worker"),
        "worker_sessions",
        ["worker_id"],
        unique=True,
        postgresql_where=sa.text("status IN ('active', 'draining')"),
    )
    op.create_index(
        op.f("ix_worker_sessions_active"),
        "worker_sessions",
        ["id"],
        postgresql_where=sa.text("status = 'active'"),
    )

    op.create_table(
        "attempt_stop_reports",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("attempt_id", _id(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("reported_at", _time(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempt_stop_reports")),
        sa.CheckConstraint(
            "kind IN ('session_closed', 'session_replaced', 'worker_abandoned',"
            " 'operator_attested')",
            name=op.f("ck_attempt_stop_reports_kind"),
        ),
    )
    op.create_index(
        op.f("ix_attempt_stop_reports_attempt_id"),
        "attempt_stop_reports",
        ["attempt_id", "reported_at"],
    )


def downgrade() -> None:
    op.drop_table("attempt_stop_reports")
    op.drop_table("worker_sessions")
    op.drop_table("run_events")
    op.drop_table("run_dispatch_leases")
    op.drop_table("run_attempts")
    op.drop_table("runs")
