"""A Run whose policy retries on error is ``idempotent`` or ``deduplicated`` (ADR 0013, 0022).

The domain refuses such a policy (``ql3.domain.policy.RETRYABLE_SAFETY``) and the worker
ingress's functions check it before they retry; this revision makes the database state it too:
``ck_runs_retry_on_error_safety`` refuses a row of ``runs`` written around the API whose
``retry_on_error`` is set while its safety is ``unsafe`` or absent. ``ADD CONSTRAINT`` checks
the rows already there: a Run admitted through the API always satisfies it.

Frozen here as a literal (the declared schema renders the same predicate from the domain; the
test of the migrated catalog against the declared one compares them).

Revision ID: r0002_retry_on_error_safety
Revises: r0001_baseline
Create Date: 2026-12-04
"""

from __future__ import annotations

from alembic import op

revision = "r0002_retry_on_error_safety"
down_revision = "r0001_baseline"
branch_labels = None
depends_on = None

CHECK = (
    "retry_on_error IS NOT TRUE"
    " OR (safety IS NOT NULL AND safety IN ('idempotent', 'deduplicated'))"
)


def upgrade() -> None:
    op.create_check_constraint(op.f("ck_runs_retry_on_error_safety"), "runs", CHECK)


def downgrade() -> None:
    op.drop_constraint(op.f("ck_runs_retry_on_error_safety"), "runs", type_="check")
