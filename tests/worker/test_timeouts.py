"""The worker SDK stops a task past its run's timeout with the self-fence's stop (its slot's
child is killed) and reports a failing completion that timed out, while its lease is live; the
node then retries it on error or fails it (ADR 0013). A task that ends in time is unaffected."""

from __future__ import annotations

import os

from ql3.application.admission import AdmissionRequest
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.worker.conftest import Ledger, LocalNode, WorkerThread, worker_settings

RETRY = RetryPolicy(
    retry_on_error=True,
    max_attempts=2,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=0, cap_ms=0),
)


def _submit(node: LocalNode, payload: object, policy: RetryPolicy | None, timeout_ms: int) -> str:
    (run_id,) = node.admission.submit_many(
        [AdmissionRequest(task="e2e.sleep", input=payload, policy=policy, timeout_ms=timeout_ms)]
    )
    return str(run_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_task_past_its_timeout_is_killed_reported_and_retried(
    node: LocalNode, ledger: Ledger
) -> None:
    run_id = _submit(node, {"seconds": 0.1, "first_attempt_seconds": 60}, RETRY, 500)
    worker = WorkerThread(worker_settings(node)).start()
    node.wait_for(lambda: node.run(run_id).status.is_terminal, timeout=20)
    assert node.run(run_id).status is RunStatus.SUCCEEDED
    first, second = node.attempts(run_id)
    assert (first.status, first.error) == (AttemptStatus.FAILED, "timed out after 0.5 s")
    assert second.status is AttemptStatus.SUCCEEDED
    lease = node.leases(run_id)[0]
    assert (lease.status, lease.release_reason) == (LeaseStatus.RELEASED, ReleaseReason.COMPLETED)
    started = [e for e in ledger.entries("start") if e["attempt"] == 1]
    assert len(started) == 1 and not _alive(started[0]["pid"])  # the slot's child was killed
    assert [e["attempt"] for e in ledger.entries("end")] == [2]
    worker.worker.request_drain()
    assert worker.join() == 0
    assert worker.worker.abandoned == 0


def test_without_retry_the_timeout_fails_the_run_and_a_quick_task_is_unaffected(
    node: LocalNode, ledger: Ledger
) -> None:
    slow = _submit(node, {"seconds": 60}, None, 300)
    quick = _submit(node, {"seconds": 0.05}, None, 10_000)
    worker = WorkerThread(worker_settings(node, concurrency=2)).start()
    node.wait_for(lambda: all(node.run(r).status.is_terminal for r in (slow, quick)), timeout=20)
    assert (node.run(slow).status, node.run(slow).error) == (
        RunStatus.FAILED,
        "timed out after 0.3 s",
    )
    assert node.run(quick).status is RunStatus.SUCCEEDED
    assert node.events(quick)[-1] == "attempt_succeeded" and len(node.attempts(quick)) == 1
    worker.worker.request_drain()
    assert worker.join() == 0
