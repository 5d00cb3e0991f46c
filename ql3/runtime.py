"""The runtime an application embeds: submit and read runs, and start the profile's work.

Build one with :func:`ql3.cluster`, :func:`ql3.standalone`, :func:`ql3.edge` or, in tests,
:func:`ql3.testing.in_memory`. Building opens the store only; nothing runs until
:meth:`Runtime.start`. Submitting, reading, waiting and cancelling work before and after a start:
a web process that only submits never starts the runtime (ADR 0009)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ql3.application.admission import (
    Admission,
    AdmissionRequest,
    Admitted,
    UnknownRun,
    delay_ms,
    epoch_ms,
)
from ql3.application.budgets import DEFAULT_BATCH_SIZE
from ql3.application.history import (
    HistoryPruning,
    InvalidDuration,
    PruneReport,
    parse_duration,
)
from ql3.application.task_limits import TaskLimits
from ql3.application.tasks import TaskRegistry, json_input, timeout_millis
from ql3.bootstrap.producer import Producer
from ql3.domain.dispatch import TaskLimit
from ql3.domain.errors import Error, InvalidAdmission
from ql3.domain.model import JsonValue, Run, RunStatus
from ql3.domain.policy import RetryPolicy
from ql3.workflows import Workflow

if TYPE_CHECKING:
    # Loaded when a workflow is first used: a submit imports neither (ADR 0009).
    from ql3.application.workflows import Workflows
    from ql3.domain.workflows import WorkflowSpec
    from ql3.workflows import WorkflowInfo

Task = str | Callable[..., Any]

log = logging.getLogger("ql3")

# How long a wait sleeps between two reads where no notification wakes it: growing from the
# first to the last value.
POLL_FIRST_S = 0.005
POLL_LAST_S = 0.25
NOTIFIED_PAUSE_S = 5.0


class WaitTimeout(Error, TimeoutError):
    """The run did not finish within the wait's timeout."""


class UnsupportedTransaction(Error, TypeError):
    """This runtime cannot write in the transaction given (its profile or its type)."""


@dataclass(frozen=True, slots=True)
class Submission:
    """One run to submit: a task (by name or by its declared function), its JSON input and,
    optionally, a policy that replaces the task's template and an execution timeout in seconds
    that replaces the task's.

    ``delay`` (seconds or a ``timedelta``) or ``run_after`` (a ``datetime``; naive is UTC), not
    both, make it a delayed run, claimable once the store's clock reaches that time.
    ``unique_key``: while an unfinished run holds that key, that run answers instead and
    nothing is written (ADR 0015)."""

    task: Task
    input: object = None
    policy: RetryPolicy | None = None
    timeout: float | None = None
    priority: int = 0
    delay: float | dt.timedelta | None = None
    run_after: dt.datetime | None = None
    unique_key: str | None = None


