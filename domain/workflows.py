"""Workflows: a DAG of task steps declared at admission.

The workflow itself is an aggregate Run (``owner = 'workflow'``): it never has an Attempt, so it is
never a recovery or lost-retry candidate. Each step becomes a Run of its own (``owner =
'runtime'``, ``parent_run_id`` = the workflow), admitted by the workflow frontier once every step
it comes after has succeeded; those Runs are dispatched, recovered and retried one by one like any
other. The aggregate moves ``created -> running`` when its first steps are admitted, and ends
``succeeded`` when every step succeeded, or ``failed`` at the first step that failed (or was
cancelled). Once the workflow failed or was cancelled, steps not yet started are cancelled: the
pending ones are never admitted, the admitted ones whose Run has not crossed the start barrier
are cancelled with their Run. Steps already running finish, and their outcome is recorded.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

from attrs import evolve, field, frozen

from ql3.domain.errors import InvalidRetryPolicy, InvalidTransition, InvalidWorkflow
from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import MAX_TIMEOUT_MS, JsonValue, Run, RunOwner, RunStatus
from ql3.domain.policy import RetryPolicy, policy_from_document
from ql3.domain.states import require_run_edge
from ql3.domain.step_input import MAX_PARENT_OUTPUTS_BYTES, encoded_size, wrap
from ql3.domain.transitions import MAX_TASK_NAME_LENGTH, Change, admit, cancel

MAX_WORKFLOW_STEPS = 256
MAX_STEP_ID_LENGTH = 100

# Step Runs in these statuses have not crossed the start barrier (or no longer execute), so a
# failed workflow may cancel them.
NOT_STARTED_RUN_STATUSES = frozenset(
    {
        RunStatus.CREATED,
        RunStatus.QUEUED,
        RunStatus.DISPATCHING,
        RunStatus.LOST,
        RunStatus.RETRY_WAIT,
    }
)

_DOCUMENT_KEYS = frozenset({"name", "steps"})
_STEP_KEYS = frozenset({"id", "task", "input", "after", "policy", "timeout"})


class StepStatus(enum.Enum):
    """``pending``: not admitted yet; ``admitted``: its Run exists; then the Run's outcome."""

    PENDING = "pending"
    ADMITTED = "admitted"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_settled(self) -> bool:
        return self in (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.CANCELLED)


_STEP_OUTCOME = {
    RunStatus.SUCCEEDED: StepStatus.SUCCEEDED,
    RunStatus.FAILED: StepStatus.FAILED,
    RunStatus.CANCELLED: StepStatus.CANCELLED,
}


@frozen(kw_only=True)
class StepSpec:
    id: str
    task: str
    input: JsonValue = None
    after: tuple[str, ...] = ()
    policy: RetryPolicy | None = None
    # Each Attempt of the step's Run may run this long (ADR 0013); None: no timeout.
    timeout_ms: int | None = None


@frozen(kw_only=True)
class WorkflowSpec:
    name: str
    steps: tuple[StepSpec, ...]


@frozen(kw_only=True)
class WorkflowStep:
    """One step of an admitted workflow, as the stores keep it."""

    workflow_run_id: str
    step_id: str
    position: int
    task: str
    input: JsonValue = None
    after: tuple[str, ...] = ()
    policy: RetryPolicy | None = None
    status: StepStatus = StepStatus.PENDING
    run_id: str | None = None
    updated_at_ms: int


# --- declaration --------------------------------------------------------------------------------


def _check_name(value: object, what: str, limit: int) -> str:
    if not isinstance(value, str) or not value or len(value) > limit or value.strip() != value:
        raise InvalidWorkflow(f"{what} must be a string of 1..{limit} characters, without padding")
    return value


