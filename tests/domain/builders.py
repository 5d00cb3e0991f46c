"""Plain domain values for the pure transition tests, built through the transitions themselves
so that every fixture is a state the domain can actually reach."""

from __future__ import annotations

from domain.fence import LeaseFence, hash_token
from domain.model import (
    Attempt,
    DispatchLease,
    Run,
    RunOwner,
    SessionStatus,
    WorkerSession,
)
from domain.policy import RetryPolicy
from domain.transitions import accept, activate, admit, grant_lease, mark_running

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


def offered(
    *, policy: RetryPolicy | None = None, owner: RunOwner = RunOwner.RUNTIME,
    previous: DispatchLease | None = None,
) -> tuple[Run, Attempt, DispatchLease]:
    run, attempt = queued(policy=policy, owner=owner)
    change = grant_lease(
        run=run, attempt=attempt, previous_lease=previous, session=session(), ttl_ms=TTL,
        now_ms=NOW,
    )
    assert change.lease is not None
    return change.run, change.attempts[0], change.lease


def accepted(**kwargs: object) -> tuple[Run, Attempt, DispatchLease, LeaseFence]:
    run, attempt, lease = offered(**kwargs)  # type: ignore[arg-type]
    change = accept(
        run=run, attempt=attempt, lease=lease, session_id="s1", generation=lease.generation,
        version=lease.version, token_hash=hash_token(TOKEN), ttl_ms=TTL, now_ms=NOW + 1,
    )
    assert change.lease is not None
    fence = LeaseFence(
        attempt_id=attempt.id, generation=lease.generation, version=lease.version, token=TOKEN
    )
    return change.run, change.attempts[0], change.lease, fence


def started(**kwargs: object) -> tuple[Run, Attempt, DispatchLease, LeaseFence]:
    run, attempt, lease, fence = accepted(**kwargs)
    change = activate(run=run, attempt=attempt, lease=lease, fence=fence, ttl_ms=TTL,
                      now_ms=NOW + 2)
    assert change.lease is not None
    return change.run, change.attempts[0], change.lease, fence


def running(**kwargs: object) -> tuple[Run, Attempt, DispatchLease, LeaseFence]:
    run, attempt, lease, fence = started(**kwargs)
    change = mark_running(run=run, attempt=attempt, lease=lease, fence=fence, now_ms=NOW + 3)
    assert change.lease is not None
    return change.run, change.attempts[0], change.lease, fence
