"""The Run and Attempt state diagrams, as data, and the status sets derived from them.

Every transition of the domain moves a Run or an Attempt along one of these edges and checks it
with :func:`require_run_edge` / :func:`require_attempt_edge`; the stores' SQL guards and the
ingress functions are checked against the same edges by a test. A status set used anywhere in
the project (SQL included) is one of the sets below, never retyped.

Since ADR 0007 a worker claims a queued Attempt and starts it in one change
(``queued -> running``, ``claimed -> running``). ``dispatching`` and ``starting`` have no edge
into them any more; rows written in them by the offer protocol of ADR 0005 still leave them as
before (recovery, completion, cancellation, hand-back).
"""

from __future__ import annotations

from collections.abc import Mapping

from ql3.domain.errors import InvalidTransition
from ql3.domain.model import (
    TERMINAL_ATTEMPT_STATUSES,
    TERMINAL_RUN_STATUSES,
    AttemptStatus,
    CredentialStatus,
    Run,
    RunStatus,
    SessionStatus,
)

R = RunStatus
A = AttemptStatus

RUN_EDGES: Mapping[RunStatus, frozenset[RunStatus]] = {
    # admitted without an Attempt: the frontier or startup recovery makes Attempt 1; a workflow
    # aggregate starts, or fails when a step fails before it started
    R.CREATED: frozenset({R.QUEUED, R.RUNNING, R.FAILED, R.CANCELLED}),
    # claimed and started by a worker in one change
    R.QUEUED: frozenset({R.RUNNING, R.CANCELLED}),
    # offered under ADR 0005, never started
    R.DISPATCHING: frozenset({R.LOST, R.QUEUED, R.CANCELLED}),
    # completed, lost, handed back unstarted, cancelled; workflow aggregates succeed or fail;
    # a failed Attempt whose policy retries on error waits for its next Attempt (ADR 0013)
    R.RUNNING: frozenset({R.SUCCEEDED, R.FAILED, R.RETRY_WAIT, R.LOST, R.QUEUED, R.CANCELLED}),
    # the lost-retry decision; a lost Run whose Attempt is still active can be lost again
    R.LOST: frozenset({R.LOST, R.RETRY_WAIT, R.FAILED, R.CANCELLED}),
    # the next Attempt is created when due
    R.RETRY_WAIT: frozenset({R.QUEUED, R.CANCELLED}),
    R.SUCCEEDED: frozenset(),
    R.FAILED: frozenset(),
    R.CANCELLED: frozenset(),
}

ATTEMPT_EDGES: Mapping[AttemptStatus, frozenset[AttemptStatus]] = {
    # pristine or held: claimed and started at once; lost once its lease expired unstarted
    A.CLAIMED: frozenset({A.RUNNING, A.LOST, A.CANCELLED, A.CLAIMED}),
    A.STARTING: frozenset({A.SUCCEEDED, A.FAILED, A.LOST, A.CLAIMED, A.CANCELLED}),
    # handed back unstarted (-> claimed, pristine again), completed, lost with evidence
    A.RUNNING: frozenset({A.SUCCEEDED, A.FAILED, A.LOST, A.CLAIMED, A.CANCELLED}),
    A.SUCCEEDED: frozenset(),
    A.FAILED: frozenset(),
    A.LOST: frozenset(),
    A.CANCELLED: frozenset(),
}

# --- status sets, each derived once ------------------------------------------------------------

NON_TERMINAL_RUN_STATUSES = frozenset(RunStatus) - TERMINAL_RUN_STATUSES
NON_TERMINAL_ATTEMPT_STATUSES = frozenset(AttemptStatus) - TERMINAL_ATTEMPT_STATUSES
"""An Attempt that still holds its Run's one dispatch slot (``claimed|starting|running``)."""

STARTED_ATTEMPT_STATUSES = frozenset({A.STARTING, A.RUNNING})
"""Past the start barrier: external side effects may have begun."""

ADMITTED_RUN_STATUSES = frozenset({R.CREATED, R.QUEUED, R.RETRY_WAIT})
"""Where admission puts a new Run (the diagram's edges from its start): ``created`` without an
Attempt, ``queued`` with a pristine Attempt 1, or ``retry_wait`` without an Attempt when it is
delayed, until the store's clock reaches its due time (ADR 0015)."""

CLAIMABLE_RUN_STATUSES = frozenset({R.QUEUED})
"""Where a worker's claim starts a Run (with its pristine Attempt)."""

RECOVERABLE_RUN_STATUSES = frozenset({R.DISPATCHING, R.RUNNING, R.LOST})
"""Runs whose Attempt may have lost its lease authority (rule 1 of ADR 0002)."""

QUARANTINABLE_RUN_STATUSES = RECOVERABLE_RUN_STATUSES | frozenset({R.RETRY_WAIT})
"""Where runtime recovery or lost retry would pick a Run up, and so where an operator may
quarantine it (ADR 0010)."""

RELEASABLE_ATTEMPT_STATUSES = frozenset(s for s, to in ATTEMPT_EDGES.items() if A.CLAIMED in to)
"""Attempts a worker can hand back unstarted: held under a lease, not finished."""

OPEN_SESSION_STATUSES = frozenset({SessionStatus.ACTIVE, SessionStatus.DRAINING})
GONE_SESSION_STATUSES = frozenset({SessionStatus.CLOSED, SessionStatus.REPLACED})
"""Sessions whose process is known to execute nothing any more (not-running evidence).
``revoked`` is not one of them: a revoked worker may still be running."""

S = SessionStatus
SESSION_EDGES: Mapping[SessionStatus, frozenset[SessionStatus]] = {
    S.ACTIVE: frozenset({S.DRAINING, S.CLOSED, S.REPLACED, S.REVOKED}),
    S.DRAINING: frozenset({S.CLOSED, S.REPLACED, S.REVOKED}),
    S.CLOSED: frozenset(),
    S.REPLACED: frozenset(),
    S.REVOKED: frozenset(),
}
"""Session statuses a session may move to; open sessions also stay as they are (heartbeat)."""

CREDENTIAL_EDGES: Mapping[CredentialStatus, frozenset[CredentialStatus]] = {
    CredentialStatus.ACTIVE: frozenset({CredentialStatus.REVOKED}),
    CredentialStatus.REVOKED: frozenset(),
}
"""A worker credential is revoked once, for good (expiry is a time, not a status)."""


def values(statuses: frozenset[RunStatus] | frozenset[AttemptStatus]) -> tuple[str, ...]:
    """The stored names of a status set, sorted (for SQL ``IN`` lists and ``ANY`` arrays)."""
    return tuple(sorted(s.value for s in statuses))


def require_run_edge(run: Run, to: RunStatus, action: str) -> None:
    """Refuse a Run change that is not an edge of :data:`RUN_EDGES`."""
    if to not in RUN_EDGES[run.status]:
        raise InvalidTransition("run", run.id, run.status.value, action)


def require_admitted(run: Run) -> None:
    """Refuse a new Run whose status is not one of :data:`ADMITTED_RUN_STATUSES`."""
    if run.status not in ADMITTED_RUN_STATUSES:
        raise InvalidTransition("run", run.id, run.status.value, "be admitted so")


def require_attempt_edge(
    attempt_id: str, status: AttemptStatus, to: AttemptStatus, action: str
) -> None:
    """Refuse an Attempt change that is not an edge of :data:`ATTEMPT_EDGES`."""
    if to not in ATTEMPT_EDGES[status]:
        raise InvalidTransition("attempt", attempt_id, status.value, action)
