"""A property on every store: random DAGs complete, each step run exactly once and only after
every step it comes after succeeded, with exactly its parents' outputs in its input snapshot,
while a worker (driven in-process through the worker commands) finishes its running steps in
an arbitrary order with drawn outputs."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ql3.adapters.memory import MemoryStore
from ql3.domain import step_input
from ql3.domain.events import EventType
from ql3.domain.model import RunStatus
from tests.scheduling_support import WorkerDriver, runtime


@st.composite
def dags(draw: st.DrawFn) -> dict[str, Any]:
    """Up to seven steps; each comes after up to three earlier ones (so there is no cycle),
    declared in a random order."""
    size = draw(st.integers(min_value=1, max_value=7))
    ids = [f"s{i}" for i in range(size)]
    after = {
        step: draw(st.lists(st.sampled_from(ids[:i]), unique=True, max_size=3)) if i else []
        for i, step in enumerate(ids)
    }
    declared = draw(st.permutations(ids))
    return {
        "name": "random-dag",
        "steps": [
            {"id": step, "task": "t", "input": {"step": step}, "after": after[step]}
            for step in declared
        ],
    }


def test_random_dags_complete_in_a_topological_order_with_each_step_run_once(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    numbers = itertools.count(1)
    examples = 50 if isinstance(store, MemoryStore) else 8

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(document=dags(), data=st.data())
    def check(document: dict[str, Any], data: st.DataObject) -> None:
        # Hypothesis may stop an example half-way: each example has a task and a worker of
        # its own, so what an earlier one left running takes no capacity and no claim here.
        task = f"t{next(numbers)}"
        worker = WorkerDriver.register(rt.workers, f"w-{task}", [task], capacity=64)
        for step in document["steps"]:
            step["task"] = task
        workflow_id = rt.workflows.submit(document)
        after = {step["id"]: step["after"] for step in document["steps"]}
        clock = 0
        claimed: dict[str, int] = {}
        finished: dict[str, int] = {}
        running: dict[str, str] = {}
        outputs: dict[str, Any] = {}
        for _ in range(4 * len(after) + 4):
            assert rt.cycle().ok
            for grant in worker.claim_all():
                own, envelope = step_input.split(grant.input)
                step = own["step"]
                parents = envelope["parents"] if envelope is not None else {}
                assert parents == {before: outputs[before] for before in after[step]}, step
                assert step not in claimed, f"step {step} claimed twice"
                claimed[step] = clock = clock + 1
                running[grant.run_id] = step
            if rt.run(workflow_id).status.is_terminal:
                break
            assert running, "nothing runs and the workflow is not finished"
            # Drawn in terms of step ids (run ids are new on every replay of an example).
            run_of = {step: run_id for run_id, step in running.items()}
            order = data.draw(st.permutations(sorted(run_of)))
            for step in order[: data.draw(st.integers(1, len(order)))]:
                outputs[step] = data.draw(
                    # (no NUL: a completion whose output holds one is refused as invalid)
                    st.one_of(st.none(), st.integers(-(10**6), 10**6),
                              st.text(alphabet="abc\u00e9\u4e2d", max_size=5),
                              st.fixed_dictionaries({"step": st.just(step)}))
                )
                worker.finish(run_of[step], output=outputs[step])
                del running[run_of[step]]
                finished[step] = clock = clock + 1

        aggregate = rt.run(workflow_id)
        assert aggregate.status is RunStatus.SUCCEEDED
        assert aggregate.output == outputs
        assert set(finished) == set(after)
        for step, predecessors in after.items():
            for before in predecessors:
                assert finished[before] < claimed[step], (before, step)
        # The store's own audit agrees: a step is admitted after its predecessors succeeded.
        views = {v.step.step_id: v for v in rt.workflows.steps(workflow_id)}
        with store.unit_of_work() as uow:
            events = {
                step: {e.event.type: e.sequence for e in uow.runs.events_of(view.run.id)}
                for step, view in views.items()
            }
        for step, predecessors in after.items():
            assert views[step].run.attempt_count == 1
            assert views[step].run.status is RunStatus.SUCCEEDED
            for before in predecessors:
                assert (
                    events[before][EventType.ATTEMPT_SUCCEEDED]
                    < events[step][EventType.RUN_ADMITTED]
                )

    check()
