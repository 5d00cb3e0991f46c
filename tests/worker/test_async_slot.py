"""Async tasks in an execution slot: run on an event loop, stopped by cancellation first, the
slot killed when a task ignores it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ql3.adapters.worker.slot import Job, JobOutcome, SlotProcess


def _job(task: str, payload: object, attempt_id: str) -> Job:
    return Job(
        attempt_id=attempt_id,
        run_id="r1",
        attempt_number=1,
        idempotency_key="r1",
        task=task,
        input=payload,
    )


def _run_in_background(slot: SlotProcess, job: Job) -> tuple[threading.Thread, list[JobOutcome]]:
    outcome: list[JobOutcome] = []
    runner = threading.Thread(target=lambda: outcome.append(slot.run(job)))
    runner.start()
    return runner, outcome


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_an_async_task_runs_to_its_end(tmp_path: Path) -> None:
    slot = SlotProcess("tests.worker.async_tasks:TASKS")
    slot.start()
    try:
        done = slot.run(_job("nap", {"marker": str(tmp_path / "m"), "seconds": 0}, "a1"))
        assert done.succeeded and done.output == "rested"
        assert slot.run(_job("plain", 1, "a2")).output == 2
    finally:
        slot.close()


def test_a_self_fence_cancels_an_async_task_and_keeps_the_slot(tmp_path: Path) -> None:
    slot = SlotProcess("tests.worker.async_tasks:TASKS", cancel_grace_s=20)
    slot.start()
    pid = slot.pid
    try:
        marker = tmp_path / "nap"
        runner, outcome = _run_in_background(slot, _job("nap", {"marker": str(marker)}, "a1"))
        _wait_for(marker)
        assert slot.kill("a1")
        runner.join(20)
        assert outcome and outcome[0].killed and outcome[0].started
        assert (tmp_path / "nap.cancelled").exists()  # cancelled, not killed
        assert slot.pid == pid  # the same child takes the next task
        assert slot.run(_job("plain", 41, "a2")).output == 42
    finally:
        slot.close()


def test_a_task_that_ignores_cancellation_has_its_slot_killed(tmp_path: Path) -> None:
    slot = SlotProcess("tests.worker.async_tasks:TASKS", cancel_grace_s=0.3)
    slot.start()
    try:
        marker = tmp_path / "stubborn"
        runner, outcome = _run_in_background(slot, _job("stubborn", {"marker": str(marker)}, "a1"))
        _wait_for(marker)
        assert slot.kill("a1")
        runner.join(20)
        assert outcome and outcome[0].killed
        assert slot.pid is None  # the child is gone; the pool starts a fresh one
    finally:
        slot.close()
