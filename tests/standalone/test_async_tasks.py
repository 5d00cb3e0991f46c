"""Async tasks in Standalone: run by the embedded runtime's pool, cancelled on a self-fence."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import ql3
from ql3.adapters.standalone.pool import Execution, InProcessPool
from ql3.application.worker_commands import Grant
from tests.api.tasks import TASKS
from tests.worker.async_tasks import TASKS as ASYNC_TASKS


def _grant(task: str, payload: object) -> Grant:
    return Grant(
        run_id="r1",
        attempt_id="a1",
        attempt_number=1,
        task=task,
        input=payload,  # type: ignore[arg-type]
        generation=1,
        version=1,
        token="t",
        expires_at_ms=0,
        idempotency_key="r1",
    )


def test_the_pool_cancels_a_running_async_task(tmp_path: Path) -> None:
    finished = threading.Event()
    pool = InProcessPool(ASYNC_TASKS, finished.set)
    marker = tmp_path / "nap"
    pool.start(Execution(grant=_grant("nap", {"marker": str(marker)})))
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert pool.cancel("a1")
    assert finished.wait(10)
    (outcome,) = pool.finished()
    assert not outcome.succeeded and (outcome.error or "").splitlines()[0] == "CancelledError"
    assert (tmp_path / "nap.cancelled").exists()
    assert not pool.cancel("a1")  # nothing runs any more


def test_the_embedded_standalone_runtime_runs_async_and_sync_tasks(tmp_path: Path) -> None:
    with ql3.standalone(str(tmp_path / "s.db"), tasks=TASKS, lease_ttl_s=5) as runtime:
        runtime.start()
        doubled = runtime.submit("double", 21)
        echoed = runtime.submit("echo", {"x": 1})
        assert runtime.wait(doubled, timeout=30).output == 42
        assert runtime.wait(echoed, timeout=30).output == {"x": 1}
        runtime.stop()
        queued = runtime.submit("echo", 2)
        assert runtime.get(queued).status is ql3.RunStatus.QUEUED  # stopped: nothing runs
