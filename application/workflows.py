"""Workflows: admission of a DAG of steps and the workflow frontier step of the cadence.

Submission writes the aggregate Run and its pending steps in one transaction, or nothing when the
DAG is refused. Each cycle the frontier reads one bounded page of workflows it has work for and
advances each in its own short transaction: the aggregate Run is locked first, then its step
rows, then (only to cancel them) the step Runs; every change goes through the domain's
transitions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ql3.application.budgets import validate_page_size
from ql3.application.ports import (
    Identities,
    SchedulerUnitOfWork,
    SchedulerUnitOfWorkFactory,
    WorkflowFrontierSource,
)
from ql3.domain.errors import ConcurrencyConflict, Error
from ql3.domain.model import Run, RunOwner, RunStatus
from ql3.domain.transitions import cancel
from ql3.domain.workflows import (
    NOT_STARTED_RUN_STATUSES,
    StepStatus,
    WorkflowSpec,
    WorkflowStep,
    admit_step,
    cancel_step,
    decide_frontier,
    submit_workflow,
    workflow_from_document,
)

_WITH_RUN = frozenset({StepStatus.ADMITTED, StepStatus.SUCCEEDED})


class UnknownWorkflow(Error, LookupError):
    """No workflow aggregate Run with that id."""


@dataclass(frozen=True, slots=True)
class StepView:
    step: WorkflowStep
    run: Run | None


class Workflows:
    """Admits workflows and reads their steps."""

    def __init__(self, uow_factory: SchedulerUnitOfWorkFactory, identities: Identities) -> None:
        self._uow_factory = uow_factory
        self._identities = identities

    def submit(self, workflow: WorkflowSpec | Mapping[str, object]) -> str:
        """Admit a workflow (a :class:`WorkflowSpec` or its JSON document) and return the id
        of its aggregate Run. A refused DAG raises ``InvalidWorkflow`` and writes nothing."""
        spec = (
            workflow
            if isinstance(workflow, WorkflowSpec)
            else workflow_from_document(dict(workflow))
        )
        with self._uow_factory() as uow:
            submitted = submit_workflow(
                spec=spec, run_id=self._identities.new_id(), now_ms=uow.now_ms()
            )
            uow.runs.add(submitted.change)
            uow.workflows.add_steps(submitted.steps)
            uow.commit()
        return submitted.change.run.id

    def steps(self, workflow_run_id: str) -> list[StepView]:
        with self._uow_factory() as uow:
            run = uow.runs.get_run(workflow_run_id)
            if run is None or run.owner is not RunOwner.WORKFLOW:
                raise UnknownWorkflow(workflow_run_id)
            return steps_with_runs(uow, workflow_run_id)


def steps_with_runs(uow: SchedulerUnitOfWork, workflow_run_id: str) -> list[StepView]:
    return [
        StepView(step=step, run=uow.runs.get_run(step.run_id) if step.run_id else None)
        for step in uow.workflows.steps_of(workflow_run_id)
    ]


# --- the workflow frontier step ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrontierOutcome:
    steps_admitted: int = 0
    steps_settled: int = 0
    steps_cancelled: int = 0
    finished: RunStatus | None = None


@dataclass(frozen=True, slots=True)
class WorkflowFrontierReport:
    workflows: int = 0
    steps_admitted: int = 0
    steps_settled: int = 0
    steps_cancelled: int = 0
    succeeded: int = 0
    failed: int = 0
    moved_on: int = 0
    has_more: bool = False

    def counts(self) -> dict[str, int]:
        return {
            "workflows": self.workflows,
            "steps_admitted": self.steps_admitted,
            "steps_settled": self.steps_settled,
            "steps_cancelled": self.steps_cancelled,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "moved_on": self.moved_on,
            "has_more": int(self.has_more),
        }


def advance_workflow(
    uow: SchedulerUnitOfWork, workflow_run_id: str, identities: Identities
) -> FrontierOutcome | None:
    """Advance one workflow inside ``uow`` and commit; None when it is not a workflow."""
    snapshot = uow.runs.lock_run(workflow_run_id)
    if snapshot is None or snapshot.run.owner is not RunOwner.WORKFLOW:
        return None
    workflow = snapshot.run
    steps = uow.workflows.steps_of(workflow_run_id, lock=True)
    # Admitted steps' Runs tell the outcomes; the succeeded ones' hold the workflow's output.
    step_runs: dict[str, Run] = {}
    for step in steps:
        if step.status in _WITH_RUN and step.run_id is not None:
            run = uow.runs.get_run(step.run_id)
            if run is not None:
                step_runs[run.id] = run
    now_ms = uow.now_ms()
    decision = decide_frontier(workflow=workflow, steps=steps, step_runs=step_runs, now_ms=now_ms)
    if not decision.changes_anything:
        return FrontierOutcome()
    for before, after in decision.settle:
        uow.workflows.update_step(before, after)
    cancelled = sum(1 for _, after in decision.settle if after.status is StepStatus.CANCELLED)
    for step in decision.cancel:
        assert step.run_id is not None
        locked = uow.runs.lock_run(step.run_id)
        # Re-checked under the Run's lock: a step that crossed the start barrier meanwhile
        # runs to its end and its outcome is recorded by a later pass.
        if locked is None or locked.run.status not in NOT_STARTED_RUN_STATUSES:
            continue
        change = cancel(
            run=locked.run,
            attempt=locked.attempt,
            lease=locked.lease,
            reason=f"workflow {workflow.id} stopped",
            now_ms=now_ms,
        )
        uow.runs.apply(locked, change)
        uow.workflows.update_step(step, cancel_step(step, now_ms))
        cancelled += 1
    for step in decision.admit:
        after, change = admit_step(
            workflow=workflow,
            step=step,
            run_id=identities.new_id(),
            attempt_id=identities.new_id(),
            now_ms=now_ms,
        )
        uow.runs.add(change)
        uow.workflows.update_step(step, after)
    finished: RunStatus | None = None
    if decision.aggregate is not None:
        uow.runs.apply(snapshot, decision.aggregate)
        if decision.aggregate.run.status.is_terminal:
            finished = decision.aggregate.run.status
    uow.commit()
    settled = sum(1 for _, after in decision.settle if after.status is not StepStatus.CANCELLED)
    return FrontierOutcome(
        steps_admitted=len(decision.admit),
        steps_settled=settled,
        steps_cancelled=cancelled,
        finished=finished,
    )


class WorkflowFrontier:
    """The workflow frontier step: one bounded page of workflows per cycle, each advanced in
    its own transaction. A workflow changed concurrently by another replica is passed over
    (the next cycle sees it again); store errors end the step."""

    def __init__(
        self,
        uow_factory: SchedulerUnitOfWorkFactory,
        source: WorkflowFrontierSource,
        identities: Identities,
        page_size: int | None = None,
    ) -> None:
        self._uow_factory = uow_factory
        self._source = source
        self._identities = identities
        self._page_size = validate_page_size(page_size)

    @property
    def page_size(self) -> int:
        return self._page_size

    def run_once(self, page_size: int | None = None) -> WorkflowFrontierReport:
        limit = validate_page_size(page_size, default=self._page_size)
        page = self._source.workflow_candidates(limit)
        admitted = settled = cancelled = succeeded = failed = moved_on = 0
        for candidate in page.items:
            try:
                with self._uow_factory() as uow:
                    outcome = advance_workflow(uow, candidate.run_id, self._identities)
            except ConcurrencyConflict:
                moved_on += 1
                continue
            if outcome is None:
                moved_on += 1
                continue
            admitted += outcome.steps_admitted
            settled += outcome.steps_settled
            cancelled += outcome.steps_cancelled
            succeeded += outcome.finished is RunStatus.SUCCEEDED
            failed += outcome.finished is RunStatus.FAILED
        return WorkflowFrontierReport(
            workflows=len(page.items),
            steps_admitted=admitted,
            steps_settled=settled,
            steps_cancelled=cancelled,
            succeeded=succeeded,
            failed=failed,
            moved_on=moved_on,
            has_more=page.has_more,
        )
