"""Cancelling a Run (ADR 0017), on every store: a waiting Run ends at once; a running Attempt is
cancelled with it and its lease released for ``cancelled``, so its worker's later calls are
refused as ``cancelled`` and change nothing; a finished Run is refused and nothing is written."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ql3.application.admission import Admission, UnknownRun
from ql3.application.identities import RandomIdentities
from ql3.application.worker_commands import (
    Abandonment,
    BatchOutcome,
    Completion,
    ItemResult,
    Rejection,
    Release,
    WorkerCommands,
)
from ql3.domain.errors import FenceReason, InvalidAdmission, InvalidTransition
from ql3.domain.fence import LeaseFence
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from tests.contract.builders import (
    TTL_MS,
    committed,
    finish,
    given_created,
    given_queued,
    given_retry_wait,
    given_session,
    given_started,
    token_of,
)

SECRET = "session-secret"  # the secret whose hash the builders register sessions with
SESSION = "s1"


def _admission(store: Any) -> Admission:
    return Admission(store.unit_of_work, RandomIdentities())


def _workers(store: Any) -> WorkerCommands:
    return WorkerCommands(store.unit_of_work, RandomIdentities(), TTL_MS)


def _fence(attempt_id: str) -> LeaseFence:
    return LeaseFence(attempt_id=attempt_id, generation=1, version=1, token=token_of(attempt_id))


def _state(store: Any, run_id: str) -> tuple[object, ...]:
    """Everything stored about the Run: its row, Attempts, leases and events."""
    with store.unit_of_work() as uow:
        return (
            uow.runs.get_run(run_id),
            tuple(uow.runs.attempts_of(run_id)),
            tuple(uow.runs.leases_of(run_id)),
            tuple(uow.runs.events_of(run_id)),
        )


def _cancelled_event(store: Any, run_id: str) -> Any:
    with store.unit_of_work() as uow:
        events = uow.runs.events_of(run_id)
    assert events[-1].event.type.value == "run_cancelled"
    return events[-1].event


@pytest.mark.parametrize("status", ["queued", "created", "retry_wait"])
def test_a_waiting_run_is_cancelled_at_once(store: Any, status: str) -> None:
    run_id = "r1"
    if status == "queued":
        given_queued(store, run_id)
    elif status == "created":
        given_created(store, run_id)
    else:
        given_session(store, SESSION)
        given_retry_wait(store, run_id, SESSION)
    was = _admission(store).cancel(run_id, "not needed")
    assert was is RunStatus(status)
    run, attempts, leases, _ = _state(store, run_id)
    assert run.status is RunStatus.CANCELLED
    assert run.error == "not needed"
    assert run.next_attempt_at_ms is None
    # No Attempt stays open: a waiting one is cancelled with the Run.
    assert all(a.status.is_terminal for a in attempts)
    assert all(lease.status is LeaseStatus.RELEASED for lease in leases)
    event = _cancelled_event(store, run_id)
    assert dict(event.data) == {"reason": "not needed", "previous_status": status}


def test_a_running_attempt_is_cancelled_and_its_lease_released_for_cancelled(store: Any) -> None:
    given_session(store, SESSION)
    attempt_id = given_started(store, "r1", SESSION)
    assert _admission(store).cancel("r1") is RunStatus.RUNNING
    run, (attempt,), (lease,), _ = _state(store, "r1")
    assert run.status is RunStatus.CANCELLED
    assert attempt.status is AttemptStatus.CANCELLED
    assert attempt.finished_at_ms is not None
    assert (lease.status, lease.release_reason, lease.version) == (
        LeaseStatus.RELEASED,
        ReleaseReason.CANCELLED,
        2,
    )
    assert attempt.lease_version == 2
    assert _cancelled_event(store, "r1").attempt_id == attempt_id


def _only(results: tuple[ItemResult, ...]) -> ItemResult:
    (result,) = results
    return result


LATE_CALLS: dict[str, Callable[[WorkerCommands, LeaseFence], ItemResult]] = {
    "renew": lambda w, f: _only(w.renew_many(SESSION, SECRET, [f]).results),
    "complete": lambda w, f: _only(
        w.complete_many(SESSION, SECRET, [Completion(fence=f, succeeded=True, output=1)]).results
    ),
    "fail": lambda w, f: _only(
        w.complete_many(SESSION, SECRET, [Completion(fence=f, succeeded=False)]).results
    ),
    "claim": lambda w, f: _only(
        w.claim(
            SESSION,
            SECRET,
            limit=1,
            completions=[Completion(fence=f, succeeded=True)],
            held=[f.attempt_id],
        ).completed
    ),
}


@pytest.mark.parametrize("call", sorted(LATE_CALLS))
def test_a_late_call_of_the_cancelled_holder_is_refused_as_cancelled(store: Any, call: str) -> None:
    given_session(store, SESSION)
    attempt_id = given_started(store, "r1", SESSION)
    _admission(store).cancel("r1")
    before = _state(store, "r1")
    result = LATE_CALLS[call](_workers(store), _fence(attempt_id))
    assert (result.rejection, result.reason) == (Rejection.FENCE, FenceReason.CANCELLED.value)
    assert _state(store, "r1") == before


@pytest.mark.parametrize("report", ["abandon", "release"])
def test_the_holders_stop_report_is_taken_as_cancelled_and_changes_nothing(
    store: Any, report: str
) -> None:
    given_session(store, SESSION)
    attempt_id = given_started(store, "r1", SESSION)
    _admission(store).cancel("r1")
    before = _state(store, "r1")
    workers, fence = _workers(store), _fence(attempt_id)
    if report == "abandon":
        answer = workers.abandon_many(SESSION, SECRET, [Abandonment(fence=fence, detail="x")])
    else:
        answer = workers.release_many(SESSION, SECRET, [Release(fence=fence)])
    assert _only(answer.results).outcome is BatchOutcome.CANCELLED
    assert _state(store, "r1") == before


def test_another_sessions_fence_on_a_cancelled_lease_is_not_told_cancelled(store: Any) -> None:
    given_session(store, SESSION)
    given_session(store, "s2")
    attempt_id = given_started(store, "r1", SESSION)
    _admission(store).cancel("r1")
    workers = _workers(store)
    (result,) = workers.renew_many("s2", SECRET, [_fence(attempt_id)]).results
    assert result.reason == FenceReason.TOKEN_MISMATCH.value
    wrong_token = LeaseFence(attempt_id=attempt_id, generation=1, version=1, token="t" * 30)
    (result,) = workers.renew_many(SESSION, SECRET, [wrong_token]).results
    assert result.reason == FenceReason.TOKEN_MISMATCH.value


def test_a_cancelled_run_is_never_claimed(store: Any) -> None:
    given_session(store, SESSION)
    given_queued(store, "r1")
    _admission(store).cancel("r1")
    answer = _workers(store).claim(SESSION, SECRET, limit=4, held=[])
    assert answer.grants == ()


@pytest.mark.parametrize("succeeded", [True, False])
def test_a_finished_run_is_refused_and_nothing_is_written(store: Any, succeeded: bool) -> None:
    given_session(store, SESSION)
    attempt_id = given_started(store, "r1", SESSION)
    with committed(store) as uow:
        finish(uow, attempt_id, succeeded=succeeded)
    before = _state(store, "r1")
    with pytest.raises(InvalidTransition, match="cannot be cancelled"):
        _admission(store).cancel("r1")
    assert _state(store, "r1") == before


def test_cancelling_twice_is_refused_the_second_time(store: Any) -> None:
    given_queued(store, "r1")
    admission = _admission(store)
    admission.cancel("r1")
    before = _state(store, "r1")
    with pytest.raises(InvalidTransition, match="is cancelled"):
        admission.cancel("r1")
    assert _state(store, "r1") == before


def test_an_unknown_run_or_a_bad_reason_is_refused(store: Any) -> None:
    given_queued(store, "r1")
    before = _state(store, "r1")
    with pytest.raises(UnknownRun):
        _admission(store).cancel("nope")
    for reason in ("", "x" * 501, "a\x00b"):
        with pytest.raises(InvalidAdmission):
            _admission(store).cancel("r1", reason)
    assert _state(store, "r1") == before
