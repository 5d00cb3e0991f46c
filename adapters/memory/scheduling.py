"""Triggers and workflow steps in the memory store: the repositories and the two candidate
sources of the trigger schedule and workflow frontier steps.

They work on the same copy-on-write state as :mod:`ql3.adapters.memory.store` and check what the SQL
schema enforces (unique names of live triggers, the unique firing key, foreign keys, the
step-status CHECK), raising :class:`~ql3.domain.errors.ConcurrencyConflict` like the SQL stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ql3.application.ports import DueTrigger, Page, RunCandidate, SessionCapacity, Snapshot
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.guards import CLAIMABLE_RUN, holds
from ql3.domain.model import LeaseStatus, Run, RunOwner, RunStatus
from ql3.domain.triggers import Trigger, TriggerFiring, TriggerStatus
from ql3.domain.workflows import StepStatus, WorkflowStep, needs_frontier

if TYPE_CHECKING:
    from ql3.adapters.memory.state import State, StateAccess

FiringKey = tuple[str, int]

_RUN_BOUND_STEP_STATUSES = frozenset({StepStatus.ADMITTED, StepStatus.SUCCEEDED, StepStatus.FAILED})


def _conflict(message: str) -> ConcurrencyConflict:
    return ConcurrencyConflict(message)


def _live_name_taken(state: State, trigger: Trigger) -> bool:
    return trigger.status is not TriggerStatus.DELETED and any(
        other.id != trigger.id
        and other.name == trigger.name
        and other.status is not TriggerStatus.DELETED
        for other in state.triggers.values()
    )


class MemoryTriggerRepository:
    def __init__(self, uow: StateAccess) -> None:
        self._uow = uow

    def add(self, trigger: Trigger) -> None:
        state = self._uow.read()
        if trigger.id in state.triggers:
            raise _conflict(f"trigger {trigger.id} already exists")
        if _live_name_taken(state, trigger):
            raise _conflict(f"a trigger named {trigger.name!r} already exists")
        self._uow.write().triggers[trigger.id] = trigger

    def get(self, trigger_id: str) -> Trigger | None:
        return self._uow.read().triggers.get(trigger_id)

    def find(self, name: str, *, lock: bool = False) -> Trigger | None:
        for trigger in self._uow.read().triggers.values():
            if trigger.name == name and trigger.status is not TriggerStatus.DELETED:
                return trigger
        return None

    def lock(self, trigger_id: str, *, skip_locked: bool = False) -> Trigger | None:
        # A memory transaction holds the store's lock for its whole life: never contended.
        return self._uow.read().triggers.get(trigger_id)

    def update(self, before: Trigger, after: Trigger) -> None:
        if after.id != before.id:
            raise ValueError("a trigger update must name the same trigger before and after")
        state = self._uow.read()
        stored = state.triggers.get(before.id)
        if stored is None or stored.version != before.version:
            raise _conflict(f"trigger {before.id} changed since it was read")
        if _live_name_taken(state, after):
            raise _conflict(f"a trigger named {after.name!r} already exists")
        self._uow.write().triggers[after.id] = after

    def list_triggers(self, *, include_deleted: bool = False) -> Sequence[Trigger]:
        found = [
            t
            for t in self._uow.read().triggers.values()
            if include_deleted or t.status is not TriggerStatus.DELETED
        ]
        return tuple(sorted(found, key=lambda t: (t.name, t.id)))

    def record_firing(self, firing: TriggerFiring) -> None:
        state = self._uow.read()
        key = (firing.trigger_id, firing.scheduled_at_ms)
        if key in state.firings:
            raise _conflict(
                f"trigger {firing.trigger_id} already fired for {firing.scheduled_at_ms}"
            )
        if firing.trigger_id not in state.triggers:
            raise _conflict(f"trigger {firing.trigger_id} does not exist")
        if firing.run_id not in state.runs:
            raise _conflict(f"run {firing.run_id} does not exist")
        if any(f.run_id == firing.run_id for f in state.firings.values()):
            raise _conflict(f"run {firing.run_id} already belongs to a firing")
        self._uow.write().firings[key] = firing

    def firings_of(self, trigger_id: str, limit: int) -> Sequence[TriggerFiring]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        found = [f for f in self._uow.read().firings.values() if f.trigger_id == trigger_id]
        found.sort(key=lambda f: f.scheduled_at_ms, reverse=True)
        return tuple(found[:limit])


def _check_step(state: State, step: WorkflowStep, ignore: WorkflowStep | None = None) -> None:
    """The CHECK and foreign keys of ``workflow_steps``."""
    if step.workflow_run_id not in state.runs:
        raise _conflict(f"workflow run {step.workflow_run_id} does not exist")
    if step.status is StepStatus.PENDING and step.run_id is not None:
        raise _conflict(f"step {step.step_id}: a pending step has no run")
    if step.status in _RUN_BOUND_STEP_STATUSES and step.run_id is None:
        raise _conflict(f"step {step.step_id}: a {step.status.value} step has a run")
    if step.run_id is not None:
        if step.run_id not in state.runs:
            raise _conflict(f"run {step.run_id} of step {step.step_id} does not exist")
        for steps in state.workflow_steps.values():
            for other in steps:
                if other.run_id == step.run_id and other is not ignore:
                    raise _conflict(f"run {step.run_id} already belongs to a step")


class MemoryWorkflowRepository:
    def __init__(self, uow: StateAccess) -> None:
        self._uow = uow

    def add_steps(self, steps: Sequence[WorkflowStep]) -> None:
        state = self._uow.read()
        by_workflow: dict[str, list[WorkflowStep]] = {}
        for step in steps:
            _check_step(state, step)
            by_workflow.setdefault(step.workflow_run_id, []).append(step)
        for workflow_run_id, added in by_workflow.items():
            existing = list(state.workflow_steps.get(workflow_run_id, ()))
            ids = [s.step_id for s in existing + added]
            positions = [s.position for s in existing + added]
            if len(set(ids)) != len(ids) or len(set(positions)) != len(positions):
                raise _conflict(f"workflow {workflow_run_id}: duplicate step id or position")
        writable = self._uow.write()
        for workflow_run_id, added in by_workflow.items():
            merged = (*writable.workflow_steps.get(workflow_run_id, ()), *added)
            writable.workflow_steps[workflow_run_id] = tuple(
                sorted(merged, key=lambda s: s.position)
            )

    def steps_of(self, workflow_run_id: str, *, lock: bool = False) -> Sequence[WorkflowStep]:
        return self._uow.read().workflow_steps.get(workflow_run_id, ())

    def update_step(self, before: WorkflowStep, after: WorkflowStep) -> None:
        if (after.workflow_run_id, after.step_id) != (before.workflow_run_id, before.step_id):
            raise ValueError("a step update must name the same step before and after")
        state = self._uow.read()
        steps = state.workflow_steps.get(before.workflow_run_id, ())
        stored = next((s for s in steps if s.step_id == before.step_id), None)
        if stored is None or stored.status is not before.status or stored.run_id != before.run_id:
            raise _conflict(f"step {before.step_id} changed since it was read")
        _check_step(state, after, ignore=stored)
        writable = self._uow.write()
        writable.workflow_steps[before.workflow_run_id] = tuple(
            after if s.step_id == before.step_id else s for s in steps
        )

    def list_workflows(self, status: RunStatus | None, limit: int) -> Sequence[Run]:
        found = [
            run
            for run in self._uow.read().runs.values()
            if run.owner is RunOwner.WORKFLOW and (status is None or run.status is status)
        ]
        found.sort(key=lambda r: (r.created_at_ms, r.id), reverse=True)
        return tuple(found[:limit])

    def step_of_run(self, run_id: str) -> WorkflowStep | None:
        state = self._uow.read()
        run = state.runs.get(run_id)
        if run is None or run.parent_run_id is None:
            return None
        for step in state.workflow_steps.get(run.parent_run_id, ()):
            if step.run_id == run_id:
                return step
        return None


def session_capacity(state: State, session_id: str) -> SessionCapacity | None:
    session = state.sessions.get(session_id)
    if session is None:
        return None
    in_flight = sum(
        1
        for lease in state.leases.values()
        if lease.status is LeaseStatus.LEASED and lease.holder_session_id == session_id
    )
    return SessionCapacity(session=session, in_flight=in_flight)


def claimable(state: State, tasks: Sequence[str], limit_per_task: int) -> list[Snapshot]:
    """Pristine Attempts of ``queued`` Runs of the tasks, highest priority first, then oldest
    first within each task."""
    wanted = frozenset(tasks)
    by_task: dict[str, list[Snapshot]] = {}
    for run in state.runs.values():
        if run.task not in wanted or not holds(CLAIMABLE_RUN, {"run": run}):
            continue
        attempt = state.latest_attempt(run.id)
        if attempt is None or not attempt.is_pristine:
            continue
        by_task.setdefault(run.task, []).append(state.snapshot(run, attempt))
    found: list[Snapshot] = []
    for snapshots in by_task.values():
        snapshots.sort(
            key=lambda s: (-s.run.priority, s.attempt.created_at_ms if s.attempt else 0, s.run.id)
        )
        found.extend(snapshots[:limit_per_task])
    return found


def in_flight_by_task(state: State, tasks: Sequence[str]) -> dict[str, int]:
    wanted = frozenset(tasks)
    counts: dict[str, int] = {}
    for lease in state.leases.values():
        if lease.status is LeaseStatus.LEASED:
            task = state.runs[lease.run_id].task
            if task in wanted:
                counts[task] = counts.get(task, 0) + 1
    return counts


# --- candidate sources ----------------------------------------------------------------------------


def due_triggers(state: State, now_ms: int, limit: int) -> Page[DueTrigger]:
    due = sorted(
        (
            t
            for t in state.triggers.values()
            if t.status is TriggerStatus.ACTIVE and t.next_fire_at_ms <= now_ms
        ),
        key=lambda t: (t.next_fire_at_ms, t.id),
    )
    items = tuple(
        DueTrigger(trigger_id=t.id, next_fire_at_ms=t.next_fire_at_ms) for t in due[:limit]
    )
    return Page(items=items, has_more=len(due) > limit, observed_at_ms=now_ms)


def workflow_candidates(state: State, now_ms: int, limit: int) -> Page[RunCandidate]:
    found = []
    for run in state.runs.values():
        if run.owner is not RunOwner.WORKFLOW:
            continue
        steps = state.workflow_steps.get(run.id, ())
        step_runs = {
            s.run_id: state.runs[s.run_id]
            for s in steps
            if s.run_id is not None and s.run_id in state.runs
        }
        if needs_frontier(run, steps, step_runs):
            found.append(run)
    found.sort(key=lambda r: (r.updated_at_ms, r.id))
    items = tuple(
        RunCandidate(run_id=r.id, attempt_id=None, since_ms=r.updated_at_ms) for r in found[:limit]
    )
    return Page(items=items, has_more=len(found) > limit, observed_at_ms=now_ms)
