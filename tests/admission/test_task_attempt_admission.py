"""The claim on every store (ADR 0007): which queued Attempts a worker's claim takes. Fair
across tasks (a flood of one task starves no other; ties rotate with the store's clock),
bounded by the claim's limit and the session's capacity (counted under the session's lock, so
concurrent claims never exceed it and no Attempt is granted twice), generation-bound (a
re-claim is a new lease generation and the old fence is refused), a completion and the next
claim in one transaction, the worker's ``held`` statement, and hand-backs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from ql3.application.admission import AdmissionRequest
from ql3.application.identities import RandomIdentities
from ql3.application.worker_commands import (
    BatchOutcome,
    Completion,
    Grant,
    NoGrant,
    Rejection,
    Release,
    WorkerCommands,
)
from ql3.domain.events import EventType
from ql3.domain.fence import LeaseFence
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.scheduling_support import Runtime, WorkerDriver, runtime

TTL_S = 30.0
TTL_MS = round(TTL_S * 1000)


def _admit(rt: Runtime, task: str, count: int) -> list[str]:
    return rt.container.core.admission().submit_many(
        [AdmissionRequest(task=task) for _ in range(count)]
    )


def _tasks_of(grants: Sequence[Grant]) -> list[str]:
    return sorted(g.task for g in grants)


def _finish_all(worker: WorkerDriver) -> tuple[Completion, ...]:
    """Completions of everything the worker holds, to send with its next claim."""
    return tuple(worker.completion(run_id) for run_id in sorted(worker.fences))


def _leased(store: Any) -> list[Any]:
    with store.unit_of_work() as uow:
        return [
            lease
            for run in uow.runs.list_runs(None, 10_000)
            for lease in uow.runs.leases_of(run.id)
            if lease.status is LeaseStatus.LEASED
        ]


def _events(store: Any, run_id: str) -> list[EventType]:
    with store.unit_of_work() as uow:
        return [e.event.type for e in uow.runs.events_of(run_id)]


# --- fair across tasks ------------------------------------------------------------------------


def test_a_flood_of_one_task_does_not_starve_another(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "flood", 60)
    advance(1_000)
    _admit(rt, "rare", 3)  # admitted after the whole flood
    worker = WorkerDriver.register(rt.workers, "w1", ["flood", "rare"], capacity=2)

    served = [_tasks_of(worker.claim_all())]
    for _ in range(2):  # each claim carries the completions of the previous one
        answer = worker.claim(completions=_finish_all(worker))
        assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED] * 2
        served.append(_tasks_of(answer.grants))

    # Oldest-first across tasks would have made "rare" wait thirty claims behind the flood.
    assert served == [["flood", "rare"]] * 3


def test_a_claim_balances_the_attempts_in_flight_across_tasks(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "a", 10)
    worker = WorkerDriver.register(rt.workers, "w1", ["a", "b"], capacity=4)
    running = worker.claim_all()
    assert _tasks_of(running) == ["a"] * 4
    advance(1_000)
    _admit(rt, "b", 1)

    # One slot frees; "a" still has three in flight, "b" none.
    answer = worker.claim(completions=(worker.completion(running[0].run_id),))

    assert _tasks_of(answer.grants) == ["b"]


def test_every_task_is_served_when_tasks_outnumber_the_limit(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    tasks = [f"task{i:02d}" for i in range(12)]
    rt.container.core.admission().submit_many(
        [AdmissionRequest(task=t) for t in tasks for _ in range(3)]  # one instant: all tied
    )
    worker = WorkerDriver.register(rt.workers, "w1", tasks, capacity=64)

    served = [_tasks_of(worker.claim(limit=4).grants) for _ in range(3)]

    for claimed in served:
        assert len(claimed) == 4  # bounded by the claim's limit
        assert len(set(claimed)) == 4  # one each for four different tasks
    assert sorted(t for claimed in served for t in claimed) == tasks


def test_ties_between_tasks_rotate_with_the_clock(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    tasks = [f"task{i:02d}" for i in range(12)]
    rt.container.core.admission().submit_many([AdmissionRequest(task=t) for t in tasks])
    worker = WorkerDriver.register(rt.workers, "w1", tasks, capacity=1)

    picked = []
    for _ in range(8):  # the same tie each time, at another instant
        (grant,) = worker.claim_all()
        picked.append(grant.task)
        back = Release(fence=worker.fences.pop(grant.run_id))
        (result,) = rt.workers.release_many(worker.session_id, worker.secret, [back]).results
        assert result.outcome is BatchOutcome.RELEASED
        advance(1)

    assert len(set(picked)) > 1, picked  # no task name is always served first


# --- capacity under the session's lock --------------------------------------------------------


def _replica_store(store: Any, request: pytest.FixtureRequest) -> Any:
    """PostgreSQL: a store of its own (engine, pool) on the same database, as another node
    has. Stores whose transactions hold the whole database are shared by the threads."""
    if not type(store).__module__.startswith("ql3.adapters.postgres."):
        return store
    from ql3.adapters.postgres.store import PostgresStore

    replica = PostgresStore.from_url(request.getfixturevalue("pg_database_url"), pool_size=2)
    replica.testing_advance_clock(store.clock_offset_ms)
    request.addfinalizer(replica.close)
    return replica


def test_concurrent_claims_never_exceed_capacity_nor_grant_an_attempt_twice(
    store: Any, advance: Callable[[int], None], request: pytest.FixtureRequest
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "t", 40)
    capacities = {"w1": 3, "w2": 2}
    sessions = {w: rt.workers.register(w, c, ["t"]) for w, c in capacities.items()}
    claims = [(w, _replica_store(store, request)) for w in capacities for _ in range(3)]
    barrier = threading.Barrier(len(claims))
    granted: list[list[Grant]] = [[] for _ in claims]
    errors: list[BaseException] = []

    def claim(index: int) -> None:
        worker_id, replica = claims[index]
        commands = WorkerCommands(replica.unit_of_work, RandomIdentities(), lease_ttl_ms=TTL_MS)
        session = sessions[worker_id]
        try:
            barrier.wait()
            answer = commands.claim(session.session_id, session.secret, limit=3)
            granted[index] = list(answer.grants)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(claims))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert not errors
    by_worker = {w: [g for i, g_list in enumerate(granted) if claims[i][0] == w for g in g_list]
                 for w in capacities}
    assert {w: len(g) for w, g in by_worker.items()} == capacities
    attempt_ids = [g.attempt_id for g_list in granted for g in g_list]
    assert len(attempt_ids) == len(set(attempt_ids)) == 5
    leased = _leased(store)
    assert sorted(lease.attempt_id for lease in leased) == sorted(attempt_ids)
    holders = {s.session_id: w for w, s in sessions.items()}
    assert sorted(holders[lease.holder_session_id] for lease in leased) == [
        "w1", "w1", "w1", "w2", "w2"
    ]
    for grant in (g for g_list in granted for g in g_list):
        assert rt.run(grant.run_id).status is RunStatus.RUNNING


# --- generation-bound -------------------------------------------------------------------------


def test_a_re_claim_after_a_release_is_the_next_generation(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    (run_id,) = _admit(rt, "t", 1)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)
    (first,) = worker.claim_all()
    assert (first.generation, first.version) == (1, 1)
    old = worker.fences.pop(run_id)
    back = rt.workers.release_many(worker.session_id, worker.secret, [Release(fence=old)])
    assert [r.outcome for r in back.results] == [BatchOutcome.RELEASED]

    (second,) = worker.claim_all()

    assert (second.run_id, second.attempt_id, second.attempt_number) == (
        run_id, first.attempt_id, 1
    )
    assert (second.generation, second.version) == (2, 1)
    refused = rt.workers.complete_many(
        worker.session_id, worker.secret, [Completion(fence=old, succeeded=True)]
    ).results[0]
    assert (refused.rejection, refused.reason) == (Rejection.FENCE, "generation_mismatch")
    assert rt.run(run_id).status is RunStatus.RUNNING
    worker.finish(run_id)
    assert rt.run(run_id).status is RunStatus.SUCCEEDED


def test_a_claim_after_a_lost_attempt_is_the_next_generation(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    policy = RetryPolicy(
        retry_on_lost=True, max_attempts=2, safety=Safety.IDEMPOTENT,
        backoff=Backoff(initial_ms=0, cap_ms=0),
    )
    run_id = rt.container.core.admission().submit("t", None, policy)
    gone = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)
    (first,) = gone.claim_all()
    with store.unit_of_work() as uow:
        (lease,) = uow.runs.leases_of(run_id)
    assert (first.generation, first.version) == (lease.generation, lease.version) == (1, 1)
    rt.workers.close(gone.session_id, gone.secret)  # evidence: the worker is gone
    advance(TTL_MS + 1_000)

    summary = rt.cycle()  # lost, retried at once: Attempt 2 queued

    assert summary.step("lost_retry").counts["attempts_created"] == 1
    worker = WorkerDriver.register(rt.workers, "w2", ["t"], capacity=1)
    (second,) = worker.claim_all()
    assert (second.run_id, second.attempt_number, second.generation) == (run_id, 2, 2)
    stale = LeaseFence(attempt_id=second.attempt_id, generation=first.generation,
                       version=second.version, token=second.token)
    (refused,) = rt.workers.renew_many(worker.session_id, worker.secret, [stale]).results
    assert (refused.rejection, refused.reason) == (Rejection.FENCE, "generation_mismatch")
    worker.finish(run_id)
    assert rt.run(run_id).status is RunStatus.SUCCEEDED


# --- a completion and the next claim in one call ----------------------------------------------


class CountingFactory:
    def __init__(self, store: Any) -> None:
        self.store = store
        self.opened = 0

    def __call__(self) -> Any:
        self.opened += 1
        return self.store.unit_of_work()


def test_a_completion_and_the_next_claim_are_one_transaction(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    queued = _admit(rt, "t", 2)
    counting = CountingFactory(store)
    commands = WorkerCommands(counting, RandomIdentities(), lease_ttl_ms=TTL_MS)
    worker = WorkerDriver.register(commands, "w1", ["t"], capacity=1)
    (a,) = worker.claim_all()
    first, second = a.run_id, next(r for r in queued if r != a.run_id)
    assert worker.claim(limit=1).no_grant is NoGrant.NO_CAPACITY
    counting.opened = 0

    answer = worker.claim(completions=(worker.completion(first, output={"n": 1}),))

    assert counting.opened == 1
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    assert [g.run_id for g in answer.grants] == [second]  # the freed slot, refilled at once
    assert rt.run(first).status is RunStatus.SUCCEEDED and rt.run(first).output == {"n": 1}
    assert rt.run(second).status is RunStatus.RUNNING
    assert _events(store, first) == [
        EventType.RUN_ADMITTED, EventType.ATTEMPT_STARTED, EventType.ATTEMPT_SUCCEEDED
    ]


def test_a_draining_session_completes_but_is_granted_nothing(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "t", 3)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=2)
    a, b = worker.claim_all()
    rt.workers.drain(worker.session_id, worker.secret)

    answer = worker.claim(limit=2, completions=(worker.completion(a.run_id),))

    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    assert (answer.grants, answer.released, answer.no_grant) == (
        (), (), NoGrant.SESSION_NOT_ACTIVE
    )
    assert rt.run(a.run_id).status is RunStatus.SUCCEEDED
    assert rt.run(b.run_id).status is RunStatus.RUNNING


# --- the held statement and hand-backs ----------------------------------------------------------


def _assert_queued_again(rt: Runtime, grant: Grant) -> None:
    assert rt.run(grant.run_id).status is RunStatus.QUEUED
    with rt.store.unit_of_work() as uow:
        (attempt,) = uow.runs.attempts_of(grant.run_id)
        (lease,) = uow.runs.leases_of(grant.run_id)
    assert (attempt.id, attempt.status, attempt.is_pristine) == (
        grant.attempt_id, AttemptStatus.CLAIMED, True
    )
    assert (lease.status, lease.release_reason, lease.version) == (
        LeaseStatus.RELEASED, ReleaseReason.HANDED_BACK, 2
    )
    kinds = _events(rt.store, grant.run_id)
    assert kinds == [EventType.RUN_ADMITTED, EventType.ATTEMPT_STARTED, EventType.ATTEMPT_RELEASED]


def test_the_held_statement_releases_exactly_the_unheld_attempts(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "t", 4)
    session = rt.workers.register("w1", 4, ["t"])
    sid, secret = session.session_id, session.secret
    held, done_now, done_before, unheld = rt.workers.claim(sid, secret, limit=4).grants
    (earlier,) = rt.workers.complete_many(
        sid, secret, [Completion(fence=done_before.fence, succeeded=True)]
    ).results
    assert earlier.outcome is BatchOutcome.SUCCEEDED

    nothing = rt.workers.claim(sid, secret, limit=0, held=None)  # states nothing
    assert nothing.released == ()
    answer = rt.workers.claim(
        sid, secret, limit=0,
        completions=[Completion(fence=done_now.fence, succeeded=True)],
        held=[held.attempt_id],
    )

    assert answer.released == (unheld.attempt_id,)
    assert [r.outcome for r in answer.completed] == [BatchOutcome.SUCCEEDED]
    _assert_queued_again(rt, unheld)
    assert rt.run(held.run_id).status is RunStatus.RUNNING
    assert rt.run(done_now.run_id).status is RunStatus.SUCCEEDED
    assert rt.run(done_before.run_id).status is RunStatus.SUCCEEDED
    with store.unit_of_work() as uow:
        assert list(uow.sessions.held_by(sid)) == [held.attempt_id]
    # Claimable again, under the next generation.
    (again,) = rt.workers.claim(sid, secret, limit=4, held=[held.attempt_id]).grants
    assert (again.attempt_id, again.generation) == (unheld.attempt_id, 2)


def test_release_many_hands_back_a_started_attempt_and_an_expired_one(
    store: Any, advance: Callable[[int], None]
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_S)
    _admit(rt, "t", 2)
    session = rt.workers.register("w1", 2, ["t"])
    sid, secret = session.session_id, session.secret
    draining, expired = rt.workers.claim(sid, secret, limit=2).grants
    rt.workers.drain(sid, secret)
    (drained,) = rt.workers.release_many(
        sid, secret, [Release(fence=draining.fence, cause="draining")]
    ).results
    assert drained.outcome is BatchOutcome.RELEASED
    _assert_queued_again(rt, draining)
    advance(TTL_MS + 1_000)
    (late,) = rt.workers.release_many(sid, secret, [Release(fence=expired.fence)]).results
    assert late.outcome is BatchOutcome.RELEASED
    _assert_queued_again(rt, expired)
    assert _leased(store) == []
    # Both run elsewhere; the handed-back fences are refused.
    other = WorkerDriver.register(rt.workers, "w2", ["t"], capacity=2)
    assert sorted(g.run_id for g in other.claim_all()) == sorted(
        [draining.run_id, expired.run_id]
    )
    (refused,) = rt.workers.release_many(sid, secret, [Release(fence=draining.fence)]).results
    assert refused.rejection is Rejection.FENCE
