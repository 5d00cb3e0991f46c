"""The batched worker commands: one transaction per batch, a result per item, a refused item
changes nothing and does not stop the others; the fence is never weakened."""

from __future__ import annotations

import pytest

from application.worker_commands import (
    MAX_BATCH_ITEMS,
    Abandonment,
    BatchOutcome,
    Completion,
    Rejection,
    SessionUnauthorized,
    StartStage,
    UnknownSession,
)
from domain.errors import InvalidAdmission, SessionRejected
from domain.fence import LeaseFence
from domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from tests.application.support import (
    LEASE_TTL_MS,
    Services,
    Worker,
    build_services,
    current_attempt,
    event_types,
    register,
    run_view,
    store_view,
)

TOKEN = "t" * 30


@pytest.fixture
def svc() -> Services:
    return build_services()


def _offered(svc: Services, count: int, capacity: int = 8) -> tuple[Worker, list[str]]:
    run_ids = [svc.admission.submit("t", {"i": i}) for i in range(count)]
    worker = register(svc, capacity=capacity)
    while svc.dispatch.run_once().offered:
        pass
    return worker, run_ids


def _fences(worker: Worker, token: str = TOKEN) -> list[LeaseFence]:
    return [
        LeaseFence(attempt_id=o.attempt_id, generation=o.generation, version=o.version,
                   token=f"{token}-{o.attempt_id}")
        for o in worker.offers()
    ]


def test_start_many_takes_every_offer_to_running_in_one_batch(svc: Services) -> None:
    worker, run_ids = _offered(svc, 3)
    fences = _fences(worker)
    answer = svc.workers.start_many(worker.session_id, worker.secret, fences)
    assert [r.attempt_id for r in answer.results] == [f.attempt_id for f in fences]
    assert all(r.outcome is BatchOutcome.RUNNING for r in answer.results)
    assert all(r.expires_at_ms == answer.now_ms + LEASE_TTL_MS for r in answer.results)
    for run_id in run_ids:
        assert run_view(svc.store, run_id).run.status is RunStatus.RUNNING
        assert event_types(svc.store, run_id)[-3:] == [
            "attempt_accepted", "attempt_activated", "attempt_running"
        ]
    assert worker.offers() == []


def test_start_many_repeated_with_the_same_tokens_changes_nothing(svc: Services) -> None:
    worker, _ = _offered(svc, 2)
    fences = _fences(worker)
    svc.workers.start_many(worker.session_id, worker.secret, fences)
    before = store_view(svc.store)
    again = svc.workers.start_many(worker.session_id, worker.secret, fences)
    assert [r.outcome for r in again.results] == [BatchOutcome.RUNNING] * 2
    assert store_view(svc.store) == before


def test_one_stale_fence_does_not_fail_the_others(svc: Services) -> None:
    worker, run_ids = _offered(svc, 3)
    fences = _fences(worker)
    stale = LeaseFence(attempt_id=fences[1].attempt_id, generation=fences[1].generation,
                       version=fences[1].version + 1, token=fences[1].token)
    answer = svc.workers.start_many(
        worker.session_id, worker.secret, [fences[0], stale, fences[2]]
    )
    assert [r.ok for r in answer.results] == [True, False, True]
    refused = answer.results[1]
    assert refused.rejection is Rejection.FENCE
    assert refused.reason == "version_mismatch"
    statuses = {
        rid: current_attempt(svc.store, rid).status for rid in run_ids
    }
    stale_run = next(r for r in run_ids if current_attempt(svc.store, r).id == stale.attempt_id)
    assert statuses[stale_run] is AttemptStatus.CLAIMED
    assert current_attempt(svc.store, stale_run).accepted_at_ms is None  # nothing changed
    assert sorted(s.value for s in statuses.values()) == ["claimed", "running", "running"]


def test_unknown_attempts_are_404_items_and_the_rest_goes_on(svc: Services) -> None:
    worker, _ = _offered(svc, 1)
    (fence,) = _fences(worker)
    ghost = LeaseFence(attempt_id="no-such", generation=1, version=1, token=TOKEN)
    answer = svc.workers.start_many(worker.session_id, worker.secret, [ghost, fence])
    assert answer.results[0].rejection is Rejection.UNKNOWN_ATTEMPT
    assert answer.results[1].outcome is BatchOutcome.RUNNING


