"""The worker ingress's fenced write functions.

The worker ingress connects as its own least-privilege role (``ql3 db grant-ingress``): it may
read ``runs``, ``run_attempts``, ``run_dispatch_leases`` and ``worker_sessions`` and may execute
the four functions below, nothing else. The Python domain still decides every transition; these
functions are the only way the ingress can write, and each one

1. takes the locks the runtime's own store takes, in the same order: the Attempt's
   transaction-level advisory lock (``pg_advisory_xact_lock(0x514C33, hashtext(attempt_id))``,
   as :mod:`ql3.adapters.postgres.queries`), then the Run, Attempt and lease rows;
2. re-checks the compare-and-set preconditions of the port contract against what the caller read
   (statuses, attempt count, lease generation, version and token hash, the acting session's
   status and secret hash) and the fence (the lease is ``leased``, held by that session and, where
   the fence requires it, ``expires_at > statement_timestamp()``);
3. checks that the change is one of the transitions a worker may make (accept, activate,
   mark running, complete, abandon, not-running evidence after expiry; register, heartbeat, drain,
   close; renew), that it touches only the columns that transition changes, that every time it
   writes is a "now" of the calling transaction and that a lease moves forward by at most a day;
4. writes the rows and the one event, all or nothing.

Every function takes a JSON array of 1..256 items and returns one row per item:
``(item, outcome, detail)`` with ``item`` the item's 1-based position, ``outcome`` ``ok``,
``conflict`` (the state is no longer what the caller read or the fence does not hold; nothing was
written) or ``refused`` (not a worker transition, or malformed; nothing was written). Each item is
all or nothing on its own (a subtransaction); items are processed in the order of their Attempt
(or worker, or session) id, so that concurrent batches take their locks in one order.

The functions are ``SECURITY DEFINER``, owned by the role that runs the migrations (the schema's
owner), with ``search_path`` pinned; EXECUTE is revoked from PUBLIC. The helpers they call are
not executable by anyone but their owner.

Revision ID: 0002_ingress
Revises: 0001_initial
Create Date: 2026-08-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_ingress"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

# The first key of the store's two-key advisory locks ("QL3" in ASCII), frozen here as a literal;
# a test checks it against ql3.adapters.postgres.queries.ADVISORY_LOCK_NAMESPACE.
ADVISORY_LOCK_NAMESPACE = 5327923
MAX_BATCH_ITEMS = 256
# A lease may be moved to at most this far past the database's clock by the ingress: even a
# compromised ingress cannot hold recovery off for longer than this once it stops renewing.
MAX_LEASE_EXTENSION = "1 day"

ENTRY_POINTS = (
    "ql3_ingress_register_sessions(jsonb)",
    "ql3_ingress_update_sessions(jsonb)",
    "ql3_ingress_apply(jsonb)",
    "ql3_ingress_renew(jsonb)",
)
HELPERS = (
    "ql3_ingress_refuse(text)",
    "ql3_ingress_conflict(text)",
    "ql3_ingress_now(text, text)",
    "ql3_ingress_expiry(text, timestamp with time zone)",
    "ql3_ingress_only(jsonb, text[], text)",
    "ql3_ingress_session(text, text, boolean)",
    "ql3_ingress_check_batch(jsonb)",
    "ql3_ingress_register_one(jsonb)",
    "ql3_ingress_update_session_one(jsonb)",
    "ql3_ingress_apply_one(jsonb)",
    "ql3_ingress_renew_one(jsonb)",
)

_HELPERS_SQL = """
CREATE FUNCTION ql3_ingress_refuse(p_message text) RETURNS void
LANGUAGE plpgsql SET search_path = {path} AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'Q3R01', MESSAGE = p_message;
END $$;

CREATE FUNCTION ql3_ingress_conflict(p_message text) RETURNS void
LANGUAGE plpgsql SET search_path = {path} AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'Q3C01', MESSAGE = p_message;
END $$;

-- A time the caller observed as "now" inside this very transaction.
CREATE FUNCTION ql3_ingress_now(p_value text, p_what text) RETURNS timestamptz
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_time timestamptz := p_value::timestamptz;
BEGIN
    IF v_time IS NULL
        OR v_time < date_trunc('milliseconds', transaction_timestamp())
        OR v_time > statement_timestamp()
    THEN
        PERFORM ql3_ingress_refuse(p_what || ' must be the time observed in this transaction');
    END IF;
    RETURN v_time;
