"""Explicit mapping between rows of :mod:`ql3.adapters.sql.schema` and domain values.

``*_values`` functions give the column values of a domain object (for INSERT and UPDATE);
``*_from_row`` functions build the domain object back from a result row. A ``prefix`` selects
columns labelled ``<prefix><column>`` when one statement returns several tables side by side.
Times are already integer epoch milliseconds here: :class:`ql3.adapters.sql.schema.EpochMillis`
converts them at the driver edge.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import (
    Attempt,
    AttemptStatus,
    DispatchLease,
    EvidenceKind,
    JsonValue,
    LeaseStatus,
    Quarantine,
    ReleaseReason,
    Run,
    RunOwner,
    RunStatus,
    SessionStatus,
    StopReport,
    WorkerSession,
)
from ql3.domain.policy import Backoff, RetryPolicy, Safety

if TYPE_CHECKING:
    from ql3.domain.transitions import Change

Row = Mapping[Any, Any]
Values = dict[str, Any]

# The tables an admission writes, by the names its rows travel under, in the order written.
ADMITTED_TABLES = {
    "runs": "runs",
    "attempts": "run_attempts",
    "leases": "run_dispatch_leases",
    "events": "run_events",
}


def admitted_rows(change: Change) -> Iterator[tuple[str, Values]]:
    """The rows an admitted Run is written as, in order: the Run, its Attempts, its lease and
    its event, each with the name of its table in :data:`ADMITTED_TABLES`."""
    yield "runs", run_values(change.run)
    for attempt in change.attempts:
        yield "attempts", attempt_values(attempt)
    if change.lease is not None:
        yield "leases", lease_values(change.lease)
    yield "events", event_values(change.event)


def _field(row: Row, prefix: str, name: str) -> Any:
    return row[f"{prefix}{name}"]


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


# --- runs --------------------------------------------------------------------------------------


def policy_values(policy: RetryPolicy | None) -> Values:
    if policy is None:
        return {
            "has_policy": False,
            "retry_on_lost": None,
            "retry_on_error": None,
            "max_attempts": None,
            "safety": None,
            "backoff_initial_ms": None,
            "backoff_multiplier": None,
            "backoff_cap_ms": None,
            "backoff_jitter": None,
        }
    return {
        "has_policy": True,
        "retry_on_lost": policy.retry_on_lost,
        "retry_on_error": policy.retry_on_error,
        "max_attempts": policy.max_attempts,
        "safety": policy.safety.value if policy.safety is not None else None,
        "backoff_initial_ms": policy.backoff.initial_ms,
        "backoff_multiplier": policy.backoff.multiplier,
        "backoff_cap_ms": policy.backoff.cap_ms,
        "backoff_jitter": policy.backoff.jitter,
    }


def policy_from_row(row: Row, prefix: str = "") -> RetryPolicy | None:
    if not _field(row, prefix, "has_policy"):
        return None
    safety = _field(row, prefix, "safety")
    return RetryPolicy(
        retry_on_lost=bool(_field(row, prefix, "retry_on_lost")),
        retry_on_error=bool(_field(row, prefix, "retry_on_error")),
        max_attempts=int(_field(row, prefix, "max_attempts")),
        safety=Safety(safety) if safety is not None else None,
        backoff=Backoff(
            initial_ms=int(_field(row, prefix, "backoff_initial_ms")),
            multiplier=float(_field(row, prefix, "backoff_multiplier")),
            cap_ms=int(_field(row, prefix, "backoff_cap_ms")),
            jitter=float(_field(row, prefix, "backoff_jitter")),
        ),
    )


def run_values(run: Run) -> Values:
    return {
        "id": run.id,
        "task": run.task,
        "owner": run.owner.value,
        "status": run.status.value,
        "input": run.input,
        "output": run.output,
        "error": run.error,
        **policy_values(run.policy),
        "attempt_count": run.attempt_count,
        "next_attempt_at": run.next_attempt_at_ms,
        "parent_run_id": run.parent_run_id,
        "created_at": run.created_at_ms,
        "updated_at": run.updated_at_ms,
        "quarantined_at": run.quarantine.since_ms if run.quarantine else None,
        "quarantine_reason": run.quarantine.reason if run.quarantine else None,
        "priority": run.priority,
        "unique_key": run.unique_key,
        "timeout_ms": run.timeout_ms,
    }


def quarantine_from_row(row: Row, prefix: str = "") -> Quarantine | None:
    since = row.get(f"{prefix}quarantined_at")
    if since is None:
        return None
    return Quarantine(reason=_field(row, prefix, "quarantine_reason"), since_ms=int(since))


def run_from_row(row: Row, prefix: str = "") -> Run:
    return Run(
        id=_field(row, prefix, "id"),
        task=_field(row, prefix, "task"),
        owner=RunOwner(_field(row, prefix, "owner")),
        status=RunStatus(_field(row, prefix, "status")),
        input=_json(_field(row, prefix, "input")),
        policy=policy_from_row(row, prefix),
        attempt_count=int(_field(row, prefix, "attempt_count")),
        next_attempt_at_ms=_optional_int(_field(row, prefix, "next_attempt_at")),
        output=_json(_field(row, prefix, "output")),
        error=_field(row, prefix, "error"),
        parent_run_id=_field(row, prefix, "parent_run_id"),
        quarantine=quarantine_from_row(row, prefix),
        priority=int(_field(row, prefix, "priority")),
        unique_key=_field(row, prefix, "unique_key"),
        timeout_ms=_optional_int(_field(row, prefix, "timeout_ms")),
        created_at_ms=int(_field(row, prefix, "created_at")),
        updated_at_ms=int(_field(row, prefix, "updated_at")),
    )


def _json(value: Any) -> JsonValue:
    return value


# --- attempts ----------------------------------------------------------------------------------


def attempt_values(attempt: Attempt) -> Values:
    return {
        "id": attempt.id,
        "run_id": attempt.run_id,
        "number": attempt.number,
        "status": attempt.status.value,
        "session_id": attempt.session_id,
        "worker_id": attempt.worker_id,
        "lease_generation": attempt.lease_generation,
        "lease_version": attempt.lease_version,
        "offered_at": attempt.offered_at_ms,
        "accepted_at": attempt.accepted_at_ms,
        "started_at": attempt.started_at_ms,
        "finished_at": attempt.finished_at_ms,
        "lost_evidence": attempt.lost_evidence.value if attempt.lost_evidence else None,
        "error": attempt.error,
        "created_at": attempt.created_at_ms,
        "updated_at": attempt.updated_at_ms,
    }


def attempt_from_row(row: Row, prefix: str = "") -> Attempt:
    evidence = _field(row, prefix, "lost_evidence")
    return Attempt(
        id=_field(row, prefix, "id"),
        run_id=_field(row, prefix, "run_id"),
        number=int(_field(row, prefix, "number")),
        status=AttemptStatus(_field(row, prefix, "status")),
        session_id=_field(row, prefix, "session_id"),
        worker_id=_field(row, prefix, "worker_id"),
        lease_generation=_optional_int(_field(row, prefix, "lease_generation")),
        lease_version=_optional_int(_field(row, prefix, "lease_version")),
        offered_at_ms=_optional_int(_field(row, prefix, "offered_at")),
        accepted_at_ms=_optional_int(_field(row, prefix, "accepted_at")),
        started_at_ms=_optional_int(_field(row, prefix, "started_at")),
        finished_at_ms=_optional_int(_field(row, prefix, "finished_at")),
        lost_evidence=EvidenceKind(evidence) if evidence is not None else None,
        error=_field(row, prefix, "error"),
        created_at_ms=int(_field(row, prefix, "created_at")),
        updated_at_ms=int(_field(row, prefix, "updated_at")),
    )


# --- dispatch leases ---------------------------------------------------------------------------


def lease_values(lease: DispatchLease) -> Values:
    return {
        "run_id": lease.run_id,
        "generation": lease.generation,
        "attempt_id": lease.attempt_id,
        "version": lease.version,
        "status": lease.status.value,
        "holder_session_id": lease.holder_session_id,
        "token_hash": lease.token_hash,
        "expires_at": lease.expires_at_ms,
        "granted_at": lease.granted_at_ms,
        "release_reason": lease.release_reason.value if lease.release_reason else None,
        "released_at": lease.released_at_ms,
    }


def lease_from_row(row: Row, prefix: str = "") -> DispatchLease:
    reason = _field(row, prefix, "release_reason")
    return DispatchLease(
        run_id=_field(row, prefix, "run_id"),
        attempt_id=_field(row, prefix, "attempt_id"),
        generation=int(_field(row, prefix, "generation")),
        version=int(_field(row, prefix, "version")),
        status=LeaseStatus(_field(row, prefix, "status")),
        holder_session_id=_field(row, prefix, "holder_session_id"),
        token_hash=_field(row, prefix, "token_hash"),
        expires_at_ms=int(_field(row, prefix, "expires_at")),
        granted_at_ms=int(_field(row, prefix, "granted_at")),
        release_reason=ReleaseReason(reason) if reason is not None else None,
        released_at_ms=_optional_int(_field(row, prefix, "released_at")),
    )


# --- events ------------------------------------------------------------------------------------


def event_values(event: RunEvent) -> Values:
    """Without ``id``: the store assigns the sequence number."""
    return {
        "run_id": event.run_id,
        "attempt_id": event.attempt_id,
        "type": event.type.value,
        "at": event.at_ms,
        "data": dict(event.data),
    }


def event_from_row(row: Row, prefix: str = "") -> RunEvent:
    data = _field(row, prefix, "data")
    return RunEvent(
        run_id=_field(row, prefix, "run_id"),
        attempt_id=_field(row, prefix, "attempt_id"),
        type=EventType(_field(row, prefix, "type")),
        at_ms=int(_field(row, prefix, "at")),
        data=dict(data) if data is not None else {},
    )


# --- worker sessions ---------------------------------------------------------------------------


def session_values(session: WorkerSession) -> Values:
    return {
        "id": session.id,
        "worker_id": session.worker_id,
        "status": session.status.value,
        "capacity": session.capacity,
        "tasks": list(session.tasks),
        "secret_hash": session.secret_hash,
        "registered_at": session.registered_at_ms,
        "last_heartbeat_at": session.last_heartbeat_at_ms,
        "closed_at": session.closed_at_ms,
    }


def session_from_row(row: Row, prefix: str = "") -> WorkerSession:
    return WorkerSession(
        id=_field(row, prefix, "id"),
        worker_id=_field(row, prefix, "worker_id"),
        status=SessionStatus(_field(row, prefix, "status")),
        capacity=int(_field(row, prefix, "capacity")),
        tasks=tuple(_field(row, prefix, "tasks")),
        secret_hash=_field(row, prefix, "secret_hash"),
        registered_at_ms=int(_field(row, prefix, "registered_at")),
        last_heartbeat_at_ms=int(_field(row, prefix, "last_heartbeat_at")),
        closed_at_ms=_optional_int(_field(row, prefix, "closed_at")),
    )


# --- stop reports ------------------------------------------------------------------------------


def report_values(report: StopReport) -> Values:
    """Without ``id``: the store assigns it."""
    return {
        "attempt_id": report.attempt_id,
        "kind": report.kind.value,
        "reported_at": report.reported_at_ms,
        "detail": report.detail,
    }


def report_from_row(row: Row, prefix: str = "") -> StopReport:
    return StopReport(
        attempt_id=_field(row, prefix, "attempt_id"),
        kind=EvidenceKind(_field(row, prefix, "kind")),
        reported_at_ms=int(_field(row, prefix, "reported_at")),
        detail=_field(row, prefix, "detail"),
    )
