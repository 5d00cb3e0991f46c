"""Finished history: which Runs a prune deletes, and how many of them one batch takes.

A finished Run never changes again (its status has no edge out,
:data:`ql3.domain.states.RUN_EDGES`). Pruning deletes such Runs with every row that records them
(Attempts, leases, events, stop reports, the trigger firing that admitted them, a workflow's
steps); it changes no state, so it is no transition and writes no event (ADR 0016).

The unit of pruning is a top-level Run: a Run that is no workflow step's. A workflow aggregate is
pruned together with its step Runs, and only once the whole workflow is history: the aggregate
finished, every step settled, every step's Run finished, and nothing of it changed since the
cutoff. A step Run is never pruned on its own, so a workflow that still runs keeps every row its
frontier reads. The Run the dispatch gate names as the candidate a step fails on is kept while
the gate names it (``ql3 doctor`` reports it).

The SQL stores' pick statement mirrors :func:`is_prunable`; the memory store calls it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ql3.domain.model import TERMINAL_RUN_STATUSES, Run
from ql3.domain.workflows import StepStatus, WorkflowStep

PRUNABLE_RUN_STATUSES = TERMINAL_RUN_STATUSES
"""A Run is history once it finished: succeeded, failed or cancelled."""

SETTLED_STEP_STATUSES = frozenset(status for status in StepStatus if status.is_settled)
"""A workflow step whose outcome is recorded: nothing of it changes any more."""


def finished_before(now_ms: int, older_than_ms: int) -> int:
    """The cutoff of a prune: Runs whose last change is strictly before it are history to
    delete. ``now_ms`` is the store's clock."""
    if older_than_ms < 0:
        raise ValueError(f"an age is not negative, got {older_than_ms} ms")
    return now_ms - older_than_ms


def is_prunable(
    run: Run,
    *,
    cutoff_ms: int,
    is_step: bool,
    steps: Sequence[WorkflowStep] = (),
    step_runs: Mapping[str, Run] | None = None,
    gate_run_id: str | None = None,
) -> bool:
    """Whether a prune with this cutoff deletes ``run`` (with its step Runs, if it is a
    workflow aggregate). ``is_step``: the Run is a workflow step's; ``steps``: the Run's own
    workflow steps; ``step_runs``: those steps' Runs by id; ``gate_run_id``: the Run the
    dispatch gate names as the failing candidate, if any."""
    if is_step or run.id == gate_run_id:
        return False
    if run.status not in PRUNABLE_RUN_STATUSES or run.updated_at_ms >= cutoff_ms:
        return False
    found = step_runs or {}
    for step in steps:
        if step.status not in SETTLED_STEP_STATUSES or step.updated_at_ms >= cutoff_ms:
            return False
        if step.run_id is None:
            continue
        step_run = found.get(step.run_id)
        if step_run is None:
            return False
        if step_run.status not in PRUNABLE_RUN_STATUSES or step_run.updated_at_ms >= cutoff_ms:
            return False
    return True


def batch_take(sizes: Iterable[int], limit: int) -> int:
    """How many of the picked units one batch takes, each unit being ``size`` Runs (a
    workflow counts with its step Runs): the longest prefix of at most ``limit`` Runs, and
    always the first unit, however large, so that every unit is pruned some day."""
    if limit < 1:
        raise ValueError(f"a batch holds at least one run, got {limit}")
    taken = total = 0
    for size in sizes:
        if taken and total + size > limit:
            break
        taken += 1
        total += size
        if total >= limit:
            break
    return taken
