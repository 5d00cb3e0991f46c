/*
 * The lease protocol of QL3 runtime (ADR 0002, ADR 0007) as a Promela model for spin.
 * ADR 0011 says what is modelled, what is abstracted and how to run it; the test
 * tests/model/test_protocol_model.py runs it and checks its states and edges against
 * domain/states.py.
 *
 * Each store transaction is one atomic step (the store serialises them by row locks and
 * compare-and-set). Time is abstract: a lease expires at any moment (a clock process), and a
 * retry is due as soon as it is scheduled. Every fault has a budget, so every execution is
 * finite and the search is exhaustive.
 *
 * Run it: spin -a protocol.pml && gcc -O1 -DCOLLAPSE -DMEMLIM=1024 -o pan pan.c && ./pan -a -m100000
 */

/* ---------------------------------------------------------------- bounds */

#define NR 2            /* runs: 0 is unsafe (no retry); 1 is idempotent, retry on lost and
                           on error (ADR 0013) */
#define UNSAFE_RUN 0
#define MAXA 2          /* attempts per run: max_attempts of run 1 */
#define NW 2            /* workers, one execution slot each */
#define MAXG 5          /* lease generations per run the arrays hold (asserted, not assumed) */

/* The faults. Each search covers one configuration at a time, chosen by init: two scheduler
   replicas whose recovery or lost-retry step fails once, or one replica with one of: a worker
   crash (at any step), a claim answer lost after its transaction committed, an unstarted
   attempt handed back by its worker, an operator's cancellation, an operator's attestation
   that an attempt executes nowhere, a task of the idempotent run that raises. */
byte replicas = 1;
byte crashes, losses, handbacks, step_failures, cancels, attests, errors;

/* -DUNORDERED_GATE=1: step 5 opens a closed gate whenever it runs, as it did before the
   compare-and-set (ADR 0011); the assertion that a cycle opens the gate only when it did not
   close after that cycle's recovery began then fails */
#ifndef UNORDERED_GATE
#define UNORDERED_GATE 0
#endif

/* ---------------------------------------------------------------- states (ql3.domain.model) */

/* RunStatus */
#define R_CREATED 1
#define R_QUEUED 2
#define R_RUNNING 3
#define R_LOST 4
#define R_RETRY_WAIT 5
#define R_SUCCEEDED 6
#define R_FAILED 7
#define R_CANCELLED 8

/* AttemptStatus (0: not created) */
#define A_CLAIMED 1
#define A_RUNNING 2
#define A_SUCCEEDED 3
#define A_FAILED 4
#define A_LOST 5
#define A_CANCELLED 6

/* LeaseStatus (0: no lease of that generation) */
#define L_LEASED 1
#define L_RELEASED 2

/* SessionStatus (0: never registered) */
#define S_ACTIVE 1
#define S_REPLACED 2

/* ---------------------------------------------------------------- edges (ql3.domain.states) */

#define RUN_EDGE(f, t) ( \
    (f == R_CREATED && (t == R_QUEUED || t == R_CANCELLED)) || \
    (f == R_QUEUED && (t == R_RUNNING || t == R_CANCELLED)) || \
    (f == R_RUNNING && (t == R_SUCCEEDED || t == R_FAILED || t == R_RETRY_WAIT || t == R_LOST || t == R_QUEUED || t == R_CANCELLED)) || \
    (f == R_LOST && (t == R_RETRY_WAIT || t == R_FAILED || t == R_CANCELLED)) || \
    (f == R_RETRY_WAIT && (t == R_QUEUED || t == R_CANCELLED)) )

#define ATTEMPT_EDGE(f, t) ( \
    (f == A_CLAIMED && (t == A_RUNNING || t == A_CANCELLED)) || \
    (f == A_RUNNING && (t == A_SUCCEEDED || t == A_FAILED || t == A_LOST || t == A_CLAIMED || t == A_CANCELLED)) )

/* ---------------------------------------------------------------- the store */

#define AI(r, a) ((r) * MAXA + (a))
#define LI(r, g) ((r) * MAXG + (g) - 1)
#define SID(w, e) ((w) * 2 + (e) + 1)

