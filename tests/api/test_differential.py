"""The in-memory runtime and the SQLite runtime give the same results for the same script."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import ql3
from ql3 import InvalidTransition, RetryPolicy, Safety, Submission, UnknownTask
from ql3.bootstrap import standalone
from ql3.testing import InlineWorker, in_memory
from tests.api.tasks import TASKS, resize


def _script(rt: ql3.Runtime, run_due: Callable[[], int]) -> list[Any]:
    """Submits, runs, cancels and reads; returns everything observed, run ids left out."""
    seen: list[Any] = []
    ids = [
        rt.submit("echo", {"a": [1, "two", None]}),
        rt.submit("explode", 3),
        rt.submit("double", 21),
        rt.submit(resize, {"id": 9}, policy=RetryPolicy(max_attempts=2, safety=Safety.UNSAFE)),
    ]
    ids += rt.submit_many([("echo", i) for i in range(3)] + [Submission("charge")])
    rt.cancel(ids[-1])
    seen.append(run_due())
    try:
        rt.cancel(ids[0])
    except InvalidTransition as error:
        seen.append(str(error).replace(ids[0], "RUN"))
    try:
        rt.submit_many([("echo", 1), ("nope", 2)])
    except UnknownTask as error:
        seen.append(str(error))
    seen.append(run_due())
    for run_id in ids:
        info = rt.get(run_id)
        seen.append(
            (
                info.task,
                info.status,
                info.input,
                info.output,
                # The first line: the traceback after it names each executor's own frames.
                info.error.splitlines()[0] if info.error else None,
                info.attempts,
                info.policy,
            )
        )
    return seen


def test_memory_and_sqlite_agree(tmp_path: Path) -> None:
    memory = in_memory(TASKS)
    try:
        expected = _script(memory, memory.run_due)
    finally:
        memory.close()

    sqlite = ql3.standalone(str(tmp_path / "diff.db"), tasks=TASKS)
    container = standalone.build(store=sqlite.store, database_path=str(tmp_path / "diff.db"))
    worker = InlineWorker(
        container.core.worker_commands(), container.coordinator().run_cycle, TASKS
    )
    try:
        observed = _script(sqlite, worker.run_due)
    finally:
        sqlite.close()

    assert observed == expected
    assert expected[0] == 7  # every run but the cancelled one started once
    assert (
        "explode",
        ql3.RunStatus.FAILED,
        3,
        None,
        "ValueError: bad payload 3",
        1,
        None,
    ) in expected
