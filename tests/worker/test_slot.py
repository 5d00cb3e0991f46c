"""Execution slots: a task runs in a child process that the worker can really stop."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ql3.adapters.worker.slot import Job, SlotError, SlotProcess
from tests.worker.conftest import Ledger


def _job(task: str, payload: object, attempt_id: str = "a1", number: int = 1) -> Job:
    return Job(
        attempt_id=attempt_id,
        run_id="r1",
        attempt_number=number,
        idempotency_key="r1",
        task=task,
        input=payload,
    )


def test_a_slot_runs_tasks_one_after_another(ledger: Ledger) -> None:
    slot = SlotProcess("tests.e2e.tasks:app")
    slot.start()
    try:
        first = slot.run(_job("e2e.double", {"n": 21}))
        assert first.succeeded and first.output == {"doubled": 42}
        failed = slot.run(_job("e2e.fail", {"message": "no luck"}))
        assert not failed.succeeded and failed.error.splitlines()[0] == "RuntimeError: no luck"
        unknown = slot.run(_job("e2e.nope", None))
        assert not unknown.succeeded and "no task" in (unknown.error or "")
        pids = {e["pid"] for e in ledger.entries()}
        assert pids == {slot.pid}  # one child, reused
        (entry,) = ledger.entries("double")
        assert (entry["run_id"], entry["attempt"], entry["key"]) == ("r1", 1, "r1")
    finally:
        slot.close()


def test_kill_really_stops_the_task(ledger: Ledger, tmp_path: Path) -> None:
    import threading

    slot = SlotProcess("tests.e2e.tasks:app")
    slot.start()
    pid = slot.pid
    assert pid is not None
    outcome = []
    runner = threading.Thread(
        target=lambda: outcome.append(slot.run(_job("e2e.sleep", {"seconds": 30}, "a9")))
    )
    runner.start()
    deadline = time.monotonic() + 10
    while not ledger.entries("start"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert not slot.kill("another-attempt")  # only the named attempt's task is stopped
    assert slot.kill("a9")
    runner.join(timeout=5)
    assert outcome and outcome[0].killed and not outcome[0].succeeded
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child is gone, not merely told to stop
    assert ledger.entries("end") == []
    slot.start()  # a fresh child for the next task
    assert slot.pid != pid
    assert slot.run(_job("e2e.double", {"n": 1})).output == {"doubled": 2}
    slot.close()


def test_a_bad_app_does_not_start() -> None:
    slot = SlotProcess("tests.e2e.no_such_module:app")
    with pytest.raises(SlotError, match="cannot import"):
        slot.start()


def test_a_job_stopped_before_it_reached_the_child_never_runs(ledger: Ledger) -> None:
    slot = SlotProcess("tests.e2e.tasks:app")
    slot.start()
    try:
        assert not slot.kill("a5")  # not running yet: it is cancelled instead
        outcome = slot.run(_job("e2e.double", {"n": 1}, "a5"))
        assert outcome.killed and not outcome.succeeded
        assert ledger.entries() == []
        assert slot.run(_job("e2e.double", {"n": 1}, "a6")).output == {"doubled": 2}
    finally:
        slot.close()


def test_a_job_for_a_child_that_died_while_idle_never_began(ledger: Ledger) -> None:
    import signal

    slot = SlotProcess("tests.e2e.tasks:app")
    slot.start()
    try:
        pid = slot.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        outcome = slot.run(_job("e2e.double", {"n": 1}, "a7"))
        assert not outcome.started and not outcome.succeeded
        assert slot.pid is None  # the slot knows to start a fresh child
        assert ledger.entries() == []
        slot.start()
        assert slot.run(_job("e2e.double", {"n": 2}, "a8")).output == {"doubled": 4}
    finally:
        slot.close()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "gone"
