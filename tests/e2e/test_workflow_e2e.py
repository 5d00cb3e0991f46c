"""End to end on PostgreSQL: a three-step workflow survives the SIGKILL of the worker running
its middle (idempotent) step, and completes with each step's body run as the policies allow."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.e2e.conftest import Cluster, Ledger, alive, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

IDEMPOTENT = {
    "retry_on_lost": True,
    "max_attempts": 2,
    "safety": "idempotent",
    "backoff": {"initial_ms": 0, "cap_ms": 0},
}


def _step(document: dict[str, Any], step_id: str) -> dict[str, Any]:
    (step,) = [s for s in document["steps"] if s["id"] == step_id]
    return step


def test_a_workflow_survives_the_sigkill_of_its_middle_step(
    cluster: Cluster, ledger: Ledger
) -> None:
    workflows = cluster.container.core.workflows()
    workflow_id = workflows.submit(
        {
            "name": "three-steps",
            "steps": [
                {"id": "first", "task": "w.double", "input": {"n": 1}},
                {
                    "id": "middle",
                    "task": "w.sleep",
                    # Running when the worker dies; the retried attempt is quick.
                    "input": {"seconds": 0.1, "first_attempt_seconds": 120},
                    "after": ["first"],
                    "policy": IDEMPOTENT,
                },
                {"id": "last", "task": "w.double", "input": {"n": 3}, "after": ["middle"]},
            ],
        }
    )
    worker = cluster.start_worker("w", "worker-w", ledger, concurrency=2)
    wait_for(lambda: len(ledger.entries("start")) == 1, what="the middle step to start")
    (started,) = ledger.entries("start")
    middle_run = started["run_id"]
    cluster.wait_status([middle_run], {"running"})

    worker.signal(signal.SIGKILL)
    worker.wait()
    wait_for(lambda: not alive(started["pid"]), 5, "the middle step's slot to die")
    assert cluster.status(workflow_id) == "running"
    assert _step(cluster.show(workflow_id), "last")["run_id"] is None

    # The same worker id registers again: the old process is gone, the middle step is
    # recovered and retried (idempotent), and the workflow goes on to its last step.
    again = cluster.start_worker("w", "worker-w", ledger, concurrency=2)
    cluster.wait_status([workflow_id], {"succeeded", "failed"}, timeout=30)
    document = cluster.show(workflow_id)
    assert document["status"] == "succeeded"
    steps = {step["id"]: step for step in document["steps"]}
    assert {step["run_status"] for step in steps.values()} == {"succeeded"}
    assert steps["middle"]["run_id"] == middle_run

    middle = cluster.show(middle_run)
    assert [a["status"] for a in middle["attempts"]] == ["lost", "succeeded"]
    lost_lease = middle["attempts"][0]["lease"]
    assert (lost_lease["status"], lost_lease["release_reason"], lost_lease["version"]) == (
        "released", "lease_expired", 2
    )
    for step_id in ("first", "last"):
        assert len(cluster.show(steps[step_id]["run_id"])["attempts"]) == 1
    # Each body ran once, except the middle one: killed once, then done once.
    assert [e["attempt"] for e in ledger.entries("start", middle_run)] == [1, 2]
    assert [e["attempt"] for e in ledger.entries("end", middle_run)] == [2]
    doubled = [e["run_id"] for e in ledger.entries("double")]
    assert doubled == [steps["first"]["run_id"], steps["last"]["run_id"]]
    again.signal(signal.SIGTERM)
    assert again.wait() == 0, again.output()
