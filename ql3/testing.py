"""An in-memory runtime for an application's own tests, and the inline worker behind it.

:func:`in_memory` builds a :class:`InMemoryRuntime`: the memory store (the reference every store
is compared with), a fake clock the test moves, and the Cluster profile's services on it.
Nothing runs by itself: :meth:`InMemoryRuntime.run_due` runs one scheduler cycle and executes
every due run inline, in the test's thread, through the same worker protocol a remote worker
uses (claim, start, complete). A test can make the worker vanish in the middle of chosen runs and
see them recovered and retried, or failed, as their policy says::

    rt = ql3.testing.in_memory(tasks)
    run_id = rt.submit(resize, {"id": 7})
    rt.run_due(vanish=lambda started: started.attempt_number == 1)
    rt.advance(seconds=31)           # the vanished worker's lease expires
    rt.run_due()                     # lost, retry_wait (backoff 1 s) ...
    rt.advance(seconds=1)
    rt.run_due()                     # ... attempt 2 runs
    assert rt.get(run_id).succeeded

A run's execution timeout holds inline too, as far as a call in the test's own thread allows: an
``async def`` task is cancelled at its timeout; a plain function cannot be stopped, so one that
returns after its timeout (measured on the monotonic clock, not the fake one) fails as timed out
and its result is dropped (ADR 0013).

The pytest fixtures of :mod:`ql3.pytest_plugin` build one per test (ADR 0009)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast

from ql3.adapters.execution.app import run_awaitable
from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.adapters.memory.clock import DEFAULT_START_MS
from ql3.adapters.standalone.pool import execute_grant
from ql3.application.ports import UnitOfWork
from ql3.application.tasks import TaskRegistry
from ql3.application.worker_commands import Completion, Grant, SessionGrant, WorkerCommands
from ql3.bootstrap.producer import Producer
from ql3.domain.model import JsonValue, RunStatus
from ql3.domain.transitions import Change
from ql3.domain.workflows import WorkflowStep
from ql3.profiles import WithConsole
from ql3.runtime import RunInfo, UnsupportedTransaction, WaitTimeout

INLINE_WORKER_ID = "inline"
INLINE_CAPACITY = 64
MAX_ROUNDS = 10_000


@dataclass(frozen=True, slots=True)
class Started:
    """An attempt the inline worker just started (what ``vanish`` decides on)."""

    run_id: str
    task: str
    attempt_number: int
    input: JsonValue


class InlineWorker:
    """Executes due work in the caller's thread: one worker session claiming through
    :class:`WorkerCommands`, each task called inline, its completion carried by the next
    claim."""

    def __init__(
        self,
        commands: WorkerCommands,
        cycle: Callable[[], Any],
        tasks: TaskRegistry,
        *,
        worker_id: str = INLINE_WORKER_ID,
        capacity: int = INLINE_CAPACITY,
    ) -> None:
        self._commands = commands
        self._cycle = cycle
        self._tasks = tasks
        self._worker_id = worker_id
        self._capacity = capacity
        self._session: SessionGrant | None = None

    def run_due(self, *, vanish: Callable[[Started], bool] | None = None) -> int:
        """Run scheduler cycles and execute what they make due, until a cycle and a claim find
        nothing more; returns how many attempts started. An attempt for which ``vanish``
        answers True is started and never completed: its worker is then replaced (trusted
        evidence that it no longer runs), and its lease expires when the clock passes the TTL."""
        started = 0
        vanished = 0
        for _ in range(MAX_ROUNDS):
            self._cycle()
            session = self._register()
            completions: list[Completion] = []
            round_started = 0
            while True:
                answer = self._commands.claim(
                    session.session_id,
                    session.secret,
                    limit=self._capacity,
                    completions=completions,
                )
                completions = []
                for grant in answer.grants:
                    round_started += 1
                    if vanish is not None and vanish(_started(grant)):
                        vanished += 1
                        continue
                    completions.append(self._execute(grant))
                if not answer.grants and not completions:
                    break
            started += round_started
            if round_started == 0:
                break
        if vanished:
            self._session = None  # the next claim registers again: the old session is replaced
            self._register()
        return started

    def _register(self) -> SessionGrant:
        if self._session is None:
            self._session = self._commands.register(
                self._worker_id, self._capacity, sorted(self._tasks)
            )
        return self._session

    def _execute(self, grant: Grant) -> Completion:
        timeout_ms = grant.timeout_ms
        run: Callable[[Any], Any] | None = None
        if timeout_ms is not None:

            def run(awaitable: Any) -> Any:
                return run_awaitable(asyncio.wait_for(awaitable, timeout_ms / 1000))

        began = time.monotonic()
        outcome = execute_grant(self._tasks, grant, run=run)
        if timeout_ms is not None and (time.monotonic() - began) * 1000 >= timeout_ms:
            return Completion(fence=grant.fence, succeeded=False, timed_out=True)
        return Completion(
            fence=grant.fence,
            succeeded=outcome.succeeded,
            output=outcome.output,
            error=outcome.error,
        )


def _started(grant: Grant) -> Started:
    return Started(
        run_id=grant.run_id,
        task=grant.task,
        attempt_number=grant.attempt_number,
        input=grant.input,
    )


class InMemoryRuntime(WithConsole):
    """The runtime of an application's tests: memory store, fake clock, inline execution.

    It runs the Cluster profile's cadence (runtime recovery, lost retry, triggers, workflows,
    admission) on the memory store, so a run is recovered and retried exactly as its policy
    says in production. :meth:`start` and :meth:`stop` do nothing: :meth:`run_due` drives."""

    profile = "memory"

    def __init__(
        self, tasks: TaskRegistry, *, lease_ttl_s: float = 30.0, start_ms: int = DEFAULT_START_MS
    ) -> None:
        from ql3.bootstrap import cluster

        self.clock = FakeClock(start_ms)
        store = MemoryStore(self.clock)
        super().__init__(Producer(store), tasks)
        container = cluster.build(store=store, lease_ttl_s=lease_ttl_s)
        self.lease_ttl_s = lease_ttl_s
        self._worker = InlineWorker(
            container.core.worker_commands(), container.coordinator().run_cycle, tasks
        )
        if tasks.schedules():
            self.declare_schedules()  # their triggers fire as advance() makes them due

    def advance(self, seconds: float) -> int:
        """Move the store's clock forward; returns its new time in epoch milliseconds."""
        return self.clock.advance(round(seconds * 1000))

    def run_due(self, *, vanish: Callable[[Started], bool] | None = None) -> int:
        """See :meth:`InlineWorker.run_due`."""
        return self._worker.run_due(vanish=vanish)

    def wait(self, run_id: str, timeout: float = 30.0) -> RunInfo:
        """Run due work inline, then the run: finished, or :class:`WaitTimeout` at once (the
        clock does not move by itself, so waiting longer would change nothing)."""
        self.run_due()
        info = self.get(run_id)
        if not info.finished:
            raise WaitTimeout(f"run {run_id} is still {info.status.value}")
        return info

    def runs(self, status: RunStatus | None = None) -> list[RunInfo]:
        """Every run (of ``status``), oldest first."""
        return [RunInfo.of(run) for run in self._producer.queries.list(status, limit=10_000)]

    def events(self, run_id: str) -> list[str]:
        """The types of the run's events, in order."""
        view = self._producer.queries.show(run_id)
        return [kind for _seq, kind, _at, _attempt, _data in view.events] if view else []

    def _unit_of_work_in(self, transaction: object, *, workflow: bool) -> Callable[[], Any]:
        """Runs and workflows admitted in a SQLAlchemy ``Session`` or ``Connection`` of the
        application's own database reach the memory store when that transaction commits, and
        never when it rolls back (the memory store cannot join it, so it follows it)."""
        store = cast(MemoryStore, self.store)
        # One pending admission per transaction (and runtime): a unique key admitted earlier in
        # the same transaction is held for the later submits of it.
        slot = ("ql3.pending_admission", id(self))
        info = getattr(transaction, "info", None)
        pending = info.get(slot) if isinstance(info, dict) else None
        if pending is None:
            fresh = _PendingAdmission(self.clock, store)

            def committed() -> None:
                with store.unit_of_work() as uow:
                    uow.runs.add_many(fresh.changes)
                    uow.workflows.add_steps(fresh.steps)
                    uow.commit()

            def settled() -> None:
                if isinstance(info, dict):
                    info.pop(slot, None)

            _follow(transaction, committed, settled)
            if isinstance(info, dict):
                info[slot] = fresh
            pending = fresh
        chosen: _PendingAdmission = pending
        return lambda: chosen

    def _start(self) -> None:
        return None

    def _stop(self, timeout: float) -> None:
        return None


