"""Worker credentials (ADR 0008): ``worker_credentials``, ``worker_credential_events`` and the
``revoked`` session status.

- ``worker_credentials``: one row per credential, its secret kept as a SHA-256 hash (unique),
  the worker id pattern and tasks it admits, its expiry and revocation.
- ``worker_credential_events``: the append-only audit of every issue, use (naming the session
  registered) and revocation.
- ``ck_worker_sessions_status`` takes ``revoked``: a session whose credential was revoked.

The ingress role is granted nothing here: registration with a credential runs on the node's own
role, and the ingress role cannot read credentials.

Written out by hand and frozen: later changes to the declared metadata get their own revision.

Revision ID: 0006_worker_credentials
Revises: 0005_ingress_claim
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006_worker_credentials"
down_revision = "0005_ingress_claim"
branch_labels = None
depends_on = None

_SESSION_STATUSES_BEFORE = "status IN ('active', 'draining', 'closed', 'replaced')"
_SESSION_STATUSES_AFTER = "status IN ('active', 'draining', 'closed', 'replaced', 'revoked')"


def _id() -> sa.Text:
    return sa.Text(collation="C")


def _time() -> sa.DateTime:
    return sa.DateTime(timezone=True)


def upgrade() -> None:
    op.drop_constraint(op.f("ck_worker_sessions_status"), "worker_sessions", type_="check")
    op.create_check_constraint(
        op.f("ck_worker_sessions_status"), "worker_sessions", _SESSION_STATUSES_AFTER
    )
    op.create_table(
        "worker_credentials",
        sa.Column("id", _id(), nullable=False),
        sa.Column("worker_pattern", sa.Text(), nullable=False),
        sa.Column("tasks", postgresql.JSONB(), nullable=True),
        sa.Column("secret_hash", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("issued_at", _time(), nullable=False),
        sa.Column("expires_at", _time(), nullable=True),
        sa.Column("revoked_at", _time(), nullable=True),
        sa.Column("rotates_id", _id(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_worker_credentials")),
        sa.UniqueConstraint("secret_hash", name=op.f("uq_worker_credentials_secret_hash")),
        sa.CheckConstraint(
            "status IN ('active', 'revoked')", name=op.f("ck_worker_credentials_status")
        ),
        sa.CheckConstraint(
            "(status = 'revoked') = (revoked_at IS NOT NULL)",
            name=op.f("ck_worker_credentials_revoked_at"),
        ),
    )
    op.create_table(
        "worker_credential_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("credential_id", _id(), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("at", _time(), nullable=False),
        sa.Column("worker_id", _id(), nullable=True),
        sa.Column("session_id", _id(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_worker_credential_events")),
        sa.ForeignKeyConstraint(
            ["credential_id"],
            ["worker_credentials.id"],
            name=op.f("fk_worker_credential_events_credential_id_worker_credentials"),
        ),
        sa.CheckConstraint(
            "type IN ('issued', 'used', 'revoked')", name=op.f("ck_worker_credential_events_type")
        ),
    )
    op.create_index(
        op.f("ix_worker_credential_events_credential_id"),
        "worker_credential_events",
        ["credential_id", "id"],
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_worker_credential_events_credential_id"), table_name="worker_credential_events"
    )
    op.drop_table("worker_credential_events")
    op.drop_table("worker_credentials")
    op.drop_constraint(op.f("ck_worker_sessions_status"), "worker_sessions", type_="check")
    op.create_check_constraint(
        op.f("ck_worker_sessions_status"), "worker_sessions", _SESSION_STATUSES_BEFORE
    )
