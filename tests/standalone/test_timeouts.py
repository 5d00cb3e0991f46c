"""Execution timeouts and retry on error in the Standalone process (ADR 0013): a task past its
run's timeout fails as timed out at once (its thread cannot be stopped: what it returns later is
dropped) and is retried when its policy retries on error; a task that raises is retried the
same way."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ql3.application.admission import AdmissionRequest
from ql3.application.queries import RunQueries
from ql3.bootstrap import standalone
from ql3.domain.model import AttemptStatus, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.standalone.support import wait_for
from tests.standalone.tasks import TASKS

RETRY = RetryPolicy(
    retry_on_error=True,
    max_attempts=2,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=0, cap_ms=0),
)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Any]:
    container = standalone.build(database_path=str(tmp_path / "ql3.sqlite"), lease_ttl_s=5.0,
                                 resident_cadence_s=0.2)
    lines: list[str] = []
    runner = container.runner(tasks=TASKS, emit=lines.append)
    runner.boot()
    thread = threading.Thread(target=runner.serve, daemon=True)
    thread.start()
    container.lines = lines
    yield container
    runner.request_stop()
    runner.request_stop()  # abandon what still runs: a held thread is not waited for
    thread.join(timeout=30)
    container.store().close()


def _submit(container: Any, payload: Any, policy: RetryPolicy | None, timeout_ms: int) -> str:
    (run_id,) = container.core.admission().submit_many(
        [AdmissionRequest(task="hold", input=payload, policy=policy, timeout_ms=timeout_ms)]
    )
    return str(run_id)


def _view(container: Any, run_id: str) -> Any:
    view = RunQueries(container.store().unit_of_work).show(run_id)
    assert view is not None
    return view


def test_a_task_past_its_timeout_fails_at_once_and_is_retried(
    served: Any, tmp_path: Path
) -> None:
    payload = {"dir": str(tmp_path), "name": "t", "first_s": 30, "later_s": 0}
    run_id = _submit(served, payload, RETRY, 300)
    wait_for(lambda: _view(served, run_id).run.status.is_terminal, 15, "the retried run")
    view = _view(served, run_id)
    assert view.run.status is RunStatus.SUCCEEDED
    first, second = view.attempts
    assert (first.attempt.status, first.attempt.error) == (
        AttemptStatus.FAILED,
        "timed out after 0.3 s",
    )
    assert second.attempt.status is AttemptStatus.SUCCEEDED
    assert (tmp_path / "t-1").exists() and (tmp_path / "t-2").exists()
    assert any("timed out after 0.3 s" in line for line in served.lines), served.lines


def test_without_retry_a_timeout_fails_the_run(served: Any, tmp_path: Path) -> None:
    payload = {"dir": str(tmp_path), "name": "u", "first_s": 30}
    run_id = _submit(served, payload, None, 200)
    wait_for(lambda: _view(served, run_id).run.status.is_terminal, 15, "the timed-out run")
    view = _view(served, run_id)
    assert (view.run.status, view.run.error) == (RunStatus.FAILED, "timed out after 0.2 s")
    assert len(view.attempts) == 1