def validate_workflow(spec: WorkflowSpec) -> tuple[str, ...]:
    """Check the DAG and return its step ids in a topological order (declaration order among
    steps that are ready together). Refuses empty or oversized workflows, bad names, duplicate
    ids, unknown ``after`` ids and cycles."""
    _check_name(spec.name, "workflow name", MAX_TASK_NAME_LENGTH)
    if not 1 <= len(spec.steps) <= MAX_WORKFLOW_STEPS:
        raise InvalidWorkflow(f"a workflow has 1..{MAX_WORKFLOW_STEPS} steps")
    position: dict[str, int] = {}
    for index, step in enumerate(spec.steps):
        _check_name(step.id, "step id", MAX_STEP_ID_LENGTH)
        _check_name(step.task, f"task of step {step.id}", MAX_TASK_NAME_LENGTH)
        if step.id in position:
            raise InvalidWorkflow(f"duplicate step id {step.id!r}")
        if step.timeout_ms is not None and (
            isinstance(step.timeout_ms, bool)
            or not isinstance(step.timeout_ms, int)
            or not 1 <= step.timeout_ms <= MAX_TIMEOUT_MS
        ):
            raise InvalidWorkflow(
                f"step {step.id!r}: a timeout is within 0.001..{MAX_TIMEOUT_MS // 1000} seconds"
            )
        position[step.id] = index
    for step in spec.steps:
        for before in step.after:
            if before not in position:
                raise InvalidWorkflow(f"step {step.id!r} comes after unknown step {before!r}")
    waiting = {step.id: len(set(step.after)) for step in spec.steps}
    followers: dict[str, list[str]] = {step.id: [] for step in spec.steps}
    for step in spec.steps:
        for before in set(step.after):
            followers[before].append(step.id)
    ready = [step.id for step in spec.steps if waiting[step.id] == 0]
    order: list[str] = []
    while ready:
        ready.sort(key=position.__getitem__)
        current = ready.pop(0)
        order.append(current)
        for follower in followers[current]:
            waiting[follower] -= 1
            if waiting[follower] == 0:
                ready.append(follower)
    if len(order) != len(spec.steps):
        stuck = sorted((s for s, n in waiting.items() if n > 0), key=position.__getitem__)
        raise InvalidWorkflow(f"the steps form a cycle: {', '.join(stuck)}")
    return tuple(order)


def workflow_from_document(document: object) -> WorkflowSpec:
    """Read ``{"name": ..., "steps": [{"id", "task", "input", "after", "policy"}]}`` and
    validate it. Unknown keys and wrong types are refused, never ignored."""
    if not isinstance(document, dict):
        raise InvalidWorkflow("a workflow must be a JSON object")
    unknown = sorted(set(document) - _DOCUMENT_KEYS)
    if unknown:
        raise InvalidWorkflow(f"unknown workflow keys: {', '.join(map(str, unknown))}")
    raw_steps = document.get("steps")
    if not isinstance(raw_steps, list):
        raise InvalidWorkflow("steps must be a list")
    steps: list[StepSpec] = []
    for index, raw in enumerate(raw_steps):
        if not isinstance(raw, dict):
            raise InvalidWorkflow(f"step #{index + 1} must be a JSON object")
        unknown = sorted(set(raw) - _STEP_KEYS)
        if unknown:
            listed = ", ".join(map(str, unknown))
            raise InvalidWorkflow(f"step #{index + 1}: unknown keys: {listed}")
        step_id = _check_name(raw.get("id"), f"id of step #{index + 1}", MAX_STEP_ID_LENGTH)
        after = raw.get("after", [])
        if not isinstance(after, list) or not all(isinstance(a, str) for a in after):
            raise InvalidWorkflow(f"step {step_id!r}: after must be a list of step ids")
        try:
            policy = policy_from_document(raw.get("policy"))
        except InvalidRetryPolicy as error:
            raise InvalidWorkflow(f"step {step_id!r}: {error}") from None
        task = _check_name(raw.get("task"), f"task of step {step_id!r}", MAX_TASK_NAME_LENGTH)
        timeout = raw.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise InvalidWorkflow(f"step {step_id!r}: timeout is a positive number of seconds")
        steps.append(
            StepSpec(
                id=step_id,
                task=task,
                input=raw.get("input"),
                after=tuple(dict.fromkeys(after)),
                policy=policy,
                timeout_ms=None if timeout is None else max(1, round(timeout * 1000)),
            )
        )
    spec = WorkflowSpec(
        name=_check_name(document.get("name"), "workflow name", MAX_TASK_NAME_LENGTH),
        steps=tuple(steps),
    )
    validate_workflow(spec)
    return spec


