"""The baseline: the whole schema of the PostgreSQL store in one revision (ADR 0022).

QL3 had no release when revisions ``0001_initial`` to ``0013_prune_index`` were squashed into this
one, and no database outside the tests was made by them: a database made before it must be
recreated (``ql3 db upgrade`` refuses it, naming the revision it is at).

The revision runs ``r0001_baseline.sql``, its own frozen text: the tables and indexes, the
dispatch gate's row, the database functions (the worker ingress's fenced ``ql3_ingress_*``
functions, ADR 0004, and the trigger function of ``runs_finished_notify``, ADR 0009) with EXECUTE
revoked from PUBLIC, and the trigger. The text names the schema it is run in with the psql
variable ``schema``, which this revision binds to ``current_schema()``. It is never edited; a
later change is a new revision with its own frozen text.

Revision ID: r0001_baseline
Revises:
Create Date: 2026-12-04
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = "r0001_baseline"
down_revision = None
branch_labels = None
depends_on = None

FROZEN = Path(__file__).with_suffix(".sql")
SCHEMA_VARIABLE = ':"schema"'

# What the text creates, for the downgrade: tables in the order they may be dropped, functions.
TABLES = (
    "worker_credential_events",
    "worker_credentials",
    "workflow_steps",
    "trigger_firings",
    "triggers",
    "attempt_stop_reports",
    "run_events",
    "run_dispatch_leases",
    "run_attempts",
    "runs",
    "worker_sessions",
    "dispatch_gate",
    "scheduler_nodes",
    "task_limits",
)
FUNCTIONS = (
    "ql3_ingress_register_sessions(jsonb)",
    "ql3_ingress_update_sessions(jsonb)",
    "ql3_ingress_apply(jsonb)",
    "ql3_ingress_renew(jsonb)",
    "ql3_ingress_claim_lock(text, text, text[], integer)",
    "ql3_ingress_lock_attempts(text[], boolean)",
    "ql3_ingress_claim_one(jsonb, runs, run_attempts)",
    "ql3_ingress_register_one(jsonb)",
    "ql3_ingress_update_session_one(jsonb)",
    "ql3_ingress_apply_one(jsonb)",
    "ql3_ingress_renew_one(jsonb)",
    "ql3_ingress_check_batch(jsonb)",
    "ql3_ingress_session(text, text, boolean)",
    "ql3_ingress_only(jsonb, text[], text)",
    "ql3_ingress_expiry(text, timestamp with time zone)",
    "ql3_ingress_now(text, text)",
    "ql3_ingress_conflict(text)",
    "ql3_ingress_refuse(text)",
    "ql3_notify_run_finished()",
)


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def upgrade() -> None:
    schema = op.get_bind().execute(sa.text("SELECT current_schema()")).scalar_one()
    text = FROZEN.read_text(encoding="utf-8").replace(SCHEMA_VARIABLE, _quote(str(schema)))
    op.execute(sa.text(text))


def downgrade() -> None:
    op.execute(sa.text("DROP TRIGGER IF EXISTS runs_finished_notify ON runs"))
    for signature in FUNCTIONS:
        op.execute(sa.text(f"DROP FUNCTION IF EXISTS {signature}"))
    for table in TABLES:
        op.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
