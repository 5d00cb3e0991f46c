"""Small scenario steps for the PostgreSQL adapter tests, built from the domain transitions."""

from __future__ import annotations

from ql3.adapters.postgres.store import PostgresStore
from ql3.domain.fence import hash_token
from ql3.domain.model import RunOwner, WorkerSession
from ql3.domain.policy import RetryPolicy
from ql3.domain.sessions import close, register_session
from ql3.domain.transitions import admit, claim

TOKEN = "token-of-the-worker"
SECRET = "secret"


def admit_run(
    store: PostgresStore,
    run_id: str,
    attempt_id: str | None = None,
    *,
    task: str = "mail",
    policy: RetryPolicy | None = None,
    owner: RunOwner = RunOwner.RUNTIME,
) -> None:
    with store.unit_of_work() as uow:
        change = admit(
            run_id=run_id,
            attempt_id=attempt_id,
            task=task,
            input={"to": run_id},
            policy=policy,
            now_ms=uow.now_ms(),
            owner=owner,
        )
        uow.runs.add(change)
        uow.commit()


def open_session(
    store: PostgresStore,
    session_id: str,
    worker_id: str,
    tasks: tuple[str, ...] = ("mail",),
    *,
    capacity: int = 4,
) -> WorkerSession:
    with store.unit_of_work() as uow:
        session, replaced = register_session(
            session_id=session_id,
            worker_id=worker_id,
            capacity=capacity,
            tasks=tasks,
            secret_hash=hash_token(SECRET),
            existing=uow.sessions.open_sessions_of(worker_id),
            now_ms=uow.now_ms(),
        )
        for old in replaced:
            before = uow.sessions.get(old.id)
            assert before is not None
            uow.sessions.update(before, old)
        uow.sessions.add(session)
        uow.commit()
    return session


def close_session(store: PostgresStore, session_id: str) -> None:
    """The worker says goodbye: its unfinished Attempts have not-running evidence."""
    with store.unit_of_work() as uow:
        session = uow.sessions.get(session_id)
        assert session is not None
        uow.sessions.update(session, close(session, uow.now_ms()))
        uow.commit()


def claim_attempt(
    store: PostgresStore, attempt_id: str, session: WorkerSession, ttl_ms: int
) -> None:
    """``session`` claims and starts the pristine Attempt under the token :data:`TOKEN`."""
    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_attempt(attempt_id)
        assert snapshot is not None and snapshot.attempt is not None
        change = claim(
            run=snapshot.run,
            attempt=snapshot.attempt,
            previous_lease=snapshot.lease,
            session=session,
            token_hash=hash_token(TOKEN),
            ttl_ms=ttl_ms,
            now_ms=uow.now_ms(),
        )
        uow.runs.apply(snapshot, change)
        uow.commit()


def dispatched(
    store: PostgresStore,
    run_id: str,
    attempt_id: str,
    session: WorkerSession,
    *,
    ttl_ms: int = 30_000,
    task: str = "mail",
) -> None:
    """A Run admitted and claimed by ``session``: ``running``, its Attempt started."""
    admit_run(store, run_id, attempt_id, task=task)
    claim_attempt(store, attempt_id, session, ttl_ms)


def recover(store: PostgresStore, attempt_id: str) -> bool:
    """What runtime recovery does with one candidate; True when the Attempt became lost."""
    from ql3.domain.recovery import find_not_running_evidence, resolve_recovery

    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_attempt(attempt_id)
        assert snapshot is not None and snapshot.attempt is not None
        attempt = snapshot.attempt
        session = uow.sessions.get(attempt.session_id) if attempt.session_id else None
        evidence = find_not_running_evidence(attempt, session, uow.evidence.reports_for(attempt.id))
        resolution = resolve_recovery(
            run=snapshot.run,
            attempt=attempt,
            lease=snapshot.lease,
            evidence=evidence,
            now_ms=uow.now_ms(),
        )
        if resolution.change is None:
            return False
        uow.runs.apply(snapshot, resolution.change)
        uow.commit()
        return True


def settle(store: PostgresStore, run_id: str) -> None:
    """The lost-retry decision for a ``lost`` Run."""
    from ql3.domain.retry import settle_lost_run

    with store.unit_of_work() as uow:
        snapshot = uow.runs.lock_run(run_id)
        assert snapshot is not None and snapshot.attempt is not None
        change = settle_lost_run(
            run=snapshot.run, lost_attempt=snapshot.attempt, now_ms=uow.now_ms()
        )
        uow.runs.apply(snapshot, change)
        uow.commit()
