"""The execution slots: one thread per slot owns that slot's child process (see :mod:`.slot`),
hands it one job at a time and tells the ledger how each job ended. A child that was killed or
died is replaced before the slot is free again; a slot whose child cannot be started again is
out of service."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from ql3.adapters.worker.ledger import Ledger
from ql3.adapters.worker.settings import WorkerFailed
from ql3.adapters.worker.slot import Job, JobOutcome, SlotError, SlotProcess

log = logging.getLogger("ql3.worker")


class ChildProcess(Protocol):
    """What a slot needs of its child (:class:`~ql3.adapters.worker.slot.SlotProcess`)."""

    @property
    def pid(self) -> int | None: ...

    def start(self) -> None: ...

    def run(self, job: Job) -> JobOutcome: ...

    def kill(self, attempt_id: str | None = None) -> bool: ...

    def close(self) -> None: ...


ChildFactory = Callable[[str, str], ChildProcess]  # (app spec, name) -> a child


def default_child(app_spec: str, name: str) -> ChildProcess:
    return SlotProcess(app_spec, name=name)


class SlotThread:
    """A slot: its thread and its child process."""

    def __init__(self, index: int, child: ChildProcess, ledger: Ledger) -> None:
        self.index = index
        self.child = child
        self.ledger = ledger
        self.ready = threading.Event()
        self.error: str | None = None
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"ql3-slot-{index}", daemon=True)

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    def kill(self, attempt_id: str) -> bool:
        """Stop ``attempt_id``'s task (SIGKILL of the child's process group); a job of it that
        has not reached the child yet will not run."""
        return self.child.kill(attempt_id)

    def shutdown(self) -> None:
        self.child.kill()
        self._jobs.put(None)

    def _loop(self) -> None:
        # The child is started from this thread, which lives as long as the slot: the child's
        # parent-death signal follows the thread that started it.
        try:
            self.child.start()
        except (SlotError, OSError) as error:
            self.error = str(error)
            self.ready.set()
            return
        self.ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                break
            try:
                outcome = self.child.run(job)
            except Exception as error:  # a broken child: it may have begun the task
                log.exception("slot %d failed running attempt %s", self.index, job.attempt_id)
                self.child.kill()
                outcome = JobOutcome(succeeded=False, error=f"the slot failed: {error}")
            if self.child.pid is not None:
                self.ledger.on_outcome(self, job.attempt_id, outcome, reusable=True)
                continue
            # The child was killed or died: report the job at once (a stopped task's abandon
            # need not wait), then start a fresh child before the slot takes the next job.
            self.ledger.on_outcome(self, job.attempt_id, outcome, reusable=False)
            try:
                self.child.start()
            except (SlotError, OSError) as error:
                self.ledger.slot_lost(self, f"cannot start a new child: {error}")
                self._drain_jobs()
                return
            self.ledger.slot_free(self)
        self.child.close()

    def _drain_jobs(self) -> None:
        """An out-of-service slot hands back what was queued for it: nothing of it began."""
        not_started = JobOutcome(succeeded=False, error="its slot is out of service", started=False)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self.ledger.on_outcome(self, job.attempt_id, not_started, reusable=False)


class SlotPool:
    def __init__(
        self,
        concurrency: int,
        app_spec: str,
        ledger: Ledger,
        child_factory: ChildFactory | None = None,
    ) -> None:
        factory = child_factory or default_child
        self.ledger = ledger
        self.slots = [
            SlotThread(i, factory(app_spec, f"slot-{i}"), ledger) for i in range(concurrency)
        ]

    def start(self) -> None:
        """Start every slot's child; the worker fails if one cannot start."""
        for slot in self.slots:
            slot.thread.start()
        for slot in self.slots:
            slot.ready.wait()
        failed = [s.error for s in self.slots if s.error]
        if failed:
            raise WorkerFailed(f"a slot could not start: {failed[0]}")
        self.ledger.add_slots(self.slots)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Kill every child (a task still running dies with it) and end the slot threads."""
        for slot in self.slots:
            slot.shutdown()
        for slot in self.slots:
            if slot.thread.is_alive():
                slot.thread.join(timeout=timeout_s)