END $$;

-- A lease expiry moves forward only, and by at most MAX_LEASE_EXTENSION past the clock.
CREATE FUNCTION ql3_ingress_expiry(p_value text, p_old timestamptz) RETURNS timestamptz
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_time timestamptz := p_value::timestamptz;
BEGIN
    IF v_time IS NULL OR v_time < p_old
        OR v_time > statement_timestamp() + interval '{max_extension}'
    THEN
        PERFORM ql3_ingress_refuse(
            'a lease expiry moves forward, at most {max_extension} past the clock');
    END IF;
    RETURN v_time;
END $$;

-- The changed columns of one row: an object whose keys are all in p_allowed ('{{}}' for none).
CREATE FUNCTION ql3_ingress_only(p_to jsonb, p_allowed text[], p_what text) RETURNS jsonb
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_extra text;
BEGIN
    IF p_to IS NULL OR p_to = 'null'::jsonb THEN
        RETURN '{{}}'::jsonb;
    END IF;
    IF jsonb_typeof(p_to) <> 'object' THEN
        PERFORM ql3_ingress_refuse(p_what || ': the changed columns must be an object');
    END IF;
    SELECT string_agg(k, ', ' ORDER BY k) INTO v_extra
    FROM jsonb_object_keys(p_to) AS k WHERE k <> ALL (p_allowed);
    IF v_extra IS NOT NULL THEN
        PERFORM ql3_ingress_refuse(p_what || ' may not change ' || v_extra);
    END IF;
    RETURN p_to;
END $$;

-- The acting session, authenticated by its secret hash. Unknown and wrong secret answer alike.
CREATE FUNCTION ql3_ingress_session(p_id text, p_secret_hash text, p_allow_closed boolean)
RETURNS worker_sessions
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_session worker_sessions;
BEGIN
    SELECT * INTO v_session FROM worker_sessions WHERE id = p_id;
    IF NOT FOUND OR p_secret_hash IS NULL OR v_session.secret_hash IS DISTINCT FROM p_secret_hash
    THEN
        PERFORM ql3_ingress_conflict(format('session %s is not authenticated', p_id));
    END IF;
    IF NOT p_allow_closed AND v_session.status NOT IN ('active', 'draining') THEN
        PERFORM ql3_ingress_conflict(format('session %s is %s', p_id, v_session.status));
    END IF;
    RETURN v_session;
END $$;

