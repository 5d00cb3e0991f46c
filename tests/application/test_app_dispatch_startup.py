"""Claims (capacity, tasks, fairness, lease generations) and startup recovery on the memory
store."""

from __future__ import annotations

from collections import Counter

from ql3.application.admission import AdmissionRequest
from ql3.application.worker_commands import NoGrant
from ql3.domain.model import AttemptStatus, LeaseStatus, RunOwner, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from ql3.domain.transitions import admit
from tests.application.support import (
    LEASE_TTL_MS,
    Services,
    build_services,
    current_attempt,
    register,
    run_view,
)


def _leased_by(svc: Services) -> Counter[str]:
    held: Counter[str] = Counter()
    with svc.store.unit_of_work() as uow:
        for run in uow.runs.list_runs(None, 100_000):
            for lease in uow.runs.leases_of(run.id):
                if lease.status is LeaseStatus.LEASED:
                    held[lease.holder_session_id] += 1
    return held


def test_claims_respect_session_capacity() -> None:
    svc = build_services()
    svc.admission.submit_many([AdmissionRequest(task="t") for _ in range(10)])
    small = register(svc, "w1", capacity=2)
    big = register(svc, "w2", capacity=3)
    assert len(small.grants(limit=16)) == 2
    assert len(big.grants(limit=16)) == 3
    assert _leased_by(svc) == {small.session_id: 2, big.session_id: 3}
    full = small.claim(limit=16)
    assert (full.grants, full.no_grant) == ((), NoGrant.NO_CAPACITY)
    # Finishing one frees one slot.
    (fence, *_) = small.fences.values()
    assert small.complete(fence).ok
    assert len(small.grants(limit=16)) == 1
    assert _leased_by(svc)[small.session_id] == 2


def test_a_claim_takes_no_more_than_its_limit() -> None:
    svc = build_services()
    svc.admission.submit_many([AdmissionRequest(task="t") for _ in range(5)])
    worker = register(svc, capacity=8)
    assert len(worker.grants(limit=2)) == 2
    nothing = worker.claim(limit=0)  # a claim of nothing asks for nothing: no reason given
    assert (nothing.grants, nothing.no_grant) == ((), None)
    assert _leased_by(svc) == {worker.session_id: 2}


def test_a_draining_session_gets_nothing() -> None:
    svc = build_services()
    svc.admission.submit_many([AdmissionRequest(task="t") for _ in range(3)])
    draining = register(svc, "w2")
    svc.workers.drain(draining.session_id, draining.secret)
    answer = draining.claim(limit=4)
    assert (answer.grants, answer.no_grant) == ((), NoGrant.SESSION_NOT_ACTIVE)
    assert _leased_by(svc) == {}
    other = register(svc, "w1")
    assert len(other.grants(limit=4)) == 3


def test_sessions_only_get_their_tasks() -> None:
    svc = build_services()
    run_id = svc.admission.submit("x")
    worker = register(svc, "w1", tasks=["t"])
    answer = worker.claim(limit=4)
    assert (answer.grants, answer.no_grant) == ((), NoGrant.NOTHING_QUEUED)
    assert run_view(svc.store, run_id).run.status is RunStatus.QUEUED


def test_a_flood_of_one_task_does_not_starve_another() -> None:
    svc = build_services()
    svc.admission.submit_many([AdmissionRequest(task="a") for _ in range(100)])
    b_run = svc.admission.submit("b")
    worker = register(svc, "w1", tasks=["a", "b"], capacity=4)
    claimed_tasks = Counter(g.task for g in worker.grants(limit=4))
    assert claimed_tasks == {"a": 3, "b": 1}
    assert run_view(svc.store, b_run).run.status is RunStatus.RUNNING


def test_two_sessions_never_get_the_same_attempt() -> None:
    svc = build_services()
    run_ids = svc.admission.submit_many([AdmissionRequest(task="t") for _ in range(4)])
    one = register(svc, "w1", capacity=4)
    two = register(svc, "w2", capacity=4)
    first = [one.grants(limit=1)[0], two.grants(limit=1)[0]]
    rest = one.grants(limit=1) + two.grants(limit=4)
    granted = [g.run_id for g in first + rest]
    assert sorted(granted) == sorted(run_ids)  # each once
    assert _leased_by(svc) == {one.session_id: 2, two.session_id: 2}
    assert one.claim(limit=4).no_grant is NoGrant.NOTHING_QUEUED


