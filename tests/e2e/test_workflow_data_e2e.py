"""Workflows from Python on PostgreSQL, end to end with real ``ql3 worker`` processes (ADR
0021): a diamond whose last step gets both its parents' outputs; a worker SIGKILLed during an
idempotent middle step, which is retried so the last step gets that step's one output; the
same with an unsafe middle step, which fails closed with its workflow, the last step never
running; ``cancel_workflow`` while a step runs, which stops that step's process."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

import ql3
from ql3 import RetryPolicy, RunStatus, Safety, StepStatus, Workflow
from ql3.domain.policy import Backoff
from tests.e2e.conftest import LEASE_TTL_S, Cluster, Ledger, alive, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

IDEMPOTENT = RetryPolicy(
    safety=Safety.IDEMPOTENT, retry_on_lost=True, max_attempts=2,
    backoff=Backoff(initial_ms=0, cap_ms=0),
)
UNSAFE = RetryPolicy(safety=Safety.UNSAFE)


@pytest.fixture
def runtime(cluster: Cluster) -> Iterator[ql3.Runtime]:
    rt = ql3.cluster(cluster.database_url, pool_size=2)
    yield rt
    rt.close()


def _diamond(prefix: str, b_task: str = "gather", b_input: Any = None,
             b_policy: RetryPolicy | None = None) -> Workflow:
    wf = Workflow(f"{prefix}-diamond")
    a = wf.step("a", f"{prefix}.gather", {"n": 1})
    b = wf.step("b", f"{prefix}.{b_task}", b_input, after=[a], policy=b_policy)
    c = wf.step("c", f"{prefix}.gather", {"side": "c"}, after=[a])
    wf.step("d", f"{prefix}.gather", {"last": True}, after=[b, c])
    return wf


def test_a_diamond_submitted_from_python_runs_on_real_workers(
    cluster: Cluster, ledger: Ledger, runtime: ql3.Runtime
) -> None:
    workflow_id = runtime.submit_workflow(_diamond("dd", b_input={"side": "b"}))
    cluster.start_worker("dd", "worker-dd", ledger, concurrency=2)

    info = runtime.wait_workflow(workflow_id, timeout=60)

    assert info.status is RunStatus.SUCCEEDED, info
    a, b, c, d = (info.step(s).output for s in "abcd")
    assert a == {"input": {"n": 1}, "parents": {}}
    assert b == {"input": {"side": "b"}, "parents": {"a": a}}
    assert c == {"input": {"side": "c"}, "parents": {"a": a}}
    assert d == {"input": {"last": True}, "parents": {"b": b, "c": c}}
    assert {s.attempts for s in info.steps} == {1}
    assert [e["step"] for e in ledger.entries("gather")][-1] == "d"


def _kill_during_b(
    cluster: Cluster, ledger: Ledger, runtime: ql3.Runtime, workflow_id: str, prefix: str
) -> str:
    """Start a worker, SIGKILL it while step b sleeps (once c, beside it, is done), start it
    again with the same worker id; b's run id."""
    worker_id = f"worker-{prefix}"
    worker = cluster.start_worker(prefix, worker_id, ledger, concurrency=2)
    wait_for(lambda: len(ledger.entries("start")) == 1, 30, "step b to start")
    wait_for(
        lambda: runtime.get_workflow(workflow_id).step("c").run_status is RunStatus.SUCCEEDED,
        30,
        "step c to succeed",
    )
    (started,) = ledger.entries("start")
    worker.signal(signal.SIGKILL)
    worker.wait()
    wait_for(lambda: not alive(started["pid"]), 5, "step b's slot to die")
    cluster.start_worker(prefix, worker_id, ledger, concurrency=2)
    return str(started["run_id"])


def test_a_killed_idempotent_step_is_retried_and_the_fan_in_gets_its_one_output(
    cluster: Cluster, ledger: Ledger, runtime: ql3.Runtime
) -> None:
    wf = _diamond("ki", "sleep", {"seconds": 0.1, "first_attempt_seconds": 120}, IDEMPOTENT)
    workflow_id = runtime.submit_workflow(wf)

    b_run = _kill_during_b(cluster, ledger, runtime, workflow_id, "ki")

    info = runtime.wait_workflow(workflow_id, timeout=60)
    assert info.status is RunStatus.SUCCEEDED, info
    assert info.step("b").run_id == b_run and info.step("b").attempts == 2
    assert info.step("d").output["parents"]["b"] == {  # type: ignore[index,call-overload]
        "slept": 0.1, "attempt": 2}
    assert [e["attempt"] for e in ledger.entries("start", b_run)] == [1, 2]
    assert [e["attempt"] for e in ledger.entries("end", b_run)] == [2]
    (d_gathered,) = [e for e in ledger.entries("gather") if e["step"] == "d"]
    assert d_gathered["parents"]["b"] == {"slept": 0.1, "attempt": 2}


def test_a_killed_unsafe_step_fails_closed_and_the_fan_in_never_runs(
    cluster: Cluster, ledger: Ledger, runtime: ql3.Runtime
) -> None:
    wf = _diamond("ku", "sleep", {"seconds": 120}, UNSAFE)
    workflow_id = runtime.submit_workflow(wf)

    b_run = _kill_during_b(cluster, ledger, runtime, workflow_id, "ku")

    info = runtime.wait_workflow(workflow_id, timeout=60)
    assert info.status is RunStatus.FAILED, info
    assert info.error is not None and info.error.startswith("step b failed")
    b = info.step("b")
    assert (b.run_id, b.status, b.attempts) == (b_run, StepStatus.FAILED, 1)
    assert info.step("d").status is StepStatus.CANCELLED and info.step("d").run_id is None
    assert [e["attempt"] for e in ledger.entries("start", b_run)] == [1]
    assert "d" not in [e["step"] for e in ledger.entries("gather")]


def test_cancel_workflow_stops_the_running_steps_process(
    cluster: Cluster, ledger: Ledger, runtime: ql3.Runtime
) -> None:
    wf = _diamond("cw", "sleep", {"seconds": 120})
    workflow_id = runtime.submit_workflow(wf)
    worker = cluster.start_worker("cw", "worker-cw", ledger, concurrency=2)
    wait_for(lambda: len(ledger.entries("start")) == 1, 30, "step b to start")
    (started,) = ledger.entries("start")
    assert alive(started["pid"])

    assert runtime.cancel_workflow(workflow_id, "stop it") is RunStatus.RUNNING

    info = runtime.get_workflow(workflow_id)
    assert (info.status, info.error) == (RunStatus.CANCELLED, "stop it")
    assert info.step("b").run_status is RunStatus.CANCELLED
    assert info.step("d").status is StepStatus.CANCELLED
    # At its next renewal the worker is refused as cancelled and kills the step's process.
    wait_for(lambda: not alive(started["pid"]), 3 * LEASE_TTL_S, "step b's process to end")
    wait_for(lambda: "stopped: its run was cancelled" in worker.output(), 3 * LEASE_TTL_S,
             "the worker to report the stop")
    assert ledger.entries("end", started["run_id"]) == []
