"""Claims take the highest priority first and keep within each task's limit (ADR 0014).

- ``ix_runs_claimable`` is rebuilt on ``(task, priority DESC, updated_at, id)``: a claim reads
  the first few entries of each task in claim order (highest priority, then oldest), however
  deep the queue and however its priorities mix;
- ``ql3_ingress_claim_lock`` is replaced: after the session's row it locks the ``task_limits``
  rows of the limited tasks it would claim (in task order, ``FOR UPDATE``), before it counts
  what is in flight; it reads each task's candidates highest priority first, then in the order
  the Runs became ``queued``, and answers the limits it locked (``task_limits``) beside the
  rest. The limits are read by a ``SECURITY DEFINER`` function: the ingress role gets no
  privilege on the table;
- ``ql3_ingress_claim_one`` is replaced: a claim of a limited task is refused when as many
  Attempts of that task hold a ``leased`` lease as its limit allows (the limit's row locked
  first, as by the claim's locks).

Status lists are frozen here as literals; a test checks them against ``ql3.domain.states``.

Revision ID: 0011_claim_priority_limits
Revises: 0010_ingress_outcomes
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0011_claim_priority_limits"
down_revision = "0010_ingress_outcomes"
branch_labels = None
depends_on = None

# Frozen here as in 0005_ingress_claim; tests check them against the application's constants.
ADVISORY_LOCK_NAMESPACE = 5327923
MAX_BATCH_ITEMS = 256
CLAIM_PAGE_SLACK = 16
CLAIMABLE_RUN_STATUSES = ("queued",)

ENTRY_POINT = "ql3_ingress_claim_lock(text, text, text[], integer)"

_LOCK_SQL = """
-- The locks and reads of a claim: the session, the limits of its limited tasks, its lease
-- count, the gate, the candidates.
CREATE OR REPLACE FUNCTION ql3_ingress_claim_lock(p_session_id text, p_secret_hash text,
                                                  p_tasks text[], p_limit integer)
RETURNS json
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {path} AS $$
DECLARE
    v_session worker_sessions;
    v_gate record;
    v_in_flight integer := 0;
    v_tasks text[] := '{{}}';
    v_task text;
    v_taken integer;
    v_candidate record;
    v_seen integer;
    v_after_priority integer;
    v_after_at timestamptz;
    v_after_id text;
    v_locked text[] := '{{}}';
    v_candidates json := '[]'::json;
    v_by_task json := '{{}}'::json;
    v_limits json := '{{}}'::json;