def test_accept_then_activate_stages(svc: Services) -> None:
    worker, (run_id,) = _offered(svc, 1)
    (fence,) = _fences(worker)
    refused = svc.workers.start_many(worker.session_id, worker.secret, [fence],
                                     StartStage.ACTIVATED)
    assert refused.results[0].rejection is Rejection.FENCE  # not accepted yet: no token bound
    accepted = svc.workers.start_many(worker.session_id, worker.secret, [fence],
                                      StartStage.ACCEPTED)
    assert accepted.results[0].outcome is BatchOutcome.ACCEPTED
    assert run_view(svc.store, run_id).run.status is RunStatus.DISPATCHING
    assert svc.workers.start_many(worker.session_id, worker.secret, [fence],
                                  StartStage.ACCEPTED).results[0].outcome is BatchOutcome.ACCEPTED
    started = svc.workers.start_many(worker.session_id, worker.secret, [fence],
                                     StartStage.ACTIVATED)
    assert started.results[0].outcome is BatchOutcome.RUNNING
    late = svc.workers.start_many(worker.session_id, worker.secret, [fence], StartStage.ACCEPTED)
    assert late.results[0].rejection is Rejection.STATE


def test_another_token_cannot_take_an_accepted_offer(svc: Services) -> None:
    worker, _ = _offered(svc, 1)
    (fence,) = _fences(worker)
    svc.workers.start_many(worker.session_id, worker.secret, [fence], StartStage.ACCEPTED)
    thief = LeaseFence(attempt_id=fence.attempt_id, generation=fence.generation,
                       version=fence.version, token="x" * 40)
    before = store_view(svc.store)
    answer = svc.workers.start_many(worker.session_id, worker.secret, [thief])
    assert answer.results[0].reason == "token_mismatch"
    assert store_view(svc.store) == before


def test_another_session_cannot_take_an_offer(svc: Services) -> None:
    worker, _ = _offered(svc, 1)
    (fence,) = _fences(worker)
    other = register(svc, "w2")
    before = store_view(svc.store)
    answer = svc.workers.start_many(other.session_id, other.secret, [fence])
    assert answer.results[0].rejection is Rejection.FENCE
    assert store_view(svc.store) == before


def test_renew_many_moves_only_expiry(svc: Services) -> None:
    worker, run_ids = _offered(svc, 2)
    fences = _fences(worker)
    svc.workers.start_many(worker.session_id, worker.secret, fences)
    svc.clock.advance(10_000)
    events_before = {r: event_types(svc.store, r) for r in run_ids}
    answer = svc.workers.renew_many(worker.session_id, worker.secret, fences)
    assert [r.outcome for r in answer.results] == [BatchOutcome.RENEWED] * 2
    for run_id in run_ids:
        lease = run_view(svc.store, run_id).leases[-1]
        assert lease.expires_at_ms == answer.now_ms + LEASE_TTL_MS
        assert lease.version == 1
        assert event_types(svc.store, run_id) == events_before[run_id]


def test_renew_after_expiry_is_refused_per_item(svc: Services) -> None:
    worker, _ = _offered(svc, 1)
    fences = _fences(worker)
    svc.workers.start_many(worker.session_id, worker.secret, fences)
    svc.clock.advance(LEASE_TTL_MS)
    before = store_view(svc.store)
    answer = svc.workers.renew_many(worker.session_id, worker.secret, fences)
    assert answer.results[0].reason == "expired"
    assert store_view(svc.store) == before


