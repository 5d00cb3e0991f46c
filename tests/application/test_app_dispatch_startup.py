"""Task attempt admission (dispatch) and startup recovery on the memory store."""

from __future__ import annotations

from collections import Counter

from application.admission import AdmissionRequest
from domain.model import AttemptStatus, LeaseStatus, RunOwner, RunStatus
from domain.policy import Backoff, RetryPolicy, Safety
from domain.transitions import admit
from tests.application.support import (
    LEASE_TTL_MS,
    SILENCE_MS,
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


def test_dispatch_respects_session_capacity() -> None:
    svc = build_services()
    svc.admission.submit_many([AdmissionRequest(task="t") for _ in range(10)])
    small = register(svc, "w1", capacity=2)
    big = register(svc, "w2", capacity=3)
    report = svc.dispatch.run_once()
    assert report.offered == 5
    assert _leased_by(svc) == {small.session_id: 2, big.session_id: 3}
    assert svc.dispatch.run_once().offered == 0
    # Finishing one frees one slot.
    (fence, *_) = small.take_all()
    small.start(fence)
    svc.workers.complete(small.session_id, small.secret, fence, succeeded=True)
    assert svc.dispatch.run_once().offered == 1
    assert _leased_by(svc)[small.session_id] == 2


def test_silent_and_draining_sessions_get_nothing() -> None:
    svc = build_services()
    svc.admission.submit_many([AdmissionRequest(task="t") for _ in range(3)])
    silent = register(svc, "w1")
    svc.clock.advance(SILENCE_MS + 1)
    assert svc.dispatch.run_once().offered == 0
    assert silent.offers() == []  # the heartbeat makes it live again
    draining = register(svc, "w2")
    svc.workers.drain(draining.session_id, draining.secret)
    assert svc.dispatch.run_once().offered == 3
    assert len(silent.offers()) == 3
    assert draining.offers() == []


def test_sessions_only_get_their_tasks() -> None:
    svc = build_services()
    svc.admission.submit("x")
    worker = register(svc, "w1", tasks=["t"])
    assert svc.dispatch.run_once().offered == 0
    assert worker.offers() == []


def test_a_flood_of_one_task_does_not_starve_another() -> None:
    svc = build_services(dispatch_page_size=4)
    svc.admission.submit_many([AdmissionRequest(task="a") for _ in range(100)])
    b_run = svc.admission.submit("b")
    worker = register(svc, "w1", tasks=["a", "b"], capacity=4)
    svc.dispatch.run_once()
    offered_tasks = Counter(o.task for o in worker.offers())
    assert offered_tasks["b"] == 1
    assert sum(offered_tasks.values()) == 4
    assert run_view(svc.store, b_run).run.status is RunStatus.DISPATCHING


def test_dispatch_spreads_offers_over_sessions() -> None:
    svc = build_services()
    svc.admission.submit_many([AdmissionRequest(task="t") for _ in range(4)])
    one = register(svc, "w1", capacity=4)
    two = register(svc, "w2", capacity=4)
    svc.dispatch.run_once()
    assert len(one.offers()) == 2
    assert len(two.offers()) == 2


def test_each_offer_is_a_new_generation_after_a_lost_attempt() -> None:
    svc = build_services()
    policy = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT,
                         backoff=Backoff(initial_ms=0, cap_ms=0))
    run_id = svc.admission.submit("t", policy=policy)
    worker = register(svc)
    svc.dispatch.run_once()
    worker.take_all()
    svc.clock.advance(LEASE_TTL_MS + 1)
    svc.coordinator.run_cycle()  # lost -> retry_wait -> attempt 2 -> offered
    view = run_view(svc.store, run_id)
    assert [a.number for a in view.attempts] == [1, 2]
    assert [(lease.generation, lease.status) for lease in view.leases] == [
        (1, LeaseStatus.RELEASED), (2, LeaseStatus.LEASED)
    ]
    assert view.attempts[1].lease_generation == 2


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
    started = svc.admission.submit("t")
    worker = register(svc, capacity=10)
    svc.dispatch.run_once()
    fences = {f.attempt_id: f for f in worker.take_all()}
    started_attempt = current_attempt(svc.store, started).id
    worker.start(fences[started_attempt])
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