CREATE FUNCTION ql3_ingress_check_batch(p_items jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {path} AS $$
BEGIN
    IF jsonb_typeof(p_items) IS DISTINCT FROM 'array'
        OR jsonb_array_length(p_items) NOT BETWEEN 1 AND {max_items}
    THEN
        PERFORM ql3_ingress_refuse('a call takes a JSON array of 1..{max_items} items');
    END IF;
END $$;
"""

_REGISTER_SQL = """
-- A new active session; the open sessions of its worker id, exactly those the caller read, are
-- marked replaced at the same time.
CREATE FUNCTION ql3_ingress_register_one(p jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_new jsonb := ql3_ingress_only(
        p->'session',
        ARRAY['id', 'worker_id', 'status', 'capacity', 'tasks', 'secret_hash', 'registered_at',
              'last_heartbeat_at', 'closed_at'],
        'a new session');
    v_replaced jsonb := coalesce(p->'replaced', '[]'::jsonb);
    v_now timestamptz;
    v_open jsonb;
    v_presented jsonb;
BEGIN
    IF coalesce(v_new->>'id', '') = ''
        OR length(coalesce(v_new->>'worker_id', '')) NOT BETWEEN 1 AND 200
    THEN
        PERFORM ql3_ingress_refuse(
            'a new session needs an id and a worker id of 1..200 characters');
    END IF;
    IF v_new->>'status' IS DISTINCT FROM 'active' OR v_new->>'closed_at' IS NOT NULL THEN
        PERFORM ql3_ingress_refuse('a new session is active and not closed');
    END IF;
    IF jsonb_typeof(v_new->'capacity') IS DISTINCT FROM 'number'
        OR (v_new->>'capacity')::integer NOT BETWEEN 1 AND 1024
    THEN
        PERFORM ql3_ingress_refuse('a session capacity is an integer within 1..1024');
    END IF;
    IF jsonb_typeof(v_new->'tasks') IS DISTINCT FROM 'array'
        OR jsonb_array_length(v_new->'tasks') = 0
        OR EXISTS (
            SELECT 1 FROM jsonb_array_elements(v_new->'tasks') AS t
            WHERE jsonb_typeof(t) <> 'string' OR t #>> '{{}}' = '')
    THEN
        PERFORM ql3_ingress_refuse('a session names at least one task');
    END IF;
    IF coalesce(v_new->>'secret_hash', '') !~ '^[0-9a-f]{{64}}$' THEN
        PERFORM ql3_ingress_refuse('a session secret is stored as its SHA-256 hex digest');
    END IF;
    v_now := ql3_ingress_now(v_new->>'registered_at', 'registered_at');
    IF (v_new->>'last_heartbeat_at')::timestamptz IS DISTINCT FROM v_now THEN
        PERFORM ql3_ingress_refuse('a new session was last heard of when it registered');
    END IF;
    IF jsonb_typeof(v_replaced) <> 'array' OR EXISTS (
        SELECT 1 FROM jsonb_array_elements(v_replaced) AS r
        WHERE (r->>'closed_at')::timestamptz IS DISTINCT FROM v_now)
    THEN
        PERFORM ql3_ingress_refuse('replaced sessions close when the new one registers');
    END IF;

    SELECT coalesce(jsonb_agg(jsonb_build_object('id', o.id, 'status', o.status) ORDER BY o.id),
                    '[]'::jsonb)
    INTO v_open
    FROM (SELECT s.id, s.status FROM worker_sessions AS s
          WHERE s.worker_id = v_new->>'worker_id' AND s.status IN ('active', 'draining')
          FOR UPDATE) AS o;
    SELECT coalesce(jsonb_agg(jsonb_build_object('id', r->>'id', 'status', r->>'status')
                              ORDER BY r->>'id' COLLATE "C"), '[]'::jsonb)
    INTO v_presented
    FROM jsonb_array_elements(v_replaced) AS r;
    IF v_open IS DISTINCT FROM v_presented THEN
        PERFORM ql3_ingress_conflict(format(
            'the open sessions of worker %s changed since they were read', v_new->>'worker_id'));
    END IF;

    UPDATE worker_sessions SET status = 'replaced', closed_at = v_now
    WHERE worker_id = v_new->>'worker_id' AND status IN ('active', 'draining');
    INSERT INTO worker_sessions (id, worker_id, status, capacity, tasks, secret_hash,
                                 registered_at, last_heartbeat_at, closed_at)
    VALUES (v_new->>'id', v_new->>'worker_id', 'active', (v_new->>'capacity')::integer,
            v_new->'tasks', v_new->>'secret_hash', v_now, v_now, NULL);
END $$;

-- Heartbeat, drain or close of an open session, authenticated by its secret hash.
CREATE FUNCTION ql3_ingress_update_session_one(p jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_before worker_sessions;
    v_to jsonb;
    v_after text;
BEGIN
    SELECT * INTO v_before FROM worker_sessions WHERE id = p->>'id' FOR UPDATE;
    IF NOT FOUND OR v_before.secret_hash IS DISTINCT FROM p->>'secret_hash' THEN
        PERFORM ql3_ingress_conflict(format('session %s is not authenticated', p->>'id'));
    END IF;
    IF v_before.status IS DISTINCT FROM p->>'status' THEN
        PERFORM ql3_ingress_conflict(format('session %s changed since it was read', p->>'id'));
    END IF;
    IF v_before.status NOT IN ('active', 'draining') THEN
        PERFORM ql3_ingress_refuse(format('session %s is %s', p->>'id', v_before.status));
    END IF;
    v_to := ql3_ingress_only(p->'to', ARRAY['status', 'last_heartbeat_at', 'closed_at'],
                             'a session');
    v_after := coalesce(v_to->>'status', v_before.status);
    IF v_after = v_before.status THEN
        v_to := ql3_ingress_only(v_to, ARRAY['last_heartbeat_at'], 'a heartbeat');
        IF v_to ? 'last_heartbeat_at' AND ql3_ingress_now(v_to->>'last_heartbeat_at',
                'last_heartbeat_at') < v_before.last_heartbeat_at
        THEN
            PERFORM ql3_ingress_refuse('a heartbeat does not go back in time');
        END IF;
    ELSIF v_after = 'draining' THEN
        v_to := ql3_ingress_only(v_to, ARRAY['status', 'last_heartbeat_at'], 'a drain');
        IF v_to ? 'last_heartbeat_at' THEN
            PERFORM ql3_ingress_now(v_to->>'last_heartbeat_at', 'last_heartbeat_at');
        END IF;
    ELSIF v_after = 'closed' THEN
        v_to := ql3_ingress_only(v_to, ARRAY['status', 'closed_at'], 'a close');
        PERFORM ql3_ingress_now(v_to->>'closed_at', 'closed_at');
    ELSE
        PERFORM ql3_ingress_refuse(format('a worker cannot make a session %s', v_after));
    END IF;
    IF v_to <> '{{}}'::jsonb THEN
        UPDATE worker_sessions SET
            status = v_after,
            last_heartbeat_at = CASE WHEN v_to ? 'last_heartbeat_at'
                THEN (v_to->>'last_heartbeat_at')::timestamptz ELSE last_heartbeat_at END,
            closed_at = CASE WHEN v_to ? 'closed_at'
                THEN (v_to->>'closed_at')::timestamptz ELSE closed_at END
        WHERE id = v_before.id;
    END IF;
END $$;
"""

_APPLY_SQL = """
-- One fenced change of an Attempt the acting session holds the lease of, with its one event.
CREATE FUNCTION ql3_ingress_apply_one(p jsonb) RETURNS void
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
BEGIN
    IF v_kind IS NULL OR v_kind NOT IN ('attempt_accepted', 'attempt_activated', 'attempt_running',
            'attempt_succeeded', 'attempt_failed', 'attempt_lost', 'evidence_recorded')
    THEN
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
    IF v_kind = 'attempt_accepted' THEN
        IF v_lease.token_hash IS NOT NULL THEN
            PERFORM ql3_ingress_conflict(format('attempt %s was already accepted', v_attempt_id));
        END IF;
    ELSIF v_lease.token_hash IS NULL THEN
        PERFORM ql3_ingress_conflict(format('attempt %s was not accepted', v_attempt_id));
    END IF;
    IF v_kind = 'evidence_recorded' THEN
        IF v_lease.expires_at > statement_timestamp() THEN
            PERFORM ql3_ingress_conflict(format('lease %s/%s is live: abandon releases it',
                                                v_run_id, v_lease.generation));
        END IF;
    ELSIF v_lease.expires_at <= statement_timestamp() THEN
        PERFORM ql3_ingress_conflict(format('lease %s/%s expired', v_run_id, v_lease.generation));
    END IF;

    -- The transition: allowed (from, to) pairs and the columns each one changes.
    CASE v_kind
    WHEN 'attempt_accepted' THEN
        v_run_to := ql3_ingress_only(p #> '{{run,to}}', ARRAY[]::text[], 'accept: the run');
        v_attempt_to := ql3_ingress_only(p #> '{{attempt,to}}',
            ARRAY['accepted_at', 'updated_at'], 'accept: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{{lease,to}}',
            ARRAY['token_hash', 'expires_at'], 'accept: the lease');
        IF v_attempt.status <> 'claimed' OR v_attempt.accepted_at IS NOT NULL
            OR NOT v_attempt_to ? 'accepted_at'
        THEN
            PERFORM ql3_ingress_refuse('accept takes a claimed attempt not accepted yet');
        END IF;
        IF coalesce(v_lease_to->>'token_hash', '') !~ '^[0-9a-f]{{64}}$' THEN
            PERFORM ql3_ingress_refuse('accept binds the hash of a token');
        END IF;
    WHEN 'attempt_activated' THEN
        v_run_to := ql3_ingress_only(p #> '{{run,to}}',
            ARRAY['status', 'updated_at'], 'activate: the run');
        v_attempt_to := ql3_ingress_only(p #> '{{attempt,to}}',
            ARRAY['status', 'started_at', 'updated_at'], 'activate: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{{lease,to}}',
            ARRAY['expires_at'], 'activate: the lease');
        IF v_run.status <> 'dispatching' OR v_run_to->>'status' IS DISTINCT FROM 'running'
            OR v_attempt.status <> 'claimed' OR v_attempt_to->>'status' IS DISTINCT FROM 'starting'
            OR NOT v_attempt_to ? 'started_at'
        THEN
            PERFORM ql3_ingress_refuse(
                'activate takes a dispatching run to running and its claimed attempt to starting');
        END IF;
    WHEN 'attempt_running' THEN
        v_run_to := ql3_ingress_only(p #> '{{run,to}}', ARRAY[]::text[], 'mark running: the run');
        v_attempt_to := ql3_ingress_only(p #> '{{attempt,to}}',
            ARRAY['status', 'updated_at'], 'mark running: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{{lease,to}}', ARRAY[]::text[],
                                       'mark running: the lease');
        IF v_attempt.status <> 'starting' OR v_attempt_to->>'status' IS DISTINCT FROM 'running' THEN
            PERFORM ql3_ingress_refuse('mark running takes a starting attempt to running');
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
            OR v_attempt.status NOT IN ('starting', 'running')
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
        IF v_run.status NOT IN ('dispatching', 'running', 'lost')
            OR coalesce(v_run_to->>'status', v_run.status) <> 'lost'
            OR v_attempt.status NOT IN ('claimed', 'starting', 'running')
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
        IF v_attempt.status NOT IN ('claimed', 'starting', 'running')
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
        OR (v_attempt_to->>'lease_version')::integer IS DISTINCT FROM v_lease.version + 1
        OR v_lease_to->>'release_reason' IS DISTINCT FROM v_reason
        OR NOT v_lease_to ? 'released_at')
    THEN
        PERFORM ql3_ingress_refuse(format(
            'the lease is released for %s with its version one step up', v_reason));
    END IF;

    -- Every time written is this transaction's "now"; a lease expiry only moves forward.
    FOREACH v_key IN ARRAY ARRAY['updated_at'] LOOP
        IF v_run_to ? v_key THEN
            PERFORM ql3_ingress_now(v_run_to->>v_key, 'run ' || v_key);
        END IF;
    END LOOP;
    FOREACH v_key IN ARRAY ARRAY['accepted_at', 'started_at', 'finished_at', 'updated_at'] LOOP
        IF v_attempt_to ? v_key THEN
            PERFORM ql3_ingress_now(v_attempt_to->>v_key, 'attempt ' || v_key);
        END IF;
    END LOOP;
    IF v_lease_to ? 'released_at' THEN
        PERFORM ql3_ingress_now(v_lease_to->>'released_at', 'lease released_at');
    END IF;
    IF v_lease_to ? 'expires_at' THEN
        PERFORM ql3_ingress_expiry(v_lease_to->>'expires_at', v_lease.expires_at);
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
            lease_version = CASE WHEN v_attempt_to ? 'lease_version'
                THEN (v_attempt_to->>'lease_version')::integer ELSE lease_version END,
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
            token_hash = CASE WHEN v_lease_to ? 'token_hash'
                THEN v_lease_to->>'token_hash' ELSE token_hash END,
            expires_at = CASE WHEN v_lease_to ? 'expires_at'
                THEN (v_lease_to->>'expires_at')::timestamptz ELSE expires_at END,
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
END $$;

-- Move a live lease's expiry forward: no version change, no event.
CREATE FUNCTION ql3_ingress_renew_one(p jsonb) RETURNS void
LANGUAGE plpgsql SET search_path = {path} AS $$
DECLARE
    v_attempt_id text := p->>'attempt_id';
    v_lease run_dispatch_leases;
    v_session worker_sessions;
    v_attempt_status text;
BEGIN
    IF v_attempt_id IS NULL OR p->>'run_id' IS NULL THEN
        PERFORM ql3_ingress_refuse('a renewal names its run and attempt');
    END IF;
    PERFORM pg_advisory_xact_lock({namespace}, hashtext(v_attempt_id));
    SELECT * INTO v_lease FROM run_dispatch_leases
    WHERE run_id = p->>'run_id' AND generation = (p->>'generation')::integer FOR UPDATE;
    IF NOT FOUND OR v_lease.attempt_id <> v_attempt_id THEN
        PERFORM ql3_ingress_conflict(format('attempt %s holds no such lease', v_attempt_id));
    END IF;
    v_session := ql3_ingress_session(p->>'session_id', p->>'secret_hash', false);
    IF v_lease.holder_session_id IS DISTINCT FROM v_session.id THEN
        PERFORM ql3_ingress_conflict(format('lease %s/%s is held by another session',
                                            v_lease.run_id, v_lease.generation));
    END IF;
    IF v_lease.status <> 'leased' OR v_lease.token_hash IS NULL
        OR v_lease.version IS DISTINCT FROM (p->>'version')::integer
        OR v_lease.token_hash IS DISTINCT FROM p->>'token_hash'
    THEN
        PERFORM ql3_ingress_conflict(format('lease %s/%s is no longer the live lease presented',
                                            v_lease.run_id, v_lease.generation));
    END IF;
    IF v_lease.expires_at <= statement_timestamp() THEN
        PERFORM ql3_ingress_conflict(format('lease %s/%s expired', v_lease.run_id,
                                            v_lease.generation));
    END IF;
    SELECT status INTO v_attempt_status FROM run_attempts WHERE id = v_attempt_id;
    IF v_attempt_status IS NULL OR v_attempt_status NOT IN ('claimed', 'starting', 'running') THEN
        PERFORM ql3_ingress_conflict(format('attempt %s is %s', v_attempt_id, v_attempt_status));
    END IF;
    UPDATE run_dispatch_leases
    SET expires_at = ql3_ingress_expiry(p->>'expires_at', v_lease.expires_at)
    WHERE run_id = v_lease.run_id AND generation = v_lease.generation;
END $$;
"""

# The entry points: a batch of items, each in its own subtransaction, in lock order.
_ENTRY_SQL = """
CREATE FUNCTION {name}(p_items jsonb)
RETURNS TABLE (item integer, outcome text, detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = {path} AS $$
DECLARE
    v_entry record;
BEGIN
    PERFORM ql3_ingress_check_batch(p_items);
    FOR v_entry IN
        SELECT e.value AS body, e.ordinality::integer AS position
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e
        ORDER BY {order_key} COLLATE "C", e.ordinality
    LOOP
        item := v_entry.position;
        BEGIN
            PERFORM {one}(v_entry.body);
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

_ENTRIES = (
    (
        "ql3_ingress_register_sessions",
        "ql3_ingress_register_one",
        "e.value #>> '{{session,worker_id}}'",
    ),
    ("ql3_ingress_update_sessions", "ql3_ingress_update_session_one", "e.value->>'id'"),
    ("ql3_ingress_apply", "ql3_ingress_apply_one", "e.value->>'attempt_id'"),
    ("ql3_ingress_renew", "ql3_ingress_renew_one", "e.value->>'attempt_id'"),
)


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def upgrade() -> None:
    schema = op.get_bind().execute(sa.text("SELECT current_schema()")).scalar_one()
    values = {
        "path": f"pg_catalog, {_quote(str(schema))}, pg_temp",
        "namespace": ADVISORY_LOCK_NAMESPACE,
        "max_items": MAX_BATCH_ITEMS,
        "max_extension": MAX_LEASE_EXTENSION,
    }
    for block in (_HELPERS_SQL, _REGISTER_SQL, _APPLY_SQL):
        op.execute(sa.text(block.format(**values)))
    for name, one, order_key in _ENTRIES:
        sql = _ENTRY_SQL.format(
            name=name, one=one, order_key=order_key.format(), path=values["path"]
        )
        op.execute(sa.text(sql))
    for signature in (*ENTRY_POINTS, *HELPERS):
        op.execute(sa.text(f"REVOKE ALL ON FUNCTION {signature} FROM PUBLIC"))


def downgrade() -> None:
    for signature in (*ENTRY_POINTS, *HELPERS[::-1]):
        op.execute(sa.text(f"DROP FUNCTION IF EXISTS {signature}"))
