"""Quarantine: an operator takes a broken Run out of runtime recovery and lost retry.

Both steps fail closed on a candidate they cannot settle (ADR 0002): a Run whose resolution
keeps raising stops its step, and with it the rest of every cycle. Quarantine is how a person
lets the step proceed: a flag on the Run, never a status, that the candidate predicates of
:mod:`ql3.domain.recovery` and :mod:`ql3.domain.retry` read. It is never set by the runtime itself
and is lifted the same way, each change audited by one event (ADR 0010). Neither touches the Run's
``updated_at``: the Run keeps its place in the lost-retry and retry order."""

from __future__ import annotations

from attrs import evolve

from ql3.domain.errors import InvalidAdmission, InvalidTransition
from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import JsonValue, Quarantine, Run, RunOwner
from ql3.domain.states import QUARANTINABLE_RUN_STATUSES
from ql3.domain.transitions import Change, storable_text

MAX_REASON_LENGTH = 500


def _checked_reason(reason: str, *, required: bool) -> str:
    text = reason.strip()
    if required and not text:
        raise InvalidAdmission("a quarantine needs a reason")
    if len(text) > MAX_REASON_LENGTH or not storable_text(text):
        raise InvalidAdmission(
            f"a reason must be at most {MAX_REASON_LENGTH} characters, without NUL"
        )
    return text


def quarantine(*, run: Run, reason: str, now_ms: int) -> Change:
    """Flag a runtime-owned Run that recovery or lost retry would pick up; nothing else of it
    changes. Refused for a Run already quarantined, finished, or in no such state."""
    text = _checked_reason(reason, required=True)
    if run.owner is not RunOwner.RUNTIME or run.status not in QUARANTINABLE_RUN_STATUSES:
        raise InvalidTransition("run", run.id, run.status.value, "be quarantined")
    if run.quarantine is not None:
        raise InvalidTransition("run", run.id, "quarantined", "be quarantined again")
    new_run = evolve(run, quarantine=Quarantine(reason=text, since_ms=now_ms))
    return _flagged(new_run, EventType.RUN_QUARANTINED, now_ms, {"reason": text})


def unquarantine(*, run: Run, reason: str, now_ms: int) -> Change:
    """Lift a quarantine: the next cycle's recovery and lost retry consider the Run again."""
    text = _checked_reason(reason, required=False)
    if run.quarantine is None:
        raise InvalidTransition("run", run.id, run.status.value, "leave a quarantine it is not in")
    new_run = evolve(run, quarantine=None)
    data: dict[str, JsonValue] = {"reason": text, "quarantined_since_ms": run.quarantine.since_ms}
    return _flagged(new_run, EventType.RUN_UNQUARANTINED, now_ms, data)


def _flagged(run: Run, event_type: EventType, now_ms: int, data: dict[str, JsonValue]) -> Change:
    """The change of a Run's flag: no Attempt or lease, one event naming the Run's status."""
    return Change(
        run=run,
        attempts=(),
        lease=None,
        event=RunEvent(
            run_id=run.id,
            attempt_id=None,
            type=event_type,
            at_ms=now_ms,
            data={**data, "status": run.status.value},
        ),
    )
