"""The batched worker commands: one transaction per batch, a result per item, a refused item
changes nothing and does not stop the others; the fence is never weakened. A single command
is a batch of one."""

from __future__ import annotations

import pytest

from ql3.application.worker_commands import (
    MAX_BATCH_ITEMS,
    MAX_CLAIM,
    Abandonment,
    BatchOutcome,
    Completion,
    Grant,
    Rejection,
    Release,
    SessionUnauthorized,
    UnknownSession,
)
from ql3.domain.errors import InvalidAdmission, SessionRejected
from ql3.domain.fence import LeaseFence
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus, SessionStatus
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


def _claimed(svc: Services, count: int, capacity: int = 8) -> tuple[Worker, list[Grant]]:
    for i in range(count):
        svc.admission.submit("t", {"i": i})
    worker = register(svc, capacity=capacity)
    return worker, worker.grants(limit=count or 1)


def _fences(grants: list[Grant]) -> list[LeaseFence]:
    return [grant.fence for grant in grants]


def test_a_claim_starts_every_grant_in_one_call(svc: Services) -> None:
    worker, grants = _claimed(svc, 3)
    assert len(grants) == 3
    assert len({g.token for g in grants}) == 3  # a token of its own for each lease
    for grant in grants:
        assert grant.expires_at_ms == svc.clock.now_ms() + LEASE_TTL_MS
        assert run_view(svc.store, grant.run_id).run.status is RunStatus.RUNNING
        assert event_types(svc.store, grant.run_id) == ["run_admitted", "attempt_started"]
    with svc.store.unit_of_work() as uow:
        assert uow.sessions.held_by(worker.session_id) == tuple(
            sorted(g.attempt_id for g in grants)
        )


def test_a_claim_never_grants_what_the_session_already_holds(svc: Services) -> None:
    worker, _ = _claimed(svc, 2)
    before = store_view(svc.store)
    again = worker.claim(limit=8)
    assert again.grants == ()
    assert store_view(svc.store) == before


def test_one_stale_fence_does_not_fail_the_others(svc: Services) -> None:
    worker, grants = _claimed(svc, 3)
    fences = _fences(grants)
    stale = LeaseFence(attempt_id=fences[1].attempt_id, generation=fences[1].generation,
                       version=fences[1].version + 1, token=fences[1].token)
    done = [Completion(fence=f, succeeded=True) for f in (fences[0], stale, fences[2])]
    answer = svc.workers.complete_many(worker.session_id, worker.secret, done)
    assert [r.ok for r in answer.results] == [True, False, True]
    refused = answer.results[1]
    assert refused.rejection is Rejection.FENCE
    assert refused.reason == "version_mismatch"
    statuses = [run_view(svc.store, g.run_id).run.status for g in grants]
    assert statuses == [RunStatus.SUCCEEDED, RunStatus.RUNNING, RunStatus.SUCCEEDED]
    assert current_attempt(svc.store, grants[1].run_id).status is AttemptStatus.RUNNING


def test_unknown_attempts_are_404_items_and_the_rest_goes_on(svc: Services) -> None:
    worker, (grant,) = _claimed(svc, 1)
    ghost = LeaseFence(attempt_id="no-such", generation=1, version=1, token=TOKEN)
    answer = svc.workers.renew_many(worker.session_id, worker.secret, [ghost, grant.fence])
    assert answer.results[0].rejection is Rejection.UNKNOWN_ATTEMPT
    assert answer.results[1].outcome is BatchOutcome.RENEWED


def test_another_token_cannot_complete_a_claimed_attempt(svc: Services) -> None:
    worker, (grant,) = _claimed(svc, 1)
    thief = LeaseFence(attempt_id=grant.attempt_id, generation=grant.generation,
                       version=grant.version, token="x" * 40)
    before = store_view(svc.store)
    result = worker.complete(thief)
    assert (result.rejection, result.reason) == (Rejection.FENCE, "token_mismatch")
    assert store_view(svc.store) == before


def test_another_session_cannot_use_a_grant(svc: Services) -> None:
    _, grants = _claimed(svc, 1)
    other = register(svc, "w2")
    before = store_view(svc.store)
    answer = svc.workers.renew_many(other.session_id, other.secret, _fences(grants))
    assert answer.results[0].rejection is Rejection.FENCE
    assert store_view(svc.store) == before


