"""The worker ingress on the claim protocol of ADR 0007: the claim, the hand-back, and reads of
several Attempts in one call.

The ingress role still writes only through fenced ``SECURITY DEFINER`` functions (ADR 0004);
the Python domain decides, the functions re-check that what they are sent is a transition a worker
may make, under the locks the runtime's own store takes. This revision

- adds ``ql3_ingress_claim_lock(session_id, secret_hash, tasks, limit)`` (``SECURITY DEFINER``:
  row locks need a privilege the ingress role does not have). For the session authenticated by
  its secret hash it locks the session row (two claims of one session count its capacity one
  after the other), counts the ``leased`` leases it holds and reads the dispatch gate; while the
  gate is open and the session active, it locks, for each task both named and served by the
  session, up to ``limit`` pristine Attempts of ``queued`` Runs, in the order the Runs became
  ``queued`` (``ix_runs_claimable`` of ``0004_dispatch_gate``): the Attempt's
  advisory lock is tried (the runtime's lock order: advisory lock first, then rows) and the Run
  and Attempt rows are locked ``FOR UPDATE SKIP LOCKED``; what another transaction holds is
  skipped. It answers one JSON object (``json``, cheaper to build and to parse than ``jsonb``):
  the session, its lease count, the gate, the candidates (Run, Attempt, the Run's latest lease),
  the in-flight count of the candidates' tasks and the clock (``statement_timestamp()``, epoch
  milliseconds). Candidates are read a page at a time, so a claim reads the oldest few queued
  Runs of each task, never the whole queue;
- adds ``ql3_ingress_lock_attempts(attempt_ids, skip_locked)`` (``SECURITY INVOKER``: it only
  takes advisory locks, which any role may, and reads what the role may read). Each Attempt's
  advisory lock is taken (or tried) in the order given, then the Runs, Attempts and leases are
  read by a statement of their own, whose snapshot sees every commit made before each lock was
  granted; one call for a whole batch;
- replaces ``ql3_ingress_apply_one``: it takes the claim (``attempt_started``: Run
  ``queued -> running``, pristine Attempt ``claimed -> running`` with session, worker, the next
  lease generation, version 1 and offered/accepted/started at "now", a new ``leased`` lease held
  by the acting session with a token hash, under the dispatch gate and within the session's
  capacity; checked by ``ql3_ingress_claim_one``) and the hand-back (``attempt_released``: an
  Attempt held by the acting session goes back to pristine ``claimed``, its lease is released
  for ``handed_back`` with version + 1, the Run goes back to ``queued``, and
  ``NOTIFY ql3_dispatch`` is sent; the lease may have expired, handing back gives authority
  up). The transitions of the offer protocol of ADR 0005 (accept, activate, mark running) are
  no longer taken: nothing sends them, and they are refused as not a worker transition;
- replaces ``ql3_ingress_apply``: a call's items are processed in the order of their Attempt,
  the claims after every other item, so that a completion or hand-back frees its slot before the
  claims of the same call count the session's leases.

Status lists are frozen here as literals; a test checks them against ``ql3.domain.states``.

Revision ID: 0005_ingress_claim
Revises: 0004_dispatch_gate
Create Date: 2026-08-09
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0005_ingress_claim"
down_revision = "0004_dispatch_gate"
branch_labels = None
depends_on = None

# Frozen here as in 0002_ingress; tests check them against the application's constants.
ADVISORY_LOCK_NAMESPACE = 5327923
MAX_BATCH_ITEMS = 256
DISPATCH_CHANNEL = "ql3_dispatch"
# A claim reads its candidates of each task a page at a time: as many as it may lock, and this
# many more for those other transactions hold.
CLAIM_PAGE_SLACK = 16

# Frozen status sets (checked against ql3.domain.states by a test).
CLAIMABLE_RUN_STATUSES = ("queued",)
HANDED_BACK_RUN_STATUSES = ("dispatching", "running")
LOSABLE_RUN_STATUSES = ("dispatching", "lost", "running")
NON_TERMINAL_ATTEMPT_STATUSES = ("claimed", "running", "starting")
RELEASABLE_ATTEMPT_STATUSES = ("claimed", "running", "starting")
STARTED_ATTEMPT_STATUSES = ("running", "starting")

# What each worker transition the functions take moves: (Run statuses from, Run status to,
# Attempt statuses from, Attempt status to). A test checks every pair against the domain's
# state diagrams (ql3.domain.states.RUN_EDGES, ATTEMPT_EDGES).
WORKER_TRANSITIONS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...], str]] = {
    "attempt_started": (CLAIMABLE_RUN_STATUSES, "running", ("claimed",), "running"),
    "attempt_released": (
        HANDED_BACK_RUN_STATUSES,
        "queued",
        RELEASABLE_ATTEMPT_STATUSES,
        "claimed",
    ),
    "attempt_succeeded": (("running",), "succeeded", STARTED_ATTEMPT_STATUSES, "succeeded"),
    "attempt_failed": (("running",), "failed", STARTED_ATTEMPT_STATUSES, "failed"),
    "attempt_lost": (LOSABLE_RUN_STATUSES, "lost", NON_TERMINAL_ATTEMPT_STATUSES, "lost"),
}
# Changes that move no status: the record of a worker's abandon report after its lease expired.
WORKER_EVENTS = (*WORKER_TRANSITIONS, "evidence_recorded")

# The columns a claim sets on the pristine Attempt, and a hand-back clears again.
CLAIM_FACTS = (
    "session_id",
    "worker_id",
    "lease_generation",
    "lease_version",
    "offered_at",
    "accepted_at",
    "started_at",
)

ENTRY_POINTS = (
    "ql3_ingress_claim_lock(text, text, text[], integer)",
    "ql3_ingress_lock_attempts(text[], boolean)",
)
HELPERS = ("ql3_ingress_claim_one(jsonb, runs, run_attempts)",)


def _list(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def _pristine(alias: str) -> str:
    """The SQL condition of a pristine Attempt (``ql3.domain.model.Attempt.is_pristine``)."""
    nulls = (c for c in CLAIM_FACTS if c != "lease_version")
    return f"{alias}.status = 'claimed' AND " + " AND ".join(f"{alias}.{c} IS NULL" for c in nulls)


_LOCK_SQL = """
-- The locks and reads of a claim: the session, its lease count, the gate, the candidates.
CREATE FUNCTION ql3_ingress_claim_lock(p_session_id text, p_secret_hash text, p_tasks text[],
                                       p_limit integer)
