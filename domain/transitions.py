"""Pure transitions of the Run / Attempt / DispatchLease state machine.

Every transition takes the current values and ``now_ms`` (observed by the store) and returns a
:class:`Change` holding the new values and the one event it implies, or raises one specific
:class:`~ql3.domain.errors.DomainError`. Recovery, lost retry and the worker commands all call
these.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import evolve

from ql3.domain.change import Change as Change  # every transition returns one: imported from here
from ql3.domain.errors import (
    FenceReason,
    FenceRejected,
    InvalidAdmission,
    InvalidTransition,
    SessionRejected,
)
from ql3.domain.events import EventType, RunEvent
from ql3.domain.fence import LeaseFence, check_fence, check_not_cancelled
from ql3.domain.model import (
    MAX_PRIORITY,
    MAX_TIMEOUT_MS,
    MAX_UNIQUE_KEY_LENGTH,
    MIN_PRIORITY,
    Attempt,
    AttemptStatus,
    DispatchLease,
    EvidenceKind,
    JsonValue,
    LeaseStatus,
    NotRunningEvidence,
    ReleaseReason,
    Run,
    RunOwner,
    RunStatus,
    WorkerSession,
)
from ql3.domain.policy import RetryPolicy
from ql3.domain.retry import RetryCause, decide_retry, timed_out_error
from ql3.domain.states import (
    CLAIMABLE_RUN_STATUSES,
    require_admitted,
    require_attempt_edge,
    require_run_edge,
)

MAX_TASK_NAME_LENGTH = 200
MAX_CANCEL_REASON_LENGTH = 500


def storable_text(value: JsonValue) -> bool:
    """No string in ``value`` (keys included) holds a NUL character, which no store can keep in
    text or JSON."""
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, dict):
        return all(map(storable_text, value)) and all(map(storable_text, value.values()))
    if isinstance(value, list):
        return all(map(storable_text, value))
    return True


def _event(
    run: Run,
    attempt: Attempt | None,
    event_type: EventType,
    now_ms: int,
    data: Mapping[str, JsonValue] | None = None,
) -> RunEvent:
    return RunEvent(
        run_id=run.id,
        attempt_id=attempt.id if attempt else None,
        type=event_type,
        at_ms=now_ms,
        data=dict(data or {}),
    )


def _refuse(entity: str, entity_id: str, status: str, action: str) -> InvalidTransition:
    return InvalidTransition(entity, entity_id, status, action)


def _require_run(run: Run, to: RunStatus, action: str) -> None:
    require_run_edge(run, to, action)


def _require_attempt(run: Run, attempt: Attempt, to: AttemptStatus, action: str) -> None:
    if attempt.run_id != run.id:
        raise InvalidAdmission(f"attempt {attempt.id} does not belong to run {run.id}")
    require_attempt_edge(attempt.id, attempt.status, to, action)


def _pristine_attempt(run_id: str, attempt_id: str, number: int, now_ms: int) -> Attempt:
    return Attempt(
        id=attempt_id,
        run_id=run_id,
        number=number,
        status=AttemptStatus.CLAIMED,
        created_at_ms=now_ms,
        updated_at_ms=now_ms,
    )


def _release(lease: DispatchLease, reason: ReleaseReason, now_ms: int) -> DispatchLease:
    return evolve(
        lease,
        status=LeaseStatus.RELEASED,
        version=lease.version + 1,
        release_reason=reason,
        released_at_ms=now_ms,
    )


def _lease_of(attempt: Attempt, lease: DispatchLease | None) -> DispatchLease | None:
    """The lease that carries ``attempt``'s authority, if the given lease is that one."""
    if (
        lease is not None
        and lease.attempt_id == attempt.id
        and lease.generation == attempt.lease_generation
    ):
        return lease
    return None


# --- admission ---------------------------------------------------------------------------------