def test_each_claim_is_a_new_generation_after_a_lost_attempt() -> None:
    svc = build_services()
    policy = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT,
                         backoff=Backoff(initial_ms=0, cap_ms=0))
    run_id = svc.admission.submit("t", policy=policy)
    worker = register(svc)
    (old,) = worker.take_all()
    svc.workers.close(worker.session_id, worker.secret)  # evidence: the worker is gone
    svc.clock.advance(LEASE_TTL_MS + 1)
    svc.coordinator.run_cycle()  # lost -> retry_wait -> attempt 2 queued
    assert run_view(svc.store, run_id).run.status is RunStatus.QUEUED
    back = register(svc, "w1")
    (grant,) = back.grants()
    assert (grant.run_id, grant.attempt_number, grant.generation) == (run_id, 2, 2)
    view = run_view(svc.store, run_id)
    assert [a.number for a in view.attempts] == [1, 2]
    assert [(lease.generation, lease.status) for lease in view.leases] == [
        (1, LeaseStatus.RELEASED), (2, LeaseStatus.LEASED)
    ]
    assert view.attempts[1].lease_generation == 2
    assert old.attempt_id != grant.attempt_id


# --- startup recovery ---------------------------------------------------------------------------


def _add_created_orphans(svc: Services, count: int) -> list[str]:
    ids = []
    with svc.store.unit_of_work() as uow:
        for i in range(count):
            change = admit(run_id=f"orphan-{i}", attempt_id=None, task="t", input=None,
                           policy=None, now_ms=uow.now_ms(), owner=RunOwner.RUNTIME)
            uow.runs.add(change)
            ids.append(change.run.id)
        uow.commit()
    return ids


def test_startup_gives_created_orphans_attempt_1() -> None:
    svc = build_services(page_size=4)
    orphans = _add_created_orphans(svc, 10)
    report = svc.startup.run()
    assert report.orphans_queued == 10
    for run_id in orphans:
        view = run_view(svc.store, run_id)
        assert view.run.status is RunStatus.QUEUED
        assert [a.number for a in view.attempts] == [1]
        assert view.attempts[0].is_pristine


def test_runtime_recovery_ignores_created_orphans() -> None:
    svc = build_services()
    (orphan,) = _add_created_orphans(svc, 1)
    svc.coordinator.run_cycle()
    assert run_view(svc.store, orphan).run.status is RunStatus.CREATED


def test_startup_resolves_expired_candidates_and_settles_lost_runs() -> None:
    svc = build_services(page_size=2)
    safe = RetryPolicy(retry_on_lost=True, max_attempts=2, safety=Safety.IDEMPOTENT,
                       backoff=Backoff(initial_ms=60_000, cap_ms=60_000))
    unsafe = [svc.admission.submit("t") for _ in range(3)]
    retryable = [svc.admission.submit("t", policy=safe) for _ in range(2)]
    gone = register(svc, "gone", capacity=10)
    assert len(gone.take_all()) == 5
    svc.workers.close(gone.session_id, gone.secret)  # evidence for its five Attempts
    started = svc.admission.submit("t")
    alive = register(svc, "alive", capacity=10)
    assert [g.run_id for g in alive.grants()] == [started]  # no evidence for this one
    svc.clock.advance(LEASE_TTL_MS + 1)
    report = svc.startup.run()
    assert report.recovered == 5
    assert report.awaiting_evidence == 1
    assert report.lost_failed == 3
    assert report.retries_scheduled == 2
    for run_id in unsafe:
        assert run_view(svc.store, run_id).run.status is RunStatus.FAILED
    for run_id in retryable:
        view = run_view(svc.store, run_id)
        assert view.run.status is RunStatus.RETRY_WAIT
        assert view.run.next_attempt_at_ms == svc.clock.now_ms() + 60_000
    assert current_attempt(svc.store, started).status is AttemptStatus.RUNNING
    # The next boot after the backoff creates the fresh attempts.
    svc.clock.advance(60_000)
    assert svc.startup.run().attempts_created == 2
    for run_id in retryable:
        assert run_view(svc.store, run_id).run.status is RunStatus.QUEUED


def test_startup_on_an_empty_store_does_nothing() -> None:
    svc = build_services()
    report = svc.startup.run()
    assert report.counts() == {
        "orphans_queued": 0, "recovered": 0, "awaiting_evidence": 0, "lost_failed": 0,
        "retries_scheduled": 0, "attempts_created": 0, "pages": 1,
    }
