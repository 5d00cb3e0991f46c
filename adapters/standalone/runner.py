"""The Standalone and Edge process: boot with startup recovery, then one loop that runs the
cadence and drives the in-process pool through the worker protocol.

Boot
    1. Take the database's exclusive lock (:mod:`adapters.standalone.exclusive`): from here on no
       other process executes work on this database.
    2. Register this process's worker session under the worker id every executing process of
       the database uses. The open session of the previous process is marked ``replaced``:
       trusted evidence that what it started no longer runs.
    3. Run startup recovery (:class:`application.startup.StartupRecovery`): orphans get their
       first Attempt, Attempts the previous process left behind whose leases expired are marked
       lost, and lost Runs go through the lost-retry decision (retry only when declared safe).
    4. Leases the previous process still held keep their authority until they expire (at most one
       lease TTL after its last renewal). The runner notes the latest of those expiries and runs
       startup recovery once more when it is reached. That second pass is part of the boot; there
       is no continuous recovery.

Loop
    One thread (the caller of :meth:`StandaloneRunner.serve`) is the only one that speaks to the
    store. A cycle is: heartbeat, the coordinator's steps (due retries, trigger schedule,
    workflow frontier, task attempt admission), then every offer the session received is
    accepted, activated (the start barrier) and marked running in one batch, and handed to the
    pool. Leases of running Attempts are renewed every third of the TTL; outcomes are reported
    with the fenced completion. All of these are the worker protocol's commands
    (:class:`application.worker_commands.WorkerCommands`), so the same transitions apply as for a
    remote worker.

    Between cycles the loop blocks in ``select`` on the database's wake channel and its own
    pipe. Standalone (``resident_cadence_s`` set) also wakes on that cadence. Edge
    (``resident_cadence_s`` None) has no resident wake-up: an idle Edge process sleeps until a
    submit pokes the wake channel, a task finishes, a lease needs renewing, or the next due time
    (a retry's ``next_attempt_at_ms``, a trigger's next firing, the boot's second recovery pass)
    arrives.

Stop
    :meth:`StandaloneRunner.request_stop` (signal-safe) ends the loop: the session drains (no new
    offers), running tasks get up to ``drain_timeout_s`` to finish (a second request cuts this
    short), any still running are abandoned (lost with the worker's own report as evidence), and
    the session is closed.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from adapters.execution import TaskMapping
from adapters.standalone.pool import Execution, InProcessPool, Outcome, describe_error
from application.ports import Identities
from application.scheduler import Coordinator, CycleSummary
from application.startup import StartupRecovery, StartupReport
from application.worker_commands import (
    Abandonment,
    BatchOutcome,
    Completion,
    SessionGrant,
    StartStage,
    WorkerCommands,
)
from domain.errors import DomainError
from domain.fence import LeaseFence

Emit = Callable[[str], None]

# After a failed cycle (say, the database stayed locked), try again this much later.
RETRY_FAILED_CYCLE_S = 1.0
# Something is due but a cycle could not start it (a broken trigger, say): look again this much
# later instead of spinning.
NO_PROGRESS_BACKOFF_S = 5.0


class DueTimes(Protocol):
    """What the loop reads from the store to know how long it may sleep."""

    def now_ms(self) -> int: ...

    def next_due_at_ms(self) -> int | None:
        """The earliest time a retry or a trigger becomes due."""

    def last_foreign_lease_expiry_ms(self, session_id: str) -> int | None: ...


class ExclusiveAccess(Protocol):
    def acquire(self) -> None: ...

    def release(self) -> None: ...


class WakeSource(Protocol):
    def fileno(self) -> int: ...

    def drain(self) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """``resident_cadence_s``: seconds between cycles while idle (Standalone); None for no
    resident wake-up at all (Edge). ``capacity``: Attempts executed at once."""

    worker_id: str = "standalone"
    capacity: int = 4
    resident_cadence_s: float | None = 1.0
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.capacity <= 1024:
            raise ValueError("capacity must be within 1..1024")
        if self.resident_cadence_s is not None and self.resident_cadence_s <= 0:
            raise ValueError("the resident cadence must be positive (or None for Edge)")
        if self.drain_timeout_s < 0:
            raise ValueError("the drain timeout must not be negative")


@dataclass(frozen=True, slots=True)
class BootReport:
    session_id: str
    replaced_session_ids: tuple[str, ...]
    startup: StartupReport
    second_pass_at_ms: int | None


@dataclass(slots=True)
class _Schedule:
    """When the loop must act next: ``next_resident`` and ``retry_failed`` in the loop's
    monotonic seconds (None: not scheduled), ``due_at_ms`` by the store's clock."""

    cycle_now: bool = True
    next_resident: float | None = None
    retry_failed: float | None = None
    due_at_ms: dict[str, int] = field(default_factory=dict)


