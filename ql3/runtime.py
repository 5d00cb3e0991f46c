"""The runtime an application embeds: submit and read runs, and start the profile's work.

Build one with :func:`ql3.cluster`, :func:`ql3.standalone`, :func:`ql3.edge` or, in tests,
:func:`ql3.testing.in_memory`. Building opens the store only; nothing runs until
:meth:`Runtime.start`. Submitting, reading, waiting and cancelling work before and after a start:
a web process that only submits never starts the runtime (ADR 0009)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from application.admission import Admission, AdmissionRequest, UnknownRun
from application.task_limits import TaskLimits
from application.tasks import TaskRegistry, json_input
from bootstrap.producer import Producer
from domain.dispatch import TaskLimit
from domain.errors import InvalidAdmission
from domain.model import JsonValue, Run, RunStatus
from domain.policy import RetryPolicy

Task = str | Callable[..., Any]

# How long a wait sleeps between two reads where no notification wakes it: growing from the
# first to the last value.
POLL_FIRST_S = 0.005
POLL_LAST_S = 0.25
NOTIFIED_PAUSE_S = 5.0


class WaitTimeout(TimeoutError):
    """The run did not finish within the wait's timeout."""


class UnsupportedTransaction(TypeError):
    """This runtime cannot write in the transaction given (its profile or its type)."""


