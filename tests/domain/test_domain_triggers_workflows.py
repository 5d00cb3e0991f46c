"""The pure decisions of triggers and workflows: firing plans and their catch-up policies, DAG
validation, the frontier's decision, and policy documents."""

from __future__ import annotations

import pytest
from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st

from ql3.domain.errors import (
    InvalidRetryPolicy,
    InvalidTransition,
    InvalidTrigger,
    InvalidWorkflow,
    NotDue,
)
from ql3.domain.events import EventType
from ql3.domain.model import Run, RunOwner, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety, policy_from_document, policy_to_document
from ql3.domain.transitions import admit
from ql3.domain.triggers import (
    MAX_COUNTED_MISSED,
    MISFIRE_GRACE_MS,
    CatchUp,
    IntervalSchedule,
    Trigger,
    TriggerStatus,
    define_trigger,
    delete_trigger,
    fire,
    interval_schedule,
    pause_trigger,
    plan_firings,
    resume_trigger,
)
from ql3.domain.workflows import (
    StepSpec,
    StepStatus,
    WorkflowSpec,
    decide_frontier,
    submit_workflow,
    validate_workflow,
    workflow_from_document,
)

T0 = 1_700_000_000_000
MINUTE = 60_000


def _trigger(every_ms: int = MINUTE, catch_up: CatchUp = CatchUp.SKIP, limit: int = 10) -> Trigger:
    return define_trigger(
        trigger_id="t1", name="tick", task="mail", input={"a": 1}, policy=None,
        every_ms=every_ms, cron=None, catch_up=catch_up, catch_up_limit=limit,
        first_fire_at_ms=T0 + every_ms, now_ms=T0,
    )


def test_interval_schedule_arithmetic() -> None:
    schedule = IntervalSchedule(anchor_ms=1_000, every_ms=100)
    assert schedule.next_after(1_000) == 1_100
    assert schedule.next_after(1_099) == 1_100
    assert schedule.next_after(950) == 1_000
    assert schedule.latest_at_or_before(1_100) == 1_100
    assert schedule.latest_at_or_before(1_199) == 1_100
    assert schedule.latest_at_or_before(999) == 900


def test_a_trigger_is_not_due_before_its_time_and_fires_on_time() -> None:
    trigger = _trigger()
    with pytest.raises(NotDue):
        plan_firings(trigger, interval_schedule(trigger), T0 + MINUTE - 1)
    plan = plan_firings(trigger, interval_schedule(trigger), T0 + MINUTE + 5)
    assert (plan.fire_at_ms, plan.missed, plan.next_fire_at_ms) == ((T0 + MINUTE,), 0,
                                                                     T0 + 2 * MINUTE)


@given(
    catch_up=st.sampled_from(CatchUp),
    limit=st.integers(1, 64),
    every_s=st.integers(1, 7200),
    away_ms=st.integers(0, 50 * 3_600_000),
)
def test_every_firing_plan_is_a_bounded_ordered_choice_of_due_times(
    catch_up: CatchUp, limit: int, every_s: int, away_ms: int
) -> None:
    every = every_s * 1000
    trigger = _trigger(every, catch_up, limit)
    now = trigger.next_fire_at_ms + away_ms
    plan = plan_firings(trigger, interval_schedule(trigger), now)
    due = (now - trigger.next_fire_at_ms) // every + 1
    latest = trigger.next_fire_at_ms + (due - 1) * every
    assert list(plan.fire_at_ms) == sorted(set(plan.fire_at_ms))
    assert all(trigger.next_fire_at_ms <= t <= now for t in plan.fire_at_ms)
    assert all((t - trigger.next_fire_at_ms) % every == 0 for t in plan.fire_at_ms)
    assert plan.next_fire_at_ms == latest + every > now
    counted = min(due, MAX_COUNTED_MISSED + 1)  # the count saturates on long downtimes
    assert plan.missed == max(0, counted - len(plan.fire_at_ms))
    if catch_up is CatchUp.SKIP:
        assert plan.fire_at_ms == ((latest,) if now - latest < MISFIRE_GRACE_MS else ())
    elif catch_up is CatchUp.ONE:
        assert plan.fire_at_ms == (latest,)
    else:
        assert len(plan.fire_at_ms) == min(due, limit)
        assert plan.fire_at_ms[-1] == latest