def test_complete_many_with_outcomes_and_repeats(svc: Services) -> None:
    worker, run_ids = _offered(svc, 2)
    fences = _fences(worker)
    svc.workers.start_many(worker.session_id, worker.secret, fences)
    done = [
        Completion(fence=fences[0], succeeded=True, output={"ok": 1}),
        Completion(fence=fences[1], succeeded=False, error="boom"),
    ]
    answer = svc.workers.complete_many(worker.session_id, worker.secret, done)
    assert [r.outcome for r in answer.results] == [BatchOutcome.SUCCEEDED, BatchOutcome.FAILED]
    by_attempt = {current_attempt(svc.store, r).id: run_view(svc.store, r) for r in run_ids}
    ok, failed = by_attempt[fences[0].attempt_id], by_attempt[fences[1].attempt_id]
    assert ok.run.status is RunStatus.SUCCEEDED and ok.run.output == {"ok": 1}
    assert failed.run.status is RunStatus.FAILED and failed.run.error == "boom"
    for view in (ok, failed):
        lease = view.leases[-1]
        assert (lease.status, lease.version, lease.release_reason) == (
            LeaseStatus.RELEASED, 2, ReleaseReason.COMPLETED
        )
    before = store_view(svc.store)
    again = svc.workers.complete_many(worker.session_id, worker.secret, done)
    assert [r.outcome for r in again.results] == [BatchOutcome.ALREADY_COMPLETED] * 2
    flipped = svc.workers.complete_many(
        worker.session_id, worker.secret, [Completion(fence=fences[0], succeeded=False)]
    )
    assert flipped.results[0].rejection is Rejection.FENCE
    assert store_view(svc.store) == before


def test_abandon_many_live_and_expired(svc: Services) -> None:
    worker, run_ids = _offered(svc, 2)
    fences = _fences(worker)
    svc.workers.start_many(worker.session_id, worker.secret, fences[:1])
    svc.workers.start_many(worker.session_id, worker.secret, fences[1:])
    svc.workers.renew_many(worker.session_id, worker.secret, fences[:1])
    answer = svc.workers.abandon_many(
        worker.session_id, worker.secret, [Abandonment(fence=fences[0], detail="stopping")]
    )
    assert answer.results[0].outcome is BatchOutcome.LOST
    svc.clock.advance(LEASE_TTL_MS)
    svc.workers.close(worker.session_id, worker.secret)
    late = svc.workers.abandon_many(  # a closed session may still report what it stopped
        worker.session_id, worker.secret, [Abandonment(fence=fences[1], detail="self-fenced")]
    )
    assert late.results[0].outcome is BatchOutcome.RECORDED
    (stopped,) = [r for r in run_ids if current_attempt(svc.store, r).id == fences[1].attempt_id]
    assert "evidence_recorded" in event_types(svc.store, stopped)


def test_session_problems_fail_the_whole_batch_and_change_nothing(svc: Services) -> None:
    worker, _ = _offered(svc, 1)
    fences = _fences(worker)
    before = store_view(svc.store, [worker.session_id])
    with pytest.raises(SessionUnauthorized):
        svc.workers.start_many(worker.session_id, "wrong", fences)
    with pytest.raises(UnknownSession):
        svc.workers.start_many("nope", worker.secret, fences)
    assert store_view(svc.store, [worker.session_id]) == before
    register(svc, "w1")  # the same worker id again: the old session is replaced
    with pytest.raises(SessionRejected):
        svc.workers.start_many(worker.session_id, worker.secret, fences)


@pytest.mark.parametrize("size", [0, MAX_BATCH_ITEMS + 1])
def test_batch_bounds(svc: Services, size: int) -> None:
    worker, _ = _offered(svc, 1)
    fence = LeaseFence(attempt_id="a", generation=1, version=1, token=TOKEN)
    with pytest.raises(InvalidAdmission):
        svc.workers.renew_many(worker.session_id, worker.secret, [fence] * size)


def test_a_batch_names_each_attempt_once(svc: Services) -> None:
    worker, _ = _offered(svc, 1)
    (fence,) = _fences(worker)
    with pytest.raises(InvalidAdmission):
        svc.workers.start_many(worker.session_id, worker.secret, [fence, fence])


def test_short_tokens_are_refused_before_anything_is_read(svc: Services) -> None:
    worker, _ = _offered(svc, 1)
    (fence,) = _fences(worker)
    short = LeaseFence(attempt_id=fence.attempt_id, generation=1, version=1, token="short")
    with pytest.raises(InvalidAdmission):
        svc.workers.start_many(worker.session_id, worker.secret, [short])


def test_poll_tells_status_offers_and_time(svc: Services) -> None:
    worker, _ = _offered(svc, 2)
    answer = svc.workers.poll(worker.session_id, worker.secret)
    assert answer.status.value == "active"
    assert len(answer.offers) == 2
    assert answer.now_ms == svc.clock.now_ms()
    svc.workers.drain(worker.session_id, worker.secret)
    assert svc.workers.poll(worker.session_id, worker.secret).status.value == "draining"
