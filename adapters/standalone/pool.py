"""The in-process executor pool: task code runs on threads of the executing process.

The pool only runs task code. It never touches the store: each finished task leaves its outcome
in a queue and calls ``notify`` so that the runner's loop (the one thread that speaks to the
store) reports it through the fenced worker commands. Threads are daemons: a process that stops
before a task returns does not wait for it (the task's Attempt is then abandoned or, after a
crash, recovered at the next boot).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from adapters.execution import TaskContext, TaskMapping, invoke_task
from application.worker_commands import Offer
from domain.fence import LeaseFence
from domain.model import JsonValue

MAX_ERROR_LENGTH = 2_000


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one execution of a task returned, or why it failed."""

    attempt_id: str
    succeeded: bool
    output: JsonValue = None
    error: str | None = None


@dataclass(slots=True)
class Execution:
    """An Attempt this process started: its offer, its fence and when to renew its lease."""

    offer: Offer
    fence: LeaseFence
    renew_at: float
    thread: threading.Thread | None = None
    orphaned: bool = False


def describe_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text[:MAX_ERROR_LENGTH]


class InProcessPool:
    """Runs each started Attempt's task on a daemon thread of its own. How many run at once is
    bounded upstream: dispatch offers a session no more Attempts than its capacity."""

    def __init__(self, tasks: TaskMapping, notify: Callable[[], None]) -> None:
        self._tasks = dict(tasks)
        self._notify = notify
        self._finished: queue.SimpleQueue[Outcome] = queue.SimpleQueue()

    @property
    def task_names(self) -> list[str]:
        return sorted(self._tasks)

    def start(self, execution: Execution) -> None:
        offer = execution.offer
        thread = threading.Thread(
            target=self._execute,
            args=(offer,),
            name=f"ql3-task-{offer.task}-{offer.attempt_id[:8]}",
            daemon=True,
        )
        execution.thread = thread
        thread.start()

    def finished(self) -> list[Outcome]:
        """Outcomes of tasks that returned since the last call."""
        outcomes: list[Outcome] = []
        while True:
            try:
                outcomes.append(self._finished.get_nowait())
            except queue.Empty:
                return outcomes

    def _execute(self, offer: Offer) -> None:
        context = TaskContext(
            run_id=offer.run_id,
            attempt_number=offer.attempt_number,
            idempotency_key=offer.idempotency_key,
        )
        try:
            function = self._tasks[offer.task]
            output = invoke_task(function, offer.input, context)
            outcome = Outcome(attempt_id=offer.attempt_id, succeeded=True, output=output)
        except BaseException as error:  # task code may raise anything; it fails the Attempt
            outcome = Outcome(
                attempt_id=offer.attempt_id, succeeded=False, error=describe_error(error)
            )
        self._finished.put(outcome)
        self._notify()
