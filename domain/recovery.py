"""Recovery of Attempts whose lease authority is gone: the candidate predicate, not-running
evidence and the resolution shared by startup and runtime recovery."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from attrs import frozen

from ql3.domain.errors import InvalidTransition
from ql3.domain.events import EventType, RunEvent
from ql3.domain.guards import LEASE_EXPIRED, holds
from ql3.domain.model import (
    Attempt,
    DispatchLease,
    EvidenceKind,
    LeaseStatus,
    NotRunningEvidence,
    ReleaseReason,
    Run,
    RunOwner,
    SessionStatus,
    StopReport,
    WorkerSession,
)
from ql3.domain.states import NON_TERMINAL_ATTEMPT_STATUSES, RECOVERABLE_RUN_STATUSES
from ql3.domain.transitions import Change, mark_lost

RECOVERABLE_ATTEMPT_STATUSES = NON_TERMINAL_ATTEMPT_STATUSES


class RecoveryHold(enum.Enum):
    """Why a candidate was left as it is."""

    NOT_A_CANDIDATE = "not_a_candidate"
    LEASE_LIVE = "lease_live"
    AWAITING_EVIDENCE = "awaiting_evidence"


def lease_authority_gone(attempt: Attempt, lease: DispatchLease | None, now_ms: int) -> bool:
    """The Attempt's own lease (its exact generation) is missing, released or expired."""
    if (
        lease is None
        or lease.attempt_id != attempt.id
        or lease.generation != attempt.lease_generation
    ):
        return True
    return lease.status is LeaseStatus.RELEASED or holds(LEASE_EXPIRED, {"lease": lease}, now_ms)


def is_recovery_candidate(
    run: Run, attempt: Attempt, lease: DispatchLease | None, now_ms: int
) -> bool:
    """ADR 0002, decision 1: a runtime-owned Run in dispatching|running|lost whose non-pristine
    Attempt is claimed|starting|running and whose lease is missing or expired by the store's
    clock. A quarantined Run is no candidate (ADR 0010)."""
    return (
        run.owner is RunOwner.RUNTIME
        and not run.is_quarantined
        and run.status in RECOVERABLE_RUN_STATUSES
        and attempt.run_id == run.id
        and attempt.status in RECOVERABLE_ATTEMPT_STATUSES
        and not attempt.is_pristine
        and lease_authority_gone(attempt, lease, now_ms)
    )


def find_not_running_evidence(
    attempt: Attempt,
    session: WorkerSession | None,
    reports: Iterable[StopReport],
) -> NotRunningEvidence | None:
    """The first trusted not-running fact about ``attempt``: a recorded stop report (the worker's
    abandon or an operator's attestation), else a closed or replaced holder session.

    A stop report speaks of the start before it: one recorded before the Attempt's current
    start (it was handed back, pristine again under the same id, then claimed anew) is no
    evidence about this start (ADR 0011)."""
    for report in sorted(reports, key=lambda r: r.reported_at_ms):
        if report.attempt_id == attempt.id and _since_start(report, attempt):
            return NotRunningEvidence(
                attempt_id=attempt.id,
                kind=report.kind,
                observed_at_ms=report.reported_at_ms,
                detail=report.detail,
            )
    if session is not None and session.id == attempt.session_id:
        if session.status is SessionStatus.CLOSED:
            kind = EvidenceKind.SESSION_CLOSED
        elif session.status is SessionStatus.REPLACED:
            kind = EvidenceKind.SESSION_REPLACED
        else:
            return None
        return NotRunningEvidence(
            attempt_id=attempt.id,
            kind=kind,
            observed_at_ms=session.closed_at_ms or session.last_heartbeat_at_ms,
            detail=f"session {session.id} of worker {session.worker_id} is {session.status.value}",
        )
    return None


def _since_start(report: StopReport, attempt: Attempt) -> bool:
    return attempt.started_at_ms is None or report.reported_at_ms >= attempt.started_at_ms


def is_resolvable(attempt: Attempt, evidence: NotRunningEvidence | None) -> bool:
    """A candidate that recovery can settle now: never started, or started with evidence."""
    return not attempt.status.is_started or evidence is not None


@frozen(kw_only=True)
class RecoveryResolution:
    """Either a change to persist, or the reason the candidate stays as it is."""

    change: Change | None
    hold: RecoveryHold | None

    @property
    def recovered(self) -> bool:
        return self.change is not None


def resolve_recovery(
    *,
    run: Run,
    attempt: Attempt,
    lease: DispatchLease | None,
    evidence: NotRunningEvidence | None,
    now_ms: int,
) -> RecoveryResolution:
    """Resolve one candidate, re-checked under the store's locks.

    An expired ``claimed`` Attempt is lost. An expired ``starting|running`` Attempt is lost only
    with trusted not-running evidence; otherwise it stays as it is (fail closed).
    """
    if not is_recovery_candidate(run, attempt, lease, now_ms):
        own_live = (
            lease is not None
            and lease.attempt_id == attempt.id
            and lease.generation == attempt.lease_generation
            and lease.is_live(now_ms)
        )
        hold = RecoveryHold.LEASE_LIVE if own_live else RecoveryHold.NOT_A_CANDIDATE
        return RecoveryResolution(change=None, hold=hold)
    if not is_resolvable(attempt, evidence):
        return RecoveryResolution(change=None, hold=RecoveryHold.AWAITING_EVIDENCE)
    change = mark_lost(
        run=run,
        attempt=attempt,
        lease=lease,
        evidence=evidence,
        release_reason=ReleaseReason.LEASE_EXPIRED,
        now_ms=now_ms,
        cause="lease_expired",
    )
    return RecoveryResolution(change=change, hold=None)


def report_stopped(
    *, run: Run, attempt: Attempt, kind: EvidenceKind, detail: str, now_ms: int
) -> tuple[StopReport, Change]:
    """Record that a non-terminal Attempt stopped executing (the worker's abandon report after
    its lease expired, or an operator's attestation). Nothing changes state yet: the report is
    the evidence the next recovery uses. The one event audits it."""
    if attempt.run_id != run.id or attempt.status not in RECOVERABLE_ATTEMPT_STATUSES:
        raise InvalidTransition("attempt", attempt.id, attempt.status.value, "be reported stopped")
    if kind not in (EvidenceKind.WORKER_ABANDONED, EvidenceKind.OPERATOR_ATTESTED):
        raise InvalidTransition("attempt", attempt.id, attempt.status.value, f"take {kind.value}")
    report = StopReport(attempt_id=attempt.id, kind=kind, reported_at_ms=now_ms, detail=detail)
    event = RunEvent(
        run_id=run.id,
        attempt_id=attempt.id,
        type=EventType.EVIDENCE_RECORDED,
        at_ms=now_ms,
        data={"evidence": kind.value, "detail": detail},
    )
    return report, Change(run=run, attempts=(), lease=None, event=event)