byte rstat[NR];
byte natt[NR];                 /* attempts created */
byte att[NR * MAXA];
byte att_gen[NR * MAXA];       /* the lease generation the attempt holds (0: pristine) */
byte att_sess[NR * MAXA];      /* its worker session (0: pristine) */
bit att_report[NR * MAXA];     /* a stop report is recorded for this attempt id */
byte lgen[NR];                 /* the run's newest lease generation (0: none yet) */
byte lease[NR * MAXG];
byte lver[NR * MAXG];
byte lholder[NR * MAXG];
bit lexpired[NR * MAXG];
byte sess[2 * NW + 1];
bit gate = 1;                  /* the dispatch gate */
byte gate_at;                  /* the store's clock when the gate last closed (changed_at) */
byte now;                      /* the store's clock, abstracted to what step 5 compares: it
                                  moves on after each close */

/* ghosts: what really happens, and what the invariants need */
byte executions[NR];           /* times the run's task began */
byte executing[NR * MAXA];     /* workers executing the attempt now */
byte in_slot[NR * MAXA];       /* worker slots holding the attempt, begun or about to begin */
byte authority[NR];            /* changes of the run's lease authority */
byte closes;                   /* times the gate was closed */

#define CUR(r) AI(r, natt[r] - 1)
#define TERMINAL_RUN(s) (s == R_SUCCEEDED || s == R_FAILED || s == R_CANCELLED)
#define SETTLED (TERMINAL_RUN(rstat[0]) && TERMINAL_RUN(rstat[1]))
#define LEASED(r) (lgen[r] > 0 && lease[LI(r, lgen[r])] == L_LEASED)

inline run_to(r, to) {
    assert(RUN_EDGE(rstat[r], to));
    rstat[r] = to
}

inline att_to(i, to) {
    assert(ATTEMPT_EDGE(att[i], to));
    att[i] = to
}

/* lease generation g of run r: leased -> released, version + 1 */
inline release_lease(r, g) {
    lease[LI(r, g)] = L_RELEASED;
    lver[LI(r, g)]++;
    authority[r]++
}

/* ---------------------------------------------------------------- invariants */

/* at most one leased lease per run, the newest, and it belongs to the run's active Attempt;
   a lost, succeeded or failed Attempt never holds a leased lease */
#define ONE_LEASE(r) ( \
    (lease[LI(r, 1)] == L_LEASED) + (lease[LI(r, 2)] == L_LEASED) + (lease[LI(r, 3)] == L_LEASED) \
    + (lease[LI(r, 4)] == L_LEASED) + (lease[LI(r, 5)] == L_LEASED) <= 1 \
    && (!LEASED(r) || (natt[r] > 0 && att[CUR(r)] == A_RUNNING && att_gen[CUR(r)] == lgen[r])))
/* a run's task never executes twice at once, and an unsafe run's task at most once at all */
#define ONE_EXECUTION(r) (executing[AI(r, 0)] + executing[AI(r, 1)] <= 1)
#define INVARIANT (ONE_LEASE(0) && ONE_LEASE(1) && ONE_EXECUTION(0) && ONE_EXECUTION(1) \
    && executions[UNSAFE_RUN] <= 1)

ltl protocol { [] INVARIANT && <> SETTLED }

/* ---------------------------------------------------------------- worker commands */

/* A claim: completion first, then the statement of what the worker holds, then a grant. */
#define P_IDLE 0
#define P_HELD 1
#define P_EXEC 2
#define P_DONE 3
#define P_DEAD 4

/* a leased attempt of session s other than the one the worker holds, whose statement would
   change something: hand it back (live lease) or record the evidence (expired lease) */
#define NOT_HELD(s, r, hr) (LEASED(r) && lholder[LI(r, lgen[r])] == s && hr != r && \
    (!lexpired[LI(r, lgen[r])] || !att_report[CUR(r)]))
#define QUEUED_ANY (rstat[0] == R_QUEUED || rstat[1] == R_QUEUED)
#define HOLDS_LEASE(s) ((LEASED(0) && lholder[LI(0, lgen[0])] == s) \
    || (LEASED(1) && lholder[LI(1, lgen[1])] == s))

/* a fence (r, attempt i, generation g, version v) the store accepts: that exact lease is
   leased to session s and unexpired */
#define FENCE_OK(r, i, g, v, s) (att_gen[i] == g && lease[LI(r, g)] == L_LEASED \
    && lver[LI(r, g)] == v && lholder[LI(r, g)] == s && !lexpired[LI(r, g)])

