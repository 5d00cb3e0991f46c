"""Entities and value objects: Run, Attempt, DispatchLease, WorkerSession, evidence."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeAlias

from attrs import field, frozen, validators

from ql3.domain.policy import RetryPolicy

JsonValue: TypeAlias = (
    bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None
)


class RunStatus(enum.Enum):
    CREATED = "created"
    QUEUED = "queued"
    DISPATCHING = "dispatching"
    RUNNING = "running"
    LOST = "lost"
    RETRY_WAIT = "retry_wait"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_RUN_STATUSES


TERMINAL_RUN_STATUSES = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


class AttemptStatus(enum.Enum):
    CLAIMED = "claimed"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_ATTEMPT_STATUSES

    @property
    def is_started(self) -> bool:
        """Past the start barrier: external side effects may have begun."""
        return self in (AttemptStatus.STARTING, AttemptStatus.RUNNING)


TERMINAL_ATTEMPT_STATUSES = frozenset(
    {
        AttemptStatus.SUCCEEDED,
        AttemptStatus.FAILED,
        AttemptStatus.LOST,
        AttemptStatus.CANCELLED,
    }
)


class LeaseStatus(enum.Enum):
    LEASED = "leased"
    RELEASED = "released"


class ReleaseReason(enum.Enum):
    COMPLETED = "completed"
    LEASE_EXPIRED = "lease_expired"
    CANCELLED = "cancelled"
    ABANDONED = "abandoned"
    HANDED_BACK = "handed_back"


class RunOwner(enum.Enum):
    """Who drives a Run. Only ``runtime`` Runs are recovered and retried by the runtime."""

    RUNTIME = "runtime"
    WORKFLOW = "workflow"


class SessionStatus(enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"
    CLOSED = "closed"
    REPLACED = "replaced"
    # its credential was revoked: shut out, but not evidence that its process stopped
    REVOKED = "revoked"


class CredentialStatus(enum.Enum):
    """A worker credential's stored status; an expired one is still ``active`` (see
    ``expires_at_ms``) until revoked."""

    ACTIVE = "active"
    REVOKED = "revoked"


class EvidenceKind(enum.Enum):
    """The trusted facts that show a started Attempt is no longer executing."""

    SESSION_CLOSED = "session_closed"
    SESSION_REPLACED = "session_replaced"
    WORKER_ABANDONED = "worker_abandoned"
    OPERATOR_ATTESTED = "operator_attested"


def _non_empty(_instance: object, attribute: object, value: str) -> None:
    if not value:
        raise ValueError(f"{getattr(attribute, 'name', 'value')} must not be empty")


@frozen(kw_only=True)
class Quarantine:
    """An operator took a Run out of runtime recovery and lost retry (ADR 0010): those steps
    pass it over until the quarantine is lifted. Nothing else about the Run changes."""

    reason: str = field(validator=_non_empty)
    since_ms: int


def _positive_or_none(_instance: object, attribute: object, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{getattr(attribute, 'name', 'value')} must be positive")


def _bounded_priority(_instance: object, _attribute: object, value: int) -> None:
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"priority must be within {MIN_PRIORITY}..{MAX_PRIORITY}")


MIN_PRIORITY = -1_000_000
MAX_PRIORITY = 1_000_000
MAX_UNIQUE_KEY_LENGTH = 400
MAX_TIMEOUT_MS = 30 * 24 * 3_600_000  # an execution timeout of at most 30 days (ADR 0013)
MAX_DELAY_MS = 3650 * 24 * 3_600_000  # a delayed run is due at most 10 years after admission


@frozen(kw_only=True)
class Run:
    """A unit of work admitted by a caller. Its retry policy is a snapshot taken at admission,
    as are its priority (higher is claimed first), its unique key (while the Run is unfinished,
    no other Run holds it) and its execution timeout."""

    id: str = field(validator=_non_empty)
    task: str = field(validator=_non_empty)
    owner: RunOwner
    status: RunStatus
    input: JsonValue = None
    policy: RetryPolicy | None = None
    attempt_count: int = field(default=0, validator=validators.ge(0))
    next_attempt_at_ms: int | None = None
    output: JsonValue = None
    error: str | None = None
    parent_run_id: str | None = None
    quarantine: Quarantine | None = None
    priority: int = field(default=0, validator=_bounded_priority)
    unique_key: str | None = None
    timeout_ms: int | None = field(default=None, validator=_positive_or_none)
    created_at_ms: int
    updated_at_ms: int

    @property
    def is_quarantined(self) -> bool:
        return self.quarantine is not None


@frozen(kw_only=True)
class Attempt:
    """One execution of a Run. Numbers of a Run's Attempts are 1..N, contiguous."""

    id: str = field(validator=_non_empty)
    run_id: str = field(validator=_non_empty)
    number: int = field(validator=validators.ge(1))
    status: AttemptStatus
    session_id: str | None = None
    worker_id: str | None = None
    lease_generation: int | None = None
    lease_version: int | None = None
    offered_at_ms: int | None = None
    accepted_at_ms: int | None = None
    started_at_ms: int | None = None
    finished_at_ms: int | None = None
    lost_evidence: EvidenceKind | None = None
    error: str | None = None
    created_at_ms: int
    updated_at_ms: int

    @property
    def is_pristine(self) -> bool:
        """A claimed dispatch slot with no worker, session, offer, lease or start facts
        (:data:`ql3.domain.guards.PRISTINE_ATTEMPT`)."""
        from ql3.domain.guards import PRISTINE_ATTEMPT, holds

        return holds(PRISTINE_ATTEMPT, {"attempt": self})


