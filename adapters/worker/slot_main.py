"""The child process of one execution slot: ``python -m ql3.adapters.worker.slot_main APP PID``.

It loads the task mapping once, then runs one task at a time, reading a job per line on stdin
and answering one line on its private copy of stdout; the task's own prints go to stderr. It
dies with its parent (Linux parent-death signal), so a killed worker leaves no task running.

An ``async def`` task runs on an event loop; ``SIGUSR1`` (:data:`CANCEL_SIGNAL`) cancels it, and
the answer then says ``cancelled``. A signal that comes when no async task runs is ignored."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any, TextIO

from ql3.adapters.execution import (
    AppLoadError,
    TaskContext,
    describe_failure,
    invoke_task,
    is_async_task,
    load_app,
)

PR_SET_PDEATHSIG = 1
CANCEL_SIGNAL = signal.SIGUSR1


class Cancelled(Exception):
    """The worker cancelled the async task (a self-fence)."""


def _ignore(_signum: int, _frame: object) -> None:
    return None


def run_cancellable(awaitable: Any) -> Any:
    """Run an async task on a new event loop, cancelled by :data:`CANCEL_SIGNAL`. asyncio is
    imported here, by the first async task: most children never need it."""
    import asyncio

    async def body() -> Any:
        task = asyncio.ensure_future(awaitable)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(CANCEL_SIGNAL, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            raise Cancelled() from None
        finally:
            loop.remove_signal_handler(CANCEL_SIGNAL)
            signal.signal(CANCEL_SIGNAL, _ignore)  # removing the handler put back the default

    return asyncio.run(body())


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)


def _answer(out: TextIO, document: dict[str, Any]) -> None:
    try:
        line = json.dumps(document, allow_nan=False)
    except (TypeError, ValueError) as error:
        line = json.dumps({"ok": False, "error": f"the result is not JSON: {error}"})
    out.write(line + "\n")
    out.flush()


def _run(tasks: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    fn = tasks.get(job.get("task", ""))
    if fn is None:
        return {"ok": False, "error": f"this worker has no task {job.get('task')!r}"}
    context = TaskContext(
        run_id=job["run_id"],
        attempt_number=int(job["attempt_number"]),
        idempotency_key=job["idempotency_key"],
    )
    try:
        output = invoke_task(fn, job.get("input"), context, run=run_cancellable)
        return {"ok": True, "output": output}
    except Cancelled:
        return {"ok": False, "error": "cancelled by the worker", "cancelled": True}
    except (Exception, SystemExit) as error:
        return {"ok": False, "error": describe_failure(error, 10_000)}


def main(argv: list[str]) -> int:
    spec, parent_pid = argv[1], int(argv[2])
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a task stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(CANCEL_SIGNAL, _ignore)
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # prints of the task go to stderr, never into the protocol
    try:
        tasks = load_app(spec)
    except AppLoadError as error:
        _answer(out, {"ready": False, "error": str(error)})
        return 2
    async_tasks = sorted(name for name, fn in tasks.items() if is_async_task(fn))
    _answer(out, {"ready": True, "tasks": sorted(tasks), "async_tasks": async_tasks})
    for line in sys.stdin:
        if not line.strip():
            continue
        _answer(out, _run(tasks, json.loads(line)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
