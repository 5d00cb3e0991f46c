"""Worker credentials (ADR 0008): who may register a worker session, for which worker ids and
which tasks, until when; and the audit of every issue, use and revocation.

A credential is a random secret handed out once; only its hash is kept. It admits worker ids
matching its pattern (``fnmatch`` style: ``host-a-*``) and, when it names tasks, only sessions
that ask for a subset of them. Expiry is a time compared with the store's clock, not a status;
revocation is the one status change, for good. Revoking a credential revokes its open sessions
(no new claims, no other call accepted), but a revoked session is **not** not-running evidence:
its process may still be running, so recovery keeps waiting for trusted evidence."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

from attrs import evolve, field, frozen

from ql3.domain.errors import DomainError, InvalidAdmission, InvalidTransition
from ql3.domain.model import CredentialStatus, WorkerSession
from ql3.domain.sessions import revoke_session
from ql3.domain.states import CREDENTIAL_EDGES

MAX_PATTERN_LENGTH = 200
MAX_TASKS = 256
MAX_DETAIL_LENGTH = 500


class CredentialEventType(enum.Enum):
    ISSUED = "issued"
    USED = "used"  # a session was registered with it
    REVOKED = "revoked"


class CredentialRefusal(enum.Enum):
    """Why a registration's credential was refused."""

    MISSING = "missing"
    UNKNOWN = "unknown"
    REVOKED = "revoked"
    EXPIRED = "expired"
    WORKER_NOT_ALLOWED = "worker_not_allowed"
    TASK_NOT_ALLOWED = "task_not_allowed"


# Refusals that say the caller is not who it claims (401) rather than asking for too much (403).
UNAUTHENTICATED_REFUSALS = frozenset(
    {
        CredentialRefusal.MISSING,
        CredentialRefusal.UNKNOWN,
        CredentialRefusal.REVOKED,
        CredentialRefusal.EXPIRED,
    }
)


