-- The database functions of the PostgreSQL store: their one current text (ADR 0022).
--
-- Rendered by ql3.adapters.postgres.functions from functions.template.sql and the domain's
-- data; do not edit. Change the template or the domain, then regenerate:
--
--     python -m ql3.adapters.postgres.functions > adapters/postgres/sql/functions.sql
--
-- and carry the change in a new migration (a migration runs its own frozen copy of the text).
-- Run with psql's variable "schema" set to the schema of the tables (psql -v schema=public).

CREATE OR REPLACE FUNCTION ql3_ingress_refuse(p_message text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'Q3R01', MESSAGE = p_message;
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_conflict(p_message text)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'Q3C01', MESSAGE = p_message;
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_now(p_value text, p_what text)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_expiry(p_value text, p_old timestamp with time zone)
 RETURNS timestamp with time zone
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_time timestamptz := p_value::timestamptz;
BEGIN
    IF v_time IS NULL OR v_time < p_old
        OR v_time > statement_timestamp() + interval '1 day'
    THEN
        PERFORM ql3_ingress_refuse(
            'a lease expiry moves forward, at most 1 day past the clock');
    END IF;
    RETURN v_time;
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_only(p_to jsonb, p_allowed text[], p_what text)
 RETURNS jsonb
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_extra text;
BEGIN
    IF p_to IS NULL OR p_to = 'null'::jsonb THEN
        RETURN '{}'::jsonb;
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_session(p_id text, p_secret_hash text, p_allow_closed boolean)
 RETURNS worker_sessions
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_check_batch(p_items jsonb)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
BEGIN
    IF jsonb_typeof(p_items) IS DISTINCT FROM 'array'
        OR jsonb_array_length(p_items) NOT BETWEEN 1 AND 256
    THEN
        PERFORM ql3_ingress_refuse('a call takes a JSON array of 1..256 items');
    END IF;
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_register_one(p jsonb)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
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
            WHERE jsonb_typeof(t) <> 'string' OR t #>> '{}' = '')
    THEN
        PERFORM ql3_ingress_refuse('a session names at least one task');
    END IF;
    IF coalesce(v_new->>'secret_hash', '') !~ '^[0-9a-f]{64}$' THEN
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_update_session_one(p jsonb)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
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
    IF v_to <> '{}'::jsonb THEN
        UPDATE worker_sessions SET
            status = v_after,
            last_heartbeat_at = CASE WHEN v_to ? 'last_heartbeat_at'
                THEN (v_to->>'last_heartbeat_at')::timestamptz ELSE last_heartbeat_at END,
            closed_at = CASE WHEN v_to ? 'closed_at'
                THEN (v_to->>'closed_at')::timestamptz ELSE closed_at END
        WHERE id = v_before.id;
    END IF;
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_apply_one(p jsonb)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_kind text := p #>> '{event,type}';
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
    v_retry boolean := false;
    v_next timestamptz;
BEGIN
    IF v_kind IS NULL OR v_kind NOT IN ('attempt_started', 'attempt_released', 'attempt_succeeded', 'attempt_failed', 'attempt_lost', 'evidence_recorded') THEN
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
    PERFORM pg_advisory_xact_lock(5327923, hashtext(v_attempt_id));
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
    IF v_run.status IS DISTINCT FROM p #>> '{run,status}'
        OR v_run.attempt_count IS DISTINCT FROM (p #>> '{run,attempt_count}')::integer
    THEN
        PERFORM ql3_ingress_conflict(format('run %s changed since it was read', v_run_id));
    END IF;
    IF v_attempt.status IS DISTINCT FROM p #>> '{attempt,status}'
        OR v_attempt.lease_version IS DISTINCT FROM (p #>> '{attempt,lease_version}')::integer
    THEN
        PERFORM ql3_ingress_conflict(format('attempt %s changed since it was read', v_attempt_id));
    END IF;
    IF v_lease.generation IS DISTINCT FROM (p #>> '{lease,generation}')::integer
        OR v_lease.version IS DISTINCT FROM (p #>> '{lease,version}')::integer
        OR v_lease.status IS DISTINCT FROM p #>> '{lease,status}'
        OR v_lease.token_hash IS DISTINCT FROM p #>> '{lease,token_hash}'
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
        IF NOT (v_lease.expires_at <= statement_timestamp()) THEN
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
        v_run_to := ql3_ingress_only(p #> '{run,to}',
            ARRAY['status', 'updated_at'], 'hand-back: the run');
        v_attempt_to := ql3_ingress_only(p #> '{attempt,to}',
            ARRAY['status', 'session_id', 'worker_id', 'lease_generation', 'lease_version', 'offered_at', 'accepted_at', 'started_at', 'updated_at'], 'hand-back: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{lease,to}',
            ARRAY['status', 'version', 'release_reason', 'released_at'], 'hand-back: the lease');
        IF v_run.status NOT IN ('dispatching', 'running')
            OR v_run_to->>'status' IS DISTINCT FROM 'queued'
            OR v_attempt.status NOT IN ('claimed', 'starting', 'running')
            OR coalesce(v_attempt_to->>'status', v_attempt.status) <> 'claimed'
        THEN
            PERFORM ql3_ingress_refuse('a hand-back takes a held attempt back to claimed and '
                                       'its run back to queued');
        END IF;
        -- Pristine again: every fact of the claim is cleared.
        FOREACH v_key IN ARRAY ARRAY['session_id', 'worker_id', 'lease_generation', 'lease_version', 'offered_at', 'accepted_at', 'started_at'] LOOP
            v_value := CASE WHEN v_attempt_to ? v_key THEN v_attempt_to->v_key
                            ELSE to_jsonb(v_attempt)->v_key END;
            IF v_value IS DISTINCT FROM 'null'::jsonb THEN
                PERFORM ql3_ingress_refuse('a handed-back attempt is pristine again');
            END IF;
        END LOOP;
        PERFORM ql3_ingress_only(v_event->'data',
            ARRAY['cause', 'lease_generation', 'lease_version', 'previous_status', 'session_id'],
            'hand-back: the event');
        IF v_event #>> '{data,session_id}' IS DISTINCT FROM v_session.id
            OR length(coalesce(v_event #>> '{data,cause}', '')) > 500
        THEN
            PERFORM ql3_ingress_refuse(
                'a hand-back''s event names the session and a cause of at most 500 characters');
        END IF;
    WHEN 'attempt_succeeded', 'attempt_failed' THEN
        v_end := CASE v_kind WHEN 'attempt_succeeded' THEN 'succeeded' ELSE 'failed' END;
        v_reason := 'completed';
        v_run_to := ql3_ingress_only(p #> '{run,to}',
            ARRAY['status', 'output', 'error', 'next_attempt_at', 'updated_at'], 'complete: the run');
        v_attempt_to := ql3_ingress_only(p #> '{attempt,to}',
            ARRAY['status', 'lease_version', 'finished_at', 'error', 'updated_at'],
            'complete: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{lease,to}',
            ARRAY['status', 'version', 'release_reason', 'released_at'], 'complete: the lease');
        -- A failure the Run's stored policy retries on error waits for its next Attempt.
        v_retry := v_end = 'failed' AND v_run_to->>'status' IS NOT DISTINCT FROM 'retry_wait';
        IF v_run.status <> 'running'
            OR (NOT v_retry AND v_run_to->>'status' IS DISTINCT FROM v_end)
            OR v_attempt.status NOT IN ('starting', 'running')
            OR v_attempt_to->>'status' IS DISTINCT FROM v_end
        THEN
            PERFORM ql3_ingress_refuse(format(
                'complete takes a running run and its started attempt to %s', v_end));
        END IF;
        IF v_end = 'failed' AND coalesce(v_run_to->'output', 'null'::jsonb) <> 'null'::jsonb THEN
            PERFORM ql3_ingress_refuse('a failed run has no output');
        END IF;
        IF v_retry THEN
            IF NOT (v_run.has_policy AND coalesce(v_run.retry_on_error, false)
                    AND v_run.safety IN ('idempotent', 'deduplicated')
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
            PERFORM ql3_ingress_only(v_event->'data', ARRAY['cause', 'error', 'next_attempt', 'next_attempt_at_ms', 'reason', 'retry'],
                                     'complete: the event');
            IF v_event #> '{data,retry}' IS DISTINCT FROM to_jsonb(v_retry) THEN
                PERFORM ql3_ingress_refuse('a failure''s event says whether it is retried');
            END IF;
        END IF;
    WHEN 'attempt_lost' THEN
        v_reason := 'abandoned';
        v_run_to := ql3_ingress_only(p #> '{run,to}',
            ARRAY['status', 'updated_at'], 'abandon: the run');
        v_attempt_to := ql3_ingress_only(p #> '{attempt,to}',
            ARRAY['status', 'lease_version', 'lost_evidence', 'finished_at', 'updated_at'],
            'abandon: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{lease,to}',
            ARRAY['status', 'version', 'release_reason', 'released_at'], 'abandon: the lease');
        IF v_run.status NOT IN ('dispatching', 'running', 'lost')
            OR coalesce(v_run_to->>'status', v_run.status) <> 'lost'
            OR v_attempt.status NOT IN ('claimed', 'starting', 'running')
            OR v_attempt_to->>'status' IS DISTINCT FROM 'lost'
            OR v_attempt_to->>'lost_evidence' IS DISTINCT FROM 'worker_abandoned'
            OR v_event #>> '{data,evidence}' IS DISTINCT FROM 'worker_abandoned'
        THEN
            PERFORM ql3_ingress_refuse(
                'abandon takes the attempt to lost on the evidence of the worker''s own report');
        END IF;
    WHEN 'evidence_recorded' THEN
        v_run_to := ql3_ingress_only(p #> '{run,to}', ARRAY[]::text[], 'evidence: the run');
        v_attempt_to := ql3_ingress_only(p #> '{attempt,to}', ARRAY[]::text[],
                                         'evidence: the attempt');
        v_lease_to := ql3_ingress_only(p #> '{lease,to}', ARRAY[]::text[], 'evidence: the lease');
        IF v_attempt.status NOT IN ('claimed', 'starting', 'running')
            OR jsonb_typeof(v_report) IS DISTINCT FROM 'object'
            OR v_report->>'attempt_id' IS DISTINCT FROM v_attempt_id
            OR v_report->>'kind' IS DISTINCT FROM 'worker_abandoned'
            OR length(coalesce(v_report->>'detail', '')) > 500
            OR v_event #>> '{data,evidence}' IS DISTINCT FROM 'worker_abandoned'
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
    IF v_run_to <> '{}'::jsonb THEN
        UPDATE runs SET
            status = CASE WHEN v_run_to ? 'status' THEN v_run_to->>'status' ELSE status END,
            output = CASE WHEN v_run_to ? 'output'
                THEN nullif(v_run_to->'output', 'null'::jsonb) ELSE output END,
            error = CASE WHEN v_run_to ? 'error' THEN v_run_to->>'error' ELSE error END,
            next_attempt_at = CASE WHEN v_run_to ? 'next_attempt_at'
                THEN (v_run_to->>'next_attempt_at')::timestamptz ELSE next_attempt_at END,
            updated_at = CASE WHEN v_run_to ? 'updated_at'
                THEN (v_run_to->>'updated_at')::timestamptz ELSE updated_at END
        WHERE id = v_run_id;
    END IF;
    IF v_attempt_to <> '{}'::jsonb THEN
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
    IF v_lease_to <> '{}'::jsonb THEN
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
        PERFORM pg_notify('ql3_dispatch', '');
    END IF;
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_renew_one(p jsonb)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_attempt_id text := p->>'attempt_id';
    v_lease run_dispatch_leases;
    v_session worker_sessions;
    v_attempt_status text;
BEGIN
    IF v_attempt_id IS NULL OR p->>'run_id' IS NULL THEN
        PERFORM ql3_ingress_refuse('a renewal names its run and attempt');
    END IF;
    PERFORM pg_advisory_xact_lock(5327923, hashtext(v_attempt_id));
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_register_sessions(p_items jsonb)
 RETURNS TABLE(item integer, outcome text, detail text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_entry record;
BEGIN
    PERFORM ql3_ingress_check_batch(p_items);
    FOR v_entry IN
        SELECT e.value AS body, e.ordinality::integer AS position
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e
        ORDER BY e.value #>> '{session,worker_id}' COLLATE "C", e.ordinality
    LOOP
        item := v_entry.position;
        BEGIN
            PERFORM ql3_ingress_register_one(v_entry.body);
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_update_sessions(p_items jsonb)
 RETURNS TABLE(item integer, outcome text, detail text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_entry record;
BEGIN
    PERFORM ql3_ingress_check_batch(p_items);
    FOR v_entry IN
        SELECT e.value AS body, e.ordinality::integer AS position
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e
        ORDER BY e.value->>'id' COLLATE "C", e.ordinality
    LOOP
        item := v_entry.position;
        BEGIN
            PERFORM ql3_ingress_update_session_one(v_entry.body);
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_apply(p_items jsonb)
 RETURNS TABLE(item integer, outcome text, detail text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_entry record;
BEGIN
    PERFORM ql3_ingress_check_batch(p_items);
    FOR v_entry IN
        SELECT e.value AS body, e.ordinality::integer AS position
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e
        ORDER BY (e.value #>> '{event,type}') IS NOT DISTINCT FROM 'attempt_started',
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_ingress_renew(p_items jsonb)
 RETURNS TABLE(item integer, outcome text, detail text)
 LANGUAGE plpgsql
 SECURITY DEFINER
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_entry record;
BEGIN
    PERFORM ql3_ingress_check_batch(p_items);
    FOR v_entry IN
        SELECT e.value AS body, e.ordinality::integer AS position
        FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e
        ORDER BY e.value->>'attempt_id' COLLATE "C", e.ordinality
    LOOP
        item := v_entry.position;
        BEGIN
            PERFORM ql3_ingress_renew_one(v_entry.body);
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
END $function$;

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

CREATE OR REPLACE FUNCTION ql3_ingress_claim_one(p jsonb, p_run runs, p_attempt run_attempts)
 RETURNS void
 LANGUAGE plpgsql
 SET search_path = pg_catalog, :"schema", pg_temp
AS $function$
DECLARE
    v_event jsonb := p->'event';
    v_data jsonb;
    v_session worker_sessions;
    v_gate_open boolean;
    v_held integer;
    v_limit integer;
    v_running integer;
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
    IF p_run.status IS DISTINCT FROM p #>> '{run,status}'
        OR p_run.attempt_count IS DISTINCT FROM (p #>> '{run,attempt_count}')::integer
    THEN
        PERFORM ql3_ingress_conflict(format('run %s changed since it was read', p_run.id));
    END IF;
    IF p_attempt.status IS DISTINCT FROM p #>> '{attempt,status}'
        OR p_attempt.lease_version IS DISTINCT FROM (p #>> '{attempt,lease_version}')::integer
    THEN
        PERFORM ql3_ingress_conflict(format('attempt %s changed since it was read', p_attempt.id));
    END IF;

    -- What a claim takes, and under which conditions.
    IF NOT (p_run.status IN ('queued')) OR NOT (p_attempt.status = 'claimed' AND p_attempt.session_id IS NULL AND p_attempt.worker_id IS NULL AND p_attempt.lease_generation IS NULL AND p_attempt.offered_at IS NULL AND p_attempt.accepted_at IS NULL AND p_attempt.started_at IS NULL)
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
    -- The task's limit, locked as a claim's locks lock it (ADR 0014).
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
    IF EXISTS (SELECT 1 FROM run_dispatch_leases WHERE run_id = p_run.id AND status = 'leased')
    THEN
        PERFORM ql3_ingress_conflict(format('run %s holds a leased lease', p_run.id));
    END IF;
    SELECT coalesce(max(generation), 0) + 1 INTO v_generation
    FROM run_dispatch_leases WHERE run_id = p_run.id;

    -- The change: exactly the claim's columns, at this transaction's "now".
    v_run_to := ql3_ingress_only(p #> '{run,to}', ARRAY['status', 'updated_at'],
                                 'claim: the run');
    v_attempt_to := ql3_ingress_only(p #> '{attempt,to}',
        ARRAY['status', 'session_id', 'worker_id', 'lease_generation', 'lease_version', 'offered_at', 'accepted_at', 'started_at', 'updated_at'], 'claim: the attempt');
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
    IF coalesce(v_lease->>'token_hash', '') !~ '^[0-9a-f]{64}$' THEN
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
END $function$;

CREATE OR REPLACE FUNCTION ql3_notify_run_finished()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
        BEGIN
            PERFORM pg_notify('ql3_run_finished', '');
            RETURN NULL;
        END
        $function$;

REVOKE ALL ON FUNCTION ql3_ingress_refuse(p_message text) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_conflict(p_message text) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_now(p_value text, p_what text) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_expiry(p_value text, p_old timestamp with time zone) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_only(p_to jsonb, p_allowed text[], p_what text) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_session(p_id text, p_secret_hash text, p_allow_closed boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_check_batch(p_items jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_register_one(p jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_update_session_one(p jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_apply_one(p jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_renew_one(p jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_register_sessions(p_items jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_update_sessions(p_items jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_apply(p_items jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_renew(p_items jsonb) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_claim_lock(p_session_id text, p_secret_hash text, p_tasks text[], p_limit integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_lock_attempts(p_attempt_ids text[], p_skip_locked boolean) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_ingress_claim_one(p jsonb, p_run runs, p_attempt run_attempts) FROM PUBLIC;
REVOKE ALL ON FUNCTION ql3_notify_run_finished() FROM PUBLIC;