def admit(
    *,
    run_id: str,
    attempt_id: str | None,
    task: str,
    input: JsonValue,
    policy: RetryPolicy | None,
    now_ms: int,
    owner: RunOwner = RunOwner.RUNTIME,
    parent_run_id: str | None = None,
    priority: int = 0,
    unique_key: str | None = None,
    timeout_ms: int | None = None,
    run_after_ms: int | None = None,
) -> Change:
    """Admit a Run. With an attempt id it is ``queued`` with a pristine Attempt 1; without one
    it stays ``created`` (an Attempt is made later, by the frontier or by startup recovery).
    Priority, unique key and timeout are snapshotted on the Run (ADRs 0013 to 0015).

    With ``run_after_ms`` later than ``now_ms`` the Run is delayed (ADR 0015): admitted in
    ``retry_wait`` without an Attempt (``attempt_id`` is not used) and due at ``run_after_ms``;
    lost retry makes its Attempt 1 once the store's clock reaches that time. A due time not
    later than ``now_ms`` admits it as without one."""
    if not task or len(task) > MAX_TASK_NAME_LENGTH or task.strip() != task or "\x00" in task:
        raise InvalidAdmission(
            f"task name must be 1..{MAX_TASK_NAME_LENGTH} characters, without padding or NUL"
        )
    if not run_id or (attempt_id is not None and not attempt_id):
        raise InvalidAdmission("run and attempt ids must not be empty")
    if not storable_text(input):
        raise InvalidAdmission("the input must not hold a NUL character")
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise InvalidAdmission("policy must be a RetryPolicy")
    if (
        not isinstance(priority, int)
        or isinstance(priority, bool)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        raise InvalidAdmission(f"priority must be an integer within {MIN_PRIORITY}..{MAX_PRIORITY}")
    if unique_key is not None:
        check_unique_key(unique_key)
    if timeout_ms is not None and (
        not isinstance(timeout_ms, int)
        or isinstance(timeout_ms, bool)
        or not 1 <= timeout_ms <= MAX_TIMEOUT_MS
    ):
        raise InvalidAdmission(f"a timeout must be within 1..{MAX_TIMEOUT_MS} milliseconds")
    if run_after_ms is not None and (
        isinstance(run_after_ms, bool) or not isinstance(run_after_ms, int)
    ):
        raise InvalidAdmission("a due time must be an integer number of milliseconds")
    delayed = run_after_ms is not None and run_after_ms > now_ms
    if delayed and owner is not RunOwner.RUNTIME:
        raise InvalidAdmission("only runtime-owned runs can be delayed")
    attempts: tuple[Attempt, ...] = ()
    status = RunStatus.CREATED
    if delayed:
        status = RunStatus.RETRY_WAIT
    elif attempt_id is not None:
        attempts = (_pristine_attempt(run_id, attempt_id, 1, now_ms),)
        status = RunStatus.QUEUED
    run = Run(
        id=run_id,
        task=task,
        owner=owner,
        status=status,
        input=input,
        policy=policy,
        attempt_count=len(attempts),
        parent_run_id=parent_run_id,
        priority=priority,
        unique_key=unique_key,
        timeout_ms=timeout_ms,
        next_attempt_at_ms=run_after_ms if delayed else None,
        created_at_ms=now_ms,
        updated_at_ms=now_ms,
    )
    require_admitted(run)
    first = attempts[0] if attempts else None
    data: dict[str, JsonValue] = {"task": task}
    if delayed:
        data["run_after_ms"] = run_after_ms
    return Change(
        run=run,
        attempts=attempts,
        lease=None,
        event=_event(run, first, EventType.RUN_ADMITTED, now_ms, data),
    )


def check_unique_key(unique_key: str) -> None:
    """Refuse a unique key no store keeps: empty, too long, not text or holding NUL."""
    if (
        not isinstance(unique_key, str)
        or not unique_key
        or len(unique_key) > MAX_UNIQUE_KEY_LENGTH
        or "\x00" in unique_key
    ):
        raise InvalidAdmission(
            f"a unique key must be 1..{MAX_UNIQUE_KEY_LENGTH} characters, without NUL"
        )


def due_time(now_ms: int, *, delay_ms: int | None, run_after_ms: int | None) -> int | None:
    """When a Run submitted at ``now_ms`` (the store's clock) becomes due: ``now_ms`` plus a
    delay, or a given time; None for neither. Both at once, or a negative delay, is refused."""
    if delay_ms is not None and run_after_ms is not None:
        raise InvalidAdmission("give a delay or a due time, not both")
    if delay_ms is not None:
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, int) or delay_ms < 0:
            raise InvalidAdmission("a delay must be a non-negative number of milliseconds")
        return now_ms + delay_ms
    return run_after_ms


