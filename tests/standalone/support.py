"""Helpers of the standalone tests: a real ``ql3 standalone`` child process and reads of its
database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ql3.adapters.sql.sqlite import SqliteStore
from ql3.application.queries import RunQueries, RunView

REPO = Path(__file__).resolve().parents[2]
APP = "tests.standalone.tasks:TASKS"


class Child:
    """``python -m ql3.adapters.cli.main standalone ...`` with its output in a file."""

    def __init__(self, database: Path, log: Path, *extra: str) -> None:
        self.log_path = log
        self._log: IO[bytes] = log.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ql3.adapters.cli.main",
                "standalone",
                "--app",
                APP,
                "--db",
                str(database),
                *extra,
            ],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self._log.close()

    def stop(self, timeout: float = 20.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self._log.close()

    def output(self) -> str:
        return self.log_path.read_text()

    def ensure_dead(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        if not self._log.closed:
            self._log.close()


def views(database: Path, run_ids: list[str]) -> dict[str, RunView]:
    store = SqliteStore(database, wake=False)
    try:
        queries = RunQueries(store.unit_of_work)
        found = {run_id: queries.show(run_id) for run_id in run_ids}
    finally:
        store.close()
    return {run_id: view for run_id, view in found.items() if view is not None}


def wait_for(
    condition: Callable[[], Any], timeout: float, what: str, child: Child | None = None
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if child is not None and child.process.poll() is not None:
            raise AssertionError(f"the child exited while waiting for {what}:\n{child.output()}")
        if time.monotonic() > deadline:
            log = child.output() if child is not None else ""
            raise AssertionError(f"timed out waiting for {what}\n{log}")
        time.sleep(0.05)
