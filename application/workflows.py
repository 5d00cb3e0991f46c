"""Workflows: admission of a DAG of steps and the workflow frontier step of the cadence.

Submission writes the aggregate Run and its pending steps in one transaction, or nothing when the
DAG is refused. Each cycle the frontier reads one bounded page of workflows it has work for and
advances each in its own short transaction: the aggregate Run is locked first, then its step
rows, then (only to cancel them) the step Runs; every change goes through the domain's
transitions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
from ql3.domain.transitions import cancel, check_unique_key
from ql3.domain.workflows import (
    NOT_STARTED_RUN_STATUSES,
    StepStatus,
    WorkflowSpec,
    WorkflowStep,
    admit_step,
    cancel_step,
    cancel_workflow,
    decide_frontier,
    settle_step,
    submit_workflow,
    workflow_from_document,
)

# How often one submission reads a unique key again after another transaction took it
# between its read and its insert.
KEY_ROUNDS = 3
MAX_LISTED = 1_000

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
        return self.admit(workflow).run_id

    def admit(
        self, workflow: WorkflowSpec | Mapping[str, object], *, unique_key: str | None = None
    ) -> SubmittedWorkflow:
        """:meth:`submit`, in one transaction of the unit of work factory (the caller's, when
        it gives its own). With ``unique_key``: while an unfinished workflow (or Run) holds
        the key, its id is answered with ``existing=True`` and nothing is written."""
        spec = (
            workflow
            if isinstance(workflow, WorkflowSpec)
            else workflow_from_document(dict(workflow))
        )
        if unique_key is not None:
            check_unique_key(unique_key)
        with self._uow_factory() as uow:
            for round_ in range(1, KEY_ROUNDS + 1):
                if unique_key is not None:
                    held = uow.runs.unfinished_with_keys([unique_key]).get(unique_key)
                    if held is not None:
                        return SubmittedWorkflow(run_id=held, existing=True)
                submitted = submit_workflow(
                    spec=spec,
                    run_id=self._identities.new_id(),
                    now_ms=uow.now_ms(),
                    unique_key=unique_key,
                )
                try:
                    uow.runs.add(submitted.change)
                    break
                except ConcurrencyConflict:
                    # Another transaction admitted a Run with the key after it was read (the
                    # refused insert left nothing behind): read it again.
                    if unique_key is None or round_ == KEY_ROUNDS:
                        raise
            uow.workflows.add_steps(submitted.steps)
            uow.commit()
        return SubmittedWorkflow(run_id=submitted.change.run.id, existing=False)

    def steps(self, workflow_run_id: str) -> list[StepView]:
        return self.get(workflow_run_id).steps

    def get(self, workflow_run_id: str) -> WorkflowView:
        """The aggregate Run and each step with its Run (None before it is admitted)."""
        with self._uow_factory() as uow:
            run = uow.runs.get_run(workflow_run_id)
            if run is None or run.owner is not RunOwner.WORKFLOW:
                raise UnknownWorkflow(workflow_run_id)
            return WorkflowView(run=run, steps=steps_with_runs(uow, workflow_run_id))

    def list_workflows(self, status: RunStatus | None = None, limit: int = 100) -> list[Run]:
        """Workflow aggregate Runs (of ``status``), the most recent first."""
        if not 1 <= limit <= MAX_LISTED:
            raise ValueError(f"limit must be within 1..{MAX_LISTED}")
        with self._uow_factory() as uow:
            return list(uow.workflows.list_workflows(status, limit))

    def cancel(self, workflow_run_id: str, reason: str = "cancelled") -> RunStatus:
        """Cancel an unfinished workflow at once and return the status it had: the aggregate
        Run, every pending step, and every admitted step whose Run has not finished, with that
        Run (a running one's worker is refused at its next call and stops the task, ADR 0017).
        One transaction, locking as the frontier does: the aggregate, its steps, their Runs. A
        workflow that failed while steps ran has those steps cancelled and stays failed; one
        with nothing left unfinished raises ``InvalidTransition`` and nothing changes."""
        with self._uow_factory() as uow:
            snapshot = uow.runs.lock_run(workflow_run_id)
            if snapshot is None or snapshot.run.owner is not RunOwner.WORKFLOW:
                raise UnknownWorkflow(workflow_run_id)
            steps = uow.workflows.steps_of(workflow_run_id, lock=True)
            now_ms = uow.now_ms()
            decision = cancel_workflow(
                workflow=snapshot.run,
                steps=steps,
                step_runs=_runs_of(uow, steps),
                reason=reason,
                now_ms=now_ms,
            )
            for before, after in decision.settle:
                uow.workflows.update_step(before, after)
            for step in decision.cancel:
                assert step.run_id is not None
                locked = uow.runs.lock_run(step.run_id)
                if locked is None:
                    continue
                if locked.run.status.is_terminal:  # it finished since it was read
                    uow.workflows.update_step(step, settle_step(step, locked.run, now_ms))
                    continue
                change = cancel(
                    run=locked.run,
                    attempt=locked.attempt,
                    lease=locked.lease,
                    reason=f"workflow {workflow_run_id} cancelled: {reason}"[:500],
                    now_ms=now_ms,
                )
                uow.runs.apply(locked, change)
                uow.workflows.update_step(step, cancel_step(step, now_ms))
            if decision.aggregate is not None:
                uow.runs.apply(snapshot, decision.aggregate)
            uow.commit()
        return snapshot.run.status


@dataclass(frozen=True, slots=True)
class SubmittedWorkflow:
    run_id: str
    existing: bool = False


@dataclass(frozen=True, slots=True)
class WorkflowView:
    run: Run
    steps: list[StepView]


def _runs_of(uow: SchedulerUnitOfWork, steps: Sequence[WorkflowStep]) -> dict[str, Run]:
    """The Runs of the admitted and succeeded steps, by run id."""
    found: dict[str, Run] = {}
    for step in steps:
        if step.status in _WITH_RUN and step.run_id is not None:
            run = uow.runs.get_run(step.run_id)
            if run is not None:
                found[run.id] = run
    return found


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
    # Admitted steps' Runs tell the outcomes; the succeeded ones' hold the outputs the steps
    # after them receive, and the workflow's output.
    step_runs = _runs_of(uow, steps)
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
            input=decision.inputs[step.step_id],
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