def create_first_attempt(run: Run, attempt_id: str, now_ms: int) -> Change:
    """A ``created`` Run gets its pristine Attempt 1 and is ``queued``."""
    _require_run(run, RunStatus.QUEUED, "create its first attempt")
    if run.status is not RunStatus.CREATED:
        raise _refuse("run", run.id, run.status.value, "create its first attempt")
    if run.attempt_count != 0:
        raise _refuse("run", run.id, run.status.value, "create a first attempt twice")
    attempt = _pristine_attempt(run.id, attempt_id, 1, now_ms)
    new_run = evolve(run, status=RunStatus.QUEUED, attempt_count=1, updated_at_ms=now_ms)
    return Change(
        run=new_run,
        attempts=(attempt,),
        lease=None,
        event=_event(new_run, attempt, EventType.ATTEMPT_CREATED, now_ms, {"number": 1}),
    )


# --- the worker's claim and the fenced commands -------------------------------------------------


def claim(
    *,
    run: Run,
    attempt: Attempt,
    previous_lease: DispatchLease | None,
    session: WorkerSession,
    token_hash: str,
    ttl_ms: int,
    now_ms: int,
) -> Change:
    """A session with a free slot claims a queued Run's pristine Attempt and starts it, in one
    change: a new lease (generation + 1, version 1) bound to the token the store minted for it,
    and the start barrier crossed, so external side effects may begin once the worker has the
    answer (ADR 0007)."""
    _require_run(run, RunStatus.RUNNING, "be claimed")
    if run.status not in CLAIMABLE_RUN_STATUSES:
        raise _refuse("run", run.id, run.status.value, "be claimed")
    _require_attempt(run, attempt, AttemptStatus.RUNNING, "be claimed")
    if not attempt.is_pristine:
        raise _refuse("attempt", attempt.id, f"{attempt.status.value} (not pristine)", "be claimed")
    if not session.accepts_work:
        raise SessionRejected(f"session {session.id} is {session.status.value}")
    if run.task not in session.tasks:
        raise SessionRejected(f"session {session.id} does not take task {run.task!r}")
    if ttl_ms <= 0:
        raise InvalidAdmission("lease ttl must be positive")
    if previous_lease is not None and previous_lease.status is LeaseStatus.LEASED:
        raise _refuse("lease", f"{run.id}/{previous_lease.generation}", "leased", "be replaced")
    generation = previous_lease.generation + 1 if previous_lease else 1
    lease = DispatchLease(
        run_id=run.id,
        attempt_id=attempt.id,
        generation=generation,
        version=1,
        status=LeaseStatus.LEASED,
        holder_session_id=session.id,
        token_hash=token_hash,
        expires_at_ms=now_ms + ttl_ms,
        granted_at_ms=now_ms,
    )
    new_attempt = evolve(
        attempt,
        status=AttemptStatus.RUNNING,
        session_id=session.id,
        worker_id=session.worker_id,
        lease_generation=generation,
        lease_version=1,
        offered_at_ms=now_ms,
        accepted_at_ms=now_ms,
        started_at_ms=now_ms,
        updated_at_ms=now_ms,
    )
    new_run = evolve(run, status=RunStatus.RUNNING, updated_at_ms=now_ms)
    return Change(
        run=new_run,
        attempts=(new_attempt,),
        lease=lease,
        event=_event(
            new_run,
            new_attempt,
            EventType.ATTEMPT_STARTED,
            now_ms,
            {"session_id": session.id, "worker_id": session.worker_id, "generation": generation},
        ),
    )