@frozen(kw_only=True)
class WorkflowSubmitted:
    change: Change
    steps: tuple[WorkflowStep, ...]


def submit_workflow(
    *, spec: WorkflowSpec, run_id: str, now_ms: int, unique_key: str | None = None
) -> WorkflowSubmitted:
    """The aggregate Run (``created``, no Attempt) and its steps, all ``pending``. A
    ``unique_key`` is held by the aggregate Run while it is unfinished (ADR 0015)."""
    order = validate_workflow(spec)
    template: dict[str, JsonValue] = {"steps": list(order)}
    timeouts: dict[str, JsonValue] = {
        s.id: s.timeout_ms for s in spec.steps if s.timeout_ms is not None
    }
    if timeouts:  # the steps' timeouts ride on the aggregate's input: the steps have no column
        template["timeouts"] = timeouts
    change = admit(
        run_id=run_id,
        attempt_id=None,
        task=spec.name,
        input=template,
        policy=None,
        owner=RunOwner.WORKFLOW,
        unique_key=unique_key,
        now_ms=now_ms,
    )
    data: dict[str, JsonValue] = {**change.event.data, "steps": len(spec.steps)}
    change = evolve(change, event=evolve(change.event, data=data))
    steps = tuple(
        WorkflowStep(
            workflow_run_id=run_id,
            step_id=step.id,
            position=index,
            task=step.task,
            input=step.input,
            after=step.after,
            policy=step.policy,
            status=StepStatus.PENDING,
            updated_at_ms=now_ms,
        )
        for index, step in enumerate(spec.steps)
    )
    return WorkflowSubmitted(change=change, steps=steps)


# --- the frontier --------------------------------------------------------------------------------


@frozen(kw_only=True)
class FrontierDecision:
    """What the frontier does with one workflow now.

    ``settle``: step rows that change without touching a Run (outcomes recorded, pending steps
    cancelled), as (before, after). ``admit``: pending steps to admit. ``cancel``: admitted steps
    whose Runs have not started and must be cancelled (re-checked under the Run's lock).
    ``aggregate``: the workflow Run's own change, if any. ``inputs``: the input snapshot of
    each step to admit, by step id (its parents' outputs fixed in it, see :func:`step_input`)."""

    settle: tuple[tuple[WorkflowStep, WorkflowStep], ...] = ()
    admit: tuple[WorkflowStep, ...] = ()
    inputs: Mapping[str, JsonValue] = field(factory=dict)
    cancel: tuple[WorkflowStep, ...] = ()
    aggregate: Change | None = None

    @property
    def changes_anything(self) -> bool:
        return bool(self.settle or self.admit or self.cancel or self.aggregate)


def _require_workflow(run: Run, action: str) -> None:
    if run.owner is not RunOwner.WORKFLOW:
        raise InvalidTransition("run", run.id, f"{run.status.value} ({run.owner.value})", action)


def _aggregate_event(
    run: Run, event_type: EventType, now_ms: int, data: Mapping[str, JsonValue]
) -> RunEvent:
    return RunEvent(run_id=run.id, attempt_id=None, type=event_type, at_ms=now_ms, data=data)


def start_workflow(run: Run, first_steps: Sequence[str], now_ms: int) -> Change:
    """``created -> running``: its first steps are being admitted."""
    _require_workflow(run, "start")
    if run.status is not RunStatus.CREATED:
        raise InvalidTransition("run", run.id, run.status.value, "start a workflow")
    require_run_edge(run, RunStatus.RUNNING, "start a workflow")
    new_run = evolve(run, status=RunStatus.RUNNING, updated_at_ms=now_ms)
    event = _aggregate_event(
        new_run, EventType.WORKFLOW_STARTED, now_ms, {"steps": list(first_steps)}
    )
    return Change(run=new_run, attempts=(), lease=None, event=event)