def test_renew_many_moves_only_expiry(svc: Services) -> None:
    worker, grants = _claimed(svc, 2)
    svc.clock.advance(10_000)
    events_before = {g.run_id: event_types(svc.store, g.run_id) for g in grants}
    answer = svc.workers.renew_many(worker.session_id, worker.secret, _fences(grants))
    assert [r.outcome for r in answer.results] == [BatchOutcome.RENEWED] * 2
    for grant in grants:
        lease = run_view(svc.store, grant.run_id).leases[-1]
        assert lease.expires_at_ms == answer.now_ms + LEASE_TTL_MS
        assert lease.version == 1
        assert event_types(svc.store, grant.run_id) == events_before[grant.run_id]


def test_renew_after_expiry_is_refused_per_item(svc: Services) -> None:
    worker, grants = _claimed(svc, 1)
    svc.clock.advance(LEASE_TTL_MS)
    before = store_view(svc.store)
    answer = svc.workers.renew_many(worker.session_id, worker.secret, _fences(grants))
    assert answer.results[0].reason == "expired"
    assert store_view(svc.store) == before


def test_complete_many_with_outcomes_and_repeats(svc: Services) -> None:
    worker, grants = _claimed(svc, 2)
    fences = _fences(grants)
    done = [
        Completion(fence=fences[0], succeeded=True, output={"ok": 1}),
        Completion(fence=fences[1], succeeded=False, error="boom"),
    ]
    answer = svc.workers.complete_many(worker.session_id, worker.secret, done)
    assert [r.outcome for r in answer.results] == [BatchOutcome.SUCCEEDED, BatchOutcome.FAILED]
    ok, failed = (run_view(svc.store, g.run_id) for g in grants)
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
    worker, grants = _claimed(svc, 2)
    fences = _fences(grants)
    svc.clock.advance(LEASE_TTL_MS // 2)
    assert worker.renew(fences[0]).ok  # the first lease outlives the second
    answer = svc.workers.abandon_many(
        worker.session_id, worker.secret, [Abandonment(fence=fences[0], detail="stopping")]
    )
    assert answer.results[0].outcome is BatchOutcome.LOST
    svc.clock.advance(LEASE_TTL_MS // 2)
    svc.workers.close(worker.session_id, worker.secret)
    late = svc.workers.abandon_many(  # a closed session may still report what it stopped
        worker.session_id, worker.secret, [Abandonment(fence=fences[1], detail="self-fenced")]
    )
    assert late.results[0].outcome is BatchOutcome.RECORDED
    assert "evidence_recorded" in event_types(svc.store, grants[1].run_id)
    assert current_attempt(svc.store, grants[1].run_id).status is AttemptStatus.RUNNING


# --- release_many: handing back what never began ---------------------------------------------


def _assert_handed_back(svc: Services, grant: Grant, cause: str) -> None:
    view = run_view(svc.store, grant.run_id)
    assert view.run.status is RunStatus.QUEUED
    (attempt,) = view.attempts  # the same Attempt, pristine again: no lost verdict
    assert attempt.id == grant.attempt_id and attempt.number == 1
    assert attempt.status is AttemptStatus.CLAIMED and attempt.is_pristine
    (lease,) = view.leases
    assert (lease.status, lease.release_reason, lease.version) == (
        LeaseStatus.RELEASED, ReleaseReason.HANDED_BACK, grant.version + 1
    )
    assert [e[1] for e in view.events] == ["run_admitted", "attempt_started", "attempt_released"]
    assert view.events[-1][3]["cause"] == cause
    assert view.events[-1][3]["previous_status"] == "running"


def test_release_many_hands_back_a_started_attempt_on_drain(svc: Services) -> None:
    worker, grants = _claimed(svc, 2)
    svc.workers.drain(worker.session_id, worker.secret)
    answer = svc.workers.release_many(
        worker.session_id, worker.secret, [Release(fence=grants[0].fence, cause="draining")]
    )
    assert [r.outcome for r in answer.results] == [BatchOutcome.RELEASED]
    _assert_handed_back(svc, grants[0], "draining")
    assert run_view(svc.store, grants[1].run_id).run.status is RunStatus.RUNNING
    # Handed back, it is claimed again by another session under the next generation.
    other = register(svc, "w2")
    (again,) = other.grants()
    assert (again.attempt_id, again.generation, again.version) == (grants[0].attempt_id, 2, 1)
    before = store_view(svc.store)
    for result in (worker.complete(grants[0].fence), worker.release(grants[0].fence)):
        assert result.rejection is Rejection.FENCE
    assert store_view(svc.store) == before


def test_release_many_works_on_an_expired_lease(svc: Services) -> None:
    worker, (grant,) = _claimed(svc, 1)
    svc.clock.advance(LEASE_TTL_MS + 1)
    assert worker.renew(grant.fence).reason == "expired"
    assert worker.release(grant.fence, cause="self_fenced").outcome is BatchOutcome.RELEASED
    _assert_handed_back(svc, grant, "self_fenced")
    assert svc.recovery.run_once().examined == 0  # nothing is left for recovery


def test_release_many_needs_the_exact_fence_and_a_held_lease(svc: Services) -> None:
    worker, grants = _claimed(svc, 2)
    assert worker.complete(grants[1].fence).ok
    before = store_view(svc.store)
    results = {
        "version": worker.release(LeaseFence(
            attempt_id=grants[0].attempt_id, generation=1, version=2, token=grants[0].token
        )),
        "token": worker.release(LeaseFence(
            attempt_id=grants[0].attempt_id, generation=1, version=1, token=TOKEN
        )),
        "completed": worker.release(grants[1].fence),
    }
    assert {k: (r.rejection, r.reason) for k, r in results.items()} == {
        "version": (Rejection.FENCE, "version_mismatch"),
        "token": (Rejection.FENCE, "token_mismatch"),
        "completed": (Rejection.FENCE, "version_mismatch"),
    }
    assert store_view(svc.store) == before


def test_release_many_after_the_release_changes_nothing(svc: Services) -> None:
    worker, (grant,) = _claimed(svc, 1)
    assert worker.release(grant.fence).ok
    before = store_view(svc.store)
    again = worker.release(grant.fence)
    assert (again.rejection, again.reason) == (Rejection.FENCE, "version_mismatch")
    assert store_view(svc.store) == before


# --- whole batches ------------------------------------------------------------------------------


def test_session_problems_fail_the_whole_batch_and_change_nothing(svc: Services) -> None:
    worker, grants = _claimed(svc, 1)
    fences = _fences(grants)
    done = [Completion(fence=f, succeeded=True) for f in fences]
    before = store_view(svc.store, [worker.session_id])
    with pytest.raises(SessionUnauthorized):
        svc.workers.complete_many(worker.session_id, "wrong", done)
    with pytest.raises(UnknownSession):
        svc.workers.renew_many("nope", worker.secret, fences)
    with pytest.raises(SessionUnauthorized):
        svc.workers.claim(worker.session_id, "wrong", limit=1, completions=done, held=[])
    assert store_view(svc.store, [worker.session_id]) == before
    register(svc, "w1")  # the same worker id again: the old session is replaced
    with pytest.raises(SessionRejected):
        svc.workers.complete_many(worker.session_id, worker.secret, done)
    with pytest.raises(SessionRejected):
        svc.workers.release_many(worker.session_id, worker.secret, [Release(fence=fences[0])])


@pytest.mark.parametrize("size", [0, MAX_BATCH_ITEMS + 1])
def test_batch_bounds(svc: Services, size: int) -> None:
    worker, _ = _claimed(svc, 1)
    fences = [
        LeaseFence(attempt_id=f"a{i}", generation=1, version=1, token=TOKEN) for i in range(size)
    ]
    with pytest.raises(InvalidAdmission):
        svc.workers.renew_many(worker.session_id, worker.secret, fences)


def test_a_batch_names_each_attempt_once(svc: Services) -> None:
    worker, (grant,) = _claimed(svc, 1)
    before = store_view(svc.store)
    done = Completion(fence=grant.fence, succeeded=True)
    with pytest.raises(InvalidAdmission):
        svc.workers.complete_many(worker.session_id, worker.secret, [done, done])
    with pytest.raises(InvalidAdmission):
        svc.workers.claim(worker.session_id, worker.secret, limit=1, completions=[done, done])
    assert store_view(svc.store) == before


@pytest.mark.parametrize("limit", [-1, MAX_CLAIM + 1])
def test_claim_bounds(svc: Services, limit: int) -> None:
    worker, _ = _claimed(svc, 0)
    svc.admission.submit("t")
    before = store_view(svc.store)
    with pytest.raises(InvalidAdmission):
        worker.claim(limit=limit)
    with pytest.raises(InvalidAdmission):
        worker.claim(limit=1, held=[f"a{i}" for i in range(MAX_CLAIM * 4 + 1)])
    assert store_view(svc.store) == before


def test_poll_tells_status_and_time(svc: Services) -> None:
    worker, _ = _claimed(svc, 2)
    svc.clock.advance(1_234)
    answer = svc.workers.poll(worker.session_id, worker.secret)
    assert (answer.status, answer.now_ms) == (SessionStatus.ACTIVE, svc.clock.now_ms())
    with svc.store.unit_of_work() as uow:
        session = uow.sessions.get(worker.session_id)
    assert session is not None and session.last_heartbeat_at_ms == svc.clock.now_ms()
    svc.workers.drain(worker.session_id, worker.secret)
    assert svc.workers.poll(worker.session_id, worker.secret).status is SessionStatus.DRAINING