def release(
    *,
    run: Run,
    attempt: Attempt,
    lease: DispatchLease | None,
    session_id: str,
    cause: str,
    now_ms: int,
) -> Change:
    """The holder hands back an Attempt whose task never began (a drain, a self-fence before
    the start, a slot that failed to start, a claim answer the worker never received): its
    lease is released (version + 1, reason ``handed_back``), the Attempt is pristine again and
    the Run ``queued``, with no ``lost`` verdict (ADR 0007). The lease must still be ``leased``
    to ``session_id``; its expiry does not matter, since handing back gives authority up."""
    if run.status not in (RunStatus.RUNNING, RunStatus.DISPATCHING):
        raise _refuse("run", run.id, run.status.value, "take back an attempt")
    _require_run(run, RunStatus.QUEUED, "take back an attempt")
    _require_attempt(run, attempt, AttemptStatus.CLAIMED, "be handed back")
    own = _lease_of(attempt, lease)
    if own is None or own.status is not LeaseStatus.LEASED:
        if own is not None:
            check_not_cancelled(own, attempt.id)
        raise FenceRejected(FenceReason.RELEASED if own else FenceReason.NO_LEASE, attempt.id)
    if own.holder_session_id != session_id:
        raise SessionRejected(f"attempt {attempt.id} is not held by session {session_id}")
    released = _release(own, ReleaseReason.HANDED_BACK, now_ms)
    new_attempt = evolve(
        attempt,
        status=AttemptStatus.CLAIMED,
        session_id=None,
        worker_id=None,
        lease_generation=None,
        lease_version=None,
        offered_at_ms=None,
        accepted_at_ms=None,
        started_at_ms=None,
        updated_at_ms=now_ms,
    )
    new_run = evolve(run, status=RunStatus.QUEUED, updated_at_ms=now_ms)
    return Change(
        run=new_run,
        attempts=(new_attempt,),
        lease=released,
        event=_event(
            new_run,
            new_attempt,
            EventType.ATTEMPT_RELEASED,
            now_ms,
            {
                "cause": cause,
                "previous_status": attempt.status.value,
                "session_id": session_id,
                "lease_generation": released.generation,
                "lease_version": released.version,
            },
        ),
    )


def _fenced(
    run: Run, attempt: Attempt, lease: DispatchLease | None, fence: LeaseFence, now_ms: int
) -> DispatchLease:
    live = check_fence(lease, fence, now_ms)
    if attempt.id != fence.attempt_id or attempt.run_id != run.id:
        raise InvalidAdmission("fence, attempt and run do not belong together")
    return live


def renew(
    *, attempt: Attempt, lease: DispatchLease | None, fence: LeaseFence, ttl_ms: int, now_ms: int
) -> DispatchLease:
    """Move ``expires_at`` forward. Not a state change: no version change and no event."""
    live = check_fence(lease, fence, now_ms)
    if attempt.id != fence.attempt_id or attempt.status.is_terminal:
        raise _refuse("attempt", attempt.id, attempt.status.value, "renew its lease")
    if ttl_ms <= 0:
        raise InvalidAdmission("lease ttl must be positive")
    return evolve(live, expires_at_ms=max(live.expires_at_ms, now_ms + ttl_ms))