@dataclass(frozen=True, slots=True)
class Submission:
    """One run to submit: a task (by name or by its declared function), its JSON input and,
    optionally, a policy that replaces the task's template."""

    task: Task
    input: object = None
    policy: RetryPolicy | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What a caller reads of a run."""

    id: str
    task: str
    status: RunStatus
    input: JsonValue
    output: JsonValue
    error: str | None
    attempts: int
    policy: RetryPolicy | None

    @property
    def finished(self) -> bool:
        return self.status.is_terminal

    @property
    def succeeded(self) -> bool:
        return self.status is RunStatus.SUCCEEDED

    @classmethod
    def of(cls, run: Run) -> RunInfo:
        return cls(
            id=run.id,
            task=run.task,
            status=run.status,
            input=run.input,
            output=run.output,
            error=run.error,
            attempts=run.attempt_count,
            policy=run.policy,
        )


class Runtime:
    """One profile's runtime inside the application's process.

    Producer side (any thread, before or after :meth:`start`): :meth:`submit`,
    :meth:`submit_many`, their ``a``-prefixed asyncio forms, :meth:`get`, :meth:`wait` /
    :meth:`await_run`, :meth:`cancel`. Lifecycle: :meth:`start`, :meth:`stop`, :meth:`close`
    (also as a context manager)."""

    profile: str

    def __init__(self, producer: Producer, tasks: TaskRegistry | None) -> None:
        self._producer = producer
        self._tasks = tasks
        self._started = False
        self._stopped = False
        self._closed = False
        self._lock = threading.Lock()

    @property
    def tasks(self) -> TaskRegistry | None:
        return self._tasks

    @property
    def store(self) -> Any:
        """The store the runtime writes to (for tests and diagnostics)."""
        return self._producer.store

    # --- submitting -------------------------------------------------------------------------------

    def request(self, submission: Submission) -> AdmissionRequest:
        """The admission request of one submission: the task checked against the registry (when
        the runtime has one), the input checked as JSON, the policy snapshot chosen, the
        priority (higher is claimed first, ADR 0014)."""
        task, payload, policy = submission.task, submission.input, submission.policy
        if self._tasks is not None:
            request = self._tasks.request(task, payload, policy=policy)
        elif not isinstance(task, str):
            raise InvalidAdmission("without a task registry, a task is given by its name")
        else:
            request = AdmissionRequest(task=task, input=json_input(payload), policy=policy)
        return replace(request, priority=submission.priority)

    def submit(
        self,
        task: Task,
        input: object = None,
        *,
        policy: RetryPolicy | None = None,
        priority: int = 0,
        transaction: object | None = None,
    ) -> str:
        """Admit one run and return its id. A run of higher ``priority`` is claimed before the
        other queued runs of its task (within :data:`domain.model.MIN_PRIORITY` ..
        :data:`domain.model.MAX_PRIORITY`). With ``transaction`` (a SQLAlchemy ``Connection`` or
        ``Session``, or a psycopg connection) it is written in that transaction and commits or
        rolls back with it; workers are woken only when it commits."""
        submission = Submission(task, input, policy, priority)
        return self.submit_many([submission], transaction=transaction)[0]

    def submit_many(
        self,
        submissions: Iterable[Submission | tuple[Task, object]],
        *,
        transaction: object | None = None,
    ) -> list[str]:
        """Admit several runs at once, all or none; their ids in order."""
        requests = [self.request(_submission(item)) for item in submissions]
        if transaction is None:
            return self._producer.admission.submit_many(requests)
        return self._admission_in(transaction).submit_many(requests)

    async def asubmit(
        self,
        task: Task,
        input: object = None,
        *,
        policy: RetryPolicy | None = None,
        priority: int = 0,
    ) -> str:
        """:meth:`submit` for asyncio code (the store's call runs in a worker thread)."""
        return await asyncio.to_thread(
            self.submit, task, input, policy=policy, priority=priority
        )

    async def asubmit_many(
        self, submissions: Iterable[Submission | tuple[Task, object]]
    ) -> list[str]:
        items = list(submissions)
        return await asyncio.to_thread(self.submit_many, items)

    def _admission_in(self, transaction: object) -> Admission:
        raise UnsupportedTransaction(
            f"the {self.profile} runtime does not write in a caller's transaction"
        )

    # --- reading ----------------------------------------------------------------------------------

    def get(self, run_id: str) -> RunInfo:
        """The run's status, output and error now; :class:`UnknownRun` when there is none."""
        with self._producer.store.unit_of_work() as uow:
            run = uow.runs.get_run(run_id)
        if run is None:
            raise UnknownRun(run_id)
        return RunInfo.of(run)

    async def aget(self, run_id: str) -> RunInfo:
        return await asyncio.to_thread(self.get, run_id)

    def wait(self, run_id: str, timeout: float = 30.0) -> RunInfo:
        """Block until the run finished (succeeded, failed or cancelled) and return it; raise
        :class:`WaitTimeout` after ``timeout`` seconds. On PostgreSQL the wait is woken by the
        notification a commit that finishes runs sends; elsewhere it reads again after growing
        pauses."""
        deadline = time.monotonic() + timeout
        signal = self._finish_signal()
        pause = POLL_FIRST_S
        while True:
            mark = signal.mark()
            info = self.get(run_id)
            if info.finished:
                return info
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"run {run_id} is still {info.status.value}")
            signal.wait(mark, min(left, pause))
            pause = min(signal.longest_pause_s, pause * 2)

    async def await_run(self, run_id: str, timeout: float = 30.0) -> RunInfo:
        """:meth:`wait` for asyncio code."""
        return await asyncio.to_thread(self.wait, run_id, timeout)

    def _finish_signal(self) -> FinishSignal:
        return SLEEPING

    def cancel(self, run_id: str, reason: str = "cancelled") -> None:
        """Cancel a run that has not started (``queued``, ``created`` or ``retry_wait``): it
        never runs. A started or finished run is refused and nothing changes."""
        self._producer.admission.cancel_waiting(run_id, reason)

    async def acancel(self, run_id: str, reason: str = "cancelled") -> None:
        await asyncio.to_thread(self.cancel, run_id, reason)

    # --- task limits ------------------------------------------------------------------------------

    @property
    def _limits(self) -> TaskLimits:
        return TaskLimits(self._producer.store.unit_of_work)

    def set_task_limit(self, task: str, max_running: int) -> TaskLimit:
        """At most ``max_running`` Attempts of ``task`` run at once, across every node and
        worker (0 stops its claims); replaces the limit it has (ADR 0014)."""
        return self._limits.set(task, max_running)

    def clear_task_limit(self, task: str) -> bool:
        """Remove the task's limit; whether it had one."""
        return self._limits.clear(task)

    def task_limits(self) -> Sequence[TaskLimit]:
        """Every task limit recorded, by task name."""
        return self._limits.all()

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the profile's work in this process (idempotent; once per runtime). The limits
        declared with the tasks (``@tasks.task(limit=N)``) are recorded first."""
        with self._lock:
            if self._closed or self._stopped:
                raise RuntimeError("a stopped or closed runtime cannot start again: build one")
            if self._started:
                return
            if self._tasks is not None:
                self._limits.declare(self._tasks.limits())
            self._start()
            self._started = True

    def stop(self, timeout: float = 30.0) -> None:
        """Stop what :meth:`start` started, waiting up to ``timeout`` seconds (idempotent)."""
        with self._lock:
            if not self._started:
                return
            self._started = False
            self._stopped = True
            self._stop(timeout)

    def close(self) -> None:
        """Stop, then close the store."""
        self.stop()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._producer.close()

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self, timeout: float) -> None:
        raise NotImplementedError

    def __enter__(self) -> Runtime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class FinishSignal:
    """What a wait sleeps on between two reads of its run: without notifications, a pause."""

    longest_pause_s = POLL_LAST_S

    def mark(self) -> int:
        return 0

    def wait(self, mark: int, seconds: float) -> None:
        time.sleep(seconds)


SLEEPING = FinishSignal()


class Notified(FinishSignal):
    """Woken by a notification: :meth:`notify` (called by the listener's thread) ends every
    wait that began before it. While ``listening()`` a wait reads again only when woken (or
    every :data:`NOTIFIED_PAUSE_S`, a safety net); while the listening connection is down it
    reads again after growing pauses, as without notifications."""

    def __init__(self, listening: Callable[[], bool]) -> None:
        self._listening = listening
        self._changed = threading.Condition()
        self._generation = 0

    @property
    def longest_pause_s(self) -> float:  # type: ignore[override]
        return NOTIFIED_PAUSE_S if self._listening() else POLL_LAST_S

    def notify(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def mark(self) -> int:
        with self._changed:
            return self._generation

    def wait(self, mark: int, seconds: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._generation != mark, seconds)


def _submission(item: Submission | tuple[Task, object] | Sequence[Any]) -> Submission:
    if isinstance(item, Submission):
        return item
    if isinstance(item, tuple) and len(item) == 2:
        return Submission(item[0], item[1])
    raise InvalidAdmission("submit_many takes Submission values or (task, input) pairs")
