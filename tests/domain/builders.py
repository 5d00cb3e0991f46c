"""Plain domain values for the pure transition tests, built through the transitions themselves
so that every fixture is a state the domain can actually reach."""

from __future__ import annotations

from attrs import evolve

from ql3.domain.fence import LeaseFence, hash_token
from ql3.domain.model import (
    Attempt,
    AttemptStatus,
    DispatchLease,
    LeaseStatus,
    Run,
    RunOwner,
    RunStatus,
    SessionStatus,
    WorkerSession,
)
from ql3.domain.policy import RetryPolicy
from ql3.domain.transitions import admit, claim

NOW = 1_000_000
TTL = 30_000
TOKEN = "token-" + "a" * 26
OTHER_TOKEN = "token-" + "b" * 26


def session(
    *,
    session_id: str = "s1",
    worker_id: str = "w1",
    status: SessionStatus = SessionStatus.ACTIVE,
    tasks: tuple[str, ...] = ("t",),
    closed_at_ms: int | None = None,
) -> WorkerSession:
    return WorkerSession(
        id=session_id,
        worker_id=worker_id,
        status=status,
        capacity=2,
        tasks=tasks,
        secret_hash=hash_token("secret"),
        registered_at_ms=NOW - 10,
        last_heartbeat_at_ms=NOW - 5,
        closed_at_ms=closed_at_ms,
    )


def queued(
    *, run_id: str = "r1", policy: RetryPolicy | None = None, owner: RunOwner = RunOwner.RUNTIME
) -> tuple[Run, Attempt]:
    change = admit(
        run_id=run_id, attempt_id=f"{run_id}-a1", task="t", input={"n": 1}, policy=policy,
        now_ms=NOW - 100, owner=owner,
    )
    return change.run, change.attempts[0]


def running(
    *, policy: RetryPolicy | None = None, owner: RunOwner = RunOwner.RUNTIME,
    previous: DispatchLease | None = None,
) -> tuple[Run, Attempt, DispatchLease, LeaseFence]:
    """A queued Run claimed and started by session s1 (ADR 0007)."""
    run, attempt = queued(policy=policy, owner=owner)
    change = claim(
        run=run, attempt=attempt, previous_lease=previous, session=session(),
        token_hash=hash_token(TOKEN), ttl_ms=TTL, now_ms=NOW,
    )
    assert change.lease is not None
    fence = LeaseFence(
        attempt_id=attempt.id, generation=change.lease.generation,
        version=change.lease.version, token=TOKEN,
    )
    return change.run, change.attempts[0], change.lease, fence


def legacy_offered(
    *, policy: RetryPolicy | None = None, owner: RunOwner = RunOwner.RUNTIME,
    started: bool = False,
) -> tuple[Run, Attempt, DispatchLease, LeaseFence]:
    """Rows the offer protocol of ADR 0005 left behind: an Attempt offered to s1 and accepted
    (``dispatching``/``claimed``), or activated (``running``/``starting``). No transition makes
    them any more; recovery, completion, cancellation and hand-back still take them."""
    run, attempt = queued(policy=policy, owner=owner)
    lease = DispatchLease(
        run_id=run.id, attempt_id=attempt.id, generation=1, version=1,
        status=LeaseStatus.LEASED, holder_session_id="s1", token_hash=hash_token(TOKEN),
        expires_at_ms=NOW + TTL, granted_at_ms=NOW,
    )
    attempt = evolve(
        attempt, session_id="s1", worker_id="w1", lease_generation=1, lease_version=1,
        offered_at_ms=NOW, accepted_at_ms=NOW + 1, updated_at_ms=NOW + 1,
        status=AttemptStatus.STARTING if started else AttemptStatus.CLAIMED,
        started_at_ms=NOW + 2 if started else None,
    )
    run = evolve(run, status=RunStatus.RUNNING if started else RunStatus.DISPATCHING)
    fence = LeaseFence(attempt_id=attempt.id, generation=1, version=1, token=TOKEN)
    return run, attempt, lease, fence


def legacy_started(**kwargs: object) -> tuple[Run, Attempt, DispatchLease, LeaseFence]:
    return legacy_offered(started=True, **kwargs)  # type: ignore[arg-type]