def complete(
    *,
    run: Run,
    attempt: Attempt,
    lease: DispatchLease | None,
    fence: LeaseFence,
    succeeded: bool,
    output: JsonValue,
    error: str | None,
    now_ms: int,
    timed_out: bool = False,
) -> Change:
    """The worker reports the outcome; the lease is released with reason ``completed``.

    A failure (``timed_out``: the worker stopped the task at the Run's timeout) goes through
    the retry decision of :func:`ql3.domain.retry.decide_retry` (cause ``error`` or ``timeout``):
    the Attempt is ``failed`` either way, and the Run ``retry_wait`` until its next Attempt is
    due, or ``failed`` (ADR 0013). One event, ``attempt_failed``, says which. The error of a
    timed-out Attempt names the Run's timeout ("timed out after 2.0 s")."""
    live = _fenced(run, attempt, lease, fence, now_ms)
    if not storable_text(output) or not storable_text(error):
        raise InvalidAdmission("an output or error must not hold a NUL character")
    if succeeded and timed_out:
        raise InvalidAdmission("an attempt stopped at its timeout did not succeed")
    attempt_status = AttemptStatus.SUCCEEDED if succeeded else AttemptStatus.FAILED
    _require_attempt(run, attempt, attempt_status, "complete")
    if run.status is not RunStatus.RUNNING:
        raise _refuse("run", run.id, run.status.value, "complete")
    released = _release(live, ReleaseReason.COMPLETED, now_ms)
    failure = None if succeeded else (error or "failed")
    if timed_out and run.timeout_ms is not None:
        failure = timed_out_error(run.timeout_ms)
    new_attempt = evolve(
        attempt,
        status=attempt_status,
        lease_version=released.version,
        finished_at_ms=now_ms,
        error=failure,
        updated_at_ms=now_ms,
    )
    if succeeded:
        _require_run(run, RunStatus.SUCCEEDED, "complete")
        new_run = evolve(
            run, status=RunStatus.SUCCEEDED, output=output, error=None, updated_at_ms=now_ms
        )
        return Change(
            run=new_run,
            attempts=(new_attempt,),
            lease=released,
            event=_event(new_run, new_attempt, EventType.ATTEMPT_SUCCEEDED, now_ms),
        )
    cause = RetryCause.TIMEOUT if timed_out else RetryCause.ERROR
    decision = decide_retry(
        run_id=run.id, policy=run.policy, cause=cause, attempt_number=attempt.number, now_ms=now_ms
    )
    data: dict[str, JsonValue] = {"error": failure, "cause": cause.value, "retry": decision.retry}
    if decision.failure is None:
        _require_run(run, RunStatus.RETRY_WAIT, "complete")
        new_run = evolve(
            run,
            status=RunStatus.RETRY_WAIT,
            output=None,
            error=None,
            next_attempt_at_ms=decision.next_attempt_at_ms,
            updated_at_ms=now_ms,
        )
        data.update(
            {"next_attempt_at_ms": decision.next_attempt_at_ms, "next_attempt": attempt.number + 1}
        )
    else:
        _require_run(run, RunStatus.FAILED, "complete")
        new_run = evolve(
            run, status=RunStatus.FAILED, output=None, error=failure, updated_at_ms=now_ms
        )
        data["reason"] = decision.failure.value
    return Change(
        run=new_run,
        attempts=(new_attempt,),
        lease=released,
        event=_event(new_run, new_attempt, EventType.ATTEMPT_FAILED, now_ms, data),
    )


