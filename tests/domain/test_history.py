"""domain/history.py: what a prune deletes and how many units a batch takes (ADR 0016)."""

from __future__ import annotations

import pytest
from attrs import evolve

from ql3.domain.history import PRUNABLE_RUN_STATUSES, batch_take, finished_before, is_prunable
from ql3.domain.model import TERMINAL_RUN_STATUSES, Run, RunOwner, RunStatus
from ql3.domain.workflows import StepStatus, WorkflowStep

CUTOFF = 10_000


def _run(run_id: str, status: RunStatus, at: int, owner: RunOwner = RunOwner.RUNTIME) -> Run:
    return Run(
        id=run_id, task="t", owner=owner, status=status, created_at_ms=0, updated_at_ms=at
    )


def _step(step_id: str, status: StepStatus, run_id: str | None, at: int = 0) -> WorkflowStep:
    return WorkflowStep(
        workflow_run_id="wf", step_id=step_id, position=0, task="t", status=status,
        run_id=run_id, updated_at_ms=at,
    )


def test_the_prunable_statuses_are_the_terminal_ones() -> None:
    assert PRUNABLE_RUN_STATUSES == TERMINAL_RUN_STATUSES


@pytest.mark.parametrize("status", list(RunStatus))
def test_only_finished_runs_older_than_the_cutoff(status: RunStatus) -> None:
    old = _run("r", status, CUTOFF - 1)
    assert is_prunable(old, cutoff_ms=CUTOFF, is_step=False) is status.is_terminal
    assert not is_prunable(evolve(old, updated_at_ms=CUTOFF), cutoff_ms=CUTOFF, is_step=False)


def test_a_step_run_and_the_gates_candidate_are_never_pruned_alone() -> None:
    old = _run("r", RunStatus.SUCCEEDED, 1)
    assert not is_prunable(old, cutoff_ms=CUTOFF, is_step=True)
    assert not is_prunable(old, cutoff_ms=CUTOFF, is_step=False, gate_run_id="r")
    assert is_prunable(old, cutoff_ms=CUTOFF, is_step=False, gate_run_id="other")


def test_a_workflow_goes_only_when_all_of_it_is_history() -> None:
    workflow = _run("wf", RunStatus.FAILED, 1, RunOwner.WORKFLOW)
    done = _run("s1", RunStatus.SUCCEEDED, 1)
    steps = [_step("a", StepStatus.SUCCEEDED, "s1"), _step("b", StepStatus.CANCELLED, None)]

    def prunable(steps: list[WorkflowStep], runs: dict[str, Run]) -> bool:
        return is_prunable(workflow, cutoff_ms=CUTOFF, is_step=False, steps=steps, step_runs=runs)

    assert prunable(steps, {"s1": done})
    assert not prunable(steps, {})  # its step's Run is not there to go with it
    assert not prunable(steps, {"s1": evolve(done, status=RunStatus.RUNNING)})
    assert not prunable(steps, {"s1": evolve(done, updated_at_ms=CUTOFF)})
    assert not prunable([evolve(steps[0], status=StepStatus.ADMITTED), steps[1]], {"s1": done})
    assert not prunable([steps[0], _step("b", StepStatus.PENDING, None)], {"s1": done})
    assert not prunable([steps[0], evolve(steps[1], updated_at_ms=CUTOFF)], {"s1": done})


def test_the_cutoff_is_now_minus_the_age() -> None:
    assert finished_before(100_000, 30_000) == 70_000
    with pytest.raises(ValueError):
        finished_before(100_000, -1)


@pytest.mark.parametrize(
    ("sizes", "limit", "taken"),
    [
        ([], 3, 0),
        ([1, 1, 1, 1], 3, 3),
        ([1, 1], 3, 2),
        ([3, 1], 3, 1),
        ([5, 1], 3, 1),  # a unit larger than the batch goes alone
        ([1, 5], 3, 1),
        ([2, 1, 1], 3, 2),
        ([1], 1, 1),
    ],
)
def test_a_batch_takes_the_longest_prefix_within_its_size(
    sizes: list[int], limit: int, taken: int
) -> None:
    assert batch_take(sizes, limit) == taken


def test_a_batch_holds_at_least_one_run() -> None:
    with pytest.raises(ValueError):
        batch_take([1], 0)