class CredentialRejected(DomainError):
    """A registration's credential does not admit it; nothing was written."""

    def __init__(self, reason: CredentialRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def unauthenticated(self) -> bool:
        return self.reason in UNAUTHENTICATED_REFUSALS


class UnknownCredential(DomainError):
    """No credential with that id."""


def _pattern(_instance: object, _attribute: object, value: str) -> None:
    if not value or len(value) > MAX_PATTERN_LENGTH or value != value.strip():
        raise InvalidAdmission(f"a worker id pattern has 1..{MAX_PATTERN_LENGTH} characters")


def _task_names(value: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = tuple(sorted(set(value)))
    if not names or len(names) > MAX_TASKS or any(not n or len(n) > 200 for n in names):
        raise InvalidAdmission(f"a credential names 1..{MAX_TASKS} tasks, or none for any")
    return names


@frozen(kw_only=True)
class WorkerCredential:
    """What may register with one secret. ``tasks`` None: any task."""

    id: str
    worker_pattern: str = field(validator=_pattern)
    tasks: tuple[str, ...] | None = field(converter=_task_names)
    secret_hash: str
    status: CredentialStatus
    issued_at_ms: int
    expires_at_ms: int | None = None
    revoked_at_ms: int | None = None
    rotates_id: str | None = None  # the credential this one was issued to replace

    def expired(self, now_ms: int) -> bool:
        return self.expires_at_ms is not None and self.expires_at_ms <= now_ms

    def admits_worker(self, worker_id: str) -> bool:
        return fnmatchcase(worker_id, self.worker_pattern)

    def admits_tasks(self, tasks: Iterable[str]) -> bool:
        return self.tasks is None or set(tasks) <= set(self.tasks)


@frozen(kw_only=True)
class CredentialEvent:
    """One line of a credential's audit."""

    credential_id: str
    type: CredentialEventType
    at_ms: int
    worker_id: str | None = None
    session_id: str | None = None
    detail: str = ""


def issue_credential(
    *,
    credential_id: str,
    worker_pattern: str,
    tasks: Iterable[str] | None,
    secret_hash: str,
    now_ms: int,
    expires_in_ms: int | None = None,
    rotates: WorkerCredential | None = None,
) -> tuple[WorkerCredential, CredentialEvent]:
    """A new active credential and its ``issued`` audit line. A rotation (``rotates``) copies
    the pattern and tasks of the credential it replaces, which stays valid until revoked."""
    if expires_in_ms is not None and expires_in_ms <= 0:
        raise InvalidAdmission("a credential's lifetime must be positive")
    if rotates is not None:
        if rotates.status is not CredentialStatus.ACTIVE or rotates.expired(now_ms):
            state = "expired" if rotates.expired(now_ms) else rotates.status.value
            raise InvalidTransition("credential", rotates.id, state, "rotate")
        worker_pattern, tasks = rotates.worker_pattern, rotates.tasks
    credential = WorkerCredential(
        id=credential_id,
        worker_pattern=worker_pattern,
        tasks=tasks,
        secret_hash=secret_hash,
        status=CredentialStatus.ACTIVE,
        issued_at_ms=now_ms,
        expires_at_ms=None if expires_in_ms is None else now_ms + expires_in_ms,
        rotates_id=rotates.id if rotates is not None else None,
    )
    detail = f"rotates {rotates.id}" if rotates is not None else ""
    event = CredentialEvent(
        credential_id=credential_id, type=CredentialEventType.ISSUED, at_ms=now_ms, detail=detail
    )
    return credential, event


def authorize_registration(
    credential: WorkerCredential | None,
    *,
    worker_id: str,
    tasks: Sequence[str],
    now_ms: int,
) -> WorkerCredential:
    """The credential, when it admits a session of ``worker_id`` for ``tasks`` now; otherwise
    :class:`CredentialRejected` with the reason."""
    if credential is None:
        raise CredentialRejected(CredentialRefusal.UNKNOWN, "unknown credential")
    if credential.status is CredentialStatus.REVOKED:
        raise CredentialRejected(CredentialRefusal.REVOKED, f"credential {credential.id} revoked")
    if credential.expired(now_ms):
        raise CredentialRejected(CredentialRefusal.EXPIRED, f"credential {credential.id} expired")
    if not credential.admits_worker(worker_id):
        raise CredentialRejected(
            CredentialRefusal.WORKER_NOT_ALLOWED,
            f"credential {credential.id} does not admit worker id {worker_id}",
        )
    if not credential.admits_tasks(tasks):
        others = sorted(set(tasks) - set(credential.tasks or ()))
        raise CredentialRejected(
            CredentialRefusal.TASK_NOT_ALLOWED,
            f"credential {credential.id} does not admit tasks {', '.join(others)}",
        )
    return credential


def credential_used(credential: WorkerCredential, session: WorkerSession) -> CredentialEvent:
    return CredentialEvent(
        credential_id=credential.id,
        type=CredentialEventType.USED,
        at_ms=session.registered_at_ms,
        worker_id=session.worker_id,
        session_id=session.id,
    )


def revoke_credential(
    credential: WorkerCredential,
    open_sessions: Iterable[WorkerSession],
    *,
    now_ms: int,
    reason: str = "",
) -> tuple[WorkerCredential, tuple[WorkerSession, ...], CredentialEvent]:
    """The credential revoked, its open sessions revoked with it (no new claims, no call
    accepted), and the ``revoked`` audit line naming them."""
    _require(credential, CredentialStatus.REVOKED, "revoke")
    revoked = evolve(credential, status=CredentialStatus.REVOKED, revoked_at_ms=now_ms)
    sessions = tuple(revoke_session(s, now_ms) for s in open_sessions)
    names = ", ".join(s.id for s in sessions)
    detail = reason.strip()[:MAX_DETAIL_LENGTH]
    if sessions:
        detail = f"{detail}; sessions revoked: {names}" if detail else f"sessions revoked: {names}"
    event = CredentialEvent(
        credential_id=credential.id,
        type=CredentialEventType.REVOKED,
        at_ms=now_ms,
        detail=detail[: MAX_DETAIL_LENGTH * 4],
    )
    return revoked, sessions, event


def _require(credential: WorkerCredential, to: CredentialStatus, action: str) -> None:
    if to not in CREDENTIAL_EDGES[credential.status]:
        raise InvalidTransition("credential", credential.id, credential.status.value, action)
