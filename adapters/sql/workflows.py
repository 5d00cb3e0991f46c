"""Workflow steps on the shared SQL tables: row mapping, statements, the repository and the
frontier's candidate query, for every SQL store (see :mod:`ql3.adapters.sql.triggers` for how locks
and the store's clock are handled)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

from sqlalchemy import (
    ColumnElement,
    Insert,
    Select,
    Update,
    and_,
    insert,
    literal_column,
    or_,
    select,
    true,
    union,
    update,
)

from ql3.adapters.sql.rows import Row, Values, run_from_row
from ql3.adapters.sql.schema import runs, workflow_steps
from ql3.adapters.sql.transaction import SqlTransaction
from ql3.adapters.sql.triggers import policy_document
from ql3.domain.model import TERMINAL_RUN_STATUSES, Run, RunOwner, RunStatus
from ql3.domain.policy import policy_from_document
from ql3.domain.workflows import NOT_STARTED_RUN_STATUSES, StepStatus, WorkflowStep


def _const(value: str) -> ColumnElement[str]:
    """A constant rendered inline, so that partial indexes match generic plans too."""
    if "'" in value:
        raise ValueError(f"not a plain constant: {value!r}")
    return literal_column(f"'{value}'")


def _in(column: ColumnElement[str], statuses: Iterable[enum.Enum]) -> ColumnElement[bool]:
    return column.in_([_const(str(s.value)) for s in sorted(statuses, key=lambda s: s.value)])


# --- row mapping --------------------------------------------------------------------------------


def step_values(step: WorkflowStep) -> Values:
    return {
        "workflow_run_id": step.workflow_run_id,
        "step_id": step.step_id,
        "position": step.position,
        "task": step.task,
        "input": step.input,
        "after_steps": list(step.after),
        "policy": policy_document(step.policy),
        "status": step.status.value,
        "run_id": step.run_id,
        "updated_at": step.updated_at_ms,
    }


def step_from_row(row: Row) -> WorkflowStep:
    return WorkflowStep(
        workflow_run_id=row["workflow_run_id"],
        step_id=row["step_id"],
        position=int(row["position"]),
        task=row["task"],
        input=row["input"],
        after=tuple(row["after_steps"] or ()),
        policy=policy_from_document(row["policy"]),
        status=StepStatus(row["status"]),
        run_id=row["run_id"],
        updated_at_ms=int(row["updated_at"]),
    )


# --- statements ---------------------------------------------------------------------------------


def insert_steps(steps: Sequence[WorkflowStep]) -> Insert:
    return insert(workflow_steps).values([step_values(step) for step in steps])


def steps_of(workflow_run_id: str, *, lock: bool) -> Select:
    s = workflow_steps.c
    statement = (
        select(workflow_steps).where(s.workflow_run_id == workflow_run_id).order_by(s.position)
    )
    return statement.with_for_update() if lock else statement


def update_step(before: WorkflowStep, after: WorkflowStep) -> Update:
    """Fenced on the status and run id the transaction read."""
    s = workflow_steps.c
    values = {
        k: v for k, v in step_values(after).items() if k not in ("workflow_run_id", "step_id")
    }
    return (
        update(workflow_steps)
        .where(
            s.workflow_run_id == before.workflow_run_id,
            s.step_id == before.step_id,
            s.status == before.status.value,
            s.run_id.is_not_distinct_from(before.run_id),
        )
        .values(values)
    )


def step_of_run(run_id: str) -> Select:
    return select(workflow_steps).where(workflow_steps.c.run_id == run_id)


def list_workflows(status: RunStatus | None, limit: int) -> Select:
    """Workflow aggregate Runs, the most recently admitted first (an operator's listing)."""
    statement = select(runs).where(runs.c.owner == _const(RunOwner.WORKFLOW.value))
    if status is not None:
        statement = statement.where(runs.c.status == status.value)
    return statement.order_by(runs.c.created_at.desc(), runs.c.id.desc()).limit(limit)


def workflow_candidates_query(limit: int, now: ColumnElement[int]) -> Select:
    """Workflow aggregate Runs the frontier has work for (mirrors
    :func:`ql3.domain.workflows.needs_frontier`), by (updated_at, id), ``limit + 1`` rows, as
    ``clock LEFT JOIN page ON true``.

    Each branch starts from live work only (``created`` Runs, open steps), so the cost does not
    grow with finished history."""
    s = workflow_steps.c
    step_run = runs.alias("step_run")
    workflow = runs.alias("workflow")
    not_started = and_(
        s.status == _const(StepStatus.ADMITTED.value),
        _in(step_run.c.status, NOT_STARTED_RUN_STATUSES),
    )
    waiting = select(runs.c.id.label("workflow_run_id")).where(
        runs.c.status == _const(RunStatus.CREATED.value),
        runs.c.owner == _const(RunOwner.WORKFLOW.value),
    )
    finished_steps = (
        select(s.workflow_run_id)
        .select_from(workflow_steps.join(step_run, step_run.c.id == s.run_id))
        .where(
            s.status == _const(StepStatus.ADMITTED.value),
            _in(step_run.c.status, TERMINAL_RUN_STATUSES),
        )
    )
    stranded_steps = (
        select(s.workflow_run_id)
        .select_from(
            workflow_steps.join(workflow, workflow.c.id == s.workflow_run_id).outerjoin(
                step_run, step_run.c.id == s.run_id
            )
        )
        .where(
            _in(s.status, (StepStatus.PENDING, StepStatus.ADMITTED)),
            _in(workflow.c.status, TERMINAL_RUN_STATUSES),
            or_(s.status == _const(StepStatus.PENDING.value), not_started),
        )
    )
    candidates = union(waiting, finished_steps, stranded_steps).subquery("candidates")
    page = (
        select(runs.c.id.label("run_id"), runs.c.updated_at.label("since"))
        .where(runs.c.id.in_(select(candidates.c.workflow_run_id)))
        .order_by(runs.c.updated_at, runs.c.id)
        .limit(limit + 1)
        .subquery("page")
    )
    clock = select(now.label("observed_at")).subquery("clock")
    return (
        select(clock.c.observed_at, *page.c)
        .select_from(clock.outerjoin(page, true()))
        .order_by(page.c.since, page.c.run_id)
    )


# --- the repository -----------------------------------------------------------------------------


class SqlWorkflowRepository:
    """:class:`ql3.application.ports.WorkflowRepository` on any :class:`SqlTransaction`."""

    def __init__(self, tx: SqlTransaction) -> None:
        self._tx = tx

    def add_steps(self, steps: Sequence[WorkflowStep]) -> None:
        if not steps:
            return
        statement = insert_steps(steps)
        what = f"steps of workflow {steps[0].workflow_run_id}"
        self._tx.atomically(lambda: self._tx.write(statement, what))

    def steps_of(self, workflow_run_id: str, *, lock: bool = False) -> Sequence[WorkflowStep]:
        result = self._tx.execute(steps_of(workflow_run_id, lock=lock)).mappings()
        return tuple(step_from_row(row) for row in result)

    def update_step(self, before: WorkflowStep, after: WorkflowStep) -> None:
        if (after.workflow_run_id, after.step_id) != (before.workflow_run_id, before.step_id):
            raise ValueError("a step update must name the same step before and after")
        statement = update_step(before, after)
        what = f"step {before.step_id} of workflow {before.workflow_run_id}"
        self._tx.atomically(lambda: self._tx.compare_and_set(statement, what))

    def step_of_run(self, run_id: str) -> WorkflowStep | None:
        row = self._tx.execute(step_of_run(run_id)).mappings().first()
        return None if row is None else step_from_row(row)

    def list_workflows(self, status: RunStatus | None, limit: int) -> Sequence[Run]:
        result = self._tx.execute(list_workflows(status, limit)).mappings()
        return tuple(run_from_row(row) for row in result)
