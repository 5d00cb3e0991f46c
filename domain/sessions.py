"""Worker session transitions: register (replacing an older session of the same worker id),
heartbeat, drain, close and revoke."""

from __future__ import annotations

from collections.abc import Iterable

from attrs import evolve

from ql3.domain.errors import InvalidAdmission, InvalidTransition
from ql3.domain.model import SessionStatus, WorkerSession
from ql3.domain.states import SESSION_EDGES

MAX_CAPACITY = 1024


def register_session(
    *,
    session_id: str,
    worker_id: str,
    capacity: int,
    tasks: Iterable[str],
    secret_hash: str,
    existing: Iterable[WorkerSession],
    now_ms: int,
) -> tuple[WorkerSession, tuple[WorkerSession, ...]]:
    """A new session, and the open sessions of the same worker id marked ``replaced``."""
    task_names = tuple(sorted(set(tasks)))
    if not worker_id or len(worker_id) > 200:
        raise InvalidAdmission("worker id must be 1..200 characters")
    if not 1 <= capacity <= MAX_CAPACITY:
        raise InvalidAdmission(f"capacity must be within 1..{MAX_CAPACITY}")
    if not task_names or any(not t for t in task_names):
        raise InvalidAdmission("a session must name at least one task")
    replaced = tuple(
        evolve(s, status=SessionStatus.REPLACED, closed_at_ms=now_ms)
        for s in existing
        if s.worker_id == worker_id and s.status in (SessionStatus.ACTIVE, SessionStatus.DRAINING)
    )
    session = WorkerSession(
        id=session_id,
        worker_id=worker_id,
        status=SessionStatus.ACTIVE,
        capacity=capacity,
        tasks=task_names,
        secret_hash=secret_hash,
        registered_at_ms=now_ms,
        last_heartbeat_at_ms=now_ms,
    )
    return session, replaced


def _open(session: WorkerSession, action: str) -> None:
    if session.status not in (SessionStatus.ACTIVE, SessionStatus.DRAINING):
        raise InvalidTransition("session", session.id, session.status.value, action)


def heartbeat(session: WorkerSession, now_ms: int) -> WorkerSession:
    _open(session, "heartbeat")
    return evolve(session, last_heartbeat_at_ms=max(session.last_heartbeat_at_ms, now_ms))


def drain(session: WorkerSession, now_ms: int) -> WorkerSession:
    """No new offers; running attempts may still finish."""
    _open(session, "drain")
    return evolve(session, status=SessionStatus.DRAINING, last_heartbeat_at_ms=now_ms)


def close(session: WorkerSession, now_ms: int) -> WorkerSession:
    """The worker says it executes nothing any more: trusted not-running evidence."""
    _open(session, "close")
    return evolve(session, status=SessionStatus.CLOSED, closed_at_ms=now_ms)


def revoke_session(session: WorkerSession, now_ms: int) -> WorkerSession:
    """Its credential was revoked: the session is shut out of every call. Not not-running
    evidence: the process behind it may still be running what it holds."""
    if SessionStatus.REVOKED not in SESSION_EDGES[session.status]:
        raise InvalidTransition("session", session.id, session.status.value, "revoke")
    return evolve(session, status=SessionStatus.REVOKED, closed_at_ms=now_ms)