RETURNS json
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {path} AS $$
DECLARE
    v_session worker_sessions;
    v_gate record;
    v_in_flight integer := 0;
    v_task text;
    v_taken integer;
    v_candidate record;
    v_seen integer;
    v_after_at timestamptz;
    v_after_id text;
    v_locked text[] := '{{}}';
    v_candidates json := '[]'::json;
    v_by_task json := '{{}}'::json;
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
        SELECT count(*) INTO v_in_flight FROM run_dispatch_leases
        WHERE holder_session_id = v_session.id AND status = 'leased';
    ELSE
        v_session := NULL;
    END IF;
    SELECT g.open, g.reason, g.changed_at INTO v_gate FROM dispatch_gate AS g WHERE g.id = 1;
    IF NOT FOUND THEN
        SELECT false AS open, 'the dispatch gate has no row' AS reason,
               NULL::timestamptz AS changed_at INTO v_gate;
    END IF;

    IF v_gate.open AND v_session.status = 'active' THEN
        FOR v_task IN
            SELECT DISTINCT u.task COLLATE "C" FROM unnest(p_tasks) AS u(task)
            WHERE v_session.tasks ? u.task ORDER BY 1
        LOOP
            v_taken := 0;
            v_after_at := '-infinity';
            v_after_id := '';
            -- Pages of candidates in the order the Runs became queued (ix_runs_claimable), until
            -- enough are locked or none is left; the Attempt of a queued Run is its latest.
            LOOP
                v_seen := 0;
                FOR v_candidate IN
                    SELECT a.id AS attempt_id, a.run_id, r.updated_at
                    FROM runs AS r
                    JOIN run_attempts AS a ON a.run_id = r.id AND a.number = r.attempt_count
                    WHERE r.status IN ({claimable_runs}) AND r.task = v_task AND {pristine}
                      AND (r.updated_at, r.id) > (v_after_at, v_after_id COLLATE "C")
                    ORDER BY r.updated_at, r.id
                    LIMIT p_limit + {page_slack}
                LOOP
                    v_seen := v_seen + 1;
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
        'observed_at', floor(extract(epoch FROM statement_timestamp()) * 1000)::bigint);
END $$;

-- Attempts locked one after the other in the order given, then read once every lock is held.
CREATE FUNCTION ql3_ingress_lock_attempts(p_attempt_ids text[], p_skip_locked boolean)
RETURNS json
LANGUAGE plpgsql SECURITY INVOKER SET search_path = {path} AS $$
DECLARE
    v_id text;
    v_got boolean[] := '{{}}';
    v_found json;
BEGIN
    IF p_attempt_ids IS NULL OR cardinality(p_attempt_ids) NOT BETWEEN 1 AND {max_items} THEN
        PERFORM ql3_ingress_refuse('a call locks 1..{max_items} attempts');
    END IF;
    FOREACH v_id IN ARRAY p_attempt_ids LOOP
        IF coalesce(p_skip_locked, false) THEN
            v_got := v_got || pg_try_advisory_xact_lock({namespace}, hashtext(v_id));
        ELSE
            PERFORM pg_advisory_xact_lock({namespace}, hashtext(v_id));
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
END $$;
"""

_CLAIM_SQL = """
-- A claim: the pristine Attempt of a queued Run starts under a new lease held by the acting
-- session. The caller (ql3_ingress_apply_one) holds the Attempt's advisory lock and has locked
-- and passed the Run and Attempt rows.
CREATE FUNCTION ql3_ingress_claim_one(p jsonb, p_run runs, p_attempt run_attempts)
RETURNS void
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_event jsonb := p->'event';
    v_data jsonb;
    v_session worker_sessions;
    v_gate_open boolean;
    v_held integer;
    v_generation integer;
    v_now timestamptz;
    v_expires timestamptz;
    v_run_to jsonb;
    v_attempt_to jsonb;
    v_lease jsonb;
    v_key text;