def mark_lost(
    *,
    run: Run,
    attempt: Attempt,
    lease: DispatchLease | None,
    evidence: NotRunningEvidence | None,
    release_reason: ReleaseReason,
    now_ms: int,
    cause: str,
) -> Change:
    """Attempt -> ``lost``, Run -> ``lost``; the Attempt's own leased lease (exact generation) is
    released with version + 1 in the same change. A missing lease is not invented."""
    _require_attempt(run, attempt, AttemptStatus.LOST, "be marked lost")
    _require_run(run, RunStatus.LOST, "lose an attempt")
    if attempt.status.is_started and evidence is None:
        raise _refuse("attempt", attempt.id, attempt.status.value, "be lost without evidence")
    own = _lease_of(attempt, lease)
    released: DispatchLease | None = None
    if own is not None and own.status is LeaseStatus.LEASED:
        released = _release(own, release_reason, now_ms)
    new_attempt = evolve(
        attempt,
        status=AttemptStatus.LOST,
        lease_version=released.version if released else attempt.lease_version,
        lost_evidence=evidence.kind if evidence else None,
        finished_at_ms=now_ms,
        updated_at_ms=now_ms,
    )
    new_run = evolve(run, status=RunStatus.LOST, updated_at_ms=now_ms)
    data: dict[str, JsonValue] = {"cause": cause, "previous_status": attempt.status.value}
    if evidence is not None:
        data.update(evidence.as_data())
    if released is not None:
        data.update(
            {
                "lease_generation": released.generation,
                "lease_version": released.version,
                "release_reason": release_reason.value,
            }
        )
    return Change(
        run=new_run,
        attempts=(new_attempt,),
        lease=released,
        event=_event(new_run, new_attempt, EventType.ATTEMPT_LOST, now_ms, data),
    )


def abandon(
    *,
    run: Run,
    attempt: Attempt,
    lease: DispatchLease | None,
    fence: LeaseFence,
    detail: str,
    now_ms: int,
) -> Change:
    """The worker reports it stopped executing the Attempt while its lease is still live: the
    Attempt is lost at once (its own report is the evidence) and the lease released."""
    live = _fenced(run, attempt, lease, fence, now_ms)
    evidence = NotRunningEvidence(
        attempt_id=attempt.id,
        kind=EvidenceKind.WORKER_ABANDONED,
        observed_at_ms=now_ms,
        detail=detail,
    )
    return mark_lost(
        run=run,
        attempt=attempt,
        lease=live,
        evidence=evidence,
        release_reason=ReleaseReason.ABANDONED,
        now_ms=now_ms,
        cause="abandoned",
    )


def cancel(
    *,
    run: Run,
    attempt: Attempt | None,
    lease: DispatchLease | None,
    reason: str,
    now_ms: int,
) -> Change:
    """Cancel a non-terminal Run, its current Attempt and that Attempt's leased lease (released
    for ``cancelled``, version + 1: the holder's later calls are refused as ``cancelled``)."""
    _require_run(run, RunStatus.CANCELLED, "be cancelled")
    if not reason or len(reason) > MAX_CANCEL_REASON_LENGTH or not storable_text(reason):
        raise InvalidAdmission(
            f"a cancellation reason must be 1..{MAX_CANCEL_REASON_LENGTH} characters, without NUL"
        )
    attempts: tuple[Attempt, ...] = ()
    released: DispatchLease | None = None
    if attempt is not None and not attempt.status.is_terminal:
        _require_attempt(run, attempt, AttemptStatus.CANCELLED, "be cancelled")
        own = _lease_of(attempt, lease)
        if own is not None and own.status is LeaseStatus.LEASED:
            released = _release(own, ReleaseReason.CANCELLED, now_ms)
        attempts = (
            evolve(
                attempt,
                status=AttemptStatus.CANCELLED,
                lease_version=released.version if released else attempt.lease_version,
                finished_at_ms=now_ms,
                updated_at_ms=now_ms,
            ),
        )
    new_run = evolve(
        run, status=RunStatus.CANCELLED, error=reason, next_attempt_at_ms=None, updated_at_ms=now_ms
    )
    return Change(
        run=new_run,
        attempts=attempts,
        lease=released,
        event=_event(
            new_run,
            attempts[0] if attempts else attempt,
            EventType.RUN_CANCELLED,
            now_ms,
            {"reason": reason, "previous_status": run.status.value},
        ),
    )
