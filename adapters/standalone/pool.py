"""The in-process executor pool: task code runs on threads of the executing process.

The pool only runs task code. It never touches the store: each finished task leaves its outcome
in a queue and calls ``notify`` so that the runner's loop (the one thread that speaks to the
store) reports it through the worker protocol. Its threads are started as they are first needed
and then kept, each taking the next task when it is free: no thread is started per Attempt.
Threads are daemons: a process that stops before a task returns does not wait for it (the
task's Attempt is then abandoned or, after a crash, recovered at the next boot).

An ``async def`` task runs on an event loop of its thread; :meth:`InProcessPool.cancel` cancels
it (the runner does when the Attempt's lease is lost, or when the task runs past its run's
timeout). A thread cannot be killed: a sync task, or an async task that ignores its
cancellation, runs on until it returns, and the fence refuses its outcome (ADR 0009); one past
its timeout has been reported as a failure that timed out, and what it returns is dropped
(ADR 0013).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ql3.adapters.execution import TaskContext, TaskMapping, describe_failure, invoke_task
from ql3.application.worker_commands import Grant
from ql3.domain.fence import LeaseFence
from ql3.domain.model import JsonValue

MAX_ERROR_LENGTH = 2_000
# A task's error carries its traceback (ADR 0020).
MAX_TASK_ERROR_LENGTH = 10_000


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one execution of a task returned, or why it failed; ``timed_out``: it ran past its
    run's timeout."""

    attempt_id: str
    succeeded: bool
    output: JsonValue = None
    error: str | None = None
    timed_out: bool = False


@dataclass(slots=True)
class Execution:
    """An Attempt a claim started for this process: its grant (with the fence), when to renew
    its lease and when it runs past its run's timeout (monotonic seconds)."""

    grant: Grant
    renew_at: float
    orphaned: bool = False
    timeout_at: float | None = None
    timed_out: bool = False  # reported as timed out: what its thread returns later is dropped
    cancelled: bool = False  # its Run was cancelled: its end is reported as a stop

    @property
    def fence(self) -> LeaseFence:
        return self.grant.fence

    @property
    def label(self) -> str:
        grant = self.grant
        return f"run {grant.run_id} attempt {grant.attempt_number} ({grant.task})"


def describe_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text[:MAX_ERROR_LENGTH]


class InProcessPool:
    """Runs each started Attempt's task on a thread of the pool. How many run at once is bounded
    upstream: the runner claims no more Attempts than its free capacity, so the pool never holds
    more threads than the most tasks that ran at once."""

    def __init__(self, tasks: TaskMapping, notify: Callable[[], None]) -> None:
        self._tasks = dict(tasks)
        self._notify = notify
        self._finished: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[Grant] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        # The event loop and task of each async task running now, by attempt id.
        self._running: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[object]]] = {}

    @property
    def task_names(self) -> list[str]:
        return sorted(self._tasks)

    @property
    def threads(self) -> int:
        return self._threads

    def start(self, execution: Execution) -> None:
        """Hand the task to an idle thread, or to a new one; raises (``RuntimeError``) when no
        thread is idle and none can be started."""
        with self._lock:
            if self._idle == 0:
                thread = threading.Thread(
                    target=self._serve, name=f"ql3-pool-{self._threads + 1}", daemon=True
                )
                thread.start()
                self._threads += 1
                self._idle += 1
            self._idle -= 1
        self._work.put(execution.grant)

    def cancel(self, attempt_id: str) -> bool:
        """Cancel the attempt's task if it is an async task running now; True if it was."""
        with self._lock:
            running = self._running.get(attempt_id)
        if running is None:
            return False
        loop, task = running
        loop.call_soon_threadsafe(task.cancel)
        return True

    def finished(self) -> list[Outcome]:
        """Outcomes of tasks that returned since the last call."""
        outcomes: list[Outcome] = []
        while True:
            try:
                outcomes.append(self._finished.get_nowait())
            except queue.Empty:
                return outcomes

    def _serve(self) -> None:
        while True:
            grant = self._work.get()
            outcome = self._execute(grant)
            # Idle again before the runner learns of the outcome: the slot it frees has a thread.
            with self._lock:
                self._idle += 1
            self._finished.put(outcome)
            self._notify()

    def _run_async(self, grant: Grant, awaitable: Awaitable[object]) -> object:
        async def body() -> object:
            task = asyncio.ensure_future(awaitable)
            with self._lock:
                self._running[grant.attempt_id] = (asyncio.get_running_loop(), task)
            try:
                return await task
            finally:
                with self._lock:
                    self._running.pop(grant.attempt_id, None)

        return asyncio.run(body())

    def _execute(self, grant: Grant) -> Outcome:
        return execute_grant(self._tasks, grant, run=lambda aw: self._run_async(grant, aw))


def execute_grant(
    tasks: TaskMapping, grant: Grant, *, run: Callable[[Any], Any] | None = None
) -> Outcome:
    """Run the granted Attempt's task in this thread (``run`` runs an async task's awaitable)
    and say how it ended. Task code may raise anything: that fails the Attempt."""
    context = TaskContext(
        run_id=grant.run_id,
        attempt_number=grant.attempt_number,
        idempotency_key=grant.idempotency_key,
    )
    try:
        output = invoke_task(tasks[grant.task], grant.input, context, run=run)
        return Outcome(attempt_id=grant.attempt_id, succeeded=True, output=output)
    except BaseException as error:
        return Outcome(
            attempt_id=grant.attempt_id,
            succeeded=False,
            error=describe_failure(error, MAX_TASK_ERROR_LENGTH),
        )
