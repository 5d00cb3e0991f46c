"""Claims take a task's highest priority first, stay fair across tasks and never grant past a
task's limit, counted across every session (ADR 0014), on every store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ql3.application.admission import AdmissionRequest
from ql3.application.task_limits import TaskLimits
from ql3.application.worker_commands import NoGrant
from tests.contract.builders import committed
from tests.scheduling_support import Runtime, WorkerDriver, runtime


def _submit(rt: Runtime, advance: Callable[[int], None], task: str, priority: int = 0) -> str:
    (run_id,) = rt.container.core.admission().submit_many(
        [AdmissionRequest(task=task, priority=priority)]
    )
    advance(1)  # the next one is younger
    return run_id


def _limits(store: Any) -> TaskLimits:
    return TaskLimits(store.unit_of_work)


def test_a_task_is_claimed_highest_priority_first_then_oldest_first(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    low = _submit(rt, advance, "t", 0)
    high = _submit(rt, advance, "t", 5)
    below = _submit(rt, advance, "t", -3)
    mid = _submit(rt, advance, "t", 1)
    high_too = _submit(rt, advance, "t", 5)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)

    order = []
    for _ in range(5):
        (grant,) = worker.claim_all()
        order.append(grant.run_id)
        worker.finish(grant.run_id)

    assert order == [high, high_too, mid, low, below]


def test_a_handed_back_attempt_keeps_its_priority(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    low = _submit(rt, advance, "t", 0)
    high = _submit(rt, advance, "t", 9)
    first = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)
    assert [g.run_id for g in first.claim_all()] == [high]
    # The answer never reached the worker: its next claim states it holds nothing.
    first.fences.clear()
    answer = first.workers.claim(first.session_id, first.secret, limit=0, held=[])
    assert list(answer.released) == [first.grants[high].attempt_id]

    second = WorkerDriver.register(rt.workers, "w2", ["t"], capacity=1)
    assert [g.run_id for g in second.claim_all()] == [high]
    assert rt.run(low).status.value == "queued"


def test_priority_does_not_break_the_fairness_across_tasks(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    urgent = [_submit(rt, advance, "a", 100) for _ in range(3)]
    plain = _submit(rt, advance, "b", 0)
    worker = WorkerDriver.register(rt.workers, "w1", ["a", "b"], capacity=2)

    granted = {g.run_id for g in worker.claim_all()}

    # The fewest in flight first: one of each task, the urgent one of a first among a's.
    assert granted == {urgent[0], plain}


def test_between_equally_loaded_tasks_the_higher_priority_head_goes_first(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    older = _submit(rt, advance, "a", 0)
    urgent = _submit(rt, advance, "b", 7)
    worker = WorkerDriver.register(rt.workers, "w1", ["a", "b"], capacity=1)

    assert [g.run_id for g in worker.claim_all()] == [urgent]
    worker.finish(urgent)
    assert [g.run_id for g in worker.claim_all()] == [older]


def test_a_limit_caps_the_grants_of_a_task_across_sessions(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    _limits(store).set("t", 2)
    runs = [_submit(rt, advance, "t") for _ in range(5)]
    one = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=4)
    two = WorkerDriver.register(rt.workers, "w2", ["t"], capacity=4)

    assert [g.run_id for g in one.claim_all()] == runs[:2]
    answer = two.claim()
    assert (answer.grants, answer.no_grant) == ((), NoGrant.NOTHING_QUEUED)

    # A completion frees a place: the next claim, of either session, takes it, no more.
    one.finish(runs[0])
    assert [g.run_id for g in two.claim_all()] == [runs[2]]
    assert one.claim_all() == []
    # The completion travels with the claim and frees its place in the same transaction.
    answer = one.claim(completions=(one.completion(runs[1]),))
    assert [g.run_id for g in answer.grants] == [runs[3]]


def test_a_limit_of_zero_grants_none_and_clearing_it_restores_the_claims(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance)
    limits = _limits(store)
    limits.set("t", 0)
    held = _submit(rt, advance, "t")
    other = _submit(rt, advance, "u")
    worker = WorkerDriver.register(rt.workers, "w1", ["t", "u"], capacity=4)

    # Another task is not held back by the limited one.
    assert [g.run_id for g in worker.claim_all()] == [other]
    assert worker.claim_all() == []

    assert limits.clear("t") is True
    assert [g.run_id for g in worker.claim_all()] == [held]


def test_raising_a_limit_lets_more_run(store: Any, advance: Callable[[int], None]) -> None:
    rt = runtime(store, advance)
    limits = _limits(store)
    limits.set("t", 1)
    runs = [_submit(rt, advance, "t") for _ in range(3)]
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=4)
    assert [g.run_id for g in worker.claim_all()] == runs[:1]
    limits.set("t", 3)
    assert [g.run_id for g in worker.claim_all()] == runs[1:]


def _clock(store: Any) -> int:
    with store.unit_of_work() as uow:
        return int(uow.now_ms())


def test_limits_are_recorded_replaced_listed_and_cleared(
    store: Any, advance: Callable[[int], None]
) -> None:
    limits = _limits(store)
    before = _clock(store)
    first = limits.set("mail", 3)
    assert (first.task, first.max_running) == ("mail", 3)
    assert before <= first.updated_at_ms <= _clock(store)  # the store's clock
    limits.set("archive", 0)
    advance(5)
    second = limits.set("mail", 1)
    assert second.updated_at_ms >= first.updated_at_ms + 5

    assert [(limit.task, limit.max_running) for limit in limits.all()] == [
        ("archive", 0),
        ("mail", 1),
    ]
    assert limits.all()[1] == second
    assert limits.clear("mail") is True
    assert limits.clear("mail") is False
    assert [limit.task for limit in limits.all()] == ["archive"]


def test_declared_limits_replace_the_recorded_ones_and_leave_the_others(store: Any) -> None:
    limits = _limits(store)
    limits.set("operator", 4)
    limits.set("declared", 9)

    changed = limits.declare({"declared": 2, "new": 1})

    assert [limit.task for limit in changed] == ["declared", "new"]
    assert {limit.task: limit.max_running for limit in limits.all()} == {
        "declared": 2,
        "new": 1,
        "operator": 4,
    }
    assert limits.declare({"declared": 2}) == []  # already so: nothing written


def test_a_claim_reads_the_limits_of_its_tasks(store: Any) -> None:
    _limits(store).set("t", 2)
    _limits(store).set("elsewhere", 1)
    rt_tasks = ("t", "u")
    with committed(store) as uow:
        from tests.contract.builders import admit_run, register

        register(uow, "s1", "w1", tasks=rt_tasks)
        admit_run(uow, "r1", task="t")
    with store.unit_of_work() as uow:
        lock = uow.runs.lock_for_claim("s1", rt_tasks, 4)
    assert dict(lock.limits) == {"t": 2}
    assert [c.run.id for c in lock.candidates] == ["r1"]