def succeed_workflow(run: Run, output: JsonValue, now_ms: int) -> Change:
    """``running -> succeeded``: every step succeeded; the output maps step ids to outputs."""
    _require_workflow(run, "succeed")
    if run.status is not RunStatus.RUNNING:
        raise InvalidTransition("run", run.id, run.status.value, "succeed as a workflow")
    require_run_edge(run, RunStatus.SUCCEEDED, "succeed as a workflow")
    new_run = evolve(run, status=RunStatus.SUCCEEDED, output=output, updated_at_ms=now_ms)
    event = _aggregate_event(new_run, EventType.WORKFLOW_SUCCEEDED, now_ms, {})
    return Change(run=new_run, attempts=(), lease=None, event=event)


def fail_workflow(
    run: Run, step: WorkflowStep, detail: str | None, now_ms: int, *, reason: str | None = None
) -> Change:
    """``created|running -> failed`` because ``step`` failed or was cancelled (``reason``
    names why in the event, when it is not the step's own outcome)."""
    _require_workflow(run, "fail")
    if run.status not in (RunStatus.CREATED, RunStatus.RUNNING):
        raise InvalidTransition("run", run.id, run.status.value, "fail as a workflow")
    require_run_edge(run, RunStatus.FAILED, "fail as a workflow")
    # The step's error in its first line (its type and message); a traceback stays on its Run.
    summary = detail.splitlines()[0] if detail else ""
    error = f"step {step.step_id} {step.status.value}" + (f": {summary}" if summary else "")
    new_run = evolve(run, status=RunStatus.FAILED, error=error, updated_at_ms=now_ms)
    if reason is None:
        reason = "step_cancelled" if step.status is StepStatus.CANCELLED else "step_failed"
    event = _aggregate_event(
        new_run, EventType.RUN_FAILED, now_ms, {"reason": reason, "step": step.step_id}
    )
    return Change(run=new_run, attempts=(), lease=None, event=event)


def admit_step(
    *,
    workflow: Run,
    step: WorkflowStep,
    run_id: str,
    attempt_id: str,
    now_ms: int,
    input: JsonValue = None,
) -> tuple[WorkflowStep, Change]:
    """A pending step becomes a ``queued`` runtime Run of its own, child of the workflow, with
    ``input`` as its snapshot (what :func:`decide_frontier` chose: the step's own input, or it
    and its parents' outputs)."""
    _require_workflow(workflow, "admit a step")
    if workflow.status.is_terminal:
        raise InvalidTransition("run", workflow.id, workflow.status.value, "admit a step")
    if step.workflow_run_id != workflow.id or step.status is not StepStatus.PENDING:
        raise InvalidTransition("step", step.step_id, step.status.value, "be admitted")
    change = admit(
        run_id=run_id,
        attempt_id=attempt_id,
        task=step.task,
        input=input,
        policy=step.policy,
        owner=RunOwner.RUNTIME,
        parent_run_id=workflow.id,
        timeout_ms=step_timeout_ms(workflow, step.step_id),
        now_ms=now_ms,
    )
    data: dict[str, JsonValue] = {
        **change.event.data,
        "workflow_run_id": workflow.id,
        "step": step.step_id,
    }
    change = evolve(change, event=evolve(change.event, data=data))
    after = evolve(step, status=StepStatus.ADMITTED, run_id=run_id, updated_at_ms=now_ms)
    return after, change


