"""Retry on error and execution timeouts on every store (ADR 0013), through the worker protocol
(:class:`WorkerCommands`) and the cadence's lost-retry step (:class:`LostRetry`): a failing
completion takes a Run that retries on error to ``retry_wait`` with its due time, in one change
with one event; Attempt N+1 is made only once the store's clock reaches it; exhausted attempts
and work that is not safe to repeat fail the Run; a timeout is a failure that is retried the
same way; the claim tells the worker the Run's timeout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from ql3.adapters.sql.schema import runs
from ql3.application.admission import Admission, AdmissionRequest
from ql3.application.lost_retry import LostRetry
from ql3.application.worker_commands import (
    BatchOutcome,
    Completion,
    Grant,
    SessionGrant,
    WorkerCommands,
)
from ql3.domain.events import EventType
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.application.support import CountingIdentities
from tests.contract.conftest import STORES, advance_time, open_store

TASK = "mail"
DELAY_MS = 5_000
ON_ERROR = RetryPolicy(
    retry_on_error=True,
    max_attempts=3,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=DELAY_MS, multiplier=1.0, cap_ms=DELAY_MS),
)


class Services:
    """Admission, the worker protocol and lost retry on one store, with one worker session."""

    def __init__(self, store: Any) -> None:
        identities = CountingIdentities()
        self.store = store
        self.admission = Admission(store.unit_of_work, identities)
        self.commands = WorkerCommands(store.unit_of_work, identities, lease_ttl_ms=60_000)
        self.lost_retry = LostRetry(store.unit_of_work, store, identities)
        self.session: SessionGrant = self.commands.register("w1", 4, [TASK])

    def submit(self, policy: RetryPolicy | None, timeout_ms: int | None = None) -> str:
        (run_id,) = self.admission.submit_many(
            [AdmissionRequest(task=TASK, input={}, policy=policy, timeout_ms=timeout_ms)]
        )
        return run_id

    def claim(self) -> Grant:
        answer = self.commands.claim(self.session.session_id, self.session.secret, limit=1)
        (grant,) = answer.grants
        return grant

    def fail(self, grant: Grant, *, timed_out: bool = False) -> BatchOutcome | None:
        answer = self.commands.complete_many(
            self.session.session_id,
            self.session.secret,
            [Completion(grant.fence, succeeded=False, error="boom", timed_out=timed_out)],
        )
        (result,) = answer.results
        assert result.ok, result.message
        return result.outcome

    def succeed(self, grant: Grant) -> None:
        answer = self.commands.complete_many(
            self.session.session_id,
            self.session.secret,
            [Completion(grant.fence, succeeded=True, output={"done": True})],
        )
        assert answer.results[0].ok

    def state(self, run_id: str) -> tuple[Any, list[Any], list[Any]]:
        with self.store.unit_of_work() as uow:
            run = uow.runs.get_run(run_id)
            attempts = list(uow.runs.attempts_of(run_id))
            events = [e.event for e in uow.runs.events_of(run_id)]
        return run, attempts, events


@pytest.fixture
def services(store: Any) -> Services:
    return Services(store)


def test_an_error_waits_in_retry_wait_then_attempt_2_runs_when_due(
    services: Services, store: Any
) -> None:
    run_id = services.submit(ON_ERROR)
    first = services.claim()
    assert services.fail(first) is BatchOutcome.FAILED
    run, attempts, events = services.state(run_id)
    assert run.status is RunStatus.RETRY_WAIT and run.error is None
    assert [a.status for a in attempts] == [AttemptStatus.FAILED]
    assert attempts[0].error == "boom"
    with store.unit_of_work() as uow:
        (lease,) = uow.runs.leases_of(run_id)
    assert (lease.status, lease.release_reason) == (LeaseStatus.RELEASED, ReleaseReason.COMPLETED)
    failed = events[-1]
    assert failed.type is EventType.ATTEMPT_FAILED and failed.attempt_id == first.attempt_id
    assert failed.data["retry"] is True and failed.data["cause"] == "error"
    assert failed.data["next_attempt"] == 2
    due = failed.data["next_attempt_at_ms"]
    assert run.next_attempt_at_ms == due and due == failed.at_ms + DELAY_MS
    # One change, one event: the completion wrote exactly one.
    assert [e.type for e in events] == [
        EventType.RUN_ADMITTED,
        EventType.ATTEMPT_STARTED,
        EventType.ATTEMPT_FAILED,
    ]

    # Not due yet: the cadence's lost retry makes no Attempt, nothing is claimable.
    assert services.lost_retry.run_once().attempts_created == 0
    answer = services.commands.claim(services.session.session_id, services.session.secret, limit=1)
    assert answer.grants == ()
    advance_time(store, DELAY_MS)
    assert services.lost_retry.run_once().attempts_created == 1
    second = services.claim()
    assert (second.run_id, second.attempt_number) == (run_id, 2)
    assert second.generation == first.generation + 1
    services.succeed(second)
    run, attempts, _ = services.state(run_id)
    assert run.status is RunStatus.SUCCEEDED and run.output == {"done": True}
    assert [a.status for a in attempts] == [AttemptStatus.FAILED, AttemptStatus.SUCCEEDED]


def test_exhausted_attempts_fail_the_run(services: Services, store: Any) -> None:
    run_id = services.submit(ON_ERROR)
    for number in (1, 2, 3):
        grant = services.claim()
        assert grant.attempt_number == number
        services.fail(grant)
        if number < 3:
            advance_time(store, DELAY_MS)
            assert services.lost_retry.run_once().attempts_created == 1
    run, attempts, events = services.state(run_id)
    assert run.status is RunStatus.FAILED and run.error == "boom"
    assert run.next_attempt_at_ms is None
    assert [a.status for a in attempts] == [AttemptStatus.FAILED] * 3
    assert events[-1].data["reason"] == "attempts_exhausted"


@pytest.mark.parametrize(
    ("policy", "reason"),
    [
        (RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.UNSAFE),
         "retry_on_error_disabled"),
        (None, "no_policy"),
    ],
)
def test_unsafe_or_undeclared_work_is_never_retried(
    services: Services, store: Any, policy: RetryPolicy | None, reason: str
) -> None:
    run_id = services.submit(policy)
    services.fail(services.claim())
    advance_time(store, 10 * DELAY_MS)
    assert services.lost_retry.run_once().attempts_created == 0
    run, attempts, events = services.state(run_id)
    assert run.status is RunStatus.FAILED
    assert len(attempts) == 1
    assert events[-1].data == {"error": "boom", "cause": "error", "retry": False, "reason": reason}


def test_the_claim_carries_the_timeout_and_a_timeout_is_retried(
    services: Services, store: Any
) -> None:
    run_id = services.submit(ON_ERROR, timeout_ms=2_000)
    grant = services.claim()
    assert grant.timeout_ms == 2_000
    services.fail(grant, timed_out=True)
    run, attempts, events = services.state(run_id)
    assert run.status is RunStatus.RETRY_WAIT and run.timeout_ms == 2_000
    assert attempts[0].error == "timed out after 2.0 s"
    assert events[-1].data["cause"] == "timeout" and events[-1].data["retry"] is True
    advance_time(store, DELAY_MS)
    assert services.lost_retry.run_once().attempts_created == 1
    again = services.claim()
    assert (again.attempt_number, again.timeout_ms) == (2, 2_000)


def test_a_run_without_a_timeout_is_granted_none(services: Services) -> None:
    services.submit(None)
    assert services.claim().timeout_ms is None


def test_a_repeated_failing_completion_answers_already_completed(services: Services) -> None:
    run_id = services.submit(ON_ERROR)
    grant = services.claim()
    services.fail(grant)
    before = services.state(run_id)
    assert services.fail(grant) is BatchOutcome.ALREADY_COMPLETED
    assert services.state(run_id) == before


# --- what the database states (ADR 0022) ----------------------------------------------------------

SQL_STORES = [param for param in STORES if param.id != "memory"]


@pytest.fixture(params=SQL_STORES)
def sql_store(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from open_store(request.param, request)


def test_the_database_refuses_a_run_written_around_the_api_that_retries_unsafe_work(
    sql_store: Any,
) -> None:
    """``ck_runs_retry_on_error_safety``: a Run whose policy retries on error is idempotent or
    deduplicated, whoever writes the row."""
    run_id = Services(sql_store).submit(ON_ERROR)
    columns = [column.name for column in runs.columns]
    copied = ", ".join(
        {"id": ":copy", "safety": ":safety"}.get(name, name) for name in columns
    )
    insert = text(
        f"INSERT INTO runs ({', '.join(columns)}) SELECT {copied} FROM runs WHERE id = :id"
    )
    update = text("UPDATE runs SET safety = :safety WHERE id = :id")
    for safety in ("unsafe", None):
        with pytest.raises(IntegrityError), sql_store.engine.begin() as connection:
            connection.execute(update, {"safety": safety, "id": run_id})
        with pytest.raises(IntegrityError), sql_store.engine.begin() as connection:
            connection.execute(insert, {"copy": "copy", "safety": safety, "id": run_id})
    with pytest.raises(IntegrityError), sql_store.engine.begin() as connection:
        connection.execute(
            text("UPDATE runs SET safety = 'unsafe', retry_on_error = true WHERE id = :id"),
            {"id": run_id},
        )
    # What the check allows: the same Run not retried on error, and a retryable copy.
    with sql_store.engine.begin() as connection:
        connection.execute(
            text("UPDATE runs SET safety = 'unsafe', retry_on_error = false WHERE id = :id"),
            {"id": run_id},
        )
        connection.execute(
            text("UPDATE runs SET safety = 'deduplicated', retry_on_error = true WHERE id = :id"),
            {"id": run_id},
        )
        connection.execute(insert, {"copy": "copy", "safety": "idempotent", "id": run_id})
        stored = connection.execute(
            text("SELECT id, safety FROM runs WHERE id IN (:id, 'copy') ORDER BY id"),
            {"id": run_id},
        ).all()
    assert sorted(tuple(row) for row in stored) == sorted(
        [(run_id, "deduplicated"), ("copy", "idempotent")]
    )
