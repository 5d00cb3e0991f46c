"""The candidate sources (recovery, lost retry, startup), the dispatch gate, and what a claim
locks: :meth:`RunRepository.lock_for_claim` (ADR 0007)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from attrs import evolve

from ql3.application.ports import (
    HARD_PAGE_CAP,
    OPEN_GATE,
    ClaimLock,
    DispatchGate,
    Page,
    RecoveryCandidate,
    SessionCapacity,
    Snapshot,
)
from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import (
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunOwner,
    RunStatus,
)
from ql3.domain.transitions import Change, cancel
from tests.contract.builders import (
    OTHER_TASK,
    RETRY_DELAY_MS,
    TASK,
    TTL_MS,
    attempt_id_of,
    claim_attempt,
    close_session,
    committed,
    drain_session,
    finish,
    first_attempt,
    given_created,
    given_legacy,
    given_lost,
    given_offered,
    given_queued,
    given_retry_wait,
    given_session,
    given_started,
    hand_back,
    locked_attempt,
    locked_run,
    lose,
    next_attempt,
    register,
    report_stop,
    settle,
)

Advance = Callable[[int], None]
LONG_AGO = 10 * TTL_MS

PAGED_SOURCES: dict[str, Callable[[Any, int], Page[Any]]] = {
    "recovery_candidates": lambda store, limit: store.recovery_candidates(limit),
    "lost_runs": lambda store, limit: store.lost_runs(limit),
    "due_retries": lambda store, limit: store.due_retries(limit),
    "orphaned_runs": lambda store, limit: store.orphaned_runs(limit),
}


def _event(run_id: str, attempt_id: str, now: int) -> RunEvent:
    return RunEvent(run_id=run_id, attempt_id=attempt_id, type=EventType.ATTEMPT_OFFERED, at_ms=now)


def given_dispatching_without_lease(store: Any, run_id: str, session_id: str) -> str:
    """An Attempt that was offered under ADR 0005 (generation 1) but whose lease row is
    missing."""
    attempt_id = given_queued(store, run_id)
    with committed(store) as uow:
        before = locked_attempt(uow, attempt_id)
        assert before.attempt is not None
        now = uow.now_ms()
        change = Change(
            run=evolve(before.run, status=RunStatus.DISPATCHING, updated_at_ms=now),
            attempts=(
                evolve(
                    before.attempt,
                    session_id=session_id,
                    worker_id=f"w{session_id}",
                    lease_generation=1,
                    lease_version=1,
                    offered_at_ms=now,
                    updated_at_ms=now,
                ),
            ),
            lease=None,
            event=_event(run_id, attempt_id, now),
        )
        uow.runs.apply(before, change)
    return attempt_id


def release_lease_only(store: Any, attempt_id: str) -> None:
    """Release the Attempt's own lease and leave the Attempt as it is."""
    with committed(store) as uow:
        before = locked_attempt(uow, attempt_id)
        assert before.lease is not None
        now = uow.now_ms()
        released = evolve(
            before.lease,
            status=LeaseStatus.RELEASED,
            version=before.lease.version + 1,
            release_reason=ReleaseReason.CANCELLED,
            released_at_ms=now,
        )
        change = Change(
            run=before.run,
            attempts=(),
            lease=released,
            event=_event(before.run.id, attempt_id, now),
        )
        uow.runs.apply(before, change)


def candidate_ids(page: Page[RecoveryCandidate]) -> list[str]:
    return [c.run_id for c in page.items]


# --- limits and the clock, for every paged source ----------------------------------------------


@pytest.mark.parametrize("source", PAGED_SOURCES, ids=list(PAGED_SOURCES))
@pytest.mark.parametrize("limit", [0, -1, HARD_PAGE_CAP + 1, 1_000])
def test_page_limits_outside_one_to_the_hard_cap_are_refused(
    store: Any, source: str, limit: int
) -> None:
    with pytest.raises(ValueError):
        PAGED_SOURCES[source](store, limit)


@pytest.mark.parametrize("source", PAGED_SOURCES, ids=list(PAGED_SOURCES))
@pytest.mark.parametrize("limit", [1, HARD_PAGE_CAP])
def test_page_limits_within_bounds_are_accepted(store: Any, source: str, limit: int) -> None:
    page = PAGED_SOURCES[source](store, limit)
    assert page.items == ()
    assert page.has_more is False


