"""The claim's and the lock's reads by key: ``ql3_ingress_claim_lock`` and
``ql3_ingress_lock_attempts`` read each locked Attempt, its Run and its lease by key.

Both functions built their answer with a join of the locked keys to ``run_attempts`` and
``runs``; while a table's statistics lag far behind its size (a queue filled faster than
autovacuum analyses it), the planner hashed a sequential scan of the table for a handful of
keys. Each key is now looked up by itself (``LATERAL ... OFFSET 0``), and the claim counts the
leases in flight of the tasks it locked from the tasks it walked, not from a join back to
``runs``. The answers are the same.

The texts are frozen here: ``UPGRADE`` as the functions' renderer wrote them at this revision,
``DOWNGRADE`` as the baseline created them. The psql variable ``schema`` is bound to
``current_schema()``. ``CREATE OR REPLACE`` keeps each function's owner and privileges.

Revision ID: r0004_claim_reads_by_key
Revises: r0003_console_indexes
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "r0004_claim_reads_by_key"
down_revision = "r0003_console_indexes"
branch_labels = None
depends_on = None

SCHEMA_VARIABLE = ':"schema"'

UPGRADE = r"""
CREATE OR REPLACE FUNCTION ql3_ingress_claim_lock(p_session_id text, p_secret_hash text, p_tasks text[], p_limit integer)
 RETURNS json
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_session worker_sessions;
    v_gate record;
    v_in_flight integer := 0;
    v_tasks text[] := '{}';
    v_task text;
    v_taken integer;
    v_candidate record;
    v_seen integer;
    v_after_priority integer;
    v_after_at timestamptz;
    v_after_id text;
    v_locked text[] := '{}';
    v_locked_tasks text[] := '{}';
    v_candidates json := '[]'::json;
    v_by_task json := '{}'::json;
    v_limits json := '{}'::json;
