"""Delayed and unique submissions (ADR 0015) on every store, through admission and lost retry:
a delayed Run waits in ``retry_wait`` without an Attempt, is not claimable before its due time,
and gets its Attempt 1 from the lost-retry step once the store's clock reaches it; a unique key
held by an unfinished Run answers with that Run and writes nothing, and is free again once the
Run finished."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ql3.application.admission import Admission, AdmissionRequest
from ql3.application.identities import RandomIdentities
from ql3.application.lost_retry import LostRetry
from ql3.domain.errors import InvalidAdmission
from ql3.domain.events import EventType
from ql3.domain.model import AttemptStatus, RunStatus
from tests.contract.builders import (
    TASK,
    claim_attempt,
    committed,
    finish,
    given_session,
)

DELAY_MS = 5_000
Advance = Callable[[int], None]


def _admission(store: Any) -> Admission:
    return Admission(store.unit_of_work, RandomIdentities())


def _lost_retry(store: Any) -> LostRetry:
    return LostRetry(store.unit_of_work, store, RandomIdentities())


def _claimable(store: Any, session_id: str) -> list[str]:
    with store.unit_of_work() as uow:
        lock = uow.runs.lock_for_claim(session_id, [TASK], 16)
    return [snapshot.run.id for snapshot in lock.candidates]


def _delayed(store: Any, delay_ms: int = DELAY_MS) -> str:
    return _admission(store).submit_many(
        [AdmissionRequest(task=TASK, input={"n": 1}, delay_ms=delay_ms)]
    )[0]


def _counts(store: Any) -> tuple[int, int, int]:
    """Runs, Attempts and events in the store."""
    with store.unit_of_work() as uow:
        found = uow.runs.list_runs(None, 1_000)
        attempts = sum(len(uow.runs.attempts_of(run.id)) for run in found)
        events = sum(len(uow.runs.events_of(run.id)) for run in found)
    return len(found), attempts, events


# --- delayed runs -------------------------------------------------------------------------------


def test_a_delayed_run_waits_without_an_attempt_due_at_the_store_clock_plus_its_delay(
    store: Any,
) -> None:
    with store.unit_of_work() as uow:
        admitted_at = uow.now_ms()
    run_id = _delayed(store)
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        assert run is not None
        assert run.status is RunStatus.RETRY_WAIT
        assert run.attempt_count == 0
        assert list(uow.runs.attempts_of(run_id)) == []
        assert run.next_attempt_at_ms == run.created_at_ms + DELAY_MS
        assert run.created_at_ms >= admitted_at
        [event] = [stored.event for stored in uow.runs.events_of(run_id)]
    assert event.type is EventType.RUN_ADMITTED and event.attempt_id is None
    assert event.data == {"task": TASK, "run_after_ms": run.next_attempt_at_ms}


def test_a_delayed_run_is_claimable_only_once_lost_retry_queued_it_when_due(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    run_id = _delayed(store)
    assert _claimable(store, "s1") == []
    assert _lost_retry(store).run_once().attempts_created == 0

    # (The clocks of PostgreSQL and SQLite move on by themselves: a margin of a second.)
    advance(DELAY_MS - 1_000)
    assert store.due_retries(16).items == ()
    assert _lost_retry(store).run_once().attempts_created == 0
    assert _claimable(store, "s1") == []

    advance(1_000)
    [candidate] = store.due_retries(16).items
    assert (candidate.run_id, candidate.attempt_id) == (run_id, None)
    assert _lost_retry(store).run_once().attempts_created == 1
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        [attempt] = uow.runs.attempts_of(run_id)
        events = [stored.event.type for stored in uow.runs.events_of(run_id)]
    assert run is not None and run.status is RunStatus.QUEUED and run.attempt_count == 1
    assert run.next_attempt_at_ms is None
    assert attempt.number == 1 and attempt.status is AttemptStatus.CLAIMED
    assert events == [EventType.RUN_ADMITTED, EventType.ATTEMPT_CREATED]
    assert _claimable(store, "s1") == [run_id]

    with committed(store) as uow:
        claim_attempt(uow, attempt.id, "s1")
    with committed(store) as uow:
        finish(uow, attempt.id)
    with store.unit_of_work() as uow:
        done = uow.runs.get_run(run_id)
    assert done is not None and done.status is RunStatus.SUCCEEDED


def test_a_due_time_not_in_the_future_admits_the_run_queued_at_once(store: Any) -> None:
    given_session(store, "s1")
    with store.unit_of_work() as uow:
        now = uow.now_ms()
    admission = _admission(store)
    past, at_once = admission.submit_many(
        [
            AdmissionRequest(task=TASK, run_after_ms=now - 60_000),
            AdmissionRequest(task=TASK, delay_ms=0),
        ]
    )
    with store.unit_of_work() as uow:
        for run_id in (past, at_once):
            run = uow.runs.get_run(run_id)
            assert run is not None and run.status is RunStatus.QUEUED, run_id
            assert run.attempt_count == 1 and run.next_attempt_at_ms is None
    assert sorted(_claimable(store, "s1")) == sorted([past, at_once])


def test_a_delayed_run_is_cancelled_at_once_and_never_queued(store: Any, advance: Advance) -> None:
    run_id = _delayed(store)
    _admission(store).cancel(run_id, "not needed")
    advance(DELAY_MS)
    assert store.due_retries(16).items == ()
    assert _lost_retry(store).run_once().attempts_created == 0
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        assert list(uow.runs.attempts_of(run_id)) == []
        events = [stored.event.type for stored in uow.runs.events_of(run_id)]
    assert run is not None and run.status is RunStatus.CANCELLED
    assert events == [EventType.RUN_ADMITTED, EventType.RUN_CANCELLED]


def test_a_delay_and_a_due_time_at_once_or_a_negative_delay_write_nothing(store: Any) -> None:
    admission = _admission(store)
    for request in (
        AdmissionRequest(task=TASK, delay_ms=1_000, run_after_ms=1),
        AdmissionRequest(task=TASK, delay_ms=-1),
    ):
        with pytest.raises(InvalidAdmission):
            admission.submit_many([AdmissionRequest(task=TASK), request])
    assert _counts(store) == (0, 0, 0)


# --- unique submissions -------------------------------------------------------------------------


def _keyed(store: Any, key: str, **fields: Any) -> Any:
    return _admission(store).admit_many([AdmissionRequest(task=TASK, unique_key=key, **fields)])[0]


def test_a_second_submit_of_a_held_key_answers_the_existing_run_and_writes_nothing(
    store: Any,
) -> None:
    first = _keyed(store, "order-7")
    assert not first.existing
    before = _counts(store)
    assert before == (1, 1, 1)

    second = _keyed(store, "order-7", input={"other": True})
    assert second.existing and second.run_id == first.run_id
    assert _counts(store) == before
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(first.run_id)
        assert uow.runs.unfinished_with_keys(["order-7", "nobody"]) == {"order-7": first.run_id}
    assert run is not None and run.unique_key == "order-7" and run.input is None


def test_a_delayed_run_holds_its_key_while_it_waits(store: Any) -> None:
    first = _keyed(store, "later", delay_ms=DELAY_MS)
    again = _keyed(store, "later")
    assert again.existing and again.run_id == first.run_id
    assert _counts(store) == (1, 0, 1)


def test_the_key_is_free_again_once_the_run_finished(store: Any) -> None:
    given_session(store, "s1")
    first = _keyed(store, "k")
    with store.unit_of_work() as uow:
        [attempt] = uow.runs.attempts_of(first.run_id)
    with committed(store) as uow:
        claim_attempt(uow, attempt.id, "s1")
    assert _keyed(store, "k").run_id == first.run_id  # running: still held
    with committed(store) as uow:
        finish(uow, attempt.id)

    second = _keyed(store, "k")
    assert not second.existing and second.run_id != first.run_id
    with store.unit_of_work() as uow:
        assert uow.runs.unfinished_with_keys(["k"]) == {"k": second.run_id}

    _admission(store).cancel(second.run_id)
    third = _keyed(store, "k")
    assert not third.existing and third.run_id not in {first.run_id, second.run_id}


def test_keys_of_one_batch_map_to_one_run_each(store: Any) -> None:
    held = _keyed(store, "a")
    answers = _admission(store).admit_many(
        [
            AdmissionRequest(task=TASK, unique_key="b", input=1),
            AdmissionRequest(task=TASK, unique_key="a"),
            AdmissionRequest(task=TASK, unique_key="b", input=2),
            AdmissionRequest(task=TASK),
            AdmissionRequest(task=TASK),
        ]
    )
    b, a, b_again, plain1, plain2 = answers
    assert (a.run_id, a.existing) == (held.run_id, True)
    assert not b.existing and (b_again.run_id, b_again.existing) == (b.run_id, True)
    assert not plain1.existing and not plain2.existing and plain1.run_id != plain2.run_id
    assert _counts(store) == (4, 4, 4)
    with store.unit_of_work() as uow:
        run_b = uow.runs.get_run(b.run_id)
    assert run_b is not None and run_b.input == 1


def test_the_store_refuses_a_second_unfinished_run_with_a_held_key(store: Any) -> None:
    """The partial unique index (and the memory store's check of it), under admission's read."""
    from ql3.domain.errors import ConcurrencyConflict
    from ql3.domain.transitions import admit

    held = _keyed(store, "k")
    with store.unit_of_work() as uow:
        change = admit(
            run_id="r2",
            attempt_id="r2a1",
            task=TASK,
            input=None,
            policy=None,
            unique_key="k",
            now_ms=uow.now_ms(),
        )
        with pytest.raises(ConcurrencyConflict):
            uow.runs.add_many([change])
    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r2") is None
        assert uow.runs.unfinished_with_keys(["k"]) == {"k": held.run_id}
