"""Build store states through the real domain transitions, the way the application does: lock,
decide with a pure transition at the store's clock, apply as compare-and-set. A running Attempt
is made by :func:`ql3.domain.transitions.claim` (ADR 0007); the rows the offer protocol of ADR 0005
left behind (offered, accepted, activated) are built as such rows, since no transition makes
them any more and the stores must still recover, complete and hand them back.

Functions taking a ``uow`` work inside the caller's transaction; the ``given_*`` functions open
and commit their own. Identifiers differ only in letters and digits so that every store orders
them the same way whatever its collation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from attrs import evolve

from ql3.application.ports import Snapshot, UnitOfWork
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.events import EventType, RunEvent
from ql3.domain.fence import LeaseFence, hash_token
from ql3.domain.model import (
    AttemptStatus,
    DispatchLease,
    EvidenceKind,
    LeaseStatus,
    NotRunningEvidence,
    ReleaseReason,
    RunOwner,
    RunStatus,
    StopReport,
    WorkerSession,
)
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from ql3.domain.retry import settle_lost_run, start_next_attempt
from ql3.domain.sessions import close, drain, register_session
from ql3.domain.transitions import (
    Change,
    admit,
    claim,
    complete,
    create_first_attempt,
    mark_lost,
    release,
)

TASK = "mail"
OTHER_TASK = "report"
TTL_MS = 60_000
RETRY_DELAY_MS = 60_000
SECRET_HASH = hash_token("session-secret")

RETRY_SAFELY = RetryPolicy(
    retry_on_lost=True,
    max_attempts=3,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=RETRY_DELAY_MS, multiplier=1.0, cap_ms=RETRY_DELAY_MS),
)


def attempt_id_of(run_id: str, number: int = 1) -> str:
    return f"{run_id}a{number}"


def token_of(attempt_id: str) -> str:
    return f"token{attempt_id}"


@contextmanager
def committed(store: Any) -> Iterator[UnitOfWork]:
    """A unit of work that commits when its block ends normally."""
    with store.unit_of_work() as uow:
        yield uow
        uow.commit()


def locked_attempt(uow: UnitOfWork, attempt_id: str) -> Snapshot:
    snapshot = uow.runs.lock_attempt(attempt_id)
    assert snapshot is not None, f"attempt {attempt_id} not found"
    return snapshot


def locked_run(uow: UnitOfWork, run_id: str) -> Snapshot:
    snapshot = uow.runs.lock_run(run_id)
    assert snapshot is not None, f"run {run_id} not found"
    return snapshot


# --- steps inside a unit of work ---------------------------------------------------------------


def admit_run(
    uow: UnitOfWork,
    run_id: str,
    *,
    queued: bool = True,
    task: str = TASK,
    policy: RetryPolicy | None = None,
    owner: RunOwner = RunOwner.RUNTIME,
) -> Change:
    change = admit(
        run_id=run_id,
        attempt_id=attempt_id_of(run_id) if queued else None,
        task=task,
        input={"run": run_id},
        policy=policy,
        now_ms=uow.now_ms(),
        owner=owner,
    )
    uow.runs.add(change)
    return change


def first_attempt(uow: UnitOfWork, run_id: str) -> Change:
    before = locked_run(uow, run_id)
    change = create_first_attempt(before.run, attempt_id_of(run_id), uow.now_ms())
    uow.runs.apply(before, change)
    return change


def register(
    uow: UnitOfWork,
    session_id: str,
    worker_id: str,
    *,
    tasks: tuple[str, ...] = (TASK, OTHER_TASK),
    capacity: int = 4,
) -> WorkerSession:
    existing = uow.sessions.open_sessions_of(worker_id)
    session, replaced = register_session(
        session_id=session_id,
        worker_id=worker_id,
        capacity=capacity,
        tasks=tasks,
        secret_hash=SECRET_HASH,
        existing=existing,
        now_ms=uow.now_ms(),
    )
    stored = {s.id: s for s in existing}
    for old in replaced:
        uow.sessions.update(stored[old.id], old)
    uow.sessions.add(session)
    return session


def claim_attempt(
    uow: UnitOfWork,
    attempt_id: str,
    session_id: str,
    ttl_ms: int = TTL_MS,
    token: str | None = None,
) -> Change:
    """The session claims the pristine Attempt and starts it (a new lease bound to the token)."""
    before = locked_attempt(uow, attempt_id)
    session = uow.sessions.get(session_id)
    assert session is not None and before.attempt is not None
    change = claim(
        run=before.run,
        attempt=before.attempt,
        previous_lease=before.lease,
        session=session,
        token_hash=hash_token(token or token_of(attempt_id)),
        ttl_ms=ttl_ms,
        now_ms=uow.now_ms(),
    )
    uow.runs.apply(before, change)
    return change


def hand_back(uow: UnitOfWork, attempt_id: str, cause: str = "not_started") -> Change:
    """The holder hands the Attempt back unstarted: pristine again, its Run queued."""
    before = locked_attempt(uow, attempt_id)
    assert before.attempt is not None and before.lease is not None
    change = release(
        run=before.run,
        attempt=before.attempt,
        lease=before.lease,
        session_id=before.lease.holder_session_id,
        cause=cause,
        now_ms=uow.now_ms(),
    )
    uow.runs.apply(before, change)
    return change


LEGACY_STAGES = ("offered", "accepted", "starting")


def legacy_offer(
    uow: UnitOfWork,
    attempt_id: str,
    session_id: str,
    ttl_ms: int = TTL_MS,
    stage: str = "offered",
) -> Change:
    """The rows ADR 0005's offer protocol left for a pristine Attempt: ``offered`` (Run
    ``dispatching``, Attempt ``claimed``, a lease bound to no token), ``accepted`` (the token
    bound) or ``starting`` (Run ``running``, Attempt ``starting``), with that stage's event."""
    assert stage in LEGACY_STAGES, stage
    before = locked_attempt(uow, attempt_id)
    session = uow.sessions.get(session_id)
    assert session is not None and before.attempt is not None and before.attempt.is_pristine
    now = uow.now_ms()
    generation = before.lease.generation + 1 if before.lease else 1
    lease = DispatchLease(
        run_id=before.run.id,
        attempt_id=attempt_id,
        generation=generation,
        version=1,
        status=LeaseStatus.LEASED,
        holder_session_id=session_id,
        token_hash=None if stage == "offered" else hash_token(token_of(attempt_id)),
        expires_at_ms=now + ttl_ms,
        granted_at_ms=now,
    )
    started = stage == "starting"
    attempt = evolve(
        before.attempt,
        status=AttemptStatus.STARTING if started else AttemptStatus.CLAIMED,
        session_id=session_id,
        worker_id=session.worker_id,
        lease_generation=generation,
        lease_version=1,
        offered_at_ms=now,
        accepted_at_ms=None if stage == "offered" else now,
        started_at_ms=now if started else None,
        updated_at_ms=now,
    )
    run = evolve(
        before.run,
        status=RunStatus.RUNNING if started else RunStatus.DISPATCHING,
        updated_at_ms=now,
    )
    kind = {
        "offered": EventType.ATTEMPT_OFFERED,
        "accepted": EventType.ATTEMPT_ACCEPTED,
        "starting": EventType.ATTEMPT_ACTIVATED,
    }[stage]
    event = RunEvent(run_id=run.id, attempt_id=attempt_id, type=kind, at_ms=now)
    change = Change(run=run, attempts=(attempt,), lease=lease, event=event)
    uow.runs.apply(before, change)
    return change