def step_timeout_ms(workflow: Run, step_id: str) -> int | None:
    """The timeout the workflow was submitted with for a step (kept in its aggregate's
    input, ``{"steps": [...], "timeouts": {step id: ms}}``)."""
    template = workflow.input
    timeouts = template.get("timeouts") if isinstance(template, dict) else None
    value = timeouts.get(step_id) if isinstance(timeouts, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def cancel_step(step: WorkflowStep, now_ms: int) -> WorkflowStep:
    """A step that will not run (any more): pending, or admitted with its Run cancelled."""
    if step.status not in (StepStatus.PENDING, StepStatus.ADMITTED):
        raise InvalidTransition("step", step.step_id, step.status.value, "be cancelled")
    return evolve(step, status=StepStatus.CANCELLED, updated_at_ms=now_ms)


def settle_step(step: WorkflowStep, run: Run, now_ms: int) -> WorkflowStep:
    """An admitted step takes the outcome of its finished Run."""
    if step.status is not StepStatus.ADMITTED or step.run_id != run.id:
        raise InvalidTransition("step", step.step_id, step.status.value, "be settled")
    if not run.status.is_terminal:
        raise InvalidTransition("step", step.step_id, run.status.value, "be settled")
    return evolve(step, status=_STEP_OUTCOME[run.status], updated_at_ms=now_ms)


class StepInputTooLarge(InvalidWorkflow):
    """A step's parents' outputs are larger than :data:`MAX_PARENT_OUTPUTS_BYTES`."""


def step_input(step: WorkflowStep, parents: Mapping[str, JsonValue]) -> JsonValue:
    """The input snapshot of a step being admitted: its own input when it has no parents;
    else its input and every parent's output (``ql3.domain.step_input``), refused with
    :class:`StepInputTooLarge` above :data:`MAX_PARENT_OUTPUTS_BYTES`."""
    if not step.after:
        return step.input
    size = encoded_size(parents)
    if size > MAX_PARENT_OUTPUTS_BYTES:
        raise StepInputTooLarge(
            f"the outputs of its parents ({', '.join(step.after)}) are {size} bytes of JSON, "
            f"more than the {MAX_PARENT_OUTPUTS_BYTES} a step receives"
        )
    wrapped: JsonValue = wrap(
        workflow_run_id=step.workflow_run_id,
        step_id=step.step_id,
        input=step.input,
        parents=parents,
    )
    return wrapped


def decide_frontier(
    *,
    workflow: Run,
    steps: Sequence[WorkflowStep],
    step_runs: Mapping[str, Run],
    now_ms: int,
) -> FrontierDecision:
    """Record finished steps, then either admit the steps whose predecessors all succeeded
    (each with its parents' outputs fixed in its input), finish the workflow, or (after a
    failure or a cancellation) stop everything not started. A step whose parents' outputs are
    too large to pass is cancelled without a Run and fails the workflow.

    ``step_runs`` holds the current Runs of admitted and succeeded steps, by run id."""
    _require_workflow(workflow, "advance")
    ordered = sorted(steps, key=lambda s: s.position)
    current = {step.step_id: step for step in ordered}
    settle: list[tuple[WorkflowStep, WorkflowStep]] = []
    for step in ordered:
        run = step_runs.get(step.run_id) if step.run_id is not None else None
        if step.status is StepStatus.ADMITTED and run is not None and run.status.is_terminal:
            settled = settle_step(step, run, now_ms)
            settle.append((step, settled))
            current[step.step_id] = settled
    view = [current[step.step_id] for step in ordered]
    broken = next(
        (s for s in view if s.status in (StepStatus.FAILED, StepStatus.CANCELLED)), None
    )
    live = not workflow.status.is_terminal
    detail: str | None = None
    reason: str | None = None
    if live and broken is None:
        if all(s.status is StepStatus.SUCCEEDED for s in view):
            output: dict[str, JsonValue] = {
                s.step_id: step_runs[s.run_id].output
                for s in view
                if s.run_id is not None and s.run_id in step_runs
            }
            return FrontierDecision(
                settle=tuple(settle), aggregate=succeed_workflow(workflow, output, now_ms)
            )
        ready = tuple(
            s
            for s in view
            if s.status is StepStatus.PENDING
            and all(current[b].status is StepStatus.SUCCEEDED for b in s.after)
        )
        inputs: dict[str, JsonValue] = {}
        for s in ready:
            parents = {b: _output(current[b], step_runs) for b in s.after}
            try:
                inputs[s.step_id] = step_input(s, parents)
            except StepInputTooLarge as error:
                refused = cancel_step(s, now_ms)
                settle.append((s, refused))
                current[s.step_id] = broken = refused
                detail, reason = str(error), "step_input_too_large"
                view = [current[step.step_id] for step in ordered]
                break
        else:
            aggregate = None
            if ready and workflow.status is RunStatus.CREATED:
                aggregate = start_workflow(workflow, [s.step_id for s in ready], now_ms)
            return FrontierDecision(
                settle=tuple(settle), admit=ready, inputs=inputs, aggregate=aggregate
            )
    aggregate = None
    if live and broken is not None:
        if detail is None:
            run = step_runs.get(broken.run_id) if broken.run_id is not None else None
            detail = run.error if run else None
        aggregate = fail_workflow(workflow, broken, detail, now_ms, reason=reason)
    cancelling: list[WorkflowStep] = []
    for step in view:
        if step.status is StepStatus.PENDING:
            settle.append((step, cancel_step(step, now_ms)))
        elif step.status is StepStatus.ADMITTED:
            run = step_runs.get(step.run_id) if step.run_id is not None else None
            if run is not None and run.status in NOT_STARTED_RUN_STATUSES:
                cancelling.append(step)
    return FrontierDecision(settle=tuple(settle), cancel=tuple(cancelling), aggregate=aggregate)


def _output(step: WorkflowStep, step_runs: Mapping[str, Run]) -> JsonValue:
    run = step_runs.get(step.run_id) if step.run_id is not None else None
    if run is None:  # a succeeded step's Run is always read with it
        raise InvalidTransition("step", step.step_id, step.status.value, "pass its output")
    return run.output


@frozen(kw_only=True)
class WorkflowCancellation:
    """What cancelling a workflow does: the aggregate's ``cancel`` (None when the workflow had
    already failed and only steps still running are left to stop); step rows that change
    without touching a Run (pending steps cancelled, finished Runs' outcomes recorded); the
    admitted steps whose unfinished Runs are cancelled with them (running ones included: their
    workers are refused at their next call, ADR 0017)."""

    aggregate: Change | None
    settle: tuple[tuple[WorkflowStep, WorkflowStep], ...] = ()
    cancel: tuple[WorkflowStep, ...] = ()


def cancel_workflow(
    *,
    workflow: Run,
    steps: Sequence[WorkflowStep],
    step_runs: Mapping[str, Run],
    reason: str,
    now_ms: int,
) -> WorkflowCancellation:
    """Cancel an unfinished workflow and every step of it that has not finished. A finished
    workflow whose steps still run (it failed while they ran) has those steps cancelled and
    keeps its outcome; one with nothing left unfinished is refused (``InvalidTransition``)."""
    _require_workflow(workflow, "be cancelled")
    aggregate = None
    if not workflow.status.is_terminal:
        aggregate = cancel(run=workflow, attempt=None, lease=None, reason=reason, now_ms=now_ms)
    settle: list[tuple[WorkflowStep, WorkflowStep]] = []
    cancelling: list[WorkflowStep] = []
    for step in sorted(steps, key=lambda s: s.position):
        if step.status is StepStatus.PENDING:
            settle.append((step, cancel_step(step, now_ms)))
        elif step.status is StepStatus.ADMITTED:
            run = step_runs.get(step.run_id) if step.run_id is not None else None
            if run is not None and run.status.is_terminal:
                settle.append((step, settle_step(step, run, now_ms)))
            else:
                cancelling.append(step)
    if aggregate is None and not cancelling:
        raise InvalidTransition("run", workflow.id, workflow.status.value, "be cancelled")
    return WorkflowCancellation(
        aggregate=aggregate, settle=tuple(settle), cancel=tuple(cancelling)
    )


def needs_frontier(
    workflow: Run, steps: Sequence[WorkflowStep], step_runs: Mapping[str, Run]
) -> bool:
    """The frontier candidate predicate (the stores' candidate queries mirror it): a workflow
    not started yet, an admitted step whose Run finished, or a finished workflow with steps
    still pending or admitted but not started."""
    if workflow.owner is not RunOwner.WORKFLOW:
        return False
    if workflow.status is RunStatus.CREATED:
        return True
    for step in steps:
        run = step_runs.get(step.run_id) if step.run_id is not None else None
        if step.status is StepStatus.ADMITTED and run is not None and run.status.is_terminal:
            return True
        if workflow.status.is_terminal and (
            step.status is StepStatus.PENDING
            or (
                step.status is StepStatus.ADMITTED
                and run is not None
                and run.status in NOT_STARTED_RUN_STATUSES
            )
        ):
            return True
    return False