BEGIN
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 256 THEN
        PERFORM ql3_ingress_refuse('a claim locks 1..256 attempts of each task');
    END IF;
    IF p_tasks IS NULL OR cardinality(p_tasks) > 1024 THEN
        PERFORM ql3_ingress_refuse('a claim names at most 1024 tasks');
    END IF;
    -- Authenticated before anything is locked; unknown and wrong secret answer alike.
    SELECT * INTO v_session FROM worker_sessions WHERE id = p_session_id;
    IF FOUND AND p_secret_hash IS NOT NULL AND v_session.secret_hash = p_secret_hash THEN
        SELECT * INTO v_session FROM worker_sessions WHERE id = p_session_id FOR UPDATE;
        SELECT coalesce(array_agg(DISTINCT u.task COLLATE "C" ORDER BY u.task COLLATE "C"),
                        '{}')
        INTO v_tasks
        FROM unnest(p_tasks) AS u(task)
        WHERE v_session.tasks ? u.task;
        -- The limits of the limited tasks, after the session and in task order (the runtime's
        -- lock order); each statement after this one sees every claim of them committed.
        PERFORM 1 FROM task_limits AS tl WHERE tl.task = ANY (v_tasks)
        ORDER BY tl.task FOR UPDATE;
        SELECT count(*) INTO v_in_flight FROM run_dispatch_leases
        WHERE holder_session_id = v_session.id AND status = 'leased';
        SELECT coalesce(json_object_agg(tl.task, tl.max_running), '{}'::json) INTO v_limits
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
                    WHERE r.status IN ('queued') AND r.task = v_task
                      AND a.status = 'claimed' AND a.session_id IS NULL AND a.worker_id IS NULL AND a.lease_generation IS NULL AND a.offered_at IS NULL AND a.accepted_at IS NULL AND a.started_at IS NULL
                      AND (v_after_priority IS NULL
                           OR r.priority < v_after_priority
                           OR (r.priority = v_after_priority
                               AND (r.updated_at, r.id) > (v_after_at, v_after_id COLLATE "C")))
                    ORDER BY r.priority DESC, r.updated_at, r.id
                    LIMIT p_limit + 16
                LOOP
                    v_seen := v_seen + 1;
                    v_after_priority := v_candidate.priority;
                    v_after_at := v_candidate.updated_at;
                    v_after_id := v_candidate.run_id;
                    -- The runtime's lock order: the Attempt's advisory lock, then its rows.
                    CONTINUE WHEN NOT pg_try_advisory_xact_lock(
                        5327923, hashtext(v_candidate.attempt_id));
                    PERFORM 1 FROM runs AS r JOIN run_attempts AS a ON a.run_id = r.id
                    WHERE a.id = v_candidate.attempt_id
                      AND r.status IN ('queued') AND a.status = 'claimed' AND a.session_id IS NULL AND a.worker_id IS NULL AND a.lease_generation IS NULL AND a.offered_at IS NULL AND a.accepted_at IS NULL AND a.started_at IS NULL
                    FOR UPDATE OF r, a SKIP LOCKED;
                    CONTINUE WHEN NOT FOUND;
                    v_locked := v_locked || v_candidate.attempt_id;
                    v_taken := v_taken + 1;
                    EXIT WHEN v_taken >= p_limit;
                END LOOP;
                EXIT WHEN v_taken >= p_limit OR v_seen < p_limit + 16;
            END LOOP;
            IF v_taken > 0 THEN
                v_locked_tasks := v_locked_tasks || v_task;
            END IF;
        END LOOP;
        -- What was locked, read once (and built into JSON once), in the order it was locked:
        -- each by its key (OFFSET 0 keeps the lookup per key, whatever the statistics say of
        -- the tables' size).
        SELECT coalesce(json_agg(f.found ORDER BY k.n), '[]'::json)
        INTO v_candidates
        FROM unnest(v_locked) WITH ORDINALITY AS k(id, n)
        CROSS JOIN LATERAL (
            SELECT json_build_object(
                       'run', row_to_json(r),
                       'attempt', row_to_json(a),
                       'lease', (SELECT row_to_json(l) FROM run_dispatch_leases AS l
                                 WHERE l.run_id = r.id ORDER BY l.generation DESC LIMIT 1))
                   AS found
            FROM run_attempts AS a JOIN runs AS r ON r.id = a.run_id
            WHERE a.id = k.id
            OFFSET 0) AS f;
        SELECT coalesce(json_object_agg(f.task, f.n), '{}'::json) INTO v_by_task
        FROM (SELECT r.task, count(*) AS n
              FROM run_dispatch_leases AS l JOIN runs AS r ON r.id = l.run_id
              WHERE l.status = 'leased' AND r.task = ANY (v_locked_tasks)
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_lock_attempts(p_attempt_ids text[], p_skip_locked boolean)
 RETURNS json
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_id text;
    v_got boolean[] := '{}';
    v_found json;
BEGIN
    IF p_attempt_ids IS NULL OR cardinality(p_attempt_ids) NOT BETWEEN 1 AND 256 THEN
        PERFORM ql3_ingress_refuse('a call locks 1..256 attempts');
    END IF;
    FOREACH v_id IN ARRAY p_attempt_ids LOOP
        IF coalesce(p_skip_locked, false) THEN
            v_got := v_got || pg_try_advisory_xact_lock(5327923, hashtext(v_id));
        ELSE
            PERFORM pg_advisory_xact_lock(5327923, hashtext(v_id));
            v_got := v_got || true;
        END IF;
    END LOOP;
    -- A statement of its own, once every lock is held: its snapshot sees every commit made
    -- before each lock was granted. Each Attempt is read by its key (OFFSET 0 keeps the
    -- lookup per key, whatever the statistics say of the tables' size).
    SELECT json_agg(CASE
               WHEN NOT k.got THEN json_build_object('locked', false)
               WHEN f.found IS NULL THEN 'null'::json
               ELSE f.found
               END ORDER BY k.n)
    INTO v_found
    FROM unnest(p_attempt_ids, v_got) WITH ORDINALITY AS k(id, got, n)
    LEFT JOIN LATERAL (
        SELECT json_build_object(
                   'run', row_to_json(r),
                   'attempt', row_to_json(a),
                   'lease', (SELECT row_to_json(l) FROM run_dispatch_leases AS l
                             WHERE l.run_id = a.run_id
                               AND (a.lease_generation IS NULL
                                    OR l.generation = a.lease_generation)
                             ORDER BY l.generation DESC LIMIT 1)) AS found
        FROM run_attempts AS a JOIN runs AS r ON r.id = a.run_id
        WHERE a.id = k.id AND k.got
        OFFSET 0) AS f ON true;
    RETURN json_build_object(
        'snapshots', v_found,
        'observed_at', floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint);
END $function$;
"""

DOWNGRADE = r"""
CREATE OR REPLACE FUNCTION ql3_ingress_claim_lock(p_session_id text, p_secret_hash text, p_tasks text[], p_limit integer)
 RETURNS json
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_session worker_sessions;
    v_gate record;
    v_in_flight integer := 0;
    v_tasks text[] := '{}';
    v_task text;
    v_taken integer;
    v_candidate record;
    v_seen integer;
    v_after_priority integer;
    v_after_at timestamptz;
    v_after_id text;
    v_locked text[] := '{}';
    v_candidates json := '[]'::json;
    v_by_task json := '{}'::json;
    v_limits json := '{}'::json;
BEGIN
    IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 256 THEN
        PERFORM ql3_ingress_refuse('a claim locks 1..256 attempts of each task');
    END IF;
    IF p_tasks IS NULL OR cardinality(p_tasks) > 1024 THEN
        PERFORM ql3_ingress_refuse('a claim names at most 1024 tasks');
    END IF;
    -- Authenticated before anything is locked; unknown and wrong secret answer alike.
    SELECT * INTO v_session FROM worker_sessions WHERE id = p_session_id;
    IF FOUND AND p_secret_hash IS NOT NULL AND v_session.secret_hash = p_secret_hash THEN
        SELECT * INTO v_session FROM worker_sessions WHERE id = p_session_id FOR UPDATE;
        SELECT coalesce(array_agg(DISTINCT u.task COLLATE "C" ORDER BY u.task COLLATE "C"),
                        '{}')
        INTO v_tasks
        FROM unnest(p_tasks) AS u(task)
        WHERE v_session.tasks ? u.task;
        -- The limits of the limited tasks, after the session and in task order (the runtime's
        -- lock order); each statement after this one sees every claim of them committed.
        PERFORM 1 FROM task_limits AS tl WHERE tl.task = ANY (v_tasks)
        ORDER BY tl.task FOR UPDATE;
        SELECT count(*) INTO v_in_flight FROM run_dispatch_leases
        WHERE holder_session_id = v_session.id AND status = 'leased';
        SELECT coalesce(json_object_agg(tl.task, tl.max_running), '{}'::json) INTO v_limits
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
                    WHERE r.status IN ('queued') AND r.task = v_task
                      AND a.status = 'claimed' AND a.session_id IS NULL AND a.worker_id IS NULL AND a.lease_generation IS NULL AND a.offered_at IS NULL AND a.accepted_at IS NULL AND a.started_at IS NULL
                      AND (v_after_priority IS NULL
                           OR r.priority < v_after_priority
                           OR (r.priority = v_after_priority
                               AND (r.updated_at, r.id) > (v_after_at, v_after_id COLLATE "C")))
                    ORDER BY r.priority DESC, r.updated_at, r.id
                    LIMIT p_limit + 16
                LOOP
                    v_seen := v_seen + 1;
                    v_after_priority := v_candidate.priority;
                    v_after_at := v_candidate.updated_at;
                    v_after_id := v_candidate.run_id;
                    -- The runtime's lock order: the Attempt's advisory lock, then its rows.
                    CONTINUE WHEN NOT pg_try_advisory_xact_lock(
                        5327923, hashtext(v_candidate.attempt_id));
                    PERFORM 1 FROM runs AS r JOIN run_attempts AS a ON a.run_id = r.id
                    WHERE a.id = v_candidate.attempt_id
                      AND r.status IN ('queued') AND a.status = 'claimed' AND a.session_id IS NULL AND a.worker_id IS NULL AND a.lease_generation IS NULL AND a.offered_at IS NULL AND a.accepted_at IS NULL AND a.started_at IS NULL
                    FOR UPDATE OF r, a SKIP LOCKED;
                    CONTINUE WHEN NOT FOUND;
                    v_locked := v_locked || v_candidate.attempt_id;
                    v_taken := v_taken + 1;
                    EXIT WHEN v_taken >= p_limit;
                END LOOP;
                EXIT WHEN v_taken >= p_limit OR v_seen < p_limit + 16;
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
        SELECT coalesce(json_object_agg(f.task, f.n), '{}'::json) INTO v_by_task
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_lock_attempts(p_attempt_ids text[], p_skip_locked boolean)
 RETURNS json
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_id text;
    v_got boolean[] := '{}';
    v_found json;
BEGIN
    IF p_attempt_ids IS NULL OR cardinality(p_attempt_ids) NOT BETWEEN 1 AND 256 THEN
        PERFORM ql3_ingress_refuse('a call locks 1..256 attempts');
    END IF;
    FOREACH v_id IN ARRAY p_attempt_ids LOOP
        IF coalesce(p_skip_locked, false) THEN
            v_got := v_got || pg_try_advisory_xact_lock(5327923, hashtext(v_id));
        ELSE
            PERFORM pg_advisory_xact_lock(5327923, hashtext(v_id));
            v_got := v_got || true;
        END IF;
    END LOOP;
    -- A statement of its own, once every lock is held: its snapshot sees every commit made
    -- before each lock was granted.
    SELECT json_agg(CASE
               WHEN NOT k.got THEN json_build_object('locked', false)
               WHEN a.id IS NULL THEN 'null'::json
               ELSE json_build_object(
                   'run', row_to_json(r),
                   'attempt', row_to_json(a),
                   'lease', (SELECT row_to_json(l) FROM run_dispatch_leases AS l
                             WHERE l.run_id = a.run_id
                               AND (a.lease_generation IS NULL
                                    OR l.generation = a.lease_generation)
                             ORDER BY l.generation DESC LIMIT 1))
               END ORDER BY k.n)
    INTO v_found
    FROM unnest(p_attempt_ids, v_got) WITH ORDINALITY AS k(id, got, n)
    LEFT JOIN run_attempts AS a ON a.id = k.id AND k.got
    LEFT JOIN runs AS r ON r.id = a.run_id;
    RETURN json_build_object(
        'snapshots', v_found,
        'observed_at', floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint);
END $function$;
"""


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _run(text: str) -> None:
    schema = op.get_bind().execute(sa.text("SELECT current_schema()")).scalar_one()
    op.execute(sa.text(text.replace(SCHEMA_VARIABLE, _quote(str(schema)))))


def upgrade() -> None:
    _run(UPGRADE)


def downgrade() -> None:
    _run(DOWNGRADE)
