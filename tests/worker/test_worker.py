"""The worker SDK against a real node (HTTP, scheduler lifecycle) in this process: it runs tasks
in its slots, renews in the background, fences itself when it cannot renew, drains, stops when
its session is taken over, and gets back what a lost claim answer granted."""

from __future__ import annotations

import time

from ql3.adapters.worker.client import IngressClient
from ql3.adapters.worker.settings import WorkerFailed
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus, SessionStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.worker.conftest import (
    LEASE_TTL_S,
    Ledger,
    LocalNode,
    WorkerThread,
    worker_settings,
)
from tests.worker.fakes import DropsFirstGrantingClaimAnswer

SAFE = RetryPolicy(
    retry_on_lost=True,
    max_attempts=3,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=0, cap_ms=0),
)


def _terminal(node: LocalNode, run_ids: list[str]) -> bool:
    return all(node.run(r).status.is_terminal for r in run_ids)


def test_tasks_run_and_complete_with_their_outputs(node: LocalNode, ledger: Ledger) -> None:
    run_ids = [node.admission.submit("e2e.double", {"n": n}) for n in range(6)]
    failing = node.admission.submit("e2e.fail", {"message": "nope"})
    worker = WorkerThread(worker_settings(node, concurrency=3)).start()
    node.wait_for(lambda: _terminal(node, [*run_ids, failing]))
    worker.worker.request_drain()
    assert worker.join() == 0
    for n, run_id in enumerate(run_ids):
        run = node.run(run_id)
        assert run.status is RunStatus.SUCCEEDED and run.output == {"doubled": 2 * n}
        (lease,) = node.leases(run_id)
        assert (lease.status, lease.release_reason, lease.version) == (
            LeaseStatus.RELEASED,
            ReleaseReason.COMPLETED,
            2,
        )
    assert node.run(failing).status is RunStatus.FAILED
    error = node.run(failing).error
    assert error is not None and error.splitlines()[0] == "RuntimeError: nope"
    assert "Traceback (most recent call last)" in error
    assert len(ledger.entries("double")) == 6
    assert len({e["pid"] for e in ledger.entries()}) <= 3  # three slots, reused
    with node.store.unit_of_work() as uow:
        (session,) = [uow.sessions.get(worker.worker.session_id)]
        assert session is not None and session.status is SessionStatus.CLOSED


def test_renewals_keep_a_long_task_alive(node: LocalNode, ledger: Ledger) -> None:
    run_id = node.admission.submit("e2e.sleep", {"seconds": 1.5 * LEASE_TTL_S})
    worker = WorkerThread(worker_settings(node)).start()
    node.wait_for(lambda: node.run(run_id).status.is_terminal, timeout=20)
    worker.worker.request_drain()
    assert worker.join() == 0
    assert node.run(run_id).status is RunStatus.SUCCEEDED
    assert [a.number for a in node.attempts(run_id)] == [1]
    assert len(ledger.entries("start")) == 1


def test_drain_finishes_running_tasks_and_takes_no_new_work(
    node: LocalNode, ledger: Ledger
) -> None:
    running = [node.admission.submit("e2e.sleep", {"seconds": 1.0}) for _ in range(2)]
    worker = WorkerThread(worker_settings(node, concurrency=2)).start()
    node.wait_for(lambda: len(ledger.entries("start")) == 2)
    waiting = node.admission.submit("e2e.double", {"n": 1})
    worker.worker.request_drain()
    assert worker.join() == 0
    assert all(node.run(r).status is RunStatus.SUCCEEDED for r in running)
    assert node.run(waiting).status is RunStatus.QUEUED  # left for another worker, not lost
    assert ledger.entries("double") == []


