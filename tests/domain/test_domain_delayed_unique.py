"""Delayed admission and unique keys in the pure domain (ADR 0015): a delayed Run waits in
``retry_wait`` without an Attempt and lost retry's :func:`start_next_attempt` makes its
Attempt 1 when due; the due time is the store's clock plus the delay, or the time given."""

from __future__ import annotations

import pytest

from ql3.domain.errors import InvalidAdmission, NotDue
from ql3.domain.events import EventType
from ql3.domain.model import MAX_UNIQUE_KEY_LENGTH, RunOwner, RunStatus
from ql3.domain.retry import is_due_retry, start_next_attempt
from ql3.domain.transitions import admit, cancel, check_unique_key, due_time

NOW = 1_000_000


def _admit(**fields: object):  # type: ignore[no-untyped-def]
    values: dict[str, object] = {
        "run_id": "r", "attempt_id": "a1", "task": "mail", "input": None, "policy": None,
        "now_ms": NOW,
    }
    values.update(fields)
    return admit(**values)  # type: ignore[arg-type]


def test_a_due_time_in_the_future_admits_the_run_waiting_without_an_attempt() -> None:
    change = _admit(run_after_ms=NOW + 5_000, unique_key="k")
    run = change.run
    assert run.status is RunStatus.RETRY_WAIT and run.attempt_count == 0
    assert run.next_attempt_at_ms == NOW + 5_000 and run.unique_key == "k"
    assert change.attempts == () and change.lease is None
    assert change.event.type is EventType.RUN_ADMITTED and change.event.attempt_id is None
    assert change.event.data == {"task": "mail", "run_after_ms": NOW + 5_000}


@pytest.mark.parametrize("due", [None, NOW, NOW - 1])
def test_no_due_time_or_one_not_in_the_future_admits_it_queued(due: int | None) -> None:
    change = _admit(run_after_ms=due)
    assert change.run.status is RunStatus.QUEUED and change.run.attempt_count == 1
    assert change.run.next_attempt_at_ms is None
    assert change.event.data == {"task": "mail"}


def test_lost_retry_makes_attempt_1_of_a_delayed_run_only_when_due() -> None:
    run = _admit(run_after_ms=NOW + 5_000).run
    assert not is_due_retry(run, NOW + 4_999)
    with pytest.raises(NotDue):
        start_next_attempt(run=run, attempt_id="a1", now_ms=NOW + 4_999)
    assert is_due_retry(run, NOW + 5_000)
    change = start_next_attempt(run=run, attempt_id="a1", now_ms=NOW + 5_000)
    assert change.run.status is RunStatus.QUEUED and change.run.attempt_count == 1
    [attempt] = change.attempts
    assert attempt.number == 1 and attempt.is_pristine
    assert change.event.type is EventType.ATTEMPT_CREATED and change.event.data == {"number": 1}


def test_a_delayed_run_is_cancelled_without_an_attempt() -> None:
    run = _admit(run_after_ms=NOW + 5_000).run
    change = cancel(run=run, attempt=None, lease=None, reason="r", now_ms=NOW + 1)
    assert change.run.status is RunStatus.CANCELLED and change.attempts == ()
    assert change.event.type is EventType.RUN_CANCELLED


def test_only_runtime_owned_runs_are_delayed() -> None:
    with pytest.raises(InvalidAdmission):
        _admit(attempt_id=None, owner=RunOwner.WORKFLOW, run_after_ms=NOW + 1)


@pytest.mark.parametrize("due", [True, 1.5, "1"])
def test_a_due_time_is_an_integer(due: object) -> None:
    with pytest.raises(InvalidAdmission):
        _admit(run_after_ms=due)


def test_due_time_adds_the_delay_to_the_stores_clock_or_takes_the_time_given() -> None:
    assert due_time(NOW, delay_ms=None, run_after_ms=None) is None
    assert due_time(NOW, delay_ms=0, run_after_ms=None) == NOW
    assert due_time(NOW, delay_ms=250, run_after_ms=None) == NOW + 250
    assert due_time(NOW, delay_ms=None, run_after_ms=7) == 7
    for delay, after in ((1, 1), (-1, None), (True, None), (1.5, None)):
        with pytest.raises(InvalidAdmission):
            due_time(NOW, delay_ms=delay, run_after_ms=after)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["", "a\x00b", "x" * (MAX_UNIQUE_KEY_LENGTH + 1), 7])
def test_unique_keys_no_store_keeps_are_refused(key: object) -> None:
    with pytest.raises(InvalidAdmission):
        check_unique_key(key)  # type: ignore[arg-type]
    with pytest.raises(InvalidAdmission):
        _admit(unique_key=key)
    check_unique_key("x" * MAX_UNIQUE_KEY_LENGTH)