def fence_of(before: Snapshot, token: str | None = None) -> LeaseFence:
    assert before.attempt is not None and before.lease is not None
    return LeaseFence(
        attempt_id=before.attempt.id,
        generation=before.lease.generation,
        version=before.lease.version,
        token=token or token_of(before.attempt.id),
    )


def finish(uow: UnitOfWork, attempt_id: str, *, succeeded: bool = True) -> Change:
    before = locked_attempt(uow, attempt_id)
    assert before.attempt is not None
    change = complete(
        run=before.run,
        attempt=before.attempt,
        lease=before.lease,
        fence=fence_of(before),
        succeeded=succeeded,
        output={"ok": succeeded},
        error=None if succeeded else "boom",
        now_ms=uow.now_ms(),
    )
    uow.runs.apply(before, change)
    return change


def lose(uow: UnitOfWork, attempt_id: str, evidence_kind: EvidenceKind | None = None) -> Change:
    before = locked_attempt(uow, attempt_id)
    assert before.attempt is not None
    now = uow.now_ms()
    evidence = (
        NotRunningEvidence(attempt_id=attempt_id, kind=evidence_kind, observed_at_ms=now)
        if evidence_kind is not None
        else None
    )
    change = mark_lost(
        run=before.run,
        attempt=before.attempt,
        lease=before.lease,
        evidence=evidence,
        release_reason=ReleaseReason.LEASE_EXPIRED,
        now_ms=now,
        cause="lease_expired",
    )
    uow.runs.apply(before, change)
    return change