def test_self_fencing_stops_the_task_when_the_ingress_is_gone(
    node: LocalNode, ledger: Ledger
) -> None:
    run_id = node.admission.submit("e2e.sleep", {"seconds": 60}, SAFE)
    worker = WorkerThread(worker_settings(node)).start()
    node.wait_for(lambda: len(ledger.entries("start")) == 1)
    (started,) = ledger.entries("start")
    node.stop()  # renewals fail from now on
    stopped_at = time.monotonic()
    deadline = stopped_at + LEASE_TTL_S
    # The slot's child is killed before the lease could have expired.
    while True:
        try:
            import os

            os.kill(started["pid"], 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the task was not stopped before its lease expired"
        time.sleep(0.02)
    assert ledger.entries("end") == []
    node.start()  # same port, same store: the worker reports what it stopped
    node.wait_for(
        lambda: (
            "evidence_recorded" in node.events(run_id)
            or node.attempts(run_id)[0].status is AttemptStatus.LOST
        )
    )
    # With the evidence, recovery loses attempt 1 and the safe run is retried and runs again.
    node.wait_for(lambda: len(node.attempts(run_id)) == 2, timeout=20)
    first = node.attempts(run_id)[0]
    assert first.status is AttemptStatus.LOST
    assert first.lost_evidence is not None
    assert first.lost_evidence.value == "worker_abandoned"
    worker.worker.request_stop()
    worker.join()


def test_a_worker_whose_session_is_replaced_stops(node: LocalNode, ledger: Ledger) -> None:
    run_id = node.admission.submit("e2e.sleep", {"seconds": 60})
    worker = WorkerThread(worker_settings(node, worker_id="dup")).start()
    node.wait_for(lambda: len(ledger.entries("start")) == 1)
    (started,) = ledger.entries("start")
    intruder = IngressClient(node.url)
    intruder.register("dup", 1, ["e2e.sleep"])  # the same worker id: the old process is gone
    result = worker.join(timeout=10)
    assert isinstance(result, WorkerFailed)
    import os

    try:
        os.kill(started["pid"], 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "the task of a replaced session must not keep running"
    # The replaced session is evidence: recovery fails the run (no policy) after expiry.
    node.wait_for(lambda: node.run(run_id).status is RunStatus.FAILED, timeout=15)
    intruder.close_connection()


def test_a_lost_claim_answer_is_handed_back_by_the_next_claim(
    node: LocalNode, ledger: Ledger
) -> None:
    run_id = node.admission.submit("e2e.double", {"n": 5})
    transport = DropsFirstGrantingClaimAnswer()
    worker = WorkerThread(
        worker_settings(node),
        client_factory=lambda s: IngressClient(s.ingress_url, transport=transport),
    ).start()
    node.wait_for(lambda: node.run(run_id).status.is_terminal)
    worker.worker.request_drain()
    assert worker.join() == 0
    (attempt,) = node.attempts(run_id)
    assert transport.dropped == [[attempt.id]]
    # The repeated claim did not name it: the node handed it back at once (no lost verdict,
    # no wait for the lease to expire), and the same Attempt was claimed again and ran once.
    assert node.run(run_id).status is RunStatus.SUCCEEDED
    assert attempt.number == 1 and attempt.status is AttemptStatus.SUCCEEDED
    assert [(le.generation, le.release_reason) for le in node.leases(run_id)] == [
        (1, ReleaseReason.HANDED_BACK),
        (2, ReleaseReason.COMPLETED),
    ]
    with node.store.unit_of_work() as uow:
        released = [
            e.event for e in uow.runs.events_of(run_id) if e.event.type.value == "attempt_released"
        ]
    assert [e.data["cause"] for e in released] == ["not_held"]
    assert "attempt_lost" not in node.events(run_id)
    assert len(ledger.entries("double")) == 1


def test_an_output_too_large_for_the_ingress_fails_the_attempt(
    node: LocalNode, ledger: Ledger
) -> None:
    run_id = node.admission.submit("e2e.big", {"bytes": 2 * 1024 * 1024})
    worker = WorkerThread(worker_settings(node)).start()
    node.wait_for(lambda: node.run(run_id).status.is_terminal)
    worker.worker.request_drain()
    assert worker.join() == 0
    run = node.run(run_id)
    assert run.status is RunStatus.FAILED
    assert run.error == "the ingress refused the result: body_too_large"
