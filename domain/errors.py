"""Domain errors. Each transition raises exactly one of these, never a bare exception."""

from __future__ import annotations

import enum


class Error(Exception):
    """Base class of every error QL3 raises on purpose (``ql3.Error``): a refused input, an
    unknown id, a transition the state does not allow, a wait that timed out. Each subclass
    that stands for a builtin kind keeps that base too (``UnknownRun`` is a ``LookupError``)."""


class DomainError(Error):
    """Base class of every error the domain raises."""


class InvalidRetryPolicy(DomainError):
    """A retry policy given at admission is not acceptable."""


class InvalidAdmission(DomainError):
    """An admission request is malformed (empty task name, bad identifiers)."""


class InvalidTrigger(InvalidAdmission):
    """A trigger definition is not acceptable (name, schedule, catch-up, template)."""


class InvalidWorkflow(InvalidAdmission):
    """A workflow definition is not a valid DAG of task steps (duplicate or unknown step ids,
    a cycle, a malformed step)."""


class InvalidTransition(DomainError):
    """The entity is not in a state that allows the requested transition."""

    def __init__(self, entity: str, entity_id: str, status: str, action: str) -> None:
        super().__init__(f"{entity} {entity_id} is {status}: cannot {action}")
        self.entity = entity
        self.entity_id = entity_id
        self.status = status
        self.action = action


class NotDue(DomainError):
    """A time-bound transition was asked for before its due time."""


class FenceReason(enum.Enum):
    """Why a worker's fence was refused."""

    NO_LEASE = "no_lease"
    ATTEMPT_MISMATCH = "attempt_mismatch"
    GENERATION_MISMATCH = "generation_mismatch"
    VERSION_MISMATCH = "version_mismatch"
    TOKEN_MISMATCH = "token_mismatch"
    RELEASED = "released"
    EXPIRED = "expired"
    # the fence's own lease was released because its Run was cancelled: stop the task
    CANCELLED = "cancelled"


class FenceRejected(DomainError):
    """A worker presented a fence that does not match the live lease. Nothing changes."""

    def __init__(self, reason: FenceReason, attempt_id: str) -> None:
        super().__init__(f"fence rejected for attempt {attempt_id}: {reason.value}")
        self.reason = reason
        self.attempt_id = attempt_id


class SessionRejected(DomainError):
    """A worker session is not active, unknown, or not allowed to take the work."""


class ConcurrencyConflict(DomainError):
    """A compare-and-set write matched no row: someone else changed the state first."""
