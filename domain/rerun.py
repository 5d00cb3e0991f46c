"""Running a finished Run again (ADR 0020): a new Run of the same task with the old Run's
policy snapshot, priority and timeout, and an input an operator may have edited.

The new Run is admitted as any Run is (:func:`ql3.domain.transitions.admit`); its admission
event names the Run it runs again and the operator. A Run whose task is not declared safe to
repeat (``unsafe``, or no policy at all) is run again only when the operator confirms by
typing the task's name: the page says that the task's effects may then happen twice."""

from __future__ import annotations

from attrs import evolve

from ql3.domain.errors import InvalidAdmission, InvalidTransition
from ql3.domain.model import JsonValue, Run, RunOwner
from ql3.domain.policy import Safety
from ql3.domain.transitions import Change, admit


def needs_confirmation(run: Run) -> bool:
    """Whether running ``run`` again may repeat effects nobody declared safe to repeat."""
    policy = run.policy
    return policy is None or policy.safety in (None, Safety.UNSAFE)


def run_again(
    *,
    old: Run,
    run_id: str,
    attempt_id: str,
    input: JsonValue,
    operator: str,
    confirmation: str | None,
    now_ms: int,
) -> Change:
    """The admission of ``old`` run again. Refused for a Run that is not finished (cancel it
    first), for a workflow's aggregate or step (run the workflow again instead), and, when
    :func:`needs_confirmation`, unless ``confirmation`` is the task's name."""
    if not old.status.is_terminal:
        raise InvalidTransition("run", old.id, old.status.value, "be run again before it ends")
    if old.owner is not RunOwner.RUNTIME or old.parent_run_id is not None:
        raise InvalidTransition("run", old.id, "part of a workflow", "be run again alone")
    if needs_confirmation(old) and (confirmation or "").strip() != old.task:
        raise InvalidAdmission(
            f"task {old.task} is not declared safe to repeat: type its name to confirm"
        )
    change = admit(
        run_id=run_id,
        attempt_id=attempt_id,
        task=old.task,
        input=input,
        policy=old.policy,
        now_ms=now_ms,
        priority=old.priority,
        timeout_ms=old.timeout_ms,
    )
    event = evolve(
        change.event, data={**change.event.data, "again_of": old.id, "operator": operator}
    )
    return evolve(change, event=event)
