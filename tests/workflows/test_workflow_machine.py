"""A state machine of workflows with outputs, on every store (ADR 0021): it submits random DAGs
whose steps are idempotent (retried once after a lost attempt) or unsafe, runs the cadence,
finishes running steps with drawn outputs or failures, makes the worker vanish mid-step and
cancels workflows, in any order. After every step: a step has a run only once every step it
comes after succeeded, and that run's input holds exactly their outputs; a root step's input is
its own; an unsafe step never has a second attempt; a succeeded workflow's output is its steps'
outputs; a cancelled workflow has no unfinished step run. At the end, with everything finished,
every workflow is finished and none has a pending step."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ql3.adapters.memory import MemoryStore
from ql3.domain import step_input
from ql3.domain.errors import InvalidTransition
from ql3.domain.model import RunStatus
from ql3.domain.workflows import StepStatus
from tests.scheduling_support import WorkerDriver, runtime

TTL_MS = 30_000
IDEMPOTENT = {"safety": "idempotent", "retry_on_lost": True, "max_attempts": 2,
              "backoff": {"initial_ms": 0, "cap_ms": 0}}
UNSAFE = {"safety": "unsafe"}
OUTPUTS = st.one_of(st.none(), st.integers(-5, 5), st.text(alphabet="abc\u00e9", max_size=3),
                    st.dictionaries(st.sampled_from("xyz"), st.integers(0, 3), max_size=2))


@st.composite
def dags(draw: st.DrawFn) -> list[dict[str, Any]]:
    size = draw(st.integers(min_value=1, max_value=5))
    ids = [f"s{i}" for i in range(size)]
    return [
        {
            "id": step,
            "input": {"own": step},
            "after": draw(st.lists(st.sampled_from(ids[:i]), unique=True, max_size=3)) if i else [],
            "policy": draw(st.sampled_from([IDEMPOTENT, UNSAFE])),
        }
        for i, step in enumerate(ids)
    ]


def test_workflows_with_outputs_keep_their_invariants(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_MS / 1000)
    numbers = itertools.count(1)

    class WorkflowMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            # A task and a worker of its own per example: what an earlier example left behind
            # is never claimed here.
            self.task = f"wm{next(numbers)}"
            self.worker = self._worker()
            self.workflows: dict[str, dict[str, dict[str, Any]]] = {}
            self.cancelled: set[str] = set()
            # workflows that had failed when they were cancelled: they stay failed
            self.stopped: set[str] = set()

        def _worker(self) -> WorkerDriver:
            return WorkerDriver.register(rt.workers, f"w-{self.task}-{next(numbers)}",
                                         [self.task], capacity=16)

        @rule(steps=dags())
        def submit(self, steps: list[dict[str, Any]]) -> None:
            document = {"name": "machine",
                        "steps": [{**step, "task": self.task} for step in steps]}
            self.workflows[rt.workflows.submit(document)] = {s["id"]: s for s in steps}

        @rule()
        def cycle(self) -> None:
            assert rt.cycle().ok
            self.worker.claim_all()

        @precondition(lambda self: bool(self.worker.fences))
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            run_id = data.draw(st.sampled_from(sorted(self.worker.fences)))
            if data.draw(st.booleans()):
                self.worker.finish(run_id, output=data.draw(OUTPUTS))
            else:
                self.worker.finish(run_id, succeeded=False, error="drawn failure")

        @precondition(lambda self: bool(self.worker.fences))
        @rule()
        def vanish(self) -> None:
            """The worker dies with its steps running: its session is closed (evidence), and
            once the leases expire they are lost (idempotent steps retried, unsafe failed)."""
            rt.workers.close(self.worker.session_id, self.worker.secret)
            self.worker = self._worker()
            advance(TTL_MS + 1_000)
            assert rt.cycle().ok

        @precondition(lambda self: bool(self.workflows))
        @rule(data=st.data())
        def cancel(self, data: st.DataObject) -> None:
            workflow_id = data.draw(st.sampled_from(sorted(self.workflows)))
            failed = rt.run(workflow_id).status is RunStatus.FAILED
            try:
                rt.workflows.cancel(workflow_id, "drawn")
            except InvalidTransition:
                assert rt.run(workflow_id).status.is_terminal
                return
            # A failed workflow's cancel stops the steps still running; it stays failed.
            (self.stopped if failed else self.cancelled).add(workflow_id)
            for view in rt.workflows.steps(workflow_id):
                self.worker.fences.pop(view.step.run_id or "", None)  # refused from now on

        @invariant()
        def steps_receive_exactly_their_parents_outputs(self) -> None:
            for workflow_id, declared in self.workflows.items():
                views = {v.step.step_id: v for v in rt.workflows.steps(workflow_id)}
                aggregate = rt.run(workflow_id)
                for step_id, view in views.items():
                    run = view.run
                    if run is None:
                        continue
                    parents = declared[step_id]["after"]
                    for parent in parents:
                        assert views[parent].run is not None
                        assert views[parent].run.status is RunStatus.SUCCEEDED, (step_id, parent)
                    own, envelope = step_input.split(run.input)
                    assert own == {"own": step_id}
                    if parents:
                        assert envelope is not None
                        assert envelope["parents"] == {
                            p: views[p].run.output for p in parents}
                    else:
                        assert envelope is None
                    if declared[step_id]["policy"] is UNSAFE:
                        assert run.attempt_count == 1
                if aggregate.status is RunStatus.SUCCEEDED:
                    assert {v.step.status for v in views.values()} == {StepStatus.SUCCEEDED}
                    assert aggregate.output == {s: v.run.output for s, v in views.items()}
                if workflow_id in self.cancelled | self.stopped:
                    wanted = (
                        RunStatus.CANCELLED if workflow_id in self.cancelled
                        else RunStatus.FAILED
                    )
                    assert aggregate.status is wanted
                    for view in views.values():
                        assert view.run is None or view.run.status.is_terminal

        def teardown(self) -> None:
            # Everything left finishes: every workflow ends, none with a pending step.
            for round_ in range(40):
                assert rt.cycle().ok
                for run_id in sorted(self.worker.fences):
                    self.worker.finish(run_id, output={"done": run_id, "round": round_})
                self.worker.claim_all()
                if all(rt.run(w).status.is_terminal for w in self.workflows) and not (
                    self.worker.fences
                ):
                    assert rt.cycle().ok
                    break
            self.steps_receive_exactly_their_parents_outputs()
            for workflow_id in self.workflows:
                assert rt.run(workflow_id).status.is_terminal, workflow_id
                statuses = {v.step.status for v in rt.workflows.steps(workflow_id)}
                assert StepStatus.PENDING not in statuses, (workflow_id, statuses)

    examples = 40 if isinstance(store, MemoryStore) else 5
    WorkflowMachine.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=14,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    WorkflowMachine.TestCase().runTest()
