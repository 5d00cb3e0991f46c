"""Finished history in the memory store (ADR 0016): a prune's pick, counts and deletes on the
same copy-on-write state as :mod:`ql3.adapters.memory.store`. The pick is
:func:`ql3.domain.history.is_prunable`; a memory transaction holds the store's lock for its whole
life, so nothing is ever skipped as locked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ql3.application.ports import PrunableRun, PrunedRows, PruneMark
from ql3.domain.history import is_prunable

if TYPE_CHECKING:
    from ql3.adapters.memory.state import State, StateAccess


def _ids(picked: Sequence[PrunableRun]) -> list[str]:
    return [p.run_id for p in picked] + [s for p in picked for s in p.step_run_ids]


def _rows(state: State, picked: Sequence[PrunableRun]) -> PrunedRows:
    ids = _ids(picked)
    wanted = set(ids)
    attempts = [a for run_id in ids for a in state.run_attempts.get(run_id, ())]
    return PrunedRows(
        runs=sum(1 for run_id in ids if run_id in state.runs),
        attempts=len(attempts),
        leases=sum(len(state.run_leases.get(run_id, ())) for run_id in ids),
        events=sum(len(state.events.get(run_id, ())) for run_id in ids),
        stop_reports=sum(len(state.reports.get(a, ())) for a in attempts),
        trigger_firings=sum(1 for f in state.firings.values() if f.run_id in wanted),
        workflow_steps=sum(len(state.workflow_steps.get(p.run_id, ())) for p in picked),
    )


class MemoryHistoryRepository:
    def __init__(self, uow: StateAccess) -> None:
        self._uow = uow

    def prunable(
        self, finished_before_ms: int, limit: int, after: PruneMark | None = None
    ) -> Sequence[PrunableRun]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        state = self._uow.read()
        step_run_ids = {
            step.run_id
            for steps in state.workflow_steps.values()
            for step in steps
            if step.run_id is not None
        }
        gate_run_id = state.gate.failure.run_id if state.gate.failure is not None else None
        found = []
        for run in state.runs.values():
            if after is not None and (run.updated_at_ms, run.id) <= (
                after.finished_at_ms,
                after.run_id,
            ):
                continue
            steps = state.workflow_steps.get(run.id, ())
            step_runs = {
                s.run_id: state.runs[s.run_id]
                for s in steps
                if s.run_id is not None and s.run_id in state.runs
            }
            if is_prunable(
                run,
                cutoff_ms=finished_before_ms,
                is_step=run.id in step_run_ids,
                steps=steps,
                step_runs=step_runs,
                gate_run_id=gate_run_id,
            ):
                found.append(
                    PrunableRun(
                        run_id=run.id,
                        finished_at_ms=run.updated_at_ms,
                        step_run_ids=tuple(sorted(step_runs)),
                    )
                )
        found.sort(key=lambda p: (p.finished_at_ms, p.run_id))
        return tuple(found[:limit])

    def count(self, picked: Sequence[PrunableRun]) -> PrunedRows:
        return _rows(self._uow.read(), picked)

    def delete(self, picked: Sequence[PrunableRun]) -> PrunedRows:
        removed = _rows(self._uow.read(), picked)
        if not picked:
            return removed
        state = self._uow.write()
        wanted = set(_ids(picked))
        for run_id in wanted:
            for attempt_id in state.run_attempts.pop(run_id, ()):
                state.attempts.pop(attempt_id, None)
                state.reports.pop(attempt_id, None)
            for generation in state.run_leases.pop(run_id, ()):
                state.leases.pop((run_id, generation), None)
            state.events.pop(run_id, None)
            state.runs.pop(run_id, None)
        for p in picked:
            state.workflow_steps.pop(p.run_id, None)
        for key in [k for k, f in state.firings.items() if f.run_id in wanted]:
            del state.firings[key]
        return removed