inline complete(r, i, g, v, s, seen, ok) {
    if
    :: FENCE_OK(r, i, g, v, s) && att[i] == A_RUNNING && rstat[r] == R_RUNNING ->
        assert(seen == authority[r]);   /* a fence the store accepts is not stale */
        release_lease(r, g);
        if
        :: ok -> att_to(i, A_SUCCEEDED); run_to(r, R_SUCCEEDED)
        :: !ok && r != UNSAFE_RUN && natt[r] < MAXA ->    /* retried on error (ADR 0013) */
            att_to(i, A_FAILED); run_to(r, R_RETRY_WAIT)
        :: !ok && (r == UNSAFE_RUN || natt[r] >= MAXA) -> att_to(i, A_FAILED); run_to(r, R_FAILED)
        fi
    :: else -> skip    /* already completed, or a stale fence: nothing changes */
    fi
}

/* hand an unstarted attempt back: lease released (version + 1), attempt pristine, run queued */
inline hand_back(r, i, g) {
    release_lease(r, g);
    att_to(i, A_CLAIMED);
    att_gen[i] = 0;
    att_sess[i] = 0;
    run_to(r, R_QUEUED)
}

/* what the statement "I hold nothing of run r" changes, for session s */
inline not_held(s, r) {
    if
    :: !lexpired[LI(r, lgen[r])] -> hand_back(r, CUR(r), lgen[r])
    :: else -> att_report[CUR(r)] = 1  /* recorded as not-running evidence */
    fi
}

inline grant(s, r) {
    assert(gate);
    gi = CUR(r);
    assert(att[gi] == A_CLAIMED && att_gen[gi] == 0);
    assert(!LEASED(r));
    assert(lgen[r] < MAXG);            /* the bound holds every generation */
    lgen[r]++;
    lease[LI(r, lgen[r])] = L_LEASED;
    lver[LI(r, lgen[r])] = 1;
    lholder[LI(r, lgen[r])] = s;
    authority[r]++;
    att_to(gi, A_RUNNING);
    att_gen[gi] = lgen[r];
    att_sess[gi] = s;
    run_to(r, R_RUNNING);
    att_report[gi] = 0;                /* a stop report counts only after this start */
    granted = r
}

/* the slot is empty again: the worker keeps nothing of what it held */
inline forget(to) {
    phase = to; hr = 255; hi = 0; hg = 0; hv = 0; seen = 0; ok = 0
}