@pytest.mark.parametrize("source", PAGED_SOURCES, ids=list(PAGED_SOURCES))
def test_observed_at_is_the_store_clock(store: Any, advance: Advance, source: str) -> None:
    with store.unit_of_work() as uow:
        low = uow.now_ms()
    page = PAGED_SOURCES[source](store, 16)
    with store.unit_of_work() as uow:
        high = uow.now_ms()
    assert low <= page.observed_at_ms <= high

    advance(7_000)
    later = PAGED_SOURCES[source](store, 16)
    assert later.observed_at_ms >= page.observed_at_ms + 7_000


# --- recovery_candidates -----------------------------------------------------------------------


def test_pristine_created_and_settled_work_is_never_a_recovery_candidate(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    given_queued(store, "r1")  # pristine claimed Attempt
    given_created(store, "r2")  # startup-only orphan
    given_lost(store, "r3", "s1")  # Attempt already lost
    done = given_started(store, "r4", "s1")
    with committed(store) as uow:
        finish(uow, done)  # succeeded
    advance(LONG_AGO)
    assert store.recovery_candidates(16).items == ()


def test_a_legacy_offer_is_a_candidate_only_once_its_lease_expired(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    attempt_id = given_offered(store, "r1", "s1", ttl_ms=10_000)
    assert store.recovery_candidates(16).items == ()

    advance(10_001)
    page = store.recovery_candidates(16)
    with store.unit_of_work() as uow:
        lease = locked_attempt(uow, attempt_id).lease
    assert lease is not None
    assert page.items == (
        RecoveryCandidate(
            run_id="r1",
            attempt_id=attempt_id,
            attempt_status=AttemptStatus.CLAIMED,
            lease_expires_at_ms=lease.expires_at_ms,
            resolvable=True,
        ),
    )
    assert page.has_more is False
    assert lease.expires_at_ms <= page.observed_at_ms


@pytest.mark.parametrize(
    "evidence", ["none", "stop_report", "session_closed", "session_replaced", "session_drained"]
)
def test_a_started_attempt_is_resolvable_only_with_not_running_evidence(
    store: Any, advance: Advance, evidence: str
) -> None:
    given_session(store, "s1", "w1")
    attempt_id = given_started(store, "r1", "s1", ttl_ms=10_000)
    advance(TTL_MS + 1)
    with committed(store) as uow:
        if evidence == "stop_report":
            report_stop(uow, attempt_id, EvidenceKind.WORKER_ABANDONED)
        elif evidence == "session_closed":
            close_session(uow, "s1")
        elif evidence == "session_replaced":
            register(uow, "s2", "w1")
        elif evidence == "session_drained":
            drain_session(uow, "s1")

    (candidate,) = store.recovery_candidates(16).items
    assert candidate.attempt_id == attempt_id
    assert candidate.attempt_status is AttemptStatus.RUNNING
    assert candidate.resolvable is (evidence not in {"none", "session_drained"})


@pytest.mark.parametrize("stage", ["accepted", "starting"])
def test_legacy_rows_are_candidates_once_their_lease_expired(
    store: Any, advance: Advance, stage: str
) -> None:
    """Rows the offer protocol of ADR 0005 left: an accepted offer is resolvable on expiry
    alone (it never started); an activated one needs evidence like any started Attempt."""
    given_session(store, "s1")
    attempt_id = given_legacy(store, "r1", "s1", ttl_ms=10_000, stage=stage)
    assert store.recovery_candidates(16).items == ()
    advance(10_001)
    (candidate,) = store.recovery_candidates(16).items
    assert candidate.attempt_id == attempt_id
    expected = AttemptStatus.CLAIMED if stage == "accepted" else AttemptStatus.STARTING
    assert candidate.attempt_status is expected
    assert candidate.resolvable is (stage == "accepted")


def test_a_handed_back_attempt_is_no_candidate(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1", ttl_ms=10_000)
    with committed(store) as uow:
        hand_back(uow, attempt_id)
        close_session(uow, "s1")
    advance(LONG_AGO)
    assert store.recovery_candidates(16).items == ()
    assert store.lost_runs(16).items == ()


def test_a_running_attempt_with_a_live_lease_is_not_a_candidate(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    given_started(store, "r1", "s1")
    with committed(store) as uow:
        close_session(uow, "s1")  # evidence alone does not make a candidate
    assert store.recovery_candidates(16).items == ()
    advance(TTL_MS + 1)
    assert candidate_ids(store.recovery_candidates(16)) == ["r1"]


@pytest.mark.parametrize("stage", ["offered", "started"])
def test_workflow_owned_runs_are_never_candidates(store: Any, advance: Advance, stage: str) -> None:
    given_session(store, "s1")
    if stage == "offered":
        given_offered(store, "r1", "s1", owner=RunOwner.WORKFLOW)
    else:
        given_started(store, "r1", "s1", owner=RunOwner.WORKFLOW)
    with committed(store) as uow:
        close_session(uow, "s1")
    advance(LONG_AGO)
    assert store.recovery_candidates(16).items == ()
    assert store.lost_runs(16).items == ()


def test_a_missing_lease_makes_a_candidate_without_expiry(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_dispatching_without_lease(store, "r1", "s1")
    (candidate,) = store.recovery_candidates(16).items
    assert candidate.attempt_id == attempt_id
    assert candidate.lease_expires_at_ms is None
    assert candidate.resolvable is True


def test_a_released_own_lease_makes_a_candidate_before_it_expires(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    release_lease_only(store, attempt_id)
    with store.unit_of_work() as uow:
        lease = uow.runs.leases_of("r1")[0]
    page = store.recovery_candidates(16)
    (candidate,) = page.items
    assert candidate.attempt_id == attempt_id
    assert candidate.lease_expires_at_ms == lease.expires_at_ms
    assert lease.expires_at_ms > page.observed_at_ms  # not expired, but released
    assert candidate.resolvable is False


def test_resolvable_candidates_come_first_then_by_expiry_missing_first(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    # Unresolvable (started, no evidence): ra expires after re.
    given_started(store, "ra", "s1", ttl_ms=20_000)
    given_started(store, "re", "s1", ttl_ms=10_000)
    # Resolvable: rb (claimed) expires after rc (started, the worker reported it stopped);
    # rd has no lease at all.
    given_offered(store, "rb", "s1", ttl_ms=40_000)
    rc = given_started(store, "rc", "s1", ttl_ms=30_000)
    with committed(store) as uow:
        report_stop(uow, rc)
    given_dispatching_without_lease(store, "rd", "s1")
    advance(LONG_AGO)

    page = store.recovery_candidates(16)
    assert candidate_ids(page) == ["rd", "rc", "rb", "re", "ra"]
    assert [c.resolvable for c in page.items] == [True, True, True, False, False]
    expiries = [c.lease_expires_at_ms for c in page.items]
    assert expiries[0] is None
    assert expiries[1] is not None and expiries[2] is not None and expiries[1] < expiries[2]
    assert expiries[3] is not None and expiries[4] is not None and expiries[3] < expiries[4]


def test_candidates_with_equal_standing_are_ordered_by_expiry_then_attempt_id(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    for run_id in ("rc", "ra", "rb"):
        given_offered(store, run_id, "s1", ttl_ms=10_000)
    advance(LONG_AGO)
    with store.unit_of_work() as uow:
        expected = sorted(
            (uow.runs.leases_of(run_id)[0].expires_at_ms, attempt_id_of(run_id))
            for run_id in ("ra", "rb", "rc")
        )
    page = store.recovery_candidates(16)
    assert [c.attempt_id for c in page.items] == [attempt_id for _, attempt_id in expected]


def test_recovery_pages_read_limit_plus_one(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    for run_id in ("r1", "r2", "r3"):
        given_offered(store, run_id, "s1", ttl_ms=10_000)
        advance(1_000)
    advance(LONG_AGO)

    full = store.recovery_candidates(3)
    assert candidate_ids(full) == ["r1", "r2", "r3"] and full.has_more is False
    short = store.recovery_candidates(2)
    assert candidate_ids(short) == ["r1", "r2"] and short.has_more is True
    one = store.recovery_candidates(1)
    assert candidate_ids(one) == ["r1"] and one.has_more is True


def test_reading_candidates_changes_nothing(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    attempt_id = given_offered(store, "r1", "s1", ttl_ms=10_000)
    advance(LONG_AGO)
    with store.unit_of_work() as uow:
        before = locked_attempt(uow, attempt_id)
        events = len(uow.runs.events_of("r1"))
    assert len(store.recovery_candidates(16).items) == 1
    with store.unit_of_work() as uow:
        assert locked_attempt(uow, attempt_id) == before
        assert len(uow.runs.events_of("r1")) == events


# --- lost_runs ---------------------------------------------------------------------------------


def test_lost_runs_are_runtime_owned_lost_runs_oldest_first(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    given_lost(store, "r2", "s1")
    advance(1_000)
    given_lost(store, "r1", "s1")
    given_lost(store, "r3", "s1", owner=RunOwner.WORKFLOW)
    given_offered(store, "r4", "s1")
    given_retry_wait(store, "r5", "s1")

    page = store.lost_runs(16)
    with store.unit_of_work() as uow:
        updated = {r: uow.runs.get_run(r).updated_at_ms for r in ("r1", "r2")}
    assert [(c.run_id, c.attempt_id, c.since_ms) for c in page.items] == [
        ("r2", attempt_id_of("r2"), updated["r2"]),
        ("r1", attempt_id_of("r1"), updated["r1"]),
    ]
    assert page.has_more is False
    short = store.lost_runs(1)
    assert [c.run_id for c in short.items] == ["r2"] and short.has_more is True


def test_a_lost_run_names_its_latest_attempt(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    given_retry_wait(store, "r1", "s1")
    advance(RETRY_DELAY_MS)
    with committed(store) as uow:
        next_attempt(uow, "r1")
    with committed(store) as uow:
        claim_attempt(uow, attempt_id_of("r1", 2), "s1")
    with committed(store) as uow:
        lose(uow, attempt_id_of("r1", 2), EvidenceKind.WORKER_ABANDONED)

    (candidate,) = store.lost_runs(16).items
    assert candidate.attempt_id == attempt_id_of("r1", 2)


# --- due_retries -------------------------------------------------------------------------------


def test_a_retry_is_due_when_the_store_clock_reaches_it(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    given_retry_wait(store, "r1", "s1")
    assert store.due_retries(16).items == ()
    with store.unit_of_work() as uow:
        due_at = uow.runs.get_run("r1").next_attempt_at_ms
    assert due_at is not None

    advance(RETRY_DELAY_MS)
    page = store.due_retries(16)
    assert [(c.run_id, c.attempt_id, c.since_ms) for c in page.items] == [
        ("r1", attempt_id_of("r1"), due_at)
    ]
    assert due_at <= page.observed_at_ms
    assert store.lost_runs(16).items == ()


def test_due_retries_come_earliest_first_with_limit_plus_one(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    given_retry_wait(store, "r3", "s1")
    advance(1_000)
    given_retry_wait(store, "r1", "s1")
    advance(1_000)
    given_retry_wait(store, "r2", "s1")
    advance(RETRY_DELAY_MS + 2_000)

    page = store.due_retries(16)
    assert [c.run_id for c in page.items] == ["r3", "r1", "r2"]
    dues = [c.since_ms for c in page.items]
    assert dues == sorted(dues)
    short = store.due_retries(2)
    assert [c.run_id for c in short.items] == ["r3", "r1"] and short.has_more is True


def test_due_retries_skip_workflow_owned_and_started_runs(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    given_retry_wait(store, "r1", "s1")
    given_created(store, "r2", owner=RunOwner.WORKFLOW)
    with committed(store) as uow:
        before = locked_run(uow, "r2")
        now = uow.now_ms()
        parked = evolve(
            before.run, status=RunStatus.RETRY_WAIT, next_attempt_at_ms=now, updated_at_ms=now
        )
        uow.runs.apply(
            before,
            Change(
                run=parked,
                attempts=(),
                lease=None,
                event=RunEvent(
                    run_id="r2", attempt_id=None, type=EventType.RETRY_SCHEDULED, at_ms=now
                ),
            ),
        )
    advance(RETRY_DELAY_MS)
    assert [c.run_id for c in store.due_retries(16).items] == ["r1"]

    with committed(store) as uow:
        next_attempt(uow, "r1")  # queued again: no longer waiting
    assert store.due_retries(16).items == ()


def test_a_run_that_failed_instead_of_retrying_is_in_no_source(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    given_lost(store, "r1", "s1")  # no policy
    with committed(store) as uow:
        change = settle(uow, "r1")
    assert change.run.status is RunStatus.FAILED
    advance(LONG_AGO)
    for source in PAGED_SOURCES.values():
        assert source(store, 16).items == ()


# --- orphaned_runs -----------------------------------------------------------------------------


def test_orphaned_runs_are_runtime_owned_created_runs_oldest_first(
    store: Any, advance: Advance
) -> None:
    given_created(store, "r2")
    advance(1_000)
    given_created(store, "r1")
    advance(1_000)
    given_created(store, "r3")
    given_created(store, "r4", owner=RunOwner.WORKFLOW)
    given_queued(store, "r5")
    given_created(store, "r6")
    with committed(store) as uow:
        first_attempt(uow, "r6")  # queued now

    page = store.orphaned_runs(16)
    with store.unit_of_work() as uow:
        created = {r: uow.runs.get_run(r).created_at_ms for r in ("r1", "r2", "r3")}
    assert [(c.run_id, c.attempt_id, c.since_ms) for c in page.items] == [
        ("r2", None, created["r2"]),
        ("r1", None, created["r1"]),
        ("r3", None, created["r3"]),
    ]
    assert page.has_more is False
    short = store.orphaned_runs(2)
    assert [c.run_id for c in short.items] == ["r2", "r1"] and short.has_more is True


# --- the dispatch gate ------------------------------------------------------------------------


def _set_gate(store: Any, open_: bool, reason: str | None) -> DispatchGate:
    with committed(store) as uow:
        gate = DispatchGate(open=open_, reason=reason, changed_at_ms=uow.now_ms())
        uow.gate.set(gate)
    return gate


def test_the_gate_is_open_by_default(store: Any) -> None:
    gate = store.dispatch_gate()
    assert gate.open is True and gate.reason is None
    with store.unit_of_work() as uow:
        assert uow.runs.lock_for_claim("nobody", [TASK], 1).gate.open is True


def test_a_closed_gate_keeps_its_reason_until_it_is_opened(store: Any, advance: Advance) -> None:
    closed = _set_gate(store, False, "runtime_recovery failed: OperationalError")
    assert store.dispatch_gate() == closed
    with store.unit_of_work() as uow:
        assert uow.runs.lock_for_claim("nobody", [TASK], 1).gate == closed
    advance(1_000)
    opened = _set_gate(store, True, None)
    assert opened.changed_at_ms is not None and closed.changed_at_ms is not None
    assert opened.changed_at_ms >= closed.changed_at_ms + 1_000
    assert store.dispatch_gate() == opened


def test_a_rolled_back_gate_change_leaves_the_gate_as_it_was(store: Any) -> None:
    closed = _set_gate(store, False, "lost_retry failed: timeout")
    with store.unit_of_work() as uow:
        uow.gate.set(DispatchGate(open=True, reason=None, changed_at_ms=uow.now_ms()))
        # the transaction sees its own write
        assert uow.runs.lock_for_claim("nobody", [TASK], 1).gate.open is True
    assert store.dispatch_gate() == closed
    with pytest.raises(RuntimeError), store.unit_of_work() as uow:
        uow.gate.set(OPEN_GATE)
        raise RuntimeError("boom")
    assert store.dispatch_gate() == closed


# --- lock_for_claim ----------------------------------------------------------------------------


def _claim_lock(store: Any, session_id: str, tasks: list[str], limit: int) -> ClaimLock:
    with store.unit_of_work() as uow:
        return uow.runs.lock_for_claim(session_id, tasks, limit)


def _by_task(lock: ClaimLock) -> dict[str, list[str]]:
    """The candidates' run ids per task, in the order given."""
    found: dict[str, list[str]] = {}
    for snapshot in lock.candidates:
        found.setdefault(snapshot.run.task, []).append(snapshot.run.id)
    return found


def test_lock_for_claim_gives_the_session_with_its_leased_leases(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1", "w1")  # capacity 4
    given_session(store, "s2", "w2")
    given_started(store, "r1", "s1")
    given_started(store, "r2", "s1", ttl_ms=1_000)  # leased, and expired below
    given_legacy(store, "r3", "s1", stage="offered")  # leased, bound to no token
    given_lost(store, "r4", "s1")  # released
    done = given_started(store, "r5", "s1")
    back = given_started(store, "r6", "s1")
    given_started(store, "r7", "s2")
    with committed(store) as uow:
        finish(uow, done)
        hand_back(uow, back)
    advance(2_000)

    lock = _claim_lock(store, "s1", [TASK], 1)
    with store.unit_of_work() as uow:
        session = uow.sessions.get("s1")
    assert lock.capacity == SessionCapacity(session=session, in_flight=3)
    assert lock.capacity.free == 1
    other = _claim_lock(store, "s2", [TASK], 1)
    assert other.capacity is not None and other.capacity.in_flight == 1
    assert _claim_lock(store, "nobody", [TASK], 1).capacity is None


def test_lock_for_claim_counts_the_transactions_own_writes(store: Any) -> None:
    given_session(store, "s1", "w1")
    attempt_id = given_queued(store, "r1")
    with store.unit_of_work() as uow:
        claim_attempt(uow, attempt_id, "s1")
        lock = uow.runs.lock_for_claim("s1", [TASK], 4)
        assert lock.capacity is not None and lock.capacity.in_flight == 1
        assert lock.candidates == ()
    lock = _claim_lock(store, "s1", [TASK], 4)
    assert lock.capacity is not None and lock.capacity.in_flight == 0
    assert [s.run.id for s in lock.candidates] == ["r1"]


def test_candidates_are_the_oldest_of_each_task_at_most_the_limit_each(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1", "w1")
    for run_id, task in [
        ("m3", TASK),
        ("p2", OTHER_TASK),
        ("m1", TASK),
        ("p1", OTHER_TASK),
        ("m2", TASK),
        ("x1", "elsewhere"),
    ]:
        given_queued(store, run_id, task=task)
        advance(1_000)

    two = _claim_lock(store, "s1", [TASK, OTHER_TASK], 2)
    assert _by_task(two) == {TASK: ["m3", "m1"], OTHER_TASK: ["p2", "p1"]}
    with store.unit_of_work() as uow:
        for snapshot in two.candidates:
            assert snapshot.attempt is not None
            assert snapshot == Snapshot(
                run=uow.runs.get_run(snapshot.run.id),
                attempt=uow.runs.get_attempt(snapshot.attempt.id),
                lease=None,
            )
            assert snapshot.attempt.is_pristine
            assert snapshot.attempt.id == attempt_id_of(snapshot.run.id)
    three = _claim_lock(store, "s1", [OTHER_TASK, TASK], 3)
    assert _by_task(three) == {TASK: ["m3", "m1", "m2"], OTHER_TASK: ["p2", "p1"]}
    assert _by_task(_claim_lock(store, "s1", [OTHER_TASK], 1)) == {OTHER_TASK: ["p2"]}
    assert _claim_lock(store, "s1", [], 5).candidates == ()
    assert _claim_lock(store, "s1", ["unknown"], 5).candidates == ()


def test_candidates_are_pristine_attempts_of_queued_runs(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    given_queued(store, "r1")
    given_started(store, "r2", "s1")
    given_created(store, "r3")
    given_retry_wait(store, "r4", "s1")
    given_legacy(store, "r5", "s1", stage="accepted")
    # A queued Run whose Attempt carries a worker fact is not claimed.
    marked = given_queued(store, "r6")
    with committed(store) as uow:
        before = locked_attempt(uow, marked)
        assert before.attempt is not None
        now = uow.now_ms()
        touched = evolve(before.attempt, worker_id="w1", updated_at_ms=now)
        uow.runs.apply(
            before,
            Change(
                run=before.run, attempts=(touched,), lease=None, event=_event("r6", marked, now)
            ),
        )
    back = given_started(store, "r7", "s1")
    with committed(store) as uow:
        hand_back(uow, back)  # pristine again, its Run queued
    given_queued(store, "r8")
    with committed(store) as uow:
        before = locked_run(uow, "r8")
        uow.runs.apply(
            before,
            cancel(
                run=before.run,
                attempt=before.attempt,
                lease=before.lease,
                reason="gone",
                now_ms=uow.now_ms(),
            ),
        )

    lock = _claim_lock(store, "s1", [TASK], 16)
    assert [s.run.id for s in lock.candidates] == ["r1", "r7"]
    with store.unit_of_work() as uow:
        (released,) = uow.runs.leases_of("r7")
    # a handed-back Attempt is locked with the Run's latest lease, the one it handed back
    assert lock.candidates[1].lease == released
    assert released.release_reason is ReleaseReason.HANDED_BACK

    advance(RETRY_DELAY_MS)
    with committed(store) as uow:
        next_attempt(uow, "r4")
    lock = _claim_lock(store, "s1", [TASK], 16)
    assert [(s.run.id, s.attempt.id if s.attempt else None) for s in lock.candidates] == [
        ("r1", attempt_id_of("r1")),
        ("r7", attempt_id_of("r7")),
        ("r4", attempt_id_of("r4", 2)),
    ]
    with store.unit_of_work() as uow:
        (lost_lease,) = uow.runs.leases_of("r4")
    assert lock.candidates[2].lease == lost_lease  # the lost Attempt 1's, released


def test_the_in_flight_count_is_per_task_over_every_session(store: Any) -> None:
    with committed(store) as uow:
        register(uow, "s1", "w1", tasks=(TASK, OTHER_TASK, "idle"), capacity=8)
        register(uow, "s2", "w2", tasks=(TASK, OTHER_TASK, "elsewhere"), capacity=8)
    given_started(store, "m1", "s1")
    given_started(store, "m2", "s2")
    given_legacy(store, "m3", "s1", stage="offered")
    done = given_started(store, "m4", "s1")
    with committed(store) as uow:
        finish(uow, done)  # released: not in flight
    given_lost(store, "m5", "s1")  # released: not in flight
    given_started(store, "p1", "s2", task=OTHER_TASK)
    given_started(store, "x1", "s2", task="elsewhere")
    for run_id, task in [("mq", TASK), ("pq", OTHER_TASK), ("zq", "idle")]:
        given_queued(store, run_id, task=task)

    lock = _claim_lock(store, "s1", [TASK, OTHER_TASK, "idle"], 4)
    assert _by_task(lock) == {TASK: ["mq"], OTHER_TASK: ["pq"], "idle": ["zq"]}
    counts = lock.in_flight_by_task
    assert (counts.get(TASK, 0), counts.get(OTHER_TASK, 0), counts.get("idle", 0)) == (3, 1, 0)
    assert "elsewhere" not in counts


def test_nothing_is_locked_for_a_claim_while_the_gate_is_closed(store: Any) -> None:
    given_session(store, "s1", "w1")
    given_started(store, "r1", "s1")
    given_queued(store, "r2")
    closed = _set_gate(store, False, "runtime_recovery failed: boom")

    lock = _claim_lock(store, "s1", [TASK], 4)
    assert lock.gate == closed
    assert lock.candidates == ()
    assert lock.capacity is not None and lock.capacity.in_flight == 1

    _set_gate(store, True, None)
    assert [s.run.id for s in _claim_lock(store, "s1", [TASK], 4).candidates] == ["r2"]


def test_lock_for_claim_observes_the_store_clock(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    advance(7_000)
    with store.unit_of_work() as uow:
        low = uow.now_ms()
        lock = uow.runs.lock_for_claim("s1", [TASK], 1)
        high = uow.now_ms()
    assert low <= lock.observed_at_ms <= high


def test_lock_for_claim_changes_nothing(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_queued(store, "r1")
    with committed(store) as uow:
        before = locked_attempt(uow, attempt_id)
        uow.runs.lock_for_claim("s1", [TASK], 4)
    with store.unit_of_work() as uow:
        assert locked_attempt(uow, attempt_id) == before
        assert len(uow.runs.events_of("r1")) == 1
        assert list(uow.sessions.held_by("s1")) == []