BEGIN
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND {max_items} THEN
        PERFORM ql3_ingress_refuse('a claim locks 1..{max_items} attempts of each task');
    END IF;
    IF p_tasks IS NULL OR cardinality(p_tasks) > 1024 THEN
        PERFORM ql3_ingress_refuse('a claim names at most 1024 tasks');
    END IF;
    -- Authenticated before anything is locked; unknown and wrong secret answer alike.
    SELECT * INTO v_session FROM worker_sessions WHERE id = p_session_id;
    IF FOUND AND p_secret_hash IS NOT NULL AND v_session.secret_hash = p_secret_hash THEN
        SELECT * INTO v_session FROM worker_sessions WHERE id = p_session_id FOR UPDATE;
        SELECT coalesce(array_agg(DISTINCT u.task COLLATE "C" ORDER BY u.task COLLATE "C"),
                        '{{}}')
        INTO v_tasks
        FROM unnest(p_tasks) AS u(task)
        WHERE v_session.tasks ? u.task;
        -- The limits of the limited tasks, after the session and in task order (the runtime's
        -- lock order); each statement after this one sees every claim of them committed.
        PERFORM 1 FROM task_limits AS tl WHERE tl.task = ANY (v_tasks)
        ORDER BY tl.task FOR UPDATE;
        SELECT count(*) INTO v_in_flight FROM run_dispatch_leases
        WHERE holder_session_id = v_session.id AND status = 'leased';
        SELECT coalesce(json_object_agg(tl.task, tl.max_running), '{{}}'::json) INTO v_limits
        FROM task_limits AS tl WHERE tl.task = ANY (v_tasks);
    ELSE
        v_session := NULL;
    END IF;
    SELECT g.open, g.reason, g.changed_at INTO v_gate FROM dispatch_gate AS g WHERE g.id = 1;
    IF NOT FOUND THEN
        SELECT false AS open, 'the dispatch gate has no row' AS reason,
               NULL::timestamptz AS changed_at INTO v_gate;
    END IF;

    IF v_gate.open AND v_session.status = 'active' THEN
        FOREACH v_task IN ARRAY v_tasks LOOP
            v_taken := 0;
            v_after_priority := NULL;
            v_after_at := '-infinity';
            v_after_id := '';
            -- Pages of candidates in claim order (ix_runs_claimable): the highest priority
            -- first, then in the order the Runs became queued, until enough are locked or none
            -- is left; the Attempt of a queued Run is its latest.
            LOOP
                v_seen := 0;
                FOR v_candidate IN
                    SELECT a.id AS attempt_id, a.run_id, r.priority, r.updated_at
                    FROM runs AS r
                    JOIN run_attempts AS a ON a.run_id = r.id AND a.number = r.attempt_count
                    WHERE r.status IN ({claimable_runs}) AND r.task = v_task AND {pristine}
                      AND (v_after_priority IS NULL
                           OR r.priority < v_after_priority
                           OR (r.priority = v_after_priority
                               AND (r.updated_at, r.id) > (v_after_at, v_after_id COLLATE "C")))
                    ORDER BY r.priority DESC, r.updated_at, r.id
                    LIMIT p_limit + {page_slack}
                LOOP
                    v_seen := v_seen + 1;
                    v_after_priority := v_candidate.priority;
                    v_after_at := v_candidate.updated_at;
                    v_after_id := v_candidate.run_id;
                    -- The runtime's lock order: the Attempt's advisory lock, then its rows.
                    CONTINUE WHEN NOT pg_try_advisory_xact_lock(
                        {namespace}, hashtext(v_candidate.attempt_id));
                    PERFORM 1 FROM runs AS r JOIN run_attempts AS a ON a.run_id = r.id
                    WHERE a.id = v_candidate.attempt_id
                      AND r.status IN ({claimable_runs}) AND {pristine}
                    FOR UPDATE OF r, a SKIP LOCKED;
                    CONTINUE WHEN NOT FOUND;
                    v_locked := v_locked || v_candidate.attempt_id;
                    v_taken := v_taken + 1;
                    EXIT WHEN v_taken >= p_limit;
                END LOOP;
                EXIT WHEN v_taken >= p_limit OR v_seen < p_limit + {page_slack};
            END LOOP;
        END LOOP;
        -- What was locked, read once (and built into JSON once), in the order it was locked.
        SELECT coalesce(json_agg(json_build_object(
                   'run', row_to_json(r),
                   'attempt', row_to_json(a),
                   'lease', (SELECT row_to_json(l) FROM run_dispatch_leases AS l
                             WHERE l.run_id = r.id ORDER BY l.generation DESC LIMIT 1))
                   ORDER BY k.n), '[]'::json)
        INTO v_candidates
        FROM unnest(v_locked) WITH ORDINALITY AS k(id, n)
        JOIN run_attempts AS a ON a.id = k.id
        JOIN runs AS r ON r.id = a.run_id;
        SELECT coalesce(json_object_agg(f.task, f.n), '{{}}'::json) INTO v_by_task
        FROM (SELECT r.task, count(*) AS n
              FROM run_dispatch_leases AS l JOIN runs AS r ON r.id = l.run_id
              WHERE l.status = 'leased' AND r.task IN (
                  SELECT c.task FROM runs AS c JOIN run_attempts AS a ON a.run_id = c.id
                  WHERE a.id = ANY (v_locked))
              GROUP BY r.task) AS f;
    END IF;

    RETURN json_build_object(
        'session', CASE WHEN v_session.id IS NULL THEN NULL ELSE row_to_json(v_session) END,
        'in_flight', v_in_flight,
        'gate', json_build_object('open', v_gate.open, 'reason', v_gate.reason,
                                  'changed_at', v_gate.changed_at),
        'candidates', v_candidates,
        'in_flight_by_task', v_by_task,
        'task_limits', v_limits,
        'observed_at', floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint);
