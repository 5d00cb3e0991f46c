"""The append-only audit of every state change of a Run."""

from __future__ import annotations

import enum
from collections.abc import Mapping

from attrs import field, frozen

from ql3.domain.model import JsonValue


class EventType(enum.Enum):
    """Offered, accepted, activated and running are written only by the offer protocol of
    ADR 0005 and kept for the history it left; a claim writes ``attempt_started``."""

    RUN_ADMITTED = "run_admitted"
    ATTEMPT_CREATED = "attempt_created"
    ATTEMPT_OFFERED = "attempt_offered"
    ATTEMPT_ACCEPTED = "attempt_accepted"
    ATTEMPT_ACTIVATED = "attempt_activated"
    ATTEMPT_RUNNING = "attempt_running"
    ATTEMPT_STARTED = "attempt_started"
    ATTEMPT_RELEASED = "attempt_released"
    ATTEMPT_SUCCEEDED = "attempt_succeeded"
    ATTEMPT_FAILED = "attempt_failed"
    ATTEMPT_LOST = "attempt_lost"
    RETRY_SCHEDULED = "retry_scheduled"
    RUN_FAILED = "run_failed"
    RUN_CANCELLED = "run_cancelled"
    EVIDENCE_RECORDED = "evidence_recorded"
    WORKFLOW_STARTED = "workflow_started"
    WORKFLOW_SUCCEEDED = "workflow_succeeded"
    RUN_QUARANTINED = "run_quarantined"
    RUN_UNQUARANTINED = "run_unquarantined"


def _freeze(value: Mapping[str, JsonValue]) -> Mapping[str, JsonValue]:
    return dict(value)


@frozen(kw_only=True)
class RunEvent:
    """One audited change. The store assigns the sequence number when it appends the event."""

    run_id: str
    attempt_id: str | None
    type: EventType
    at_ms: int
    data: Mapping[str, JsonValue] = field(factory=dict, converter=_freeze)