proctype Worker(byte w) {
    byte epoch = 0;
    byte me = SID(w, 0);
    byte phase = P_IDLE;
    byte hr = 255, hi, hg, hv, seen;   /* the attempt the slot holds, and its fence */
    bit ok;
    byte r, gi, granted;
    sess[me] = S_ACTIVE;
end_idle:
    do
    :: SETTLED && phase != P_HELD && phase != P_EXEC && phase != P_DONE -> break

    /* a claim: only when it would change something (an idle claim is a stutter) */
    :: atomic {
        (phase == P_IDLE || phase == P_DONE) &&
        (phase == P_DONE || NOT_HELD(me, 0, hr) || NOT_HELD(me, 1, hr) ||
            (gate && QUEUED_ANY && !HOLDS_LEASE(me))) &&
        sess[me] == S_ACTIVE ->
        if
        :: phase == P_DONE -> complete(hr, hi, hg, hv, me, seen, ok)
        :: else -> skip
        fi;
        r = 0;
        do
        :: r < NR -> if :: NOT_HELD(me, r, hr) -> not_held(me, r) :: else -> skip fi; r++
        :: else -> break
        od;
        granted = 255;
        if
        :: gate && !HOLDS_LEASE(me) && rstat[0] == R_QUEUED -> grant(me, 0)
        :: gate && !HOLDS_LEASE(me) && rstat[1] == R_QUEUED -> grant(me, 1)
        :: else -> skip
        fi;
        if
        :: losses > 0 -> losses--      /* committed; the answer never reaches the worker */
        :: true ->
            forget(P_IDLE);
            if
            :: granted != 255 ->
                hr = granted; hi = CUR(hr); hg = lgen[hr]; hv = 1; seen = authority[hr];
                in_slot[hi]++;
                phase = P_HELD
            :: else -> skip
            fi
        fi;
        r = 0; gi = 0; granted = 0
    }

    /* the slot begins the task: the start barrier is crossed on the worker */
    :: atomic {
        phase == P_HELD ->
        executions[hr]++;
        executing[hi]++;
        phase = P_EXEC
    }

    /* the slot could not start it: handed back unstarted (fenced; expiry does not matter) */
    :: atomic {
        phase == P_HELD && handbacks > 0 ->
        handbacks--;
        in_slot[hi]--;
        if
        :: att_gen[hi] == hg && lease[LI(hr, hg)] == L_LEASED && lver[LI(hr, hg)] == hv &&
           lholder[LI(hr, hg)] == me ->
            assert(seen == authority[hr]);
            hand_back(hr, hi, hg)
        :: else -> skip
        fi;
        forget(P_IDLE)
    }

    /* the task ends, well or not */
    :: atomic { phase == P_EXEC -> executing[hi]--; in_slot[hi]--; ok = 1; phase = P_DONE }
    :: atomic { phase == P_EXEC && hr == UNSAFE_RUN -> executing[hi]--; in_slot[hi]--; ok = 0; phase = P_DONE }
    :: atomic { phase == P_EXEC && hr != UNSAFE_RUN && errors > 0 -> errors--; executing[hi]--; in_slot[hi]--; ok = 0; phase = P_DONE }

    /* self-fencing: the slot is killed, then the abandon report (fenced) */
    :: atomic {
        phase == P_EXEC ->
        executing[hi]--;
        in_slot[hi]--;
        if
        :: att_gen[hi] == hg && lease[LI(hr, hg)] == L_LEASED && lver[LI(hr, hg)] == hv &&
           lholder[LI(hr, hg)] == me && att[hi] == A_RUNNING ->
            if
            :: !lexpired[LI(hr, hg)] ->
                assert(seen == authority[hr]);
                assert(executing[hi] == 0);
                release_lease(hr, hg);           /* reason abandoned */
                att_to(hi, A_LOST);
                run_to(hr, R_LOST)
            :: else -> att_report[hi] = 1       /* expired: only recorded */
            fi
        :: else -> skip
        fi;
        forget(P_IDLE)
    }

    /* a crash at any step; the slot's task dies with the worker */
    :: atomic {
        phase != P_DEAD && crashes > 0 ->
        crashes--;
        if :: phase == P_EXEC -> executing[hi]-- :: else -> skip fi;
        if :: phase == P_HELD || phase == P_EXEC -> in_slot[hi]-- :: else -> skip fi;
        forget(P_DEAD)
    }

    /* restarted under the same worker id: the old session is replaced */
    :: atomic {
        phase == P_DEAD ->
        sess[me] = S_REPLACED;
        epoch++;
        me = SID(w, epoch);
        sess[me] = S_ACTIVE;
        phase = P_IDLE
    }
    od
}

/* ---------------------------------------------------------------- the scheduler */

#define EVIDENCE(i) (att_report[i] || sess[att_sess[i]] == S_REPLACED)
/* runtime recovery's candidate: started attempt whose lease authority is gone */
#define CANDIDATE(r) (natt[r] > 0 && (rstat[r] == R_RUNNING || rstat[r] == R_LOST) \
    && att[CUR(r)] == A_RUNNING && att_gen[CUR(r)] > 0 \
    && (lease[LI(r, att_gen[CUR(r)])] != L_LEASED || lexpired[LI(r, att_gen[CUR(r)])]))
#define RESOLVABLE(r) (CANDIDATE(r) && EVIDENCE(CUR(r)))
#define RETRY_WORK(r) (rstat[r] == R_LOST || rstat[r] == R_RETRY_WAIT)
#define CYCLE_WORK (RESOLVABLE(0) || RESOLVABLE(1) || RETRY_WORK(0) || RETRY_WORK(1) \
    || rstat[0] == R_CREATED || rstat[1] == R_CREATED || !gate)

inline recover(r) {
    if
    :: RESOLVABLE(r) ->
        assert(executing[CUR(r)] == 0);  /* the evidence is true: nothing executes it */
        if
        :: lease[LI(r, att_gen[CUR(r)])] == L_LEASED -> release_lease(r, att_gen[CUR(r)])
        :: else -> skip                  /* no release is invented */
        fi;
        att_to(CUR(r), A_LOST);
        run_to(r, R_LOST)
    :: else -> skip                      /* fail closed: tried again next cycle */
    fi
}