class StandaloneRunner:
    def __init__(
        self,
        *,
        tasks: TaskMapping,
        commands: WorkerCommands,
        coordinator: Coordinator,
        startup: StartupRecovery,
        due_times: DueTimes,
        identities: Identities,
        settings: RunnerSettings,
        exclusive: ExclusiveAccess | None = None,
        open_wake: Callable[[], WakeSource] | None = None,
        emit: Emit | None = None,
    ) -> None:
        if not tasks:
            raise ValueError("the runner needs at least one task")
        self._commands = commands
        self._coordinator = coordinator
        self._startup = startup
        self._due_times = due_times
        self._identities = identities
        self.settings = settings
        self._exclusive = exclusive
        self._open_wake = open_wake
        self._emit = emit or _silent
        self._pipe_r, self._pipe_w = os.pipe()
        os.set_blocking(self._pipe_r, False)
        os.set_blocking(self._pipe_w, False)
        self._pool = InProcessPool(tasks, self._poke_self)
        self._wake: WakeSource | None = None
        self._grant: SessionGrant | None = None
        self._in_flight: dict[str, Execution] = {}
        self._unreported: list[Outcome] = []
        self._schedule = _Schedule()
        self._stop_requested = threading.Event()
        self._hurry = threading.Event()
        self._cycle_requested = threading.Event()
        self._boot_report: BootReport | None = None
        self._closed = False
        self.cycles = 0
        self.wakeups = 0
        self.last_summary: CycleSummary | None = None

    # --- public ---------------------------------------------------------------------------------

    @property
    def session_id(self) -> str | None:
        return self._grant.session_id if self._grant else None

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def boot(self) -> BootReport:
        """Exclusive lock, session, startup recovery. Once: later calls return the same report."""
        if self._boot_report is not None:
            return self._boot_report
        if self._closed:
            raise RuntimeError("a stopped runner cannot boot again")
        try:
            if self._exclusive is not None:
                self._exclusive.acquire()
            if self._open_wake is not None and self._wake is None:
                self._wake = self._open_wake()
            grant = self._commands.register(
                self.settings.worker_id, self.settings.capacity, self._pool.task_names
            )
            self._grant = grant
            report = self._startup.run()
            second_pass = self._schedule_second_pass()
        except BaseException:
            self._release_resources()
            raise
        counts = ", ".join(f"{k}={v}" for k, v in report.counts().items() if v and k != "pages")
        self._emit(
            f"session {grant.session_id} registered as {self.settings.worker_id}"
            + (
                f" (replaced {len(grant.replaced_session_ids)})"
                if grant.replaced_session_ids
                else ""
            )
        )
        self._emit("startup recovery: " + (counts or "nothing to recover"))
        if second_pass is not None:
            wait_s = max(0.0, (second_pass - self._due_times.now_ms()) / 1000)
            self._emit(
                f"leases of the previous process expire in {wait_s:.1f}s; "
                "startup recovery runs again then"
            )
        self._boot_report = BootReport(
            session_id=grant.session_id,
            replaced_session_ids=grant.replaced_session_ids,
            startup=report,
            second_pass_at_ms=second_pass,
        )
        return self._boot_report

    def serve(self) -> None:
        """Boot if needed, then run until :meth:`request_stop`; drain and close on the way out."""
        self.boot()
        try:
            while not self._stop_requested.is_set():
                self._step()
                if self._stop_requested.is_set():
                    break
                self._wait(self._timeout())
        finally:
            self._shutdown()

    def request_stop(self) -> None:
        """Ask the loop to drain and stop; asked again, running tasks are abandoned at once
        instead of being waited for. Safe from signal handlers and other threads."""
        if self._stop_requested.is_set():
            self._hurry.set()
        self._stop_requested.set()
        self._poke_self()

    def wake(self) -> None:
        """Ask for a cycle now (what a poke of the wake channel does). Thread-safe."""
        self._cycle_requested.set()
        self._poke_self()

    # --- the loop -------------------------------------------------------------------------------

    def _step(self) -> None:
        self._report_finished()
        self._renew_due_leases()
        now = time.monotonic()
        schedule = self._schedule
        due = schedule.cycle_now or any(
            at is not None and at <= now for at in (schedule.next_resident, schedule.retry_failed)
        )
        store_due = self._store_due()
        if store_due is not None and store_due <= self._due_times.now_ms():
            due = True
        if due:
            self._cycle()

    def _cycle(self) -> None:
        schedule = self._schedule
        schedule.cycle_now = False
        schedule.retry_failed = None
        cadence = self.settings.resident_cadence_s
        schedule.next_resident = time.monotonic() + cadence if cadence is not None else None
        self.cycles += 1
        try:
            if self._second_pass_due():
                report = self._startup.run()
                counts = ", ".join(
                    f"{k}={v}" for k, v in report.counts().items() if v and k != "pages"
                )
                self._emit(
                    "startup recovery, leases of the previous process expired: "
                    + (counts or "nothing to recover")
                )
                self._schedule_second_pass()
            self._take_offers()  # the heartbeat first: dispatch skips silent sessions
            summary = self._coordinator.run_cycle()
            self.last_summary = summary
            if not summary.ok:
                failed = summary.step(summary.aborted_at or "")
                self._emit(
                    f"cycle stopped at {summary.aborted_at}: {failed.error if failed else ''}"
                )
                schedule.retry_failed = time.monotonic() + RETRY_FAILED_CYCLE_S
            self._take_offers()
            self._refresh_due_times(summary)
            dispatch = summary.step("task_attempt_admission")
            offered = dispatch.counts.get("offered", 0) if dispatch is not None else 0
            if offered and len(self._in_flight) < self.settings.capacity:
                # Work was dispatched and capacity is left: more may be waiting.
                schedule.cycle_now = True
        except Exception as error:  # the database stayed locked, and the like: try again soon
            self._emit(f"cycle failed: {describe_error(error)}")
            schedule.retry_failed = time.monotonic() + RETRY_FAILED_CYCLE_S

    def _take_offers(self) -> int:
        """Heartbeat, then start every offer received (accept, the start barrier, running) in
        one batch and hand each started Attempt to the pool. Returns how many started."""
        grant = self._require_session()
        offers = self._commands.heartbeat(grant.session_id, grant.secret)
        if not offers:
            return 0
        fences = [
            LeaseFence(
                attempt_id=offer.attempt_id,
                generation=offer.generation,
                version=offer.version,
                token=self._identities.new_secret(),
            )
            for offer in offers
        ]
        answer = self._commands.start_many(
            grant.session_id, grant.secret, fences, StartStage.STARTED
        )
        started = 0
        renew_at = time.monotonic() + self._renew_every()
        for offer, fence, result in zip(offers, fences, answer.results, strict=True):
            label = f"run {offer.run_id} attempt {offer.attempt_number} ({offer.task})"
            if result.outcome not in (BatchOutcome.RUNNING, BatchOutcome.STARTING):
                self._emit(f"{label} not started: {result.message or result.rejection}")
                continue
            execution = Execution(offer=offer, fence=fence, renew_at=renew_at)
            self._in_flight[offer.attempt_id] = execution
            self._emit(f"{label} started")
            self._pool.start(execution)
            started += 1
        return started

    def _report_finished(self) -> None:
        """Report every finished task in one batch. Outcomes that could not be reported (the
        database stayed locked) are kept and reported on the next pass."""
        self._unreported.extend(self._pool.finished())
        outcomes = [o for o in self._unreported if o.attempt_id in self._in_flight]
        self._unreported = []
        if not outcomes:
            return
        grant = self._require_session()
        completions = [
            Completion(
                fence=self._in_flight[o.attempt_id].fence,
                succeeded=o.succeeded,
                output=o.output,
                error=o.error,
            )
            for o in outcomes
        ]
        try:
            answer = self._commands.complete_many(grant.session_id, grant.secret, completions)
        except Exception as error:
            self._unreported = outcomes
            self._emit(f"reporting outcomes failed: {describe_error(error)}")
            self._schedule.retry_failed = time.monotonic() + RETRY_FAILED_CYCLE_S
            return
        for outcome, result in zip(outcomes, answer.results, strict=True):
            offer = self._in_flight.pop(outcome.attempt_id).offer
            label = f"run {offer.run_id} attempt {offer.attempt_number} ({offer.task})"
            if not result.ok:
                self._emit(f"{label} finished, but its outcome was refused: {result.message}")
            elif outcome.succeeded:
                self._emit(f"{label} succeeded")
            else:
                self._emit(f"{label} failed: {outcome.error}")
        self._schedule.cycle_now = not self._stop_requested.is_set()  # capacity was freed

    def _renew_due_leases(self) -> None:
        grant = self._grant
        if grant is None:
            return
        now = time.monotonic()
        due = [e for e in self._in_flight.values() if not e.orphaned and e.renew_at <= now]
        if not due:
            return
        try:
            answer = self._commands.renew_many(
                grant.session_id, grant.secret, [e.fence for e in due]
            )
        except Exception as error:  # the database stayed locked: try again soon
            for execution in due:
                execution.renew_at = now + min(RETRY_FAILED_CYCLE_S, self._renew_every())
            self._emit(f"lease renewal failed: {describe_error(error)}")
            return
        for execution, result in zip(due, answer.results, strict=True):
            if result.ok:
                execution.renew_at = now + self._renew_every()
                continue
            # The lease's authority is gone: the task keeps running, but the fence will refuse
            # its outcome.
            execution.orphaned = True
            offer = execution.offer
            self._emit(
                f"run {offer.run_id} attempt {offer.attempt_number} lost its lease: "
                f"{result.message}"
            )

    def _renew_every(self) -> float:
        return self._commands.lease_ttl_ms / 3000

    # --- sleeping -------------------------------------------------------------------------------

    def _store_due(self) -> int | None:
        """The earliest store time at which the loop has work to do."""
        times = list(self._schedule.due_at_ms.values())
        return min(times) if times else None

    def _refresh_due_times(self, summary: CycleSummary) -> None:
        due = self._schedule.due_at_ms
        next_due = self._due_times.next_due_at_ms()
        if next_due is None:
            due.pop("work", None)
            return
        now = self._due_times.now_ms()
        progressed = any(
            step.counts.get(key, 0)
            for step, key in (
                (summary.step("due_retries"), "attempts_created"),
                (summary.step("trigger_schedule"), "fired"),
            )
            if step is not None
        )
        if next_due <= now and not progressed:
            next_due = now + round(NO_PROGRESS_BACKOFF_S * 1000)
        due["work"] = next_due

    def _schedule_second_pass(self) -> int | None:
        """Note when the leases left by another session expire, if some still hold."""
        grant = self._require_session()
        expiry = self._due_times.last_foreign_lease_expiry_ms(grant.session_id)
        if expiry is None or expiry < self._due_times.now_ms():
            self._schedule.due_at_ms.pop("second_pass", None)
            return None
        self._schedule.due_at_ms["second_pass"] = expiry + 1
        return expiry + 1

    def _second_pass_due(self) -> bool:
        at = self._schedule.due_at_ms.get("second_pass")
        return at is not None and at <= self._due_times.now_ms()

    def _timeout(self) -> float | None:
        """Seconds the loop may sleep; None: until something wakes it."""
        schedule = self._schedule
        if schedule.cycle_now:
            return 0.0
        now = time.monotonic()
        deadlines = [at for at in (schedule.next_resident, schedule.retry_failed) if at is not None]
        deadlines.extend(
            execution.renew_at for execution in self._in_flight.values() if not execution.orphaned
        )
        store_due = self._store_due()
        if store_due is not None:
            deadlines.append(now + max(0, store_due - self._due_times.now_ms()) / 1000)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - now)

    def _wait(self, timeout: float | None) -> None:
        descriptors = [self._pipe_r]
        if self._wake is not None:
            descriptors.append(self._wake.fileno())
        if timeout is not None and timeout > 0:
            # Whole milliseconds, rounded up: never wake a hair before a deadline.
            timeout = math.ceil(timeout * 1000) / 1000
        ready, _, _ = select.select(descriptors, [], [], timeout)
        self.wakeups += 1
        if self._pipe_r in ready:
            _drain_pipe(self._pipe_r)
        if self._cycle_requested.is_set():
            self._cycle_requested.clear()
            self._schedule.cycle_now = True
        if self._wake is not None and self._wake.fileno() in ready:
            self._wake.drain()
            self._schedule.cycle_now = True

    def _poke_self(self) -> None:
        fd = self._pipe_w
        if fd < 0:
            return
        with contextlib.suppress(OSError):  # a full pipe already holds a wake-up
            os.write(fd, b"\x01")

    # --- stopping -------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        if self._closed:
            return
        grant = self._grant
        try:
            if grant is not None:
                self._drain(grant)
        finally:
            self._release_resources()

    def _drain(self, grant: SessionGrant) -> None:
        with contextlib.suppress(DomainError):
            self._commands.drain(grant.session_id, grant.secret)
        if self._in_flight:
            self._emit(f"draining: waiting for {len(self._in_flight)} running attempt(s)")
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._in_flight and time.monotonic() < deadline and not self._hurry.is_set():
            self._report_finished()
            self._renew_due_leases()
            if not self._in_flight:
                break
            renewals = [e.renew_at for e in self._in_flight.values() if not e.orphaned]
            wait = min([deadline, *renewals]) - time.monotonic()
            self._wait(max(0.0, wait))
        self._report_finished()
        left = list(self._in_flight.values())
        if left:
            detail = "the process stopped before the task finished"
            answer = self._commands.abandon_many(
                grant.session_id,
                grant.secret,
                [Abandonment(fence=e.fence, detail=detail) for e in left],
            )
            for execution, result in zip(left, answer.results, strict=True):
                offer = execution.offer
                what = "abandoned" if result.ok else f"not abandoned: {result.message}"
                self._emit(f"run {offer.run_id} attempt {offer.attempt_number} {what}")
        self._in_flight.clear()
        with contextlib.suppress(DomainError):
            self._commands.close(grant.session_id, grant.secret)
        self._emit("stopped")

    def _release_resources(self) -> None:
        self._closed = True
        if self._wake is not None:
            self._wake.close()
            self._wake = None
        if self._exclusive is not None:
            self._exclusive.release()
        fds = (self._pipe_r, self._pipe_w)
        self._pipe_r = self._pipe_w = -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _require_session(self) -> SessionGrant:
        if self._grant is None:
            raise RuntimeError("the runner has not booted")
        return self._grant


def _drain_pipe(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):
        while os.read(fd, 4096):
            pass


def _silent(_line: str) -> None:
    return None
