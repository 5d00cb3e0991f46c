"""Cancelling a running run end to end on PostgreSQL (ADR 0017): ``ql3 runs cancel`` against a
real ``ql3 serve`` node, whose ingress connects as its least-privilege role, and a real
``ql3 worker`` process. The worker learns of the cancellation at its next renewal, kills the
task's slot process and reports the stop; the run stays cancelled and the worker goes on."""

from __future__ import annotations

import json
import signal

import pytest

from tests.e2e.conftest import LEASE_TTL_S, Cluster, Ledger, alive, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def test_a_running_task_is_stopped_when_its_run_is_cancelled(
    cluster: Cluster, ledger: Ledger
) -> None:
    run_id = cluster.submit("k.sleep", {"seconds": 120})
    worker = cluster.start_worker("k", "worker-k", ledger)
    wait_for(lambda: len(ledger.entries("start", run_id)) == 1, what="the task to start")
    (started,) = ledger.entries("start", run_id)
    assert alive(started["pid"])

    cancelled = cluster.ql3("runs", "cancel", run_id, "--reason", "operator stop", "--json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout) == {
        "run_id": run_id,
        "status": "cancelled",
        "was": "running",
    }
    # At its next renewal (every third of the TTL) the worker is refused as cancelled and
    # kills the slot's process group: the task's process is gone.
    wait_for(lambda: not alive(started["pid"]), 3 * LEASE_TTL_S, "the task's process to end")
    wait_for(
        lambda: "stopped: its run was cancelled" in worker.output(),
        3 * LEASE_TTL_S,
        "the worker to report the stop",
    )
    assert "its run was cancelled; stopping the task" in worker.output()
    assert ledger.entries("end", run_id) == []

    document = cluster.show(run_id)
    assert (document["status"], document["error"]) == ("cancelled", "operator stop")
    (attempt,) = document["attempts"]
    assert attempt["status"] == "cancelled"
    lease = attempt["lease"]
    assert (lease["status"], lease["release_reason"], lease["version"]) == (
        "released",
        "cancelled",
        2,
    )
    assert [e["type"] for e in document["events"]][-1] == "run_cancelled"

    # A finished run: exit 1, nothing changes.
    again = cluster.ql3("runs", "cancel", run_id)
    assert again.returncode == 1 and "is cancelled" in again.stderr
    assert cluster.show(run_id) == document

    # The worker goes on: its slot takes the next task in a fresh process.
    nxt = cluster.submit("k.double", {"n": 3})
    cluster.wait_status([nxt], {"succeeded"})
    assert cluster.show(run_id) == document  # the cancelled run never runs again
    assert len(ledger.entries("start", run_id)) == 1
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.output()
