"""Pure transitions of the Run / Attempt / DispatchLease state machine.

Every transition takes the current values and ``now_ms`` (observed by the store) and returns a
:class:`Change` holding the new values and the one event it implies, or raises one specific
:class:`~domain.errors.DomainError`. Recovery, lost retry and the worker commands all call these.
"""

from __future__ import annotations

from collections.abc import Mapping

from attrs import evolve, frozen

from domain.errors import (
    FenceReason,
    FenceRejected,
    InvalidAdmission,
    InvalidTransition,
    SessionRejected,
)
from domain.events import EventType, RunEvent
from domain.fence import LeaseFence, check_fence
from domain.model import (
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
from domain.policy import RetryPolicy

MAX_TASK_NAME_LENGTH = 200


@frozen(kw_only=True)
class Change:
    """The outcome of one transition: the values to persist and the event to append.

    ``attempts`` holds the Attempts that changed or were created; ``lease`` the lease that changed
    or was created, if any.
    """

    run: Run
    attempts: tuple[Attempt, ...]
    lease: DispatchLease | None
    event: RunEvent


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


def _require_run(run: Run, allowed: frozenset[RunStatus], action: str) -> None:
    if run.status not in allowed:
        raise _refuse("run", run.id, run.status.value, action)


def _require_attempt(
    run: Run, attempt: Attempt, allowed: frozenset[AttemptStatus], action: str
) -> None:
    if attempt.run_id != run.id:
        raise InvalidAdmission(f"attempt {attempt.id} does not belong to run {run.id}")
    if attempt.status not in allowed:
        raise _refuse("attempt", attempt.id, attempt.status.value, action)


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
) -> Change:
    """Admit a Run. With an attempt id it is ``queued`` with a pristine Attempt 1; without one
    it stays ``created`` (an Attempt is made later, by the frontier or by startup recovery)."""
    if not task or len(task) > MAX_TASK_NAME_LENGTH or task.strip() != task:
        raise InvalidAdmission(
            f"task name must be 1..{MAX_TASK_NAME_LENGTH} characters, without padding"
        )
    if not run_id or (attempt_id is not None and not attempt_id):
        raise InvalidAdmission("run and attempt ids must not be empty")
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise InvalidAdmission("policy must be a RetryPolicy")
    attempts: tuple[Attempt, ...] = ()
    status = RunStatus.CREATED
    if attempt_id is not None:
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
        created_at_ms=now_ms,
        updated_at_ms=now_ms,
    )
    first = attempts[0] if attempts else None
    return Change(
        run=run,
        attempts=attempts,
        lease=None,
        event=_event(run, first, EventType.RUN_ADMITTED, now_ms, {"task": task}),
    )


def create_first_attempt(run: Run, attempt_id: str, now_ms: int) -> Change:
    """A ``created`` Run gets its pristine Attempt 1 and is ``queued``."""
    _require_run(run, frozenset({RunStatus.CREATED}), "create its first attempt")
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


# --- dispatch and the worker commands ---------------------------------------------------------


def grant_lease(
    *,
    run: Run,
    attempt: Attempt,
    previous_lease: DispatchLease | None,
    session: WorkerSession,
    ttl_ms: int,
    now_ms: int,
) -> Change:
    """Offer a pristine Attempt to a session under a new lease (generation + 1, version 1).

    The lease is reserved for the session but bound to no token yet: the worker binds its own
    secret token when it accepts, so a lost answer can be retried without minting a new one."""
    _require_run(run, frozenset({RunStatus.QUEUED}), "be offered")
    _require_attempt(run, attempt, frozenset({AttemptStatus.CLAIMED}), "be offered")
    if not attempt.is_pristine:
        raise _refuse("attempt", attempt.id, "claimed (not pristine)", "be offered")
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
        token_hash=None,
        expires_at_ms=now_ms + ttl_ms,
        granted_at_ms=now_ms,
    )
    new_attempt = evolve(
        attempt,
        session_id=session.id,
        worker_id=session.worker_id,
        lease_generation=generation,
        lease_version=1,
        offered_at_ms=now_ms,
        updated_at_ms=now_ms,
    )
    new_run = evolve(run, status=RunStatus.DISPATCHING, updated_at_ms=now_ms)
    return Change(
        run=new_run,
        attempts=(new_attempt,),
        lease=lease,
        event=_event(
            new_run,
            new_attempt,
            EventType.ATTEMPT_OFFERED,
            now_ms,
            {"session_id": session.id, "worker_id": session.worker_id, "generation": generation},
        ),
    )


def _fenced(
    run: Run, attempt: Attempt, lease: DispatchLease | None, fence: LeaseFence, now_ms: int
) -> DispatchLease:
    live = check_fence(lease, fence, now_ms)
    if attempt.id != fence.attempt_id or attempt.run_id != run.id:
        raise InvalidAdmission("fence, attempt and run do not belong together")
    return live