def settle(uow: UnitOfWork, run_id: str) -> Change:
    before = locked_run(uow, run_id)
    assert before.attempt is not None
    change = settle_lost_run(run=before.run, lost_attempt=before.attempt, now_ms=uow.now_ms())
    uow.runs.apply(before, change)
    return change


def next_attempt(uow: UnitOfWork, run_id: str) -> Change:
    before = locked_run(uow, run_id)
    number = before.run.attempt_count + 1
    change = start_next_attempt(
        run=before.run, attempt_id=attempt_id_of(run_id, number), now_ms=uow.now_ms()
    )
    uow.runs.apply(before, change)
    return change


def close_session(uow: UnitOfWork, session_id: str) -> WorkerSession:
    before = uow.sessions.get(session_id)
    assert before is not None
    after = close(before, uow.now_ms())
    uow.sessions.update(before, after)
    return after


def drain_session(uow: UnitOfWork, session_id: str) -> WorkerSession:
    before = uow.sessions.get(session_id)
    assert before is not None
    after = drain(before, uow.now_ms())
    uow.sessions.update(before, after)
    return after


def report_stop(
    uow: UnitOfWork, attempt_id: str, kind: EvidenceKind = EvidenceKind.WORKER_ABANDONED
) -> StopReport:
    report = StopReport(attempt_id=attempt_id, kind=kind, reported_at_ms=uow.now_ms())
    uow.evidence.record(report)
    return report


# --- whole committed states --------------------------------------------------------------------


def given_session(store: Any, session_id: str, worker_id: str | None = None) -> WorkerSession:
    with committed(store) as uow:
        return register(uow, session_id, worker_id or f"w{session_id}")


def given_queued(store: Any, run_id: str, **admission: Any) -> str:
    """A queued Run with its pristine Attempt 1; returns the Attempt's id."""
    with committed(store) as uow:
        admit_run(uow, run_id, **admission)
    return attempt_id_of(run_id)


def given_created(store: Any, run_id: str, **admission: Any) -> None:
    with committed(store) as uow:
        admit_run(uow, run_id, queued=False, **admission)


def given_started(
    store: Any, run_id: str, session_id: str, ttl_ms: int = TTL_MS, **admission: Any
) -> str:
    """A running Run whose Attempt 1 ``session_id`` claimed (and so started)."""
    attempt_id = given_queued(store, run_id, **admission)
    with committed(store) as uow:
        claim_attempt(uow, attempt_id, session_id, ttl_ms)
    return attempt_id


def given_legacy(
    store: Any,
    run_id: str,
    session_id: str,
    ttl_ms: int = TTL_MS,
    stage: str = "offered",
    **admission: Any,
) -> str:
    """A Run whose Attempt 1 the offer protocol of ADR 0005 left at ``stage``."""
    attempt_id = given_queued(store, run_id, **admission)
    with committed(store) as uow:
        legacy_offer(uow, attempt_id, session_id, ttl_ms, stage)
    return attempt_id


def given_offered(
    store: Any, run_id: str, session_id: str, ttl_ms: int = TTL_MS, **admission: Any
) -> str:
    """A ``dispatching`` Run whose Attempt 1 was offered under ADR 0005 and never accepted:
    resolvable by recovery as soon as its lease expires."""
    return given_legacy(store, run_id, session_id, ttl_ms, "offered", **admission)


def given_lost(store: Any, run_id: str, session_id: str, **admission: Any) -> str:
    """A ``lost`` Run: Attempt 1 was claimed, then lost with the worker's report as evidence
    (its lease released)."""
    attempt_id = given_started(store, run_id, session_id, **admission)
    with committed(store) as uow:
        lose(uow, attempt_id, EvidenceKind.WORKER_ABANDONED)
    return attempt_id


def given_retry_wait(store: Any, run_id: str, session_id: str) -> str:
    """A ``retry_wait`` Run due ``RETRY_DELAY_MS`` after it was settled."""
    attempt_id = given_lost(store, run_id, session_id, policy=RETRY_SAFELY)
    with committed(store) as uow:
        settle(uow, run_id)
    return attempt_id


def refused(store: Any, write: Callable[[UnitOfWork], object]) -> None:
    """``write`` raises ConcurrencyConflict in a transaction of its own (which then rolls back).

    The ports do not promise that a transaction stays usable after a refused write, so the
    caller checks the outcome in a fresh one."""
    with store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        write(uow)
