"""The in-process execution back-end: task code runs on threads of the executing process.

The pool only runs task code. It never touches the store: each finished task leaves its outcome
in a queue and calls ``notify`` so that the runner's loop (the one thread that speaks to the
store) hands it to the worker's ledger, which reports it through the worker protocol (ADR 0023).
:class:`PoolSlots` are the ledger's slots over this pool, as a remote worker's are child
processes. Its threads are started as they are first needed
and then kept, each taking the next task when it is free: no thread is started per Attempt.
Threads are daemons: a process that stops before a task returns does not wait for it (the
task's Attempt is then abandoned or, after a crash, recovered at the next boot).

An ``async def`` task runs on an event loop of its thread; :meth:`InProcessPool.cancel` cancels
it (the ledger stops it when the Attempt's lease is refused or its Run cancelled, or when the
task runs past its run's timeout). A thread cannot be killed: a sync task, or an async task
that ignores its cancellation, runs on until it returns, and the fence refuses its outcome
(ADR 0009); one past its timeout has been reported as a failure that timed out, and what it
returns is dropped (ADR 0013).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ql3.adapters.execution import TaskContext, TaskMapping, describe_failure, invoke_task
from ql3.adapters.worker.ledger import Ledger
from ql3.adapters.worker.slot import Job, JobOutcome
from ql3.domain.model import JsonValue

MAX_ERROR_LENGTH = 2_000
# A task's error carries its traceback (ADR 0020).
MAX_TASK_ERROR_LENGTH = 10_000


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one execution of a task returned, or why it failed."""

    attempt_id: str
    succeeded: bool
    output: JsonValue = None
    error: str | None = None


class Granted(Protocol):
    """What running an Attempt's task needs of its grant."""

    @property
    def run_id(self) -> str: ...

    @property
    def attempt_id(self) -> str: ...

    @property
    def attempt_number(self) -> int: ...

    @property
    def idempotency_key(self) -> str: ...

    @property
    def task(self) -> str: ...

    @property
    def input(self) -> JsonValue: ...


@dataclass(frozen=True, slots=True)
class Execution:
    """An Attempt handed to the pool: the grant its task runs for."""

    grant: Granted


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
        self._work: queue.SimpleQueue[Granted] = queue.SimpleQueue()
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

    def _run_async(self, grant: Granted, awaitable: Awaitable[object]) -> object:
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

    def _execute(self, grant: Granted) -> Outcome:
        return execute_grant(self._tasks, grant, run=lambda aw: self._run_async(grant, aw))


def execute_grant(
    tasks: TaskMapping, grant: Granted, *, run: Callable[[Any], Any] | None = None
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


class PoolSlot:
    """One of the ledger's slots (:class:`ql3.adapters.worker.ledger.SlotHandle`) over the pool:
    a place for one running task, not a thread of its own."""

    def __init__(self, index: int, slots: PoolSlots) -> None:
        self._index = index
        self._slots = slots

    @property
    def index(self) -> int:
        return self._index

    def put(self, job: Job) -> None:
        self._slots.start(self, job)

    def kill(self, attempt_id: str) -> bool:
        return self._slots.stop(attempt_id)


class PoolSlots:
    """The ledger's slots over the in-process pool, used by the runner's loop thread alone.

    A grant put into a slot starts on the pool; a pool that cannot start it reports it not
    started (the ledger hands it back). A stop cancels an async task; whatever way the task
    then ends, its outcome is a stop (as a child process's slot reports a killed task). A thread
    cannot be killed: :meth:`detach` reports a stopped task ended at once (its timeout, the end
    of a drain), and what its thread returns later is dropped. :meth:`deliver` hands the
    outcomes to the ledger; each frees its slot."""

    def __init__(self, pool: InProcessPool, capacity: int, notify: Callable[[], None]) -> None:
        self._pool = pool
        self._notify = notify
        self.handles = [PoolSlot(i, self) for i in range(capacity)]
        self._running: dict[str, PoolSlot] = {}  # attempt id -> the slot its task runs in
        self._stopping: set[str] = set()  # asked to stop: the outcome is a stop
        self._detached: set[str] = set()  # reported ended: what the thread returns is dropped
        self._ended: list[tuple[PoolSlot, str, JobOutcome]] = []  # outcomes not from the pool

    def start(self, slot: PoolSlot, job: Job) -> None:
        try:
            self._pool.start(Execution(grant=job))
        except Exception as error:  # no thread to be had
            outcome = JobOutcome(
                succeeded=False,
                error=f"slot failed to start: {describe_error(error)}",
                started=False,
            )
            self._ended.append((slot, job.attempt_id, outcome))
            self._notify()
            return
        self._running[job.attempt_id] = slot

    def stop(self, attempt_id: str) -> bool:
        if attempt_id not in self._running:
            return False
        self._stopping.add(attempt_id)
        self._pool.cancel(attempt_id)
        return True

    def detach(self, attempt_id: str) -> None:
        """Report the stopped task ended now; its thread, if it runs on, is forgotten."""
        slot = self._running.pop(attempt_id, None)
        if slot is None:
            return
        self._stopping.discard(attempt_id)
        self._detached.add(attempt_id)
        self._ended.append((slot, attempt_id, JobOutcome(succeeded=False, killed=True)))

    def deliver(self, ledger: Ledger) -> int:
        """Hand every outcome since the last call to the ledger; how many there were."""
        ended, self._ended = self._ended, []
        for outcome in self._pool.finished():
            attempt_id = outcome.attempt_id
            if attempt_id in self._detached:
                self._detached.discard(attempt_id)
                continue
            slot = self._running.pop(attempt_id, None)
            if slot is None:
                continue
            if attempt_id in self._stopping:
                self._stopping.discard(attempt_id)
                ended.append((slot, attempt_id, JobOutcome(succeeded=False, killed=True)))
            else:
                ended.append(
                    (
                        slot,
                        attempt_id,
                        JobOutcome(
                            succeeded=outcome.succeeded, output=outcome.output, error=outcome.error
                        ),
                    )
                )
        for slot, attempt_id, job_outcome in ended:
            ledger.on_outcome(slot, attempt_id, job_outcome, reusable=True)
        return len(ended)
