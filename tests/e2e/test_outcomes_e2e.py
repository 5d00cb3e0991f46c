"""Retry on error and execution timeouts end to end on PostgreSQL (ADR 0013): runs submitted
with ``ql3 submit``, a ``ql3 serve`` node whose ingress writes as its least-privilege role, and
a ``ql3 worker`` process whose tasks run in child processes.

A task that raises on its first two attempts ends ``succeeded`` on attempt 3; a task that sleeps
past its timeout is stopped (its child killed before the task could end) and retried, then
fails once its attempts are exhausted; an unsafe run that raises is never executed twice."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest

from tests.e2e.conftest import Cluster, Ledger, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _submit(cluster: Cluster, task: str, payload: Any, *options: str) -> str:
    done = cluster.ql3("submit", task, "--input", json.dumps(payload), *options, "--json")
    assert done.returncode == 0, done.stderr
    run_id: str = json.loads(done.stdout)["run_id"]
    return run_id


def _failed_events(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [e["data"] for e in document["events"] if e["type"] == "attempt_failed"]


def test_a_task_raising_twice_succeeds_on_attempt_3(cluster: Cluster, ledger: Ledger) -> None:
    run_id = _submit(
        cluster, "o1.flaky", {"failures": 2}, "--safety", "idempotent", "--retry-on-error",
        "--max-attempts", "3", "--backoff-initial", "0.2",
    )
    worker = cluster.start_worker("o1", "worker-o1", ledger)
    cluster.wait_status([run_id], {"succeeded", "failed"})
    document = cluster.show(run_id)
    assert document["status"] == "succeeded"
    assert document["output"] == {"attempt": 3}
    assert [a["status"] for a in document["attempts"]] == ["failed", "failed", "succeeded"]
    first_error = document["attempts"][0]["error"]
    assert first_error.splitlines()[0] == "RuntimeError: attempt 1 fails"
    assert "Traceback (most recent call last)" in first_error
    failures = _failed_events(document)
    assert [(f["cause"], f["retry"], f["next_attempt"]) for f in failures] == [
        ("error", True, 2),
        ("error", True, 3),
    ]
    assert [e["attempt"] for e in ledger.entries("flaky", run_id)] == [1, 2, 3]
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.output()


def test_a_task_past_its_timeout_is_stopped_retried_and_failed(
    cluster: Cluster, ledger: Ledger
) -> None:
    run_id = _submit(
        cluster, "o2.sleep", {"seconds": 30}, "--timeout", "1", "--safety", "idempotent",
        "--retry-on-error", "--max-attempts", "2", "--backoff-initial", "0.2",
    )
    worker = cluster.start_worker("o2", "worker-o2", ledger)
    cluster.wait_status([run_id], {"succeeded", "failed"}, timeout=30)
    document = cluster.show(run_id)
    assert document["status"] == "failed"
    assert document["error"] == "timed out after 1.0 s"
    assert document["timeout_ms"] == 1_000
    assert [a["status"] for a in document["attempts"]] == ["failed", "failed"]
    assert [f["cause"] for f in _failed_events(document)] == ["timeout", "timeout"]
    assert [f["retry"] for f in _failed_events(document)] == [True, False]
    assert _failed_events(document)[-1]["reason"] == "attempts_exhausted"
    # Both attempts began and were stopped: neither task body reached its end.
    assert [e["attempt"] for e in ledger.entries("start", run_id)] == [1, 2]
    assert ledger.entries("end", run_id) == []
    for attempt in document["attempts"]:
        assert attempt["lease"]["release_reason"] == "completed"
    assert "ran past its timeout" in worker.output()
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.output()


def test_an_unsafe_run_that_raises_is_not_retried(cluster: Cluster, ledger: Ledger) -> None:
    refused = cluster.ql3(
        "submit", "o3.flaky", "--safety", "unsafe", "--retry-on-error", "--max-attempts", "3"
    )
    assert refused.returncode == 2 and "idempotent or deduplicated" in refused.stderr
    run_id = _submit(
        cluster, "o3.flaky", {"failures": 1}, "--safety", "unsafe", "--retry-on-lost",
        "--max-attempts", "3",
    )
    worker = cluster.start_worker("o3", "worker-o3", ledger)
    cluster.wait_status([run_id], {"succeeded", "failed"})
    document = cluster.show(run_id)
    assert document["status"] == "failed"
    assert [a["status"] for a in document["attempts"]] == ["failed"]
    wait_for(lambda: len(ledger.entries("flaky", run_id)) == 1, 5, "the one execution")
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.output()