@frozen(kw_only=True)
class DispatchLease:
    """The fenced authority to execute one Attempt. One per (run, generation).

    ``version`` changes only when the authority changes (release, reassignment); a renewal only
    moves ``expires_at_ms``. The token itself is secret: only its hash is kept.
    """

    run_id: str
    attempt_id: str
    generation: int = field(validator=validators.ge(1))
    version: int = field(validator=validators.ge(1))
    status: LeaseStatus
    holder_session_id: str
    token_hash: str | None
    expires_at_ms: int
    granted_at_ms: int
    release_reason: ReleaseReason | None = None
    released_at_ms: int | None = None

    def is_live(self, now_ms: int) -> bool:
        """:data:`ql3.domain.guards.LEASE_LIVE`: leased, and not expired at ``now_ms``."""
        from ql3.domain.guards import LEASE_LIVE, holds

        return holds(LEASE_LIVE, {"lease": self}, now_ms)


@frozen(kw_only=True)
class WorkerSession:
    """A registered worker process. A worker id names one execution slot: a new session with the
    same worker id means the process behind the older session is gone."""

    id: str = field(validator=_non_empty)
    worker_id: str = field(validator=_non_empty)
    status: SessionStatus
    capacity: int = field(validator=validators.ge(1))
    tasks: tuple[str, ...]
    secret_hash: str
    registered_at_ms: int
    last_heartbeat_at_ms: int
    closed_at_ms: int | None = None

    @property
    def accepts_work(self) -> bool:
        return self.status is SessionStatus.ACTIVE


@frozen(kw_only=True)
class StopReport:
    """A recorded statement that an Attempt stopped executing: the worker's own abandon report or
    an operator's attestation."""

    attempt_id: str
    kind: EvidenceKind
    reported_at_ms: int
    detail: str = ""


@frozen(kw_only=True)
class NotRunningEvidence:
    """Trusted proof that a started Attempt no longer executes anywhere."""

    attempt_id: str
    kind: EvidenceKind
    observed_at_ms: int
    detail: str = ""

    def as_data(self) -> Mapping[str, JsonValue]:
        return {
            "evidence": self.kind.value,
            "evidence_observed_at_ms": self.observed_at_ms,
            "evidence_detail": self.detail,
        }