def accept(
    *,
    run: Run,
    attempt: Attempt,
    lease: DispatchLease | None,
    session_id: str,
    generation: int,
    version: int,
    token_hash: str,
    ttl_ms: int,
    now_ms: int,
) -> Change:
    """The session takes the offer and binds its secret token (stored only as a hash). The lease
    is extended; its version is unchanged. Accepting again with the same token is refused as
    already accepted, with another token as a fence mismatch."""
    if lease is None:
        raise FenceRejected(FenceReason.NO_LEASE, attempt.id)
    if lease.attempt_id != attempt.id or attempt.run_id != run.id:
        raise FenceRejected(FenceReason.ATTEMPT_MISMATCH, attempt.id)
    if lease.generation != generation:
        raise FenceRejected(FenceReason.GENERATION_MISMATCH, attempt.id)
    if lease.version != version:
        raise FenceRejected(FenceReason.VERSION_MISMATCH, attempt.id)
    if lease.status is not LeaseStatus.LEASED:
        raise FenceRejected(FenceReason.RELEASED, attempt.id)
    if lease.expires_at_ms <= now_ms:
        raise FenceRejected(FenceReason.EXPIRED, attempt.id)
    if lease.holder_session_id != session_id:
        raise SessionRejected(f"attempt {attempt.id} was not offered to session {session_id}")
    if lease.token_hash is not None:
        if lease.token_hash != token_hash:
            raise FenceRejected(FenceReason.TOKEN_MISMATCH, attempt.id)
        raise _refuse("attempt", attempt.id, "claimed (already accepted)", "be accepted")
    _require_attempt(run, attempt, frozenset({AttemptStatus.CLAIMED}), "be accepted")
    new_attempt = evolve(attempt, accepted_at_ms=now_ms, updated_at_ms=now_ms)
    new_lease = evolve(
        lease, token_hash=token_hash, expires_at_ms=max(lease.expires_at_ms, now_ms + ttl_ms)
    )
    return Change(
        run=run,
        attempts=(new_attempt,),
        lease=new_lease,
        event=_event(run, new_attempt, EventType.ATTEMPT_ACCEPTED, now_ms),
    )


def activate(
    *,
    run: Run,
    attempt: Attempt,
    lease: DispatchLease | None,
    fence: LeaseFence,
    ttl_ms: int,
    now_ms: int,
) -> Change:
    """The start barrier: from here on, external side effects may have begun. Requires an
    accepted offer (the fence's token was bound at accept)."""
    live = _fenced(run, attempt, lease, fence, now_ms)
    _require_attempt(run, attempt, frozenset({AttemptStatus.CLAIMED}), "be activated")
    _require_run(run, frozenset({RunStatus.DISPATCHING}), "start an attempt")
    new_attempt = evolve(
        attempt,
        status=AttemptStatus.STARTING,
        started_at_ms=now_ms,
        updated_at_ms=now_ms,
    )
    new_run = evolve(run, status=RunStatus.RUNNING, updated_at_ms=now_ms)
    new_lease = evolve(live, expires_at_ms=max(live.expires_at_ms, now_ms + ttl_ms))
    return Change(
        run=new_run,
        attempts=(new_attempt,),
        lease=new_lease,
        event=_event(new_run, new_attempt, EventType.ATTEMPT_ACTIVATED, now_ms),
    )


def mark_running(
    *, run: Run, attempt: Attempt, lease: DispatchLease | None, fence: LeaseFence, now_ms: int
) -> Change:
    """The worker reports the task body is executing."""
    live = _fenced(run, attempt, lease, fence, now_ms)
    _require_attempt(run, attempt, frozenset({AttemptStatus.STARTING}), "be marked running")
    new_attempt = evolve(attempt, status=AttemptStatus.RUNNING, updated_at_ms=now_ms)
    return Change(
        run=run,
        attempts=(new_attempt,),
        lease=live,
        event=_event(run, new_attempt, EventType.ATTEMPT_RUNNING, now_ms),
    )


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
) -> Change:
    """The worker reports the outcome. The lease is released with reason ``completed``."""
    live = _fenced(run, attempt, lease, fence, now_ms)
    started = frozenset({AttemptStatus.STARTING, AttemptStatus.RUNNING})
    _require_attempt(run, attempt, started, "complete")
    _require_run(run, frozenset({RunStatus.RUNNING}), "complete")
    released = _release(live, ReleaseReason.COMPLETED, now_ms)
    attempt_status = AttemptStatus.SUCCEEDED if succeeded else AttemptStatus.FAILED
    new_attempt = evolve(
        attempt,
        status=attempt_status,
        lease_version=released.version,
        finished_at_ms=now_ms,
        error=None if succeeded else (error or "failed"),
        updated_at_ms=now_ms,
    )
    new_run = evolve(
        run,
        status=RunStatus.SUCCEEDED if succeeded else RunStatus.FAILED,
        output=output if succeeded else None,
        error=None if succeeded else (error or "failed"),
        updated_at_ms=now_ms,
    )
    event_type = EventType.ATTEMPT_SUCCEEDED if succeeded else EventType.ATTEMPT_FAILED
    data: dict[str, JsonValue] = {} if succeeded else {"error": new_run.error}
    return Change(
        run=new_run,
        attempts=(new_attempt,),
        lease=released,
        event=_event(new_run, new_attempt, event_type, now_ms, data),
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
    active = frozenset({AttemptStatus.CLAIMED, AttemptStatus.STARTING, AttemptStatus.RUNNING})
    _require_attempt(run, attempt, active, "be marked lost")
    losable = frozenset({RunStatus.DISPATCHING, RunStatus.RUNNING, RunStatus.LOST})
    _require_run(run, losable, "lose an attempt")
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
    """Cancel a non-terminal Run, its current Attempt and that Attempt's leased lease."""
    if run.status.is_terminal:
        raise _refuse("run", run.id, run.status.value, "be cancelled")
    attempts: tuple[Attempt, ...] = ()
    released: DispatchLease | None = None
    if attempt is not None and not attempt.status.is_terminal:
        _require_attempt(run, attempt, frozenset(AttemptStatus) - _TERMINAL_A, "be cancelled")
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
            {"reason": reason},
        ),
    )


_TERMINAL_A = frozenset(s for s in AttemptStatus if s.is_terminal)
