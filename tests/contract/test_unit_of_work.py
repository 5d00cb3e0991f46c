"""A unit of work is one transaction: it commits on request and rolls back otherwise."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from ql3.application.ports import DispatchGate
from ql3.domain.errors import ConcurrencyConflict, DomainError
from ql3.domain.events import EventType
from ql3.domain.fence import hash_token
from ql3.domain.model import AttemptStatus, RunStatus
from ql3.domain.transitions import claim
from tests.contract.builders import (
    TASK,
    admit_run,
    attempt_id_of,
    claim_attempt,
    committed,
    given_queued,
    given_session,
    register,
    report_stop,
)


class Boom(Exception):
    pass


def test_committed_writes_are_visible_to_later_transactions(store: Any) -> None:
    with store.unit_of_work() as uow:
        change = admit_run(uow, "r1")
        uow.commit()

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1") == change.run
        assert uow.runs.get_attempt(attempt_id_of("r1")) == change.attempts[0]


def test_leaving_without_commit_rolls_everything_back(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_queued(store, "r1")
    before_gate = store.dispatch_gate()

    with store.unit_of_work() as uow:
        admit_run(uow, "r2")
        claim_attempt(uow, attempt_id, "s1")
        register(uow, "s2", "w2")
        report_stop(uow, attempt_id)
        uow.gate.set(DispatchGate(open=False, reason="rolled back", changed_at_ms=uow.now_ms()))
        assert uow.runs.get_run("r2") is not None  # visible inside the transaction

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r2") is None
        run = uow.runs.get_run("r1")
        assert run is not None and run.status is RunStatus.QUEUED
        assert uow.runs.leases_of("r1") == ()
        assert len(uow.runs.events_of("r1")) == 1
        assert uow.sessions.get("s2") is None
        assert list(uow.evidence.reports_for(attempt_id)) == []
        assert list(uow.sessions.held_by("s1")) == []
    assert store.dispatch_gate() == before_gate


def test_an_exception_rolls_back_and_propagates(store: Any) -> None:
    with pytest.raises(Boom), store.unit_of_work() as uow:
        admit_run(uow, "r1")
        register(uow, "s1", "w1")
        raise Boom

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1") is None
        assert uow.sessions.get("s1") is None


def test_an_exception_after_commit_keeps_what_was_committed(store: Any) -> None:
    with pytest.raises(Boom), store.unit_of_work() as uow:
        admit_run(uow, "r1")
        uow.commit()
        raise Boom

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1") is not None


def test_a_transaction_reads_its_own_writes(store: Any) -> None:
    given_session(store, "s1")
    with store.unit_of_work() as uow:
        change = admit_run(uow, "r1")
        assert uow.runs.get_run("r1") == change.run
        claim_attempt(uow, attempt_id_of("r1"), "s1")
        snapshot = uow.runs.lock_attempt(attempt_id_of("r1"))
        assert snapshot is not None
        assert snapshot.run.status is RunStatus.RUNNING
        assert snapshot.lease is not None and snapshot.lease.holder_session_id == "s1"
        assert [e.event.type for e in uow.runs.events_of("r1")] == [
            EventType.RUN_ADMITTED,
            EventType.ATTEMPT_STARTED,
        ]
        assert list(uow.sessions.held_by("s1")) == [attempt_id_of("r1")]


def test_a_failed_write_changes_nothing_that_was_committed(store: Any) -> None:
    with committed(store) as uow:
        first = admit_run(uow, "r1")

    with pytest.raises(ConcurrencyConflict), store.unit_of_work() as uow:
        uow.runs.add(first)

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1") == first.run
        assert len(uow.runs.events_of("r1")) == 1


def test_now_ms_is_the_store_clock_and_advance_moves_it(
    store: Any, advance: Callable[[int], None]
) -> None:
    with store.unit_of_work() as uow:
        before = uow.now_ms()
    advance(90_000)
    with store.unit_of_work() as uow:
        after = uow.now_ms()
    assert after - before >= 90_000
    assert after - before < 90_000 + 60_000  # the clock moved by the offset, plus a little


def test_transitions_use_the_transaction_clock(store: Any, advance: Callable[[int], None]) -> None:
    advance(5_000)
    with store.unit_of_work() as uow:
        low = uow.now_ms()
        change = admit_run(uow, "r1")
        high = uow.now_ms()
        uow.commit()
    assert low <= change.run.created_at_ms <= high


def test_concurrent_claims_of_one_attempt_let_exactly_one_through(store: Any) -> None:
    contenders = 4
    for n in range(contenders):
        given_session(store, f"s{n}")
    attempt_id = given_queued(store, "r1")
    barrier = threading.Barrier(contenders)
    outcomes: list[str] = []
    outcomes_lock = threading.Lock()

    def contend(n: int) -> None:
        barrier.wait()
        try:
            with store.unit_of_work() as uow:
                claim_attempt(uow, attempt_id, f"s{n}", token=f"token-of-s{n}")
                uow.commit()
            outcome = "won"
        except DomainError as error:
            outcome = type(error).__name__
        with outcomes_lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert len(outcomes) == contenders
    assert outcomes.count("won") == 1
    assert set(outcomes) - {"won"} <= {"InvalidTransition", "ConcurrencyConflict"}
    with store.unit_of_work() as uow:
        leases = uow.runs.leases_of("r1")
        assert len(leases) == 1
        attempt = uow.runs.get_attempt(attempt_id)
        assert attempt is not None and attempt.status is AttemptStatus.RUNNING
        assert attempt.session_id == leases[0].holder_session_id
        assert len(uow.runs.events_of("r1")) == 2
        assert [e.event.type for e in uow.runs.events_of("r1")][-1] is EventType.ATTEMPT_STARTED


def test_each_test_starts_from_an_empty_store(store: Any) -> None:
    with store.unit_of_work() as uow:
        assert list(uow.runs.list_runs(None, 10)) == []
    assert store.recovery_candidates(16).items == ()
    assert store.orphaned_runs(16).items == ()
    gate = store.dispatch_gate()
    assert (gate.open, gate.reason) == (True, None)


def test_concurrent_claims_of_one_session_count_its_capacity_one_after_the_other(
    store: Any,
) -> None:
    """Each claim locks the session row before it counts the session's leases, so claims of
    one session running at once never hold more than its capacity."""
    with committed(store) as uow:
        register(uow, "s1", "w1", capacity=2)
    for n in range(6):
        given_queued(store, f"r{n}")
    contenders = 4
    barrier = threading.Barrier(contenders)
    claimed: list[int] = []
    outcomes_lock = threading.Lock()

    def contend(n: int) -> None:
        barrier.wait()
        taken = 0
        try:
            with store.unit_of_work() as uow:
                lock = uow.runs.lock_for_claim("s1", [TASK], 4)
                assert lock.capacity is not None
                writes = []
                for snapshot in lock.candidates[: lock.capacity.free]:
                    assert snapshot.attempt is not None
                    change = claim(
                        run=snapshot.run,
                        attempt=snapshot.attempt,
                        previous_lease=snapshot.lease,
                        session=lock.capacity.session,
                        token_hash=hash_token(f"token-{n}-{snapshot.run.id}"),
                        ttl_ms=60_000,
                        now_ms=lock.observed_at_ms,
                    )
                    writes.append((snapshot, change))
                uow.runs.apply_many(writes)
                uow.commit()
                taken = len(writes)
        except ConcurrencyConflict:
            taken = 0
        with outcomes_lock:
            claimed.append(taken)

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert len(claimed) == contenders
    assert sum(claimed) == 2, claimed
    with store.unit_of_work() as uow:
        held = list(uow.sessions.held_by("s1"))
        assert len(held) == 2
        for attempt_id in held:
            events = uow.runs.events_of(attempt_id.removesuffix("a1"))
            assert [e.event.type for e in events] == [
                EventType.RUN_ADMITTED,
                EventType.ATTEMPT_STARTED,
            ]