END $$;
"""

# Inserted into ql3_ingress_claim_one after its capacity check.
_LIMIT_ANCHOR = (
    "    IF EXISTS (SELECT 1 FROM run_dispatch_leases"
    " WHERE run_id = p_run.id AND status = 'leased')\n"
)
_LIMIT_CHECK = """    -- The task's limit, locked as a claim's locks lock it (ADR 0014).
    SELECT tl.max_running INTO v_limit FROM task_limits AS tl WHERE tl.task = p_run.task
    FOR UPDATE;
    IF FOUND THEN
        SELECT count(*) INTO v_running FROM run_dispatch_leases AS l
        JOIN runs AS r ON r.id = l.run_id
        WHERE l.status = 'leased' AND r.task = p_run.task;
        IF v_running >= v_limit THEN
            PERFORM ql3_ingress_conflict(format(
                'task %s has %s attempts running: its limit is %s',
                p_run.task, v_running, v_limit));
        END IF;
    END IF;
"""
_DECLARE_ANCHOR = "    v_held integer;\n"
_DECLARE_LIMIT = "    v_held integer;\n    v_limit integer;\n    v_running integer;\n"


def _revision_0005() -> ModuleType:
    """Migration 0005_ingress_claim, whose claim functions this one replaces."""
    path = Path(__file__).with_name("r0005_ingress_claim.py")
    spec = importlib.util.spec_from_file_location("ql3_migration_0005_ingress_claim", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replaced(sql: str, anchor: str, text: str) -> str:
    if sql.count(anchor) != 1:
        raise RuntimeError(f"migration 0005's text changed: {anchor.strip()!r}")
    return sql.replace(anchor, text)


def claim_one_sql(r0005: ModuleType) -> str:
    """0005's ``ql3_ingress_claim_one`` with the task limit's check."""
    sql = r0005._CLAIM_SQL.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION")
    sql = _replaced(sql, _DECLARE_ANCHOR, _DECLARE_LIMIT)
    return _replaced(sql, _LIMIT_ANCHOR, _LIMIT_CHECK + _LIMIT_ANCHOR)


def upgrade() -> None:
    r0005 = _revision_0005()
    values = r0005._values()
    values.update(
        namespace=ADVISORY_LOCK_NAMESPACE,
        max_items=MAX_BATCH_ITEMS,
        page_slack=CLAIM_PAGE_SLACK,
        claimable_runs=r0005._list(CLAIMABLE_RUN_STATUSES),
    )
    op.drop_index(op.f("ix_runs_claimable"), table_name="runs")
    op.create_index(
        op.f("ix_runs_claimable"),
        "runs",
        ["task", sa.text("priority DESC"), "updated_at", "id"],
        postgresql_where=sa.text("status IN ('queued')"),
    )
    op.execute(sa.text(_LOCK_SQL.format(pristine=r0005._pristine("a"), **values)))
    op.execute(
        sa.text(claim_one_sql(r0005).format(pristine=r0005._pristine("p_attempt"), **values))
    )
    op.execute(sa.text(f"REVOKE ALL ON FUNCTION {ENTRY_POINT} FROM PUBLIC"))


def downgrade() -> None:
    r0005 = _revision_0005()
    values = r0005._values()
    replace = "CREATE OR REPLACE FUNCTION"
    for block, alias in ((r0005._LOCK_SQL, "a"), (r0005._CLAIM_SQL, "p_attempt")):
        sql = block.format(pristine=r0005._pristine(alias), **values)
        op.execute(sa.text(sql.replace("CREATE FUNCTION", replace)))
    op.drop_index(op.f("ix_runs_claimable"), table_name="runs")
    op.create_index(
        op.f("ix_runs_claimable"),
        "runs",
        ["task", "updated_at", "id"],
        postgresql_where=sa.text("status IN ('queued')"),
    )