def test_fire_admits_one_run_per_planned_time_and_moves_the_trigger() -> None:
    trigger = _trigger(catch_up=CatchUp.ALL)
    plan = plan_firings(trigger, interval_schedule(trigger), T0 + 3 * MINUTE)
    fired = fire(trigger=trigger, plan=plan, ids=[("r1", "a1"), ("r2", "a2"), ("r3", "a3")],
                 now_ms=T0 + 3 * MINUTE)
    assert [c.run.id for c in fired.admissions] == ["r1", "r2", "r3"]
    assert all(c.run.status is RunStatus.QUEUED and c.run.input == {"a": 1}
               for c in fired.admissions)
    assert [c.event.data["scheduled_at_ms"] for c in fired.admissions] == list(plan.fire_at_ms)
    assert [f.scheduled_at_ms for f in fired.firings] == list(plan.fire_at_ms)
    assert fired.trigger.version == 2 and fired.trigger.next_fire_at_ms == T0 + 4 * MINUTE
    with pytest.raises(InvalidTrigger):
        fire(trigger=trigger, plan=plan, ids=[("r1", "a1")], now_ms=T0 + 3 * MINUTE)


def test_pause_resume_delete_transitions() -> None:
    trigger = _trigger()
    paused = pause_trigger(trigger, T0 + 1)
    with pytest.raises(InvalidTransition):
        pause_trigger(paused, T0 + 2)
    with pytest.raises(InvalidTransition):
        plan_firings(paused, interval_schedule(paused), T0 + 10 * MINUTE)
    resumed = resume_trigger(paused, interval_schedule(paused), T0 + 10 * MINUTE + 1)
    assert resumed.status is TriggerStatus.ACTIVE
    assert resumed.next_fire_at_ms == T0 + 11 * MINUTE
    deleted = delete_trigger(resumed, T0 + 11 * MINUTE)
    assert (deleted.status, deleted.version) == (TriggerStatus.DELETED, 4)
    with pytest.raises(InvalidTransition):
        delete_trigger(deleted, T0)


def test_trigger_definitions_are_validated() -> None:
    with pytest.raises(InvalidTrigger):
        evolve(_trigger(), cron="* * * * *")  # both an interval and a cron expression
    with pytest.raises(InvalidTrigger):
        _trigger(every_ms=999)
    with pytest.raises(InvalidTrigger):
        _trigger(limit=0)
    with pytest.raises(InvalidTrigger):
        define_trigger(trigger_id="t", name="n", task="t", input=None, policy=None,
                       every_ms=MINUTE, cron=None, catch_up=CatchUp.ONE, catch_up_limit=1,
                       first_fire_at_ms=T0, now_ms=T0)


# --- workflows ---------------------------------------------------------------------------------


def _spec(*steps: tuple[str, tuple[str, ...]]) -> WorkflowSpec:
    return WorkflowSpec(
        name="w", steps=tuple(StepSpec(id=i, task="t", after=after) for i, after in steps)
    )


def test_validation_returns_a_topological_order_and_refuses_bad_dags() -> None:
    spec = _spec(("d", ("b", "c")), ("b", ("a",)), ("c", ("a",)), ("a", ()))
    assert validate_workflow(spec) == ("a", "b", "c", "d")
    for bad, message in [
        (_spec(("a", ()), ("a", ())), "duplicate"),
        (_spec(("a", ("z",))), "unknown"),
        (_spec(("a", ("b",)), ("b", ("c",)), ("c", ("a",)), ("d", ())), "cycle: a, b, c"),
        (WorkflowSpec(name="w", steps=()), "1..256"),
        (WorkflowSpec(name="", steps=_spec(("a", ())).steps), "workflow name"),
    ]:
        with pytest.raises(InvalidWorkflow, match=message):
            validate_workflow(bad)


def test_documents_are_read_strictly() -> None:
    spec = workflow_from_document({"name": "w", "steps": [
        {"id": "a", "task": "t", "input": [1], "policy": {"max_attempts": 2}},
        {"id": "b", "task": "t", "after": ["a", "a"]},
    ]})
    assert spec.steps[0].policy == RetryPolicy(max_attempts=2)
    assert spec.steps[1].after == ("a",)
    for bad in ([], {"name": "w", "steps": {}}, {"name": "w", "steps": [{"id": "a"}]},
                {"name": "w", "steps": [{"id": "a", "task": "t", "after": "a"}]},
                {"name": "w", "steps": [], "extra": 1}):
        with pytest.raises(InvalidWorkflow):
            workflow_from_document(bad)


