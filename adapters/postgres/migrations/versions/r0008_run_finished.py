"""A notification when Runs finish, for callers that wait for a run (ADR 0009).

This revision adds the row trigger ``runs_finished_notify``: after an update that moves a Run
into ``succeeded``, ``failed`` or ``cancelled`` from any other status, it calls
``pg_notify('ql3_run_finished', '')``. The payload is empty, so a transaction that finishes many
Runs sends one notification (PostgreSQL folds identical ones), delivered when it commits; a
waiting caller reads its Run again when woken. The ``WHEN`` clause is evaluated before the
trigger is queued: an update that finishes nothing costs no function call.

Revision ID: 0008_run_finished
Revises: 0007_quarantine
"""

from __future__ import annotations

from alembic import op

revision = "0008_run_finished"
down_revision = "0007_quarantine"
branch_labels = None
depends_on = None

# The terminal Run statuses of domain/model.py, as this revision wrote them.
_TERMINAL = "('succeeded', 'failed', 'cancelled')"
FINISHED_CHANNEL = "ql3_run_finished"


def upgrade() -> None:
    op.execute(
        f"""
        CREATE FUNCTION ql3_notify_run_finished() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{FINISHED_CHANNEL}', '');
            RETURN NULL;
        END
        $$
        """
    )
    # Only a trigger calls it; no role, the ingress role included, may execute it otherwise.
    op.execute("REVOKE ALL ON FUNCTION ql3_notify_run_finished() FROM PUBLIC")
    op.execute(
        f"""
        CREATE TRIGGER runs_finished_notify
        AFTER UPDATE OF status ON runs
        FOR EACH ROW
        WHEN (NEW.status IN {_TERMINAL} AND OLD.status NOT IN {_TERMINAL})
        EXECUTE FUNCTION ql3_notify_run_finished()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER runs_finished_notify ON runs")
    op.execute("DROP FUNCTION ql3_notify_run_finished()")
