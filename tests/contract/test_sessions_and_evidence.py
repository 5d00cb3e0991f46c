"""WorkerSessionRegistry and EvidenceRepository."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import evolve

from ql3.domain.model import EvidenceKind, SessionStatus, StopReport
from ql3.domain.sessions import heartbeat
from tests.contract.builders import (
    SECRET_HASH,
    TASK,
    close_session,
    committed,
    drain_session,
    finish,
    given_legacy,
    given_lost,
    given_queued,
    given_session,
    given_started,
    hand_back,
    refused,
    register,
)

# --- sessions ----------------------------------------------------------------------------------


def test_add_and_get_a_session(store: Any) -> None:
    with committed(store) as uow:
        session = register(uow, "s1", "w1", capacity=3)

    with store.unit_of_work() as uow:
        stored = uow.sessions.get("s1")
        assert stored == session
        assert stored is not None and stored.status is SessionStatus.ACTIVE
        assert stored.capacity == 3 and stored.secret_hash == SECRET_HASH
        assert uow.sessions.get("nope") is None


def test_add_refuses_a_session_id_that_exists(store: Any) -> None:
    session = given_session(store, "s1", "w1")
    refused(store, lambda uow: uow.sessions.add(evolve(session, worker_id="w2")))
    with store.unit_of_work() as uow:
        assert uow.sessions.get("s1") == session
        assert list(uow.sessions.open_sessions_of("w2")) == []


def test_add_refuses_a_second_open_session_of_one_worker(store: Any) -> None:
    first = given_session(store, "s1", "w1")
    second = evolve(first, id="s2")
    refused(store, lambda uow: uow.sessions.add(second))
    with store.unit_of_work() as uow:
        assert uow.sessions.get("s2") is None


def test_a_draining_session_still_blocks_a_second_open_one(store: Any) -> None:
    first = given_session(store, "s1", "w1")
    with committed(store) as uow:
        drain_session(uow, "s1")
    refused(store, lambda uow: uow.sessions.add(evolve(first, id="s2")))


def test_registering_again_replaces_the_open_session_of_the_worker(store: Any) -> None:
    given_session(store, "s1", "w1")
    with committed(store) as uow:
        register(uow, "s2", "w1")

    with store.unit_of_work() as uow:
        old = uow.sessions.get("s1")
        assert old is not None and old.status is SessionStatus.REPLACED
        assert old.closed_at_ms is not None
        assert [s.id for s in uow.sessions.open_sessions_of("w1")] == ["s2"]


def test_open_sessions_of_lists_active_and_draining_sessions_of_that_worker_by_id(
    store: Any,
) -> None:
    # w1: s3 closed, then s2 registered and draining; w2: s1 active.
    given_session(store, "s3", "w1")
    with committed(store) as uow:
        close_session(uow, "s3")
    given_session(store, "s2", "w1")
    with committed(store) as uow:
        drain_session(uow, "s2")
    given_session(store, "s1", "w2")

    with store.unit_of_work() as uow:
        assert [(s.id, s.status) for s in uow.sessions.open_sessions_of("w1")] == [
            ("s2", SessionStatus.DRAINING)
        ]
        assert [s.id for s in uow.sessions.open_sessions_of("w2")] == ["s1"]
        assert list(uow.sessions.open_sessions_of("w3")) == []


def test_update_is_a_compare_and_set_on_status(store: Any, advance: Callable[[int], None]) -> None:
    session = given_session(store, "s1", "w1")
    advance(1_000)
    with committed(store) as uow:
        beat = heartbeat(session, uow.now_ms())
        uow.sessions.update(session, beat)
    with store.unit_of_work() as uow:
        assert uow.sessions.get("s1") == beat
        assert beat.last_heartbeat_at_ms > session.last_heartbeat_at_ms

    with committed(store) as uow:
        closed = close_session(uow, "s1")
    # The session was read as active, but it is closed now: a stale update changes nothing.
    refused(store, lambda uow: uow.sessions.update(session, evolve(session, capacity=9)))
    with store.unit_of_work() as uow:
        assert uow.sessions.get("s1") == closed


def test_update_of_an_unknown_session_is_refused(store: Any) -> None:
    session = given_session(store, "s1", "w1")
    ghost = evolve(session, id="s9", worker_id="w9")
    refused(store, lambda uow: uow.sessions.update(ghost, evolve(ghost, capacity=2)))
    with store.unit_of_work() as uow:
        assert uow.sessions.get("s9") is None


def test_held_by_names_the_attempts_of_the_leased_leases_of_that_session_sorted(
    store: Any, advance: Callable[[int], None]
) -> None:
    given_session(store, "s1", "w1")
    given_session(store, "s2", "w2")
    # Claimed in the order r3, r1 so that claim order differs from attempt id order.
    r3 = given_started(store, "r3", "s1")
    advance(1_000)
    r1 = given_started(store, "r1", "s1")
    given_started(store, "r2", "s2")  # another session's
    given_lost(store, "r4", "s1")  # released: lost
    done = given_started(store, "r5", "s1")
    back = given_started(store, "r6", "s1")
    legacy = given_legacy(store, "r7", "s1", stage="offered")  # leased, bound to no token
    expired = given_started(store, "r8", "s1", ttl_ms=1_000)
    with committed(store) as uow:
        finish(uow, done)  # released: completed
        hand_back(uow, back)  # released: handed back
    given_queued(store, "r9")
    advance(5_000)  # r8's lease expired, but it is still leased: the session still holds it

    with store.unit_of_work() as uow:
        assert list(uow.sessions.held_by("s1")) == sorted([r1, r3, legacy, expired])
        assert list(uow.sessions.held_by("s2")) == ["r2a1"]
        assert list(uow.sessions.held_by("nope")) == []
        for attempt_id in uow.sessions.held_by("s1"):
            lease = uow.runs.lock_attempt(attempt_id).lease
            assert lease is not None and lease.holder_session_id == "s1"


def test_held_by_sees_the_transactions_own_writes_and_no_rolled_back_ones(store: Any) -> None:
    given_session(store, "s1", "w1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        hand_back(uow, attempt_id)
        assert list(uow.sessions.held_by("s1")) == []
    with store.unit_of_work() as uow:
        assert list(uow.sessions.held_by("s1")) == [attempt_id]


def test_a_closed_session_still_holds_its_leases_until_recovery_takes_them(store: Any) -> None:
    given_session(store, "s1", "w1")
    attempt_id = given_started(store, "r1", "s1")
    with committed(store) as uow:
        close_session(uow, "s1")
    with store.unit_of_work() as uow:
        assert list(uow.sessions.held_by("s1")) == [attempt_id]


def test_rolled_back_sessions_are_not_kept(store: Any) -> None:
    with store.unit_of_work() as uow:
        register(uow, "s1", "w1", tasks=(TASK,))
        assert uow.sessions.get("s1") is not None
    with store.unit_of_work() as uow:
        assert uow.sessions.get("s1") is None
        assert list(uow.sessions.open_sessions_of("w1")) == []


# --- evidence ----------------------------------------------------------------------------------


def test_reports_are_recorded_and_read_back_by_report_time(store: Any) -> None:
    with store.unit_of_work() as uow:
        now = uow.now_ms()
    late = StopReport(
        attempt_id="r1a1", kind=EvidenceKind.OPERATOR_ATTESTED, reported_at_ms=now + 2_000
    )
    early = StopReport(
        attempt_id="r1a1", kind=EvidenceKind.WORKER_ABANDONED, reported_at_ms=now, detail="bye"
    )
    other = StopReport(attempt_id="r2a1", kind=EvidenceKind.WORKER_ABANDONED, reported_at_ms=now)
    given_session(store, "s1")
    given_started(store, "r1", "s1")
    given_started(store, "r2", "s1")
    with committed(store) as uow:
        uow.evidence.record(late)
        uow.evidence.record(early)
        uow.evidence.record(other)

    with store.unit_of_work() as uow:
        assert list(uow.evidence.reports_for("r1a1")) == [early, late]
        assert list(uow.evidence.reports_for("r2a1")) == [other]
        assert list(uow.evidence.reports_for("r3a1")) == []


def test_rolled_back_reports_are_not_kept(store: Any) -> None:
    given_session(store, "s1")
    given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        report = StopReport(
            attempt_id="r1a1", kind=EvidenceKind.WORKER_ABANDONED, reported_at_ms=uow.now_ms()
        )
        uow.evidence.record(report)
        assert list(uow.evidence.reports_for("r1a1")) == [report]
    with store.unit_of_work() as uow:
        assert list(uow.evidence.reports_for("r1a1")) == []
