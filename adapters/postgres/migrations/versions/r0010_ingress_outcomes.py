"""The worker ingress takes a failing completion that retries on error (ADR 0013).

Since ADR 0013 a failed Attempt of a Run whose policy retries on error takes the Run
``running -> retry_wait`` with a due time, in the completion's one change; the cadence's lost
retry makes Attempt N+1 when it is due. The ingress role writes only through fenced functions
(ADR 0004), so this revision replaces ``ql3_ingress_apply_one`` (the function of
``0005_ingress_claim`` with these changes only):

- a failing completion (``attempt_failed``) may move the Run to ``retry_wait`` and set its
  ``next_attempt_at``, only when the Run's stored policy allows it: ``retry_on_error`` set,
  safety ``idempotent`` or ``deduplicated``, ``attempt_count < max_attempts``, the completed
  Attempt the Run's latest. The due time is a "now" of the calling transaction plus at most
  the policy's backoff cap. Any other change of ``next_attempt_at`` is refused;
- the event of a failing completion carries only the keys the domain writes (the error, its
  cause, whether it is retried, and the due time and next Attempt, or the failure's reason),
  and says ``retry`` exactly when the Run goes to ``retry_wait``.

The function's text is 0005's, edited at the places named below (each edit must match exactly
once, so a changed base fails loudly); the downgrade puts 0005's text back. Status and safety
lists are frozen here as literals; a test checks them against ``ql3.domain.states`` and
``ql3.domain.policy``.

Revision ID: 0010_ingress_outcomes
Revises: 0009_job_columns
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0010_ingress_outcomes"
down_revision = "0009_job_columns"
branch_labels = None
depends_on = None

# Frozen status and safety sets (checked against ql3.domain.states and ql3.domain.policy by a test).
STARTED_ATTEMPT_STATUSES = ("running", "starting")
RETRYABLE_SAFETY = ("deduplicated", "idempotent")

# The worker transitions this revision changes, as in 0005_ingress_claim: (Run statuses from,
# Run statuses to, Attempt statuses from, Attempt status to). A test checks every pair against
# the domain's state diagrams.
WORKER_TRANSITIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str]] = {
    "attempt_failed": (("running",), ("failed", "retry_wait"), STARTED_ATTEMPT_STATUSES, "failed"),
}
# The keys of a failing completion's event data (ql3.domain.transitions.complete).
FAILED_EVENT_KEYS = ("cause", "error", "next_attempt", "next_attempt_at_ms", "reason", "retry")


def _list(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{value}'" for value in values)


_DECLARE = (
    "    v_value jsonb;\nBEGIN\n",
    "    v_value jsonb;\n    v_retry boolean := false;\n    v_next timestamptz;\nBEGIN\n",
)

_RUN_COLUMNS = (
    "ARRAY['status', 'output', 'error', 'updated_at'], 'complete: the run');",
    "ARRAY['status', 'output', 'error', 'next_attempt_at', 'updated_at'], 'complete: the run');",
)

_STATUS_CHECK = (
    """        IF v_run.status <> 'running' OR v_run_to->>'status' IS DISTINCT FROM v_end
            OR v_attempt.status NOT IN""",
    """        -- A failure the Run's stored policy retries on error waits for its next Attempt.
        v_retry := v_end = 'failed' AND v_run_to->>'status' IS NOT DISTINCT FROM 'retry_wait';
        IF v_run.status <> 'running'
            OR (NOT v_retry AND v_run_to->>'status' IS DISTINCT FROM v_end)
            OR v_attempt.status NOT IN""",
)

_FAILED_CHECKS = (
    """            PERFORM ql3_ingress_refuse('a failed run has no output');
        END IF;
""",
    f"""            PERFORM ql3_ingress_refuse('a failed run has no output');
        END IF;
        IF v_retry THEN
            IF NOT (v_run.has_policy AND coalesce(v_run.retry_on_error, false)
                    AND v_run.safety IN ({_list(RETRYABLE_SAFETY)})
                    AND v_run.attempt_count < v_run.max_attempts
                    AND v_attempt.number = v_run.attempt_count)
            THEN
                PERFORM ql3_ingress_refuse(format(
                    'the policy of run %s does not retry attempt %s on error',
                    v_run_id, v_attempt.number));
            END IF;
            v_next := (v_run_to->>'next_attempt_at')::timestamptz;
            IF v_next IS NULL
                OR v_next < date_trunc('milliseconds', transaction_timestamp())
                OR v_next > statement_timestamp()
                    + v_run.backoff_cap_ms * interval '1 millisecond'
            THEN
                PERFORM ql3_ingress_refuse(
                    'a retry is due at the time observed in this transaction plus at most '
                    'the backoff cap');
            END IF;
        ELSIF v_run_to ? 'next_attempt_at' THEN
            PERFORM ql3_ingress_refuse('only a retry sets when the next attempt is due');
        END IF;
        IF v_end = 'failed' THEN
            PERFORM ql3_ingress_only(v_event->'data', ARRAY[{_list(FAILED_EVENT_KEYS)}],
                                     'complete: the event');
            IF v_event #> '{{data,retry}}' IS DISTINCT FROM to_jsonb(v_retry) THEN
                PERFORM ql3_ingress_refuse('a failure''s event says whether it is retried');
            END IF;
        END IF;
""",
)

_RUN_UPDATE = (
    """            error = CASE WHEN v_run_to ? 'error' THEN v_run_to->>'error' ELSE error END,
            updated_at = CASE WHEN v_run_to ? 'updated_at'
                THEN (v_run_to->>'updated_at')::timestamptz ELSE updated_at END
        WHERE id = v_run_id;""",
    """            error = CASE WHEN v_run_to ? 'error' THEN v_run_to->>'error' ELSE error END,
            next_attempt_at = CASE WHEN v_run_to ? 'next_attempt_at'
                THEN (v_run_to->>'next_attempt_at')::timestamptz ELSE next_attempt_at END,
            updated_at = CASE WHEN v_run_to ? 'updated_at'
                THEN (v_run_to->>'updated_at')::timestamptz ELSE updated_at END
        WHERE id = v_run_id;""",
)

EDITS = (_DECLARE, _RUN_COLUMNS, _STATUS_CHECK, _FAILED_CHECKS, _RUN_UPDATE)


def _revision_0005() -> ModuleType:
    """Migration 0005_ingress_claim, whose function text this revision edits."""
    path = Path(__file__).with_name("r0005_ingress_claim.py")
    spec = importlib.util.spec_from_file_location("ql3_migration_0005_ingress_claim", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replace_once(sql: str, old: str, new: str) -> str:
    found = sql.count(old)
    if found != 1:
        raise RuntimeError(f"0010_ingress_outcomes: an edit matches {found} times: {old[:60]!r}")
    return sql.replace(old, new)


def _base_sql(r0005: ModuleType) -> str:
    """0005's ``ql3_ingress_apply_one`` and ``ql3_ingress_apply`` (both ``CREATE OR REPLACE``,
    which keeps owner and grants)."""
    return str(r0005._APPLY_SQL.format(pristine=r0005._pristine("a"), **r0005._values()))


def outcomes_sql(base: str) -> str:
    """0005's function text with this revision's edits."""
    sql = base
    for old, new in EDITS:
        sql = _replace_once(sql, old, new)
    return sql


def upgrade() -> None:
    op.execute(sa.text(outcomes_sql(_base_sql(_revision_0005()))))


def downgrade() -> None:
    op.execute(sa.text(_base_sql(_revision_0005())))