def in_memory(tasks: TaskRegistry, *, lease_ttl_s: float = 30.0) -> InMemoryRuntime:
    """A fresh in-memory runtime for ``tasks``."""
    return InMemoryRuntime(tasks, lease_ttl_s=lease_ttl_s)


@dataclass
class _PendingAdmission:
    """A unit of work that keeps the admitted changes until the caller's transaction commits."""

    clock: FakeClock
    store: MemoryStore
    changes: list[Change] = field(default_factory=list)
    steps: list[WorkflowStep] = field(default_factory=list)

    @property
    def runs(self) -> _PendingAdmission:
        return self

    @property
    def workflows(self) -> _PendingAdmission:
        return self

    def add_many(self, changes: Sequence[Change]) -> None:
        self.changes.extend(changes)

    def add(self, change: Change) -> None:
        self.changes.append(change)

    def add_steps(self, steps: Sequence[WorkflowStep]) -> None:
        self.steps.extend(steps)

    def unfinished_with_keys(self, keys: Sequence[str]) -> Mapping[str, str]:
        """The keys held in the store now, and by the runs admitted in this transaction."""
        with self.store.unit_of_work() as uow:
            held = dict(uow.runs.unfinished_with_keys(keys))
        for change in self.changes:
            key = change.run.unique_key
            if key is not None and key in keys:
                held.setdefault(key, change.run.id)
        return held

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def commit(self) -> None:
        return None

    def __enter__(self) -> UnitOfWork:
        return cast(UnitOfWork, self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


def _follow(
    transaction: object, committed: Callable[[], None], settled: Callable[[], None]
) -> None:
    """Call ``committed`` once when the SQLAlchemy ``Session`` or ``Connection`` commits its
    transaction; forget it when the transaction rolls back. ``settled`` is called after
    either."""
    from sqlalchemy import Connection, event
    from sqlalchemy.orm import Session

    if isinstance(transaction, Session):
        commit_event, rollback_event = "after_commit", "after_rollback"
    elif isinstance(transaction, Connection):
        commit_event, rollback_event = "commit", "rollback"
    else:
        raise UnsupportedTransaction(
            "the in-memory runtime follows a SQLAlchemy Session or Connection, "
            f"not {type(transaction).__name__}"
        )

    done = False  # listeners cannot be removed while their event runs: they go quiet

    def on_commit(*_args: object) -> None:
        nonlocal done
        if not done:
            done = True
            settled()
            committed()

    def on_rollback(*_args: object) -> None:
        nonlocal done
        if not done:
            done = True
            settled()

    event.listen(transaction, commit_event, on_commit)
    event.listen(transaction, rollback_event, on_rollback)