BEGIN
    IF p->'report' IS NOT NULL AND p->'report' <> 'null'::jsonb THEN
        PERFORM ql3_ingress_refuse('a claim carries no report');
    END IF;
    -- The session's row: claims of one session count its capacity one after the other.
    SELECT * INTO v_session FROM worker_sessions WHERE id = p->>'session_id';
    IF NOT FOUND OR p->>'secret_hash' IS NULL
        OR v_session.secret_hash IS DISTINCT FROM p->>'secret_hash'
    THEN
        PERFORM ql3_ingress_conflict(format('session %s is not authenticated', p->>'session_id'));
    END IF;
    SELECT * INTO v_session FROM worker_sessions WHERE id = v_session.id FOR UPDATE;
    IF v_session.status <> 'active' THEN
        PERFORM ql3_ingress_conflict(
            format('session %s is %s: it takes no new work', v_session.id, v_session.status));
    END IF;

    -- Compare-and-set on what the caller read.
    IF p_run.status IS DISTINCT FROM p #>> '{{run,status}}'
        OR p_run.attempt_count IS DISTINCT FROM (p #>> '{{run,attempt_count}}')::integer
    THEN
        PERFORM ql3_ingress_conflict(format('run %s changed since it was read', p_run.id));
    END IF;
    IF p_attempt.status IS DISTINCT FROM p #>> '{{attempt,status}}'
        OR p_attempt.lease_version IS DISTINCT FROM (p #>> '{{attempt,lease_version}}')::integer
    THEN
        PERFORM ql3_ingress_conflict(format('attempt %s changed since it was read', p_attempt.id));
    END IF;

    -- What a claim takes, and under which conditions.
    IF p_run.status NOT IN ({claimable_runs}) OR NOT ({pristine})
        OR p_attempt.number IS DISTINCT FROM p_run.attempt_count
    THEN
        PERFORM ql3_ingress_refuse(format(
            'a claim takes the pristine attempt of a queued run (run %s is %s, attempt %s is %s)',
            p_run.id, p_run.status, p_attempt.id, p_attempt.status));
    END IF;
    IF NOT (v_session.tasks ? p_run.task) THEN
        PERFORM ql3_ingress_refuse(
            format('session %s does not serve task %s', v_session.id, p_run.task));
    END IF;
    -- Read, not locked (every claim reads it): a gate closed since the claim's locks were
    -- taken is a conflict, the claim is decided again.
    SELECT g.open INTO v_gate_open FROM dispatch_gate AS g WHERE g.id = 1;
    IF v_gate_open IS NOT TRUE THEN
        PERFORM ql3_ingress_conflict('the dispatch gate is closed: no claim is granted');
    END IF;
    SELECT count(*) INTO v_held FROM run_dispatch_leases
    WHERE holder_session_id = v_session.id AND status = 'leased';
    IF v_held >= v_session.capacity THEN
        PERFORM ql3_ingress_refuse(format('session %s holds %s leases: its capacity is %s',
                                          v_session.id, v_held, v_session.capacity));
    END IF;
    IF EXISTS (SELECT 1 FROM run_dispatch_leases WHERE run_id = p_run.id AND status = 'leased')
    THEN
        PERFORM ql3_ingress_conflict(format('run %s holds a leased lease', p_run.id));
    END IF;
    SELECT coalesce(max(generation), 0) + 1 INTO v_generation
    FROM run_dispatch_leases WHERE run_id = p_run.id;

    -- The change: exactly the claim's columns, at this transaction's "now".
    v_run_to := ql3_ingress_only(p #> '{{run,to}}', ARRAY['status', 'updated_at'],
                                 'claim: the run');
    v_attempt_to := ql3_ingress_only(p #> '{{attempt,to}}',
        ARRAY['status', {claim_facts}, 'updated_at'], 'claim: the attempt');
    v_lease := ql3_ingress_only(p->'new_lease',
        ARRAY['run_id', 'generation', 'attempt_id', 'version', 'status', 'holder_session_id',
              'token_hash', 'expires_at', 'granted_at', 'release_reason', 'released_at'],
        'claim: the new lease');
    v_now := ql3_ingress_now(v_run_to->>'updated_at', 'run updated_at');
    IF v_run_to->>'status' IS DISTINCT FROM 'running'
        OR v_attempt_to->>'status' IS DISTINCT FROM 'running'
        OR v_attempt_to->>'session_id' IS DISTINCT FROM v_session.id
        OR v_attempt_to->>'worker_id' IS DISTINCT FROM v_session.worker_id
        OR (v_attempt_to->>'lease_generation')::integer IS DISTINCT FROM v_generation
        OR (v_attempt_to->>'lease_version')::integer IS DISTINCT FROM 1
    THEN
        PERFORM ql3_ingress_refuse('a claim starts the attempt for the claiming session under '
                                   'the next lease generation, version 1');
    END IF;
    FOREACH v_key IN ARRAY ARRAY['offered_at', 'accepted_at', 'started_at', 'updated_at'] LOOP
        IF (v_attempt_to->>v_key)::timestamptz IS DISTINCT FROM v_now THEN
            PERFORM ql3_ingress_refuse(
                'a claim offers, accepts and starts the attempt at once, now');
        END IF;
    END LOOP;
    IF v_lease->>'run_id' IS DISTINCT FROM p_run.id
        OR v_lease->>'attempt_id' IS DISTINCT FROM p_attempt.id
        OR (v_lease->>'generation')::integer IS DISTINCT FROM v_generation
        OR (v_lease->>'version')::integer IS DISTINCT FROM 1
        OR v_lease->>'status' IS DISTINCT FROM 'leased'
        OR v_lease->>'holder_session_id' IS DISTINCT FROM v_session.id
        OR (v_lease->>'granted_at')::timestamptz IS DISTINCT FROM v_now
        OR v_lease->>'release_reason' IS NOT NULL
        OR v_lease->>'released_at' IS NOT NULL
    THEN
        PERFORM ql3_ingress_refuse('a claim grants a new leased lease of the next generation, '
                                   'version 1, to the claiming session, now');
    END IF;
    IF coalesce(v_lease->>'token_hash', '') !~ '^[0-9a-f]{{64}}$' THEN
        PERFORM ql3_ingress_refuse('a claim binds the hash of a token');
    END IF;
    v_expires := ql3_ingress_expiry(v_lease->>'expires_at', v_now);
    IF v_expires <= v_now THEN
        PERFORM ql3_ingress_refuse('a claim grants a lease that is live');
    END IF;
    v_data := ql3_ingress_only(v_event->'data', ARRAY['generation', 'session_id', 'worker_id'],
                               'claim: the event');
    IF v_data->>'session_id' IS DISTINCT FROM v_session.id
        OR v_data->>'worker_id' IS DISTINCT FROM v_session.worker_id
        OR (v_data->>'generation')::integer IS DISTINCT FROM v_generation
    THEN
        PERFORM ql3_ingress_refuse('a claim''s event names its session, worker and generation');
    END IF;

    UPDATE runs SET status = 'running', updated_at = v_now WHERE id = p_run.id;
    UPDATE run_attempts SET
        status = 'running', session_id = v_session.id, worker_id = v_session.worker_id,
        lease_generation = v_generation, lease_version = 1, offered_at = v_now,
        accepted_at = v_now, started_at = v_now, updated_at = v_now
    WHERE id = p_attempt.id;
    INSERT INTO run_dispatch_leases (run_id, generation, attempt_id, version, status,
                                     holder_session_id, token_hash, expires_at, granted_at,
                                     release_reason, released_at)
    VALUES (p_run.id, v_generation, p_attempt.id, 1, 'leased', v_session.id,
            v_lease->>'token_hash', v_expires, v_now, NULL, NULL);
    INSERT INTO run_events (run_id, attempt_id, type, at, data)
    VALUES (p_run.id, p_attempt.id, 'attempt_started',
            ql3_ingress_now(v_event->>'at', 'the event time'), v_data);
END $$;
"""

_APPLY_SQL = """
-- One fenced change of an Attempt, with its one event: a claim of a pristine Attempt (see
-- ql3_ingress_claim_one), or a change of an Attempt whose lease the acting session holds.
CREATE OR REPLACE FUNCTION ql3_ingress_apply_one(p jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_kind text := p #>> '{{event,type}}';
    v_run_id text := p->>'run_id';
    v_attempt_id text := p->>'attempt_id';
    v_event jsonb := p->'event';
    v_report jsonb := p->'report';
    v_session worker_sessions;
    v_run runs;
    v_attempt run_attempts;
    v_lease run_dispatch_leases;
    v_run_to jsonb;
    v_attempt_to jsonb;
    v_lease_to jsonb;
    v_end text;
    v_reason text;
    v_key text;
    v_value jsonb;
BEGIN
    IF v_kind IS NULL OR v_kind NOT IN ({worker_events}) THEN
        PERFORM ql3_ingress_refuse(
            format('%s is not a worker transition', coalesce(v_kind, 'a change without event')));
    END IF;
    IF v_run_id IS NULL OR v_attempt_id IS NULL THEN
        PERFORM ql3_ingress_refuse('a change names its run and attempt');
    END IF;
    IF v_event->>'attempt_id' IS DISTINCT FROM v_attempt_id
        OR jsonb_typeof(v_event->'data') IS DISTINCT FROM 'object'
    THEN
        PERFORM ql3_ingress_refuse('the event belongs to the attempt and carries an object');
    END IF;

    -- The store's lock order: the Attempt's advisory lock, then the Run, Attempt and lease rows.
    PERFORM pg_advisory_xact_lock({namespace}, hashtext(v_attempt_id));
    SELECT * INTO v_run FROM runs WHERE id = v_run_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM ql3_ingress_conflict(format('run %s not found', v_run_id));
    END IF;
    SELECT * INTO v_attempt FROM run_attempts
    WHERE id = v_attempt_id AND run_id = v_run_id FOR UPDATE;
    IF NOT FOUND THEN
        PERFORM ql3_ingress_conflict(
            format('attempt %s of run %s not found', v_attempt_id, v_run_id));
    END IF;
    IF v_kind = 'attempt_started' THEN
        PERFORM ql3_ingress_claim_one(p, v_run, v_attempt);
        RETURN;
    END IF;
    SELECT * INTO v_lease FROM run_dispatch_leases
    WHERE run_id = v_run_id AND generation = v_attempt.lease_generation FOR UPDATE;
    IF NOT FOUND OR v_lease.attempt_id <> v_attempt.id THEN
        PERFORM ql3_ingress_conflict(format('attempt %s holds no lease', v_attempt_id));
    END IF;

    v_session := ql3_ingress_session(p->>'session_id', p->>'secret_hash',
                                     v_kind IN ('attempt_lost', 'evidence_recorded'));

    -- Compare-and-set on what the caller read.
    IF v_run.status IS DISTINCT FROM p #>> '{{run,status}}'
        OR v_run.attempt_count IS DISTINCT FROM (p #>> '{{run,attempt_count}}')::integer
    THEN
        PERFORM ql3_ingress_conflict(format('run %s changed since it was read', v_run_id));
    END IF;
    IF v_attempt.status IS DISTINCT FROM p #>> '{{attempt,status}}'
        OR v_attempt.lease_version IS DISTINCT FROM (p #>> '{{attempt,lease_version}}')::integer
    THEN
        PERFORM ql3_ingress_conflict(format('attempt %s changed since it was read', v_attempt_id));
    END IF;
    IF v_lease.generation IS DISTINCT FROM (p #>> '{{lease,generation}}')::integer
        OR v_lease.version IS DISTINCT FROM (p #>> '{{lease,version}}')::integer
        OR v_lease.status IS DISTINCT FROM p #>> '{{lease,status}}'
        OR v_lease.token_hash IS DISTINCT FROM p #>> '{{lease,token_hash}}'
    THEN
        PERFORM ql3_ingress_conflict(format('lease %s/%s is not the lease presented',
                                            v_run_id, v_lease.generation));
    END IF;

    -- The fence.
    IF v_lease.holder_session_id IS DISTINCT FROM v_session.id THEN
        PERFORM ql3_ingress_conflict(format('lease %s/%s is held by another session',
                                            v_run_id, v_lease.generation));
    END IF;
    IF v_lease.status <> 'leased' THEN
        PERFORM ql3_ingress_conflict(
            format('lease %s/%s is released', v_run_id, v_lease.generation));
    END IF;
    -- An offer of ADR 0005 that was never accepted has no token: only a hand-back takes it.
    IF v_lease.token_hash IS NULL AND v_kind <> 'attempt_released' THEN
        PERFORM ql3_ingress_conflict(format('attempt %s was not accepted', v_attempt_id));
    END IF;
    IF v_kind = 'evidence_recorded' THEN
        IF v_lease.expires_at > statement_timestamp() THEN
            PERFORM ql3_ingress_conflict(format('lease %s/%s is live: abandon releases it',
                                                v_run_id, v_lease.generation));
        END IF;
    ELSIF v_kind <> 'attempt_released' AND v_lease.expires_at <= statement_timestamp() THEN
        -- A hand-back gives authority up: it is taken on an expired lease too.
        PERFORM ql3_ingress_conflict(format('lease %s/%s expired', v_run_id, v_lease.generation));
    END IF;

    -- The transition: allowed (from, to) pairs and the columns each one changes.
    CASE v_kind
    WHEN 'attempt_released' THEN
        v_reason := 'handed_back';
        v_run_to := ql3_ingress_only(p #> '{{run,to}}',
            ARRAY['status', 'updated_at'], 'hand-back: the run');
        v_attempt_to := ql3_ingress_only(p #> '{{attempt,to}}',
            ARRAY['status', {claim_facts}, 'updated_at'], 'hand-back: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{{lease,to}}',
            ARRAY['status', 'version', 'release_reason', 'released_at'], 'hand-back: the lease');
        IF v_run.status NOT IN ({handed_back_runs})
            OR v_run_to->>'status' IS DISTINCT FROM 'queued'
            OR v_attempt.status NOT IN ({releasable_attempts})
            OR coalesce(v_attempt_to->>'status', v_attempt.status) <> 'claimed'
        THEN
            PERFORM ql3_ingress_refuse('a hand-back takes a held attempt back to claimed and '
                                       'its run back to queued');
        END IF;
        -- Pristine again: every fact of the claim is cleared.
        FOREACH v_key IN ARRAY ARRAY[{claim_facts}] LOOP
            v_value := CASE WHEN v_attempt_to ? v_key THEN v_attempt_to->v_key
                            ELSE to_jsonb(v_attempt)->v_key END;
            IF v_value IS DISTINCT FROM 'null'::jsonb THEN
                PERFORM ql3_ingress_refuse('a handed-back attempt is pristine again');
            END IF;
        END LOOP;
        PERFORM ql3_ingress_only(v_event->'data',
            ARRAY['cause', 'lease_generation', 'lease_version', 'previous_status', 'session_id'],
            'hand-back: the event');
        IF v_event #>> '{{data,session_id}}' IS DISTINCT FROM v_session.id
            OR length(coalesce(v_event #>> '{{data,cause}}', '')) > 500
        THEN
            PERFORM ql3_ingress_refuse(
                'a hand-back''s event names the session and a cause of at most 500 characters');
        END IF;
    WHEN 'attempt_succeeded', 'attempt_failed' THEN
        v_end := CASE v_kind WHEN 'attempt_succeeded' THEN 'succeeded' ELSE 'failed' END;
        v_reason := 'completed';
        v_run_to := ql3_ingress_only(p #> '{{run,to}}',
            ARRAY['status', 'output', 'error', 'updated_at'], 'complete: the run');
        v_attempt_to := ql3_ingress_only(p #> '{{attempt,to}}',
            ARRAY['status', 'lease_version', 'finished_at', 'error', 'updated_at'],
            'complete: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{{lease,to}}',
            ARRAY['status', 'version', 'release_reason', 'released_at'], 'complete: the lease');
        IF v_run.status <> 'running' OR v_run_to->>'status' IS DISTINCT FROM v_end
            OR v_attempt.status NOT IN ({started_attempts})
            OR v_attempt_to->>'status' IS DISTINCT FROM v_end
        THEN
            PERFORM ql3_ingress_refuse(format(
                'complete takes a running run and its started attempt to %s', v_end));
        END IF;
        IF v_end = 'failed' AND coalesce(v_run_to->'output', 'null'::jsonb) <> 'null'::jsonb THEN
            PERFORM ql3_ingress_refuse('a failed run has no output');
        END IF;
    WHEN 'attempt_lost' THEN
        v_reason := 'abandoned';
        v_run_to := ql3_ingress_only(p #> '{{run,to}}',
            ARRAY['status', 'updated_at'], 'abandon: the run');
        v_attempt_to := ql3_ingress_only(p #> '{{attempt,to}}',
            ARRAY['status', 'lease_version', 'lost_evidence', 'finished_at', 'updated_at'],
            'abandon: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{{lease,to}}',
            ARRAY['status', 'version', 'release_reason', 'released_at'], 'abandon: the lease');
        IF v_run.status NOT IN ({losable_runs})
            OR coalesce(v_run_to->>'status', v_run.status) <> 'lost'
            OR v_attempt.status NOT IN ({non_terminal_attempts})
            OR v_attempt_to->>'status' IS DISTINCT FROM 'lost'
            OR v_attempt_to->>'lost_evidence' IS DISTINCT FROM 'worker_abandoned'
            OR v_event #>> '{{data,evidence}}' IS DISTINCT FROM 'worker_abandoned'
        THEN
            PERFORM ql3_ingress_refuse(
                'abandon takes the attempt to lost on the evidence of the worker''s own report');
        END IF;
    WHEN 'evidence_recorded' THEN
        v_run_to := ql3_ingress_only(p #> '{{run,to}}', ARRAY[]::text[], 'evidence: the run');
        v_attempt_to := ql3_ingress_only(p #> '{{attempt,to}}', ARRAY[]::text[],
                                         'evidence: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{{lease,to}}', ARRAY[]::text[], 'evidence: the lease');
        IF v_attempt.status NOT IN ({non_terminal_attempts})
            OR jsonb_typeof(v_report) IS DISTINCT FROM 'object'
            OR v_report->>'attempt_id' IS DISTINCT FROM v_attempt_id
            OR v_report->>'kind' IS DISTINCT FROM 'worker_abandoned'
            OR length(coalesce(v_report->>'detail', '')) > 500
            OR v_event #>> '{{data,evidence}}' IS DISTINCT FROM 'worker_abandoned'
        THEN
            PERFORM ql3_ingress_refuse(
                'a worker records only its own abandon report of an unfinished attempt');
        END IF;
    END CASE;
    IF v_kind <> 'evidence_recorded' AND v_report IS NOT NULL AND v_report <> 'null'::jsonb THEN
        PERFORM ql3_ingress_refuse('only the evidence of an expired lease carries a report');
    END IF;
    IF v_reason IS NOT NULL AND (
        v_lease_to->>'status' IS DISTINCT FROM 'released'
        OR (v_lease_to->>'version')::integer IS DISTINCT FROM v_lease.version + 1
        OR v_lease_to->>'release_reason' IS DISTINCT FROM v_reason
        OR NOT v_lease_to ? 'released_at'
        OR (v_reason <> 'handed_back' AND (v_attempt_to->>'lease_version')::integer
            IS DISTINCT FROM v_lease.version + 1))
    THEN
        PERFORM ql3_ingress_refuse(format(
            'the lease is released for %s with its version one step up', v_reason));
    END IF;

    -- Every time written is this transaction's "now" (a hand-back clears the claim's times).
    FOREACH v_key IN ARRAY ARRAY['updated_at'] LOOP
        IF v_run_to ? v_key THEN
            PERFORM ql3_ingress_now(v_run_to->>v_key, 'run ' || v_key);
        END IF;
    END LOOP;
    FOREACH v_key IN ARRAY ARRAY['offered_at', 'accepted_at', 'started_at', 'finished_at',
                                 'updated_at'] LOOP
        IF v_attempt_to ? v_key
            AND NOT (v_kind = 'attempt_released' AND v_attempt_to->v_key = 'null'::jsonb)
        THEN
            PERFORM ql3_ingress_now(v_attempt_to->>v_key, 'attempt ' || v_key);
        END IF;
    END LOOP;
    IF v_lease_to ? 'released_at' THEN
        PERFORM ql3_ingress_now(v_lease_to->>'released_at', 'lease released_at');
    END IF;

    -- The writes and the one event.
    IF v_run_to <> '{{}}'::jsonb THEN
        UPDATE runs SET
            status = CASE WHEN v_run_to ? 'status' THEN v_run_to->>'status' ELSE status END,
            output = CASE WHEN v_run_to ? 'output'
                THEN nullif(v_run_to->'output', 'null'::jsonb) ELSE output END,
            error = CASE WHEN v_run_to ? 'error' THEN v_run_to->>'error' ELSE error END,
            updated_at = CASE WHEN v_run_to ? 'updated_at'
                THEN (v_run_to->>'updated_at')::timestamptz ELSE updated_at END
        WHERE id = v_run_id;
    END IF;
    IF v_attempt_to <> '{{}}'::jsonb THEN
        UPDATE run_attempts SET
            status = CASE WHEN v_attempt_to ? 'status' THEN v_attempt_to->>'status' ELSE status END,
            session_id = CASE WHEN v_attempt_to ? 'session_id'
                THEN v_attempt_to->>'session_id' ELSE session_id END,
            worker_id = CASE WHEN v_attempt_to ? 'worker_id'
                THEN v_attempt_to->>'worker_id' ELSE worker_id END,
            lease_generation = CASE WHEN v_attempt_to ? 'lease_generation'
                THEN (v_attempt_to->>'lease_generation')::integer ELSE lease_generation END,
            lease_version = CASE WHEN v_attempt_to ? 'lease_version'
                THEN (v_attempt_to->>'lease_version')::integer ELSE lease_version END,
            offered_at = CASE WHEN v_attempt_to ? 'offered_at'
                THEN (v_attempt_to->>'offered_at')::timestamptz ELSE offered_at END,
            accepted_at = CASE WHEN v_attempt_to ? 'accepted_at'
                THEN (v_attempt_to->>'accepted_at')::timestamptz ELSE accepted_at END,
            started_at = CASE WHEN v_attempt_to ? 'started_at'
                THEN (v_attempt_to->>'started_at')::timestamptz ELSE started_at END,
            finished_at = CASE WHEN v_attempt_to ? 'finished_at'
                THEN (v_attempt_to->>'finished_at')::timestamptz ELSE finished_at END,
            lost_evidence = CASE WHEN v_attempt_to ? 'lost_evidence'
                THEN v_attempt_to->>'lost_evidence' ELSE lost_evidence END,
            error = CASE WHEN v_attempt_to ? 'error' THEN v_attempt_to->>'error' ELSE error END,
            updated_at = CASE WHEN v_attempt_to ? 'updated_at'
                THEN (v_attempt_to->>'updated_at')::timestamptz ELSE updated_at END
        WHERE id = v_attempt_id;
    END IF;
    IF v_lease_to <> '{{}}'::jsonb THEN
        UPDATE run_dispatch_leases SET
            status = CASE WHEN v_lease_to ? 'status' THEN v_lease_to->>'status' ELSE status END,
            version = CASE WHEN v_lease_to ? 'version'
                THEN (v_lease_to->>'version')::integer ELSE version END,
            release_reason = CASE WHEN v_lease_to ? 'release_reason'
                THEN v_lease_to->>'release_reason' ELSE release_reason END,
            released_at = CASE WHEN v_lease_to ? 'released_at'
                THEN (v_lease_to->>'released_at')::timestamptz ELSE released_at END
        WHERE run_id = v_run_id AND generation = v_lease.generation;
    END IF;
    IF v_kind = 'evidence_recorded' THEN
        INSERT INTO attempt_stop_reports (attempt_id, kind, reported_at, detail)
        VALUES (v_attempt_id, 'worker_abandoned',
                ql3_ingress_now(v_report->>'reported_at', 'reported_at'),
                coalesce(v_report->>'detail', ''));
    END IF;
    INSERT INTO run_events (run_id, attempt_id, type, at, data)
    VALUES (v_run_id, v_attempt_id, v_kind, ql3_ingress_now(v_event->>'at', 'the event time'),
            v_event->'data');
    IF v_kind = 'attempt_released' THEN
        -- The Run is queued again: wake the claims waiting at the nodes (sent at commit).
        PERFORM pg_notify('{channel}', '');
    END IF;
END $$;

-- The batch: each item in its own subtransaction, in the order of its Attempt, claims last.
CREATE OR REPLACE FUNCTION ql3_ingress_apply(p_items jsonb)
RETURNS TABLE (item integer, outcome text, detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {path} AS $$
DECLARE
    v_entry record;
BEGIN
    PERFORM ql3_ingress_check_batch(p_items);
    FOR v_entry IN
        SELECT e.value AS body, e.ordinality::integer AS position
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e
        ORDER BY (e.value #>> '{{event,type}}') IS NOT DISTINCT FROM 'attempt_started',
                 e.value->>'attempt_id' COLLATE "C", e.ordinality
    LOOP
        item := v_entry.position;
        BEGIN
            PERFORM ql3_ingress_apply_one(v_entry.body);
            outcome := 'ok';
            detail := NULL;
        EXCEPTION
            WHEN SQLSTATE 'Q3C01' OR integrity_constraint_violation THEN
                outcome := 'conflict';
                detail := SQLERRM;
            WHEN SQLSTATE 'Q3R01' OR data_exception THEN
                outcome := 'refused';
                detail := SQLERRM;
        END;
        RETURN NEXT;
    END LOOP;
END $$;
"""


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _values() -> dict[str, object]:
    schema = op.get_bind().execute(sa.text("SELECT current_schema()")).scalar_one()
    return {
        "path": f"pg_catalog, {_quote(str(schema))}, pg_temp",
        "namespace": ADVISORY_LOCK_NAMESPACE,
        "max_items": MAX_BATCH_ITEMS,
        "page_slack": CLAIM_PAGE_SLACK,
        "channel": DISPATCH_CHANNEL,
        "worker_events": _list(WORKER_EVENTS),
        "claimable_runs": _list(CLAIMABLE_RUN_STATUSES),
        "handed_back_runs": _list(HANDED_BACK_RUN_STATUSES),
        "losable_runs": _list(LOSABLE_RUN_STATUSES),
        "non_terminal_attempts": _list(NON_TERMINAL_ATTEMPT_STATUSES),
        "releasable_attempts": _list(RELEASABLE_ATTEMPT_STATUSES),
        "started_attempts": _list(STARTED_ATTEMPT_STATUSES),
        "claim_facts": _list(CLAIM_FACTS),
    }


def upgrade() -> None:
    values = _values()
    for block, alias in ((_LOCK_SQL, "a"), (_CLAIM_SQL, "p_attempt"), (_APPLY_SQL, "a")):
        op.execute(sa.text(block.format(pristine=_pristine(alias), **values)))
    for signature in (*ENTRY_POINTS, *HELPERS):
        op.execute(sa.text(f"REVOKE ALL ON FUNCTION {signature} FROM PUBLIC"))


def _revision_0002() -> ModuleType:
    """Migration 0002_ingress, whose functions the downgrade puts back."""
    path = Path(__file__).with_name("r0002_ingress_functions.py")
    spec = importlib.util.spec_from_file_location("ql3_migration_0002_ingress", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def downgrade() -> None:
    for signature in (*ENTRY_POINTS, *HELPERS):
        op.execute(sa.text(f"DROP FUNCTION IF EXISTS {signature}"))
    # Back to the functions of 0002_ingress (CREATE OR REPLACE keeps owner and grants).
    r0002 = _revision_0002()
    values = _values()
    old = {
        "path": values["path"],
        "namespace": ADVISORY_LOCK_NAMESPACE,
        "max_items": MAX_BATCH_ITEMS,
        "max_extension": r0002.MAX_LEASE_EXTENSION,
    }
    replace = "CREATE OR REPLACE FUNCTION"
    op.execute(sa.text(r0002._APPLY_SQL.format(**old).replace("CREATE FUNCTION", replace)))
    for name, one, order_key in r0002._ENTRIES:
        if name != "ql3_ingress_apply":
            continue
        sql = r0002._ENTRY_SQL.format(
            name=name, one=one, order_key=order_key.format(), path=old["path"]
        )
        op.execute(sa.text(sql.replace("CREATE FUNCTION", replace)))
