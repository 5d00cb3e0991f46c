"""The candidate sources: recovery, lost retry, startup and dispatch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from attrs import evolve

from application.ports import HARD_PAGE_CAP, Page, RecoveryCandidate
from domain.events import EventType, RunEvent
from domain.model import (
    AttemptStatus,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunOwner,
    RunStatus,
)
from domain.sessions import heartbeat
from domain.transitions import Change
from tests.contract.builders import (
    OTHER_TASK,
    RETRY_DELAY_MS,
    TASK,
    TTL_MS,
    attempt_id_of,
    close_session,
    committed,
    drain_session,
    finish,
    first_attempt,
    given_accepted,
    given_created,
    given_lost,
    given_offered,
    given_queued,
    given_retry_wait,
    given_session,
    given_started,
    locked_attempt,
    locked_run,
    lose,
    next_attempt,
    offer,
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
    "queued_attempts": lambda store, limit: store.queued_attempts(limit, [TASK]),
}


def _event(run_id: str, attempt_id: str, now: int) -> RunEvent:
    return RunEvent(run_id=run_id, attempt_id=attempt_id, type=EventType.ATTEMPT_OFFERED, at_ms=now)


def given_dispatching_without_lease(store: Any, run_id: str, session_id: str) -> str:
    """An Attempt that was offered (generation 1) but whose lease row is missing."""
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


def test_an_offer_is_a_candidate_only_once_its_lease_expired(store: Any, advance: Advance) -> None:
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
    assert candidate.attempt_status is AttemptStatus.STARTING
    assert candidate.resolvable is (evidence not in {"none", "session_drained"})


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
        offer(uow, attempt_id_of("r1", 2), "s1")
    with committed(store) as uow:
        lose(uow, attempt_id_of("r1", 2))

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


# --- queued_attempts ---------------------------------------------------------------------------


def test_queued_attempts_take_at_most_the_limit_of_each_task_oldest_first(
    store: Any, advance: Advance
) -> None:
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

    page = store.queued_attempts(2, [TASK, OTHER_TASK])
    assert [q.run_id for q in page.items] == ["m3", "p2", "m1", "p1"]
    assert page.has_more is True  # m2 did not fit

    with store.unit_of_work() as uow:
        for queued in page.items:
            attempt = uow.runs.get_attempt(queued.attempt_id)
            assert attempt is not None and attempt.run_id == queued.run_id
            assert attempt.is_pristine
            assert queued.queued_at_ms == attempt.created_at_ms
            assert queued.task == uow.runs.get_run(queued.run_id).task

    everything = store.queued_attempts(3, [OTHER_TASK, TASK])
    assert [q.run_id for q in everything.items] == ["m3", "p2", "m1", "p1", "m2"]
    assert everything.has_more is False
    only_reports = store.queued_attempts(1, [OTHER_TASK])
    assert [q.run_id for q in only_reports.items] == ["p2"] and only_reports.has_more is True
    assert store.queued_attempts(5, []).items == ()
    assert store.queued_attempts(5, ["unknown"]).has_more is False


def test_queued_attempts_are_pristine_attempts_of_queued_runs(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    given_queued(store, "r1")
    given_offered(store, "r2", "s1")
    given_created(store, "r3")
    given_retry_wait(store, "r4", "s1")
    given_accepted(store, "r5", "s1")
    # A queued Run whose Attempt carries a worker fact is not offered again.
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
    assert [q.run_id for q in store.queued_attempts(16, [TASK]).items] == ["r1"]

    advance(RETRY_DELAY_MS)
    with committed(store) as uow:
        next_attempt(uow, "r4")
    page = store.queued_attempts(16, [TASK])
    assert [(q.run_id, q.attempt_id) for q in page.items] == [
        ("r1", attempt_id_of("r1")),
        ("r4", attempt_id_of("r4", 2)),
    ]


# --- available_sessions ------------------------------------------------------------------------


def test_available_sessions_are_active_and_recently_heard_from(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s4", "w4")  # will fall silent
    advance(30_000)
    given_session(store, "s1", "w1")
    given_session(store, "s2", "w2")
    given_session(store, "s3", "w3")
    with committed(store) as uow:
        drain_session(uow, "s2")
        close_session(uow, "s3")

    recent = store.available_sessions(10_000)
    assert [c.session.id for c in recent] == ["s1"]
    everyone = store.available_sessions(60_000)
    assert [c.session.id for c in everyone] == ["s1", "s4"]
    with store.unit_of_work() as uow:
        assert everyone[0].session == uow.sessions.get("s1")

    advance(10_000)
    assert list(store.available_sessions(10_000)) == []


def test_available_sessions_count_the_leases_they_hold(store: Any) -> None:
    given_session(store, "s1", "w1")  # capacity 4
    given_session(store, "s2", "w2")
    given_offered(store, "r1", "s1")
    given_accepted(store, "r2", "s1")
    started = given_started(store, "r3", "s1")
    given_lost(store, "r4", "s1")  # lease released
    done = given_started(store, "r5", "s1")
    with committed(store) as uow:
        finish(uow, done)  # lease released
    given_offered(store, "r6", "s2")

    by_id = {c.session.id: c for c in store.available_sessions(60_000)}
    assert by_id["s1"].in_flight == 3
    assert by_id["s1"].free == 1
    assert by_id["s2"].in_flight == 1

    with committed(store) as uow:
        finish(uow, started)
    by_id = {c.session.id: c for c in store.available_sessions(60_000)}
    assert by_id["s1"].in_flight == 2


def test_a_heartbeat_makes_a_silent_session_available_again(store: Any, advance: Advance) -> None:
    session = given_session(store, "s1", "w1")
    advance(20_000)
    assert list(store.available_sessions(10_000)) == []
    with committed(store) as uow:
        uow.sessions.update(session, heartbeat(session, uow.now_ms()))
    assert [c.session.id for c in store.available_sessions(10_000)] == ["s1"]
