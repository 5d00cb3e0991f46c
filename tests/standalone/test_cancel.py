"""Cancelling runs in Standalone (ADR 0017): the runner learns it at its next renewal, cancels an
async task and reports the stop instead of a completion; the run stays cancelled, and the
runner goes on with other work. A task that ignores its cancellation runs on in its thread, but
its outcome is discarded and the drain does not wait for it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ql3.application.queries import RunQueries
from ql3.bootstrap import standalone
from ql3.domain.model import RunStatus
from tests.standalone.support import wait_for
from tests.worker.async_tasks import TASKS


class Served:
    def __init__(self, database: Path) -> None:
        self.container = standalone.build(
            database_path=str(database), lease_ttl_s=1.5, drain_timeout_s=600.0
        )
        self.lines: list[str] = []
        self.runner = self.container.runner(tasks=TASKS, emit=self.lines.append)
        self.runner.boot()
        self.thread = threading.Thread(target=self.runner.serve, daemon=True)
        self.thread.start()
        self.admission = self.container.core.admission()

    def status(self, run_id: str) -> tuple[RunStatus, str | None]:
        view = RunQueries(self.container.store().unit_of_work).show(run_id)
        assert view is not None
        return view.run.status, view.run.error

    def said(self, text: str) -> Callable[[], bool]:
        return lambda: any(text in line for line in self.lines)

    def stop(self) -> None:
        """Stop; the drain (600 s) must not be what ends it."""
        self.runner.request_stop()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    serving = Served(tmp_path / "ql3.sqlite")
    try:
        yield serving
    finally:
        if serving.thread.is_alive():
            serving.stop()
        serving.container.store().close()


def _plain_runs(served: Served, value: int) -> Any:
    run_id = served.admission.submit("plain", value)
    wait_for(lambda: served.status(run_id)[0].is_terminal, 10, "the plain run")
    return served.status(run_id)[0]


def test_a_cancelled_async_task_is_cancelled_and_its_run_stays_cancelled(
    served: Served, tmp_path: Path
) -> None:
    marker = tmp_path / "nap"
    run_id = served.admission.submit("nap", {"marker": str(marker), "seconds": 60})
    wait_for(marker.exists, 10, "the task to start")
    assert served.admission.cancel(run_id, "not now") is RunStatus.RUNNING
    wait_for(Path(f"{marker}.cancelled").exists, 10, "the task to be cancelled")
    wait_for(served.said("ended: its run was cancelled"), 10, "the stop report")
    assert served.said("its run was cancelled; stopping the task")()
    assert not served.said("outcome was refused")()
    assert _plain_runs(served, 1) is RunStatus.SUCCEEDED  # the runner goes on
    assert served.status(run_id) == (RunStatus.CANCELLED, "not now")
    served.stop()
    assert served.status(run_id) == (RunStatus.CANCELLED, "not now")


def test_a_task_that_ignores_its_cancellation_holds_up_nothing(
    served: Served, tmp_path: Path
) -> None:
    marker = tmp_path / "stubborn"
    run_id = served.admission.submit("stubborn", {"marker": str(marker)})
    wait_for(marker.exists, 10, "the task to start")
    served.admission.cancel(run_id)
    wait_for(served.said("its run was cancelled; stopping the task"), 10, "the runner to learn")
    assert _plain_runs(served, 2) is RunStatus.SUCCEEDED
    served.stop()  # the drain does not wait for a task whose run was cancelled
    assert served.said("left running: its run was cancelled")()
    assert served.status(run_id)[0] is RunStatus.CANCELLED
