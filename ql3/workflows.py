"""Workflows built in Python: :class:`Workflow` declares a DAG of steps, and what a caller reads
of a submitted workflow (:class:`WorkflowInfo`, :class:`StepInfo`).

A step runs once every step it comes ``after`` succeeded; its task receives their outputs as
``context.parents`` (ADR 0021). The builder checks nothing twice: :meth:`Workflow.spec` makes the
domain's :class:`~ql3.domain.workflows.WorkflowSpec` and validates it by the domain's rules (a
DAG, 1..256 steps, names, policies), which every submission does anyway."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ql3.domain.errors import InvalidWorkflow
from ql3.domain.model import JsonValue, RunStatus
from ql3.domain.policy import RetryPolicy

if TYPE_CHECKING:
    # The application's and the domain's workflows are loaded when a workflow is built: a
    # submit imports neither (ADR 0009).
    from ql3.application.workflows import StepView, WorkflowView
    from ql3.domain.workflows import StepStatus, WorkflowSpec

Task = str | Callable[..., Any]
# What resolves a step's task, input and policy into a name, a JSON input and a snapshot.
Resolve = Callable[
    [Task, object, RetryPolicy | None, float | None],
    tuple[str, JsonValue, RetryPolicy | None, int | None],
]


@dataclass(frozen=True, slots=True)
class _Step:
    id: str
    task: Task
    input: object
    after: tuple[str, ...]
    policy: RetryPolicy | None
    timeout: float | None


class Workflow:
    """A workflow under construction::

        wf = ql3.Workflow("order")
        charge = wf.step("charge", charge_card, {"order": 42})
        ship = wf.step("ship", ship_order, {"order": 42}, after=[charge])
        runtime.submit_workflow(wf)

    :meth:`step` returns the step's id, which later steps name in ``after``. A step's task is a
    declared function or a task name; its policy and timeout are the ones given, else the
    task's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._steps: list[_Step] = []

    def step(
        self,
        step_id: str,
        task: Task,
        input: object = None,
        *,
        after: Iterable[str] = (),
        policy: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> str:
        """Add a step; it runs once every step of ``after`` succeeded, and receives their
        outputs in ``context.parents``. ``timeout`` (seconds) replaces the task's. Returns
        ``step_id``."""
        if isinstance(after, str):
            raise InvalidWorkflow(f"step {step_id!r}: after is a list of step ids, not a string")
        self._steps.append(
            _Step(
                id=step_id,
                task=task,
                input=input,
                after=tuple(dict.fromkeys(after)),
                policy=policy,
                timeout=timeout,
            )
        )
        return step_id

    @property
    def steps(self) -> tuple[str, ...]:
        """The step ids, in the order they were added."""
        return tuple(step.id for step in self._steps)

    def spec(
        self,
        resolve: Resolve | None = None,
    ) -> WorkflowSpec:
        """The domain's workflow, validated. ``resolve(task, input, policy, timeout)`` gives
        each step's task name, JSON input, policy snapshot and timeout in milliseconds (the
        runtime's task registry does); without it, tasks must be names and inputs JSON."""
        from ql3.domain.workflows import StepSpec, WorkflowSpec, validate_workflow

        steps = []
        for step in self._steps:
            if resolve is not None:
                task, payload, policy, timeout_ms = resolve(
                    step.task, step.input, step.policy, step.timeout
                )
            elif isinstance(step.task, str):
                from ql3.application.tasks import json_input, timeout_millis

                task, payload, policy = step.task, json_input(step.input), step.policy
                timeout_ms = timeout_millis(step.timeout)
            else:
                raise InvalidWorkflow(
                    f"step {step.id!r}: without a task registry, a task is given by its name"
                )
            steps.append(
                StepSpec(
                    id=step.id,
                    task=task,
                    input=payload,
                    after=step.after,
                    policy=policy,
                    timeout_ms=timeout_ms,
                )
            )
        spec = WorkflowSpec(name=self.name, steps=tuple(steps))
        validate_workflow(spec)
        return spec


@dataclass(frozen=True, slots=True)
class StepInfo:
    """One step of a workflow: its status (``pending`` until its run is admitted, then
    ``admitted``, then its run's outcome, or ``cancelled``), and its run's."""

    id: str
    task: str
    after: tuple[str, ...]
    status: StepStatus
    run_id: str | None
    run_status: RunStatus | None
    attempts: int
    output: JsonValue
    error: str | None

    @classmethod
    def of(cls, view: StepView) -> StepInfo:
        step, run = view.step, view.run
        return cls(
            id=step.step_id,
            task=step.task,
            after=step.after,
            status=step.status,
            run_id=step.run_id,
            run_status=run.status if run is not None else None,
            attempts=run.attempt_count if run is not None else 0,
            output=run.output if run is not None else None,
            error=run.error if run is not None else None,
        )


@dataclass(frozen=True, slots=True)
class WorkflowInfo:
    """What a caller reads of a workflow: its aggregate run's status, output (each step's
    output by step id, once all succeeded) and error, and its steps in declaration order."""

    id: str
    name: str
    status: RunStatus
    output: JsonValue
    error: str | None
    steps: tuple[StepInfo, ...]

    @property
    def finished(self) -> bool:
        return self.status.is_terminal

    @property
    def succeeded(self) -> bool:
        return self.status is RunStatus.SUCCEEDED

    def step(self, step_id: str) -> StepInfo:
        """The step of that id (``KeyError`` when there is none)."""
        for step in self.steps:
            if step.id == step_id:
                return step
        raise KeyError(step_id)

    @classmethod
    def of(cls, view: WorkflowView) -> WorkflowInfo:
        return cls(
            id=view.run.id,
            name=view.run.task,
            status=view.run.status,
            output=view.run.output,
            error=view.run.error,
            steps=tuple(StepInfo.of(step) for step in view.steps),
        )