@dataclass(frozen=True, slots=True)
class Submitted:
    """What :meth:`Runtime.submit_unique` answers: the run's id, and whether that run existed
    already (an unfinished run held the unique key; nothing was written)."""

    run_id: str
    existing: bool

    @classmethod
    def of(cls, admitted: Admitted) -> Submitted:
        return cls(run_id=admitted.run_id, existing=admitted.existing)


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
    :meth:`await_run`, :meth:`cancel`; operators' :meth:`prune_finished`. Lifecycle:
    :meth:`start`, :meth:`stop`, :meth:`close` (also as a context manager)."""

    profile: str

    def __init__(self, producer: Producer, tasks: TaskRegistry | None) -> None:
        self._producer = producer
        self._tasks = tasks
        self._started = False
        self._stopped = False
        self._closed = False
        self._lock = threading.Lock()
        # Operator consoles built on this runtime (``console_app()``), closed with it.
        self._consoles: list[Any] = []

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
        timeout_ms = timeout_millis(submission.timeout)
        if self._tasks is not None:
            request = self._tasks.request(task, payload, policy=policy, timeout_ms=timeout_ms)
        elif not isinstance(task, str):
            raise InvalidAdmission("without a task registry, a task is given by its name")
        else:
            request = AdmissionRequest(
                task=task, input=json_input(payload), policy=policy, timeout_ms=timeout_ms
            )
        return _timed_and_keyed(replace(request, priority=submission.priority), submission)

    def submit(
        self,
        task: Task,
        input: object = None,
        *,
        policy: RetryPolicy | None = None,
        timeout: float | None = None,
        priority: int = 0,
        delay: float | dt.timedelta | None = None,
        run_after: dt.datetime | None = None,
        unique_key: str | None = None,
        transaction: object | None = None,
    ) -> str:
        """Admit one run and return its id. ``timeout``: the seconds an attempt may run before
        its worker stops it as a failure (else the task's). With ``transaction`` (a SQLAlchemy
        ``Connection`` or ``Session``, or a psycopg connection) it is written in that
        transaction and commits or rolls back with it; workers are woken only when it commits.
        A run of higher ``priority`` is claimed before the other queued runs of its task (within
        :data:`ql3.domain.model.MIN_PRIORITY` .. :data:`ql3.domain.model.MAX_PRIORITY`). ``delay``,
        ``run_after`` and ``unique_key`` as for :class:`Submission`: with a key an unfinished
        run holds, that run's id is returned (:meth:`submit_unique` also says so)."""
        one = Submission(task, input, policy, timeout, priority, delay, run_after, unique_key)
        return self.submit_many([one], transaction=transaction)[0]

    def submit_unique(
        self,
        task: Task,
        input: object = None,
        *,
        unique_key: str,
        policy: RetryPolicy | None = None,
        timeout: float | None = None,
        priority: int = 0,
        delay: float | dt.timedelta | None = None,
        run_after: dt.datetime | None = None,
        transaction: object | None = None,
    ) -> Submitted:
        """:meth:`submit` with a unique key, answering whether the run existed already: while
        an unfinished run holds ``unique_key`` its id comes back with ``existing=True`` and
        nothing is written; otherwise a new run is admitted (``existing=False``)."""
        one = Submission(task, input, policy, timeout, priority, delay, run_after, unique_key)
        request = self.request(one)
        admission = (
            self._producer.admission if transaction is None else self._admission_in(transaction)
        )
        return Submitted.of(admission.admit_many([request])[0])

    def submit_many(
        self,
        submissions: Iterable[Submission | tuple[Task, object]],
        *,
        transaction: object | None = None,
    ) -> list[str]:
        """Admit several runs at once, all or none; their ids in order. Submissions with one
        unique key share one run (the first of them is admitted, unless an unfinished run holds
        the key already)."""
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
        timeout: float | None = None,
        priority: int = 0,
        delay: float | dt.timedelta | None = None,
        run_after: dt.datetime | None = None,
        unique_key: str | None = None,
    ) -> str:
        """:meth:`submit` for asyncio code (the store's call runs in a worker thread)."""
        return await asyncio.to_thread(
            self.submit,
            task,
            input,
            policy=policy,
            timeout=timeout,
            priority=priority,
            delay=delay,
            run_after=run_after,
            unique_key=unique_key,
        )

    async def asubmit_unique(
        self,
        task: Task,
        input: object = None,
        *,
        unique_key: str,
        policy: RetryPolicy | None = None,
        timeout: float | None = None,
        priority: int = 0,
        delay: float | dt.timedelta | None = None,
        run_after: dt.datetime | None = None,
    ) -> Submitted:
        """:meth:`submit_unique` for asyncio code."""
        return await asyncio.to_thread(
            self.submit_unique,
            task,
            input,
            unique_key=unique_key,
            policy=policy,
            timeout=timeout,
            priority=priority,
            delay=delay,
            run_after=run_after,
        )

    async def asubmit_many(
        self, submissions: Iterable[Submission | tuple[Task, object]]
    ) -> list[str]:
        items = list(submissions)
        return await asyncio.to_thread(self.submit_many, items)

    def _admission_in(self, transaction: object) -> Admission:
        return self._producer.admission_in(self._unit_of_work_in(transaction, workflow=False))

    def _unit_of_work_in(self, transaction: object, *, workflow: bool) -> Callable[[], Any]:
        """A unit of work factory writing in the caller's ``transaction`` (a workflow needs
        more of it than an admission of runs)."""
        raise UnsupportedTransaction(
            f"the {self.profile} runtime does not write in a caller's transaction"
        )

    # --- workflows --------------------------------------------------------------------------------

    def workflow_spec(self, workflow: Workflow | WorkflowSpec) -> WorkflowSpec:
        """The domain's workflow of ``workflow``, validated: each step's task checked against the
        registry (when the runtime has one), its input checked as JSON, its policy and timeout
        the ones given or else the task's."""
        from ql3.domain.workflows import WorkflowSpec

        if isinstance(workflow, WorkflowSpec):
            return workflow
        if not isinstance(workflow, Workflow):
            raise InvalidAdmission("submit_workflow takes a ql3.Workflow")

        def resolve(
            task: Task, payload: object, policy: RetryPolicy | None, timeout: float | None
        ) -> tuple[str, JsonValue, RetryPolicy | None, int | None]:
            request = self.request(Submission(task, payload, policy, timeout))
            return request.task, request.input, request.policy, request.timeout_ms

        return workflow.spec(resolve)

    def submit_workflow(
        self,
        workflow: Workflow | WorkflowSpec,
        *,
        unique_key: str | None = None,
        transaction: object | None = None,
    ) -> str:
        """Admit a workflow and return the id of its aggregate run; its first steps are admitted
        by the next cycle's workflow frontier. Refused (``InvalidWorkflow``, ``UnknownTask``,
        ``InvalidInput``) before anything is written. With ``transaction`` it is written in the
        caller's transaction, as :meth:`submit`; with ``unique_key`` an unfinished workflow (or
        run) holding the key answers instead and nothing is written."""
        from ql3.application.workflows import Workflows

        spec = self.workflow_spec(workflow)
        uow_factory = (
            self.store.unit_of_work
            if transaction is None
            else self._unit_of_work_in(transaction, workflow=True)
        )
        workflows = Workflows(uow_factory, self._producer.identities)
        return workflows.admit(spec, unique_key=unique_key).run_id

    async def asubmit_workflow(
        self, workflow: Workflow | WorkflowSpec, *, unique_key: str | None = None
    ) -> str:
        """:meth:`submit_workflow` for asyncio code."""
        return await asyncio.to_thread(self.submit_workflow, workflow, unique_key=unique_key)

    @property
    def _workflows(self) -> Workflows:
        from ql3.application.workflows import Workflows

        return Workflows(self.store.unit_of_work, self._producer.identities)

    def get_workflow(self, workflow_id: str) -> WorkflowInfo:
        """The workflow's status, output and error, and each step's status, run id, attempts,
        output and error; ``UnknownWorkflow`` when there is no workflow of that id."""
        from ql3.workflows import WorkflowInfo

        return WorkflowInfo.of(self._workflows.get(workflow_id))

    async def aget_workflow(self, workflow_id: str) -> WorkflowInfo:
        return await asyncio.to_thread(self.get_workflow, workflow_id)

    def list_workflows(self, status: RunStatus | None = None, limit: int = 100) -> list[RunInfo]:
        """The workflows' aggregate runs (of ``status``), the most recent first."""
        return [RunInfo.of(run) for run in self._workflows.list_workflows(status, limit)]

    def wait_workflow(self, workflow_id: str, timeout: float = 30.0) -> WorkflowInfo:
        """Block until the workflow succeeded, failed or was cancelled and return it, as
        :meth:`wait` waits for a run; ``WaitTimeout`` after ``timeout`` seconds."""
        self.get_workflow(workflow_id)  # UnknownWorkflow before any wait
        self.wait(workflow_id, timeout)
        return self.get_workflow(workflow_id)

    async def await_workflow(self, workflow_id: str, timeout: float = 30.0) -> WorkflowInfo:
        """:meth:`wait_workflow` for asyncio code."""
        return await asyncio.to_thread(self.wait_workflow, workflow_id, timeout)

    def cancel_workflow(self, workflow_id: str, reason: str = "cancelled") -> RunStatus:
        """Cancel an unfinished workflow at once and return the status it had: every step
        that has not finished is cancelled with its run; a running step's worker is refused at
        its next call and stops the task, as for :meth:`cancel`. A finished workflow raises
        ``InvalidTransition`` and nothing changes; an unknown one ``UnknownWorkflow``."""
        return self._workflows.cancel(workflow_id, reason)

    async def acancel_workflow(self, workflow_id: str, reason: str = "cancelled") -> RunStatus:
        return await asyncio.to_thread(self.cancel_workflow, workflow_id, reason)

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

    def cancel(self, run_id: str, reason: str = "cancelled") -> RunStatus:
        """Cancel an unfinished run at once and return the status it had. A waiting run
        (``created``, ``queued``, ``retry_wait``, delayed) never runs; a running Attempt is
        cancelled too and its lease released, so its worker is refused at its next call (a
        renewal, at most a third of the lease TTL later, or its completion), stops the task
        and discards any result (ADR 0017). A finished run raises ``InvalidTransition`` and
        nothing changes; an unknown id raises ``UnknownRun``."""
        return self._producer.admission.cancel(run_id, reason)

    async def acancel(self, run_id: str, reason: str = "cancelled") -> RunStatus:
        return await asyncio.to_thread(self.cancel, run_id, reason)

    # --- finished history -------------------------------------------------------------------------

    def prune_finished(
        self,
        older_than: str | dt.timedelta,
        *,
        dry_run: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> PruneReport:
        """Delete the finished runs (succeeded, failed, cancelled) whose last change is more
        than ``older_than`` (``"30d"``, ``"12h"``, ``"90m"``, ``"3600s"`` or a ``timedelta``)
        before the store's clock, with their attempts, leases, events and every row that
        references them, in transactions of at most ``batch_size`` runs (ADR 0016). With
        ``dry_run`` it counts them and deletes nothing. Returns what it removed."""
        if isinstance(older_than, dt.timedelta):
            older_than_ms = older_than // dt.timedelta(milliseconds=1)
        elif isinstance(older_than, str):
            older_than_ms = parse_duration(older_than)
        else:
            raise InvalidDuration(f"an age is a duration text or a timedelta: {older_than!r}")
        pruning = HistoryPruning(self._producer.store.unit_of_work, batch_size)
        return pruning.prune(older_than_ms, dry_run=dry_run)

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

    def declare_schedules(self) -> Any:
        """Record the schedules declared with the tasks as the triggers ``code:NAME`` (created,
        or made to match the declaration and active) and pause every other ``code:`` trigger,
        which the code no longer declares; an operator's triggers are left alone. What
        :meth:`start` does first; returns what changed (``created``, ``updated``, ``paused``)."""
        from ql3.adapters.cron import CroniterCalendar
        from ql3.application.triggers import TriggerDefinition, Triggers
        from ql3.domain.triggers import DECLARED_PREFIX

        if self._tasks is None:
            raise RuntimeError("declaring schedules needs the runtime's task registry")
        definitions = [
            TriggerDefinition(
                name=DECLARED_PREFIX + schedule.name,
                task=schedule.task,
                input=schedule.input,
                policy=schedule.policy,
                every_ms=schedule.every_ms,
                cron=schedule.cron,
                catch_up=schedule.catch_up,
                catch_up_limit=schedule.catch_up_limit,
            )
            for schedule in self._tasks.schedules()
        ]
        triggers = Triggers(self.store.unit_of_work, self._producer.identities, CroniterCalendar())
        declared = triggers.declare(definitions)
        for name in declared.created:
            log.info("schedule %s: trigger created", name)
        for name in declared.updated:
            log.info("schedule %s: trigger updated to its declaration", name)
        for name in declared.paused:
            log.warning(
                "trigger %s is no longer declared in code: paused (ql3 triggers delete %s "
                "removes it)",
                name,
                name,
            )
        return declared

    def start(self) -> None:
        """Start the profile's work in this process (idempotent; once per runtime). The limits
        and schedules declared with the tasks (``@tasks.task(limit=N, schedule=...)``,
        ``tasks.schedule(...)``) are recorded first."""
        with self._lock:
            if self._closed or self._stopped:
                raise RuntimeError("a stopped or closed runtime cannot start again: build one")
            if self._started:
                return
            if self._tasks is not None:
                self._limits.declare(self._tasks.limits())
                self.declare_schedules()
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
        for console in self._consoles:
            console.close()
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


def _timed_and_keyed(request: AdmissionRequest, submission: Submission) -> AdmissionRequest:
    """The request with the submission's delay or due time and its unique key."""
    if submission.delay is not None and submission.run_after is not None:
        raise InvalidAdmission("give delay or run_after, not both")
    if submission.unique_key is not None and not isinstance(submission.unique_key, str):
        raise InvalidAdmission("a unique key is a string")
    return replace(
        request,
        delay_ms=delay_ms(submission.delay) if submission.delay is not None else None,
        run_after_ms=(
            epoch_ms(submission.run_after) if submission.run_after is not None else None
        ),
        unique_key=submission.unique_key,
    )


def _submission(item: Submission | tuple[Task, object] | Sequence[Any]) -> Submission:
    if isinstance(item, Submission):
        return item
    if isinstance(item, tuple) and len(item) == 2:
        return Submission(item[0], item[1])
    raise InvalidAdmission("submit_many takes Submission values or (task, input) pairs")
