"""Task attempt admission on every store: fair across tasks (a flood of one task starves no
other), bounded per cycle, generation-bound offers, no offers to a silent session, and never
more offers than a session's capacity, even from concurrent replicas."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from application.admission import AdmissionRequest
from application.dispatch import TaskAttemptAdmission
from application.ports import SessionCapacity
from domain.errors import FenceRejected
from domain.model import LeaseStatus
from domain.policy import Backoff, RetryPolicy, Safety
from tests.scheduling_support import Runtime, WorkerDriver, runtime

TTL_S = 30.0
SILENCE_S = 10.0


def _admit(rt: Runtime, task: str, count: int) -> list[str]:
    return rt.container.core.admission().submit_many(
        [AdmissionRequest(task=task) for _ in range(count)]
    )


def _dispatch(rt: Runtime) -> int:
    return rt.container.core.task_attempt_admission().run_once().offered


def _tasks_of(offers: Sequence[Any]) -> list[str]:
    return sorted(o.task for o in offers)


def test_a_flood_of_one_task_does_not_starve_another(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "flood", 60)
    advance(1_000)
    _admit(rt, "rare", 3)  # admitted after the whole flood
    worker = WorkerDriver.register(rt.workers, "w1", ["flood", "rare"], capacity=2)

    served = []
    for _ in range(3):
        assert _dispatch(rt) == 2
        offers = worker.start_all()
        served.append(_tasks_of(offers))
        for offer in offers:
            worker.finish(offer.run_id)

    # Oldest-first across tasks would have made "rare" wait thirty cycles behind the flood.
    assert served == [["flood", "rare"]] * 3


def test_admission_balances_the_attempts_in_flight_across_tasks(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "a", 10)
    worker = WorkerDriver.register(rt.workers, "w1", ["a", "b"], capacity=4)
    assert _dispatch(rt) == 4
    running = worker.start_all()
    advance(1_000)
    _admit(rt, "b", 1)
    worker.finish(running[0].run_id)  # one slot frees; "a" still has three in flight

    assert _dispatch(rt) == 1

    assert _tasks_of(worker.start_all()) == ["b"]


def test_every_task_is_served_when_tasks_outnumber_the_budget(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S, dispatch_page_size=4)
    tasks = [f"task{i:02d}" for i in range(12)]
    rt.container.core.admission().submit_many(
        [AdmissionRequest(task=t) for t in tasks for _ in range(3)]  # one instant: all tied
    )
    worker = WorkerDriver.register(rt.workers, "w1", tasks, capacity=64)

    served: list[list[str]] = []
    for _ in range(3):
        assert _dispatch(rt) == 4  # bounded per cycle
        served.append(_tasks_of(worker.start_all()))

    for cycle in served:
        assert len(set(cycle)) == 4  # one each for four different tasks
    assert sorted(t for cycle in served for t in cycle) == tasks


def test_offers_are_bound_to_their_lease_generation(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    policy = RetryPolicy(
        retry_on_lost=True, max_attempts=2, safety=Safety.IDEMPOTENT,
        backoff=Backoff(initial_ms=0, cap_ms=0),
    )
    run_id = rt.container.core.admission().submit("t", None, policy)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)
    assert _dispatch(rt) == 1
    (first,) = worker.heartbeat()
    with store.unit_of_work() as uow:
        (lease,) = uow.runs.leases_of(run_id)
    assert (first.generation, first.version) == (lease.generation, lease.version) == (1, 1)
    advance(round(TTL_S * 1000) + 1_000)  # the offer was never accepted: it expires

    rt.workers.heartbeat(worker.session_id, worker.secret)  # the session is alive
    summary = rt.cycle()  # lost, retried at once, offered again under generation 2

    assert summary.step("task_attempt_admission").counts["offered"] == 1
    (second,) = worker.heartbeat()
    assert (second.run_id, second.attempt_number, second.generation) == (run_id, 2, 2)
    with pytest.raises(FenceRejected):
        rt.workers.accept(worker.session_id, worker.secret, second.attempt_id,
                          first.generation, second.version, "t" * 32)
    rt.workers.accept(worker.session_id, worker.secret, second.attempt_id,
                      second.generation, second.version, "t" * 32)


def test_a_session_that_stopped_heartbeating_gets_no_new_offers(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S, session_silence_s=SILENCE_S)
    _admit(rt, "t", 2)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=4)
    advance(round(SILENCE_S * 1000) + 1)

    assert _dispatch(rt) == 0
    assert worker.heartbeat() == []  # the heartbeat makes it heard from again ...
    assert _dispatch(rt) == 2  # ... and it gets offers in the next cycle


def test_silence_is_checked_again_in_the_offers_own_transaction(
    store: Any, advance: Callable[[int], None]
) -> None:
    """A page read before the session fell silent does not get it an offer."""
    rt = runtime(store, advance, lease_ttl_s=TTL_S, session_silence_s=SILENCE_S)
    _admit(rt, "t", 2)
    WorkerDriver.register(rt.workers, "w1", ["t"], capacity=4)
    stale = list(store.available_sessions(round(SILENCE_S * 1000)))
    advance(round(SILENCE_S * 1000) + 1)

    class StalePage:
        def __getattr__(self, name: str) -> Any:
            return getattr(store, name)

        def available_sessions(self, max_silence_ms: int) -> Sequence[SessionCapacity]:
            return stale

    step = TaskAttemptAdmission(
        store.unit_of_work, StalePage(), lease_ttl_ms=30_000,
        max_silence_ms=round(SILENCE_S * 1000),
    )
    report = step.run_once()
    assert (report.offered, report.skipped) == (0, 2)


def _replica_store(store: Any, request: pytest.FixtureRequest) -> Any:
    from adapters.postgres.store import PostgresStore

    if not isinstance(store, PostgresStore):
        return store
    replica = PostgresStore.from_url(request.getfixturevalue("pg_database_url"), pool_size=2)
    replica.testing_advance_clock(store.clock_offset_ms)
    request.addfinalizer(replica.close)
    return replica


def test_concurrent_replicas_never_offer_a_session_more_than_its_capacity(
    store: Any, advance: Callable[[int], None], request: pytest.FixtureRequest
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "t", 40)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=3)
    replicas = 4
    steps = [
        TaskAttemptAdmission(s.unit_of_work, s, lease_ttl_ms=30_000, max_silence_ms=60_000)
        for s in (_replica_store(store, request) for _ in range(replicas))
    ]
    barrier = threading.Barrier(replicas)
    offered = [0] * replicas
    errors: list[BaseException] = []

    def replica(index: int) -> None:
        try:
            barrier.wait()
            offered[index] = steps[index].run_once().offered
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert not errors
    assert sum(offered) == 3
    assert len(worker.heartbeat()) == 3
    with store.unit_of_work() as uow:
        runs = uow.runs.list_runs(None, 100)
        leased = [
            lease
            for run in runs
            for lease in uow.runs.leases_of(run.id)
            if lease.status is LeaseStatus.LEASED
        ]
    assert len(leased) == 3
    assert {lease.holder_session_id for lease in leased} == {worker.session_id}