def _runs(submitted_steps, statuses: dict[str, RunStatus]) -> tuple[list, dict[str, Run]]:  # type: ignore[no-untyped-def]
    steps, runs = [], {}
    for step in submitted_steps:
        status = statuses.get(step.step_id)
        if status is None:
            steps.append(step)
            continue
        run = evolve(
            admit(run_id=f"r-{step.step_id}", attempt_id="a", task="t", input=None, policy=None,
                  now_ms=T0).run,
            status=status, output=step.step_id,
        )
        runs[run.id] = run
        steps.append(evolve(step, status=StepStatus.ADMITTED, run_id=run.id))
    return steps, runs


def test_the_frontier_admits_ready_steps_then_finishes_the_workflow() -> None:
    submitted = submit_workflow(spec=_spec(("a", ()), ("b", ("a",)), ("c", ())), run_id="w",
                                now_ms=T0)
    workflow = submitted.change.run
    assert (workflow.owner, workflow.status) == (RunOwner.WORKFLOW, RunStatus.CREATED)
    first = decide_frontier(workflow=workflow, steps=submitted.steps, step_runs={}, now_ms=T0)
    assert [s.step_id for s in first.admit] == ["a", "c"]
    assert first.aggregate is not None
    assert first.aggregate.event.type is EventType.WORKFLOW_STARTED
    running = first.aggregate.run
    steps, runs = _runs(submitted.steps, {"a": RunStatus.SUCCEEDED, "c": RunStatus.RUNNING})
    second = decide_frontier(workflow=running, steps=steps, step_runs=runs, now_ms=T0)
    assert [s.step_id for s in second.admit] == ["b"]
    assert [after.status for _, after in second.settle] == [StepStatus.SUCCEEDED]
    assert second.aggregate is None
    steps, runs = _runs(submitted.steps, dict.fromkeys("abc", RunStatus.SUCCEEDED))
    done = decide_frontier(workflow=running, steps=steps, step_runs=runs, now_ms=T0)
    assert done.aggregate is not None
    assert done.aggregate.run.status is RunStatus.SUCCEEDED
    assert done.aggregate.run.output == {"a": "a", "b": "b", "c": "c"}


def test_a_failed_step_fails_the_workflow_and_stops_what_has_not_started() -> None:
    submitted = submit_workflow(
        spec=_spec(("a", ()), ("b", ()), ("c", ()), ("d", ("a",))), run_id="w", now_ms=T0
    )
    running = evolve(submitted.change.run, status=RunStatus.RUNNING)
    steps, runs = _runs(submitted.steps, {"a": RunStatus.FAILED, "b": RunStatus.RUNNING,
                                          "c": RunStatus.QUEUED})
    decision = decide_frontier(workflow=running, steps=steps, step_runs=runs, now_ms=T0)
    assert decision.aggregate is not None
    assert decision.aggregate.run.status is RunStatus.FAILED
    assert decision.aggregate.event.data == {"reason": "step_failed", "step": "a"}
    assert [s.step_id for s in decision.cancel] == ["c"]  # b runs on
    assert {before.step_id: after.status for before, after in decision.settle} == {
        "a": StepStatus.FAILED, "d": StepStatus.CANCELLED}
    assert decision.admit == ()


def test_policy_documents_round_trip_and_refuse_unknown_keys() -> None:
    policy = RetryPolicy(retry_on_lost=True, max_attempts=5, safety=Safety.DEDUPLICATED,
                         backoff=Backoff(initial_ms=10, multiplier=1.5, cap_ms=20, jitter=0.1))
    assert policy_from_document(policy_to_document(policy)) == policy
    assert policy_from_document(None) is None
    for bad in ({"retries": 1}, {"max_attempts": "3"}, {"backoff": {"initial": 1}},
                {"retry_on_lost": 1}, {"max_attempts": 1.5}, [1]):
        with pytest.raises(InvalidRetryPolicy):
            policy_from_document(bad)