inline retry(r) {
    if
    :: rstat[r] == R_LOST && r != UNSAFE_RUN && natt[r] < MAXA -> run_to(r, R_RETRY_WAIT)
    :: rstat[r] == R_LOST && (r == UNSAFE_RUN || natt[r] >= MAXA) -> run_to(r, R_FAILED)
    :: rstat[r] == R_RETRY_WAIT ->       /* due: a fresh, pristine attempt N + 1 */
        natt[r]++;
        att[CUR(r)] = A_CLAIMED;
        run_to(r, R_QUEUED)
    :: else -> skip
    fi
}

inline first_attempt(r) {
    if
    :: rstat[r] == R_CREATED -> natt[r] = 1; att[AI(r, 0)] = A_CLAIMED; run_to(r, R_QUEUED)
    :: else -> skip
    fi
}

/* a guard step (recovery or lost retry) fails: nothing changes; then the gate closes, in a
   transaction of its own */
#define FAIL_STEP(work) atomic { work && step_failures > 0 -> step_failures-- }; \
    atomic { gate = 0; gate_at = now; now++; closes++ }

/* One cycle is five steps in a fixed order. A step's transactions (one per candidate) are one
   atomic step here: they touch different runs. A cycle starts only when it has something to
   do (an idle cycle is a stutter). */
proctype Replica(byte p) {
    byte began;                        /* the store's clock this cycle's recovery page read */
    byte since;                        /* ghost: the closes counted when the cycle began */
end_idle:
    do
    :: SETTLED -> break
    /* 1. runtime recovery */
    :: FAIL_STEP(CYCLE_WORK)
    :: atomic { CYCLE_WORK -> began = now; since = closes; recover(0); recover(1) };
        /* 2. lost retry; 3./4. trigger schedule and workflow frontier (a created run gets
           Attempt 1) */
        if
        :: FAIL_STEP(true); goto cycle_end
        :: atomic { retry(0); retry(1); first_attempt(0); first_attempt(1) }
        fi;
        /* 5. task attempt admission: the gate opens, a compare-and-set on its changed_at,
           unless it closed after this cycle began (then the next cycle opens it) */
        atomic {
            if
            :: !gate && (gate_at < began || UNORDERED_GATE) -> assert(since == closes); gate = 1
            :: else -> skip
            fi
        };
cycle_end:
        began = 0;
        since = 0
    od
}

/* ---------------------------------------------------------------- time and the operator */

inline expire(r) {
    atomic { LEASED(r) && !lexpired[LI(r, lgen[r])] -> lexpired[LI(r, lgen[r])] = 1 }
}

proctype Clock() {
end_idle:
    do
    :: SETTLED -> break
    :: expire(0)
    :: expire(1)
    od
}

/* ql3 runs cancel: the run, its active attempt and that attempt's leased lease */
inline cancel(r) {
    atomic {
        cancels > 0 && !TERMINAL_RUN(rstat[r]) ->
        cancels--;
        if
        :: natt[r] > 0 && (att[CUR(r)] == A_CLAIMED || att[CUR(r)] == A_RUNNING) ->
            if
            :: att_gen[CUR(r)] > 0 && lease[LI(r, att_gen[CUR(r)])] == L_LEASED ->
                release_lease(r, att_gen[CUR(r)])
            :: else -> skip
            fi;
            att_to(CUR(r), A_CANCELLED)
        :: else -> skip
        fi;
        run_to(r, R_CANCELLED)
    }
}

/* ql3 attempts attest-stopped: true when said (no worker slot holds the attempt, so nothing
   executes it or is about to) */
inline attest(r) {
    atomic {
        attests > 0 && natt[r] > 0 && (att[CUR(r)] == A_CLAIMED || att[CUR(r)] == A_RUNNING) &&
        in_slot[CUR(r)] == 0 ->
        attests--;
        att_report[CUR(r)] = 1
    }
}

proctype Operator() {
end_idle:
    do
    :: SETTLED -> break
    :: cancel(0)
    :: cancel(1)
    :: attest(0)
    :: attest(1)
    od
}

init {
    atomic {
        rstat[0] = R_CREATED;                 /* admitted without an Attempt */
        rstat[1] = R_QUEUED; natt[1] = 1; att[AI(1, 0)] = A_CLAIMED;
        if
        :: replicas = 2; step_failures = 1
        :: crashes = 1
        :: losses = 1
        :: handbacks = 1
        :: cancels = 1
        :: attests = 1
        :: errors = 1
        fi;
        run Worker(0); run Worker(1);
        run Replica(0);
        if :: replicas == 2 -> run Replica(1) :: else -> skip fi;
        run Clock(); run Operator()
    }
}
