"""The Standalone and Edge process: boot with startup recovery, then one loop that executes
work through the remote worker's own protocol loop and runs the cadence.

Boot
    1. Take the database's exclusive lock (:mod:`ql3.adapters.standalone.exclusive`): from here
       on no other process executes work on this database.
    2. Register this process's worker session under the worker id every executing process of
       the database uses. The open session of the previous process is marked ``replaced``:
       trusted evidence that what it started no longer runs.
    3. Run startup recovery (:class:`ql3.application.startup.StartupRecovery`): orphans get their
       first Attempt, Attempts the previous process left behind whose leases expired are marked
       lost, and lost Runs go through the lost-retry decision (retry only when declared safe).
    4. Leases the previous process still held keep their authority until they expire (at most one
       lease TTL after its last renewal). The runner notes the latest of those expiries and runs
       startup recovery once more when it is reached (at once when it passed while startup
       recovery ran). That second pass is part of the boot; there is no continuous recovery.

Loop
    One thread (the caller of :meth:`StandaloneRunner.serve`) is the only one that speaks to the
    store. It executes work as a remote worker does, through the worker SDK's
    :class:`~ql3.adapters.worker.ledger.Ledger` (what the process holds, phase by phase),
    :func:`~ql3.adapters.worker.claimer.claim_once` and
    :class:`~ql3.adapters.worker.reporter.Reporter`, over
    :class:`~ql3.adapters.worker.inprocess.InProcessTransport`: each call is a call of the
    worker commands (:class:`ql3.application.worker_commands.WorkerCommands`) in this process,
    so the same transitions apply as for a remote worker (ADR 0007, ADR 0023). Tasks run on the
    in-process pool (:mod:`ql3.adapters.standalone.pool`), whose slots the ledger fills, not in
    child processes. This loop plays the remote worker's claimer, reporter and watchdog:

    - Work is pulled: one ``claim`` asks for the free slots, carries the completions of the
      tasks that finished since the last call and states what the process holds (``held``), all
      in one transaction; every Attempt it grants is started on the pool at once. The loop claims
      when something may be queued for it (after boot, a wake-up, a cycle that queued work, or a
      claim that filled its whole limit) and a slot is free; finished tasks wait for that claim.
      Otherwise the reporter sends them alone, with hand-backs and abandons.
    - The reporter renews the held leases every third of the TTL, as a remote worker's does. The
      session sends no heartbeat: the process owns the database (the exclusive lock), so its
      liveness concerns nobody else and a restart replaces its session; an idle process writes
      nothing (ADR 0012). For the same reason there is no self-fencing: no one else recovers its
      leases while it runs.
    - A task past its run's timeout is stopped by the ledger and reported as timed out at once.
    - The cadence (:class:`ql3.adapters.standalone.steps.StandaloneCoordinator`: due retries,
      trigger schedule, workflow frontier, task attempt admission, the dispatch gate step) runs
      on the resident cadence, when a due time the store names is reached, and after wake-ups
      and finished tasks (a workflow's next step), but at most once per ``MIN_CYCLE_GAP_S``:
      a busy loop pays for the cadence a few times a second, not once per Run.

    Between passes the loop blocks in ``select`` on the database's wake channel and its own
    pipe, for as long as :meth:`StandaloneRunner._timeout` (the one place every wake-up is
    computed) allows. A commit that queues a Run pokes the wake channel (the store does), so an
    admission from any process is claimed within milliseconds, without polling. Standalone
    (``resident_cadence_s`` set) also wakes on that cadence. Edge (``resident_cadence_s`` None)
    has no resident wake-up: an idle Edge process sleeps until the wake channel is poked, a task
    finishes, a lease needs renewing, or the next due time (a retry's ``next_attempt_at_ms``, a
    trigger's next firing, the boot's second recovery pass) arrives.

Stop
    :meth:`StandaloneRunner.request_stop` (signal-safe) ends the loop: the session drains (no new
    claims), a grant that arrives meanwhile is handed back unstarted (``release``), running
    tasks get up to ``drain_timeout_s`` to finish (a second request cuts this short), any still
    running are abandoned (lost with the worker's own report as evidence), and the session is
    closed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ql3.adapters.execution import TaskMapping
from ql3.adapters.standalone.pool import InProcessPool, PoolSlots, describe_error
from ql3.adapters.worker.claimer import claim_once
from ql3.adapters.worker.inprocess import InProcessTransport
from ql3.adapters.worker.ledger import CANCELLED, Event, Held, Kill, Ledger, Mode, Phase
from ql3.adapters.worker.protocol import Registration
from ql3.adapters.worker.reporter import Reporter
from ql3.adapters.worker.settings import Timings
from ql3.application.scheduler import Coordinator, CycleSummary
from ql3.application.startup import StartupRecovery, StartupReport
from ql3.application.worker_commands import NoGrant, WorkerCommands
from ql3.domain.errors import DomainError
from ql3.domain.retry import timed_out_error

Emit = Callable[[str], None]

# After a failed cycle or call (say, the database stayed locked), try again this much later.
RETRY_FAILED_CYCLE_S = 1.0
# Something is due but a cycle could not start it (a broken trigger, say): look again this much
# later instead of spinning.
NO_PROGRESS_BACKOFF_S = 5.0
# Cycles asked for by wake-ups and finished tasks run at most this often.
MIN_CYCLE_GAP_S = 0.25
# On the way out, what the store could not decide yet is sent again for this long at most.
FINAL_REPORT_S = 1.0
FINAL_REPORT_PAUSE_S = 0.05
# The count of a cycle step that says it queued a Run: the loop claims after such a cycle.
_QUEUED_WORK = (
    ("due_retries", "attempts_created"),
    ("trigger_schedule", "runs_admitted"),
    ("workflow_frontier", "steps_admitted"),
    ("task_attempt_admission", "gate_opened"),
)
# How a hand-back's cause reads in the process's lines.
_CAUSES = {
    "drain": "the process is stopping",
    "worker_stopped": "the process is stopping",
    "slot_failed": "slot failed to start",
    "no_free_slot": "no free slot",
}
_EVENT_LINES = {
    Event.STARTED: "{label} started",
    Event.COMPLETED: "{label} finished",
    Event.COMPLETION_CANCELLED: "{label} finished after its run was cancelled: outcome discarded",
    Event.COMPLETION_REFUSED: "{label} finished, but its outcome was refused: {detail}",
    Event.STOPPED_CANCELLED: "{label} ended: its run was cancelled (outcome discarded)",
    Event.ABANDONED: "{label} abandoned: {detail}",
    Event.ABANDON_REFUSED: "{label} not abandoned: {detail}",
    Event.RELEASED: "{label} handed back unstarted: {detail}",
    Event.RELEASE_CANCELLED: "{label} not started: its run was cancelled",
    Event.RELEASE_REFUSED: "{label} not handed back: {detail}",
    Event.RUN_CANCELLED: "{label}: its run was cancelled; stopping the task",
    Event.LEASE_REFUSED: "{label} lost its lease: {detail}",
}
# What the store took as a task's end: a cycle follows (a workflow's next step).
_FINISHED = frozenset({Event.COMPLETED, Event.COMPLETION_CANCELLED, Event.COMPLETION_REFUSED})
# The ledger's own log lines repeat what the runner says through ``emit``.
_QUIET = logging.getLogger("ql3.standalone.ledger")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


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
    """When the loop must act next. Times in the loop's monotonic seconds (None: not
    scheduled), except ``due_at_ms``, by the store's clock.

    ``cycle_requested``: a wake-up or a finished task asked for a cycle, which runs once
    ``MIN_CYCLE_GAP_S`` has passed since ``last_cycle_at``. ``claim_due``: something may be
    queued for this process. ``call_retry_at``: a claim or completion failed; the next one waits
    until then."""

    cycle_requested: bool = True
    last_cycle_at: float | None = None
    next_resident: float | None = None
    retry_failed: float | None = None
    claim_due: bool = True
    call_retry_at: float | None = None
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
        settings: RunnerSettings,
        exclusive: ExclusiveAccess | None = None,
        open_wake: Callable[[], WakeSource] | None = None,
        emit: Emit | None = None,
    ) -> None:
        if not tasks:
            raise ValueError("the runner needs at least one task")
        self._transport = InProcessTransport(commands)
        self._coordinator = coordinator
        self._startup = startup
        self._due_times = due_times
        self.settings = settings
        self._exclusive = exclusive
        self._open_wake = open_wake
        self._emit = emit or _silent
        self._pipe_r, self._pipe_w = os.pipe()
        os.set_blocking(self._pipe_r, False)
        os.set_blocking(self._pipe_w, False)
        self._pool = InProcessPool(tasks, self._poke_self)
        # The remote worker's ledger and reporter, over the in-process transport and slots
        # (ADR 0023); this loop is their claimer, reporter and watchdog thread at once.
        self._slots = PoolSlots(self._pool, settings.capacity, self._poke_self)
        self._ledger = Ledger(settings.capacity, claims_alongside=False)
        self._ledger.log = _QUIET
        self._ledger.on_event = self._on_event
        self._ledger.add_slots(self._slots.handles)
        timings = Timings.in_process(self._transport.lease_ttl_ms)
        self._ledger.probe_s = timings.ttl_s / 3
        self._reporter = Reporter(
            self._transport,
            self._ledger,
            timings,
            grace_s=_no_grace,
            kill=self._stop_tasks,
            on_node_drain=_ignore,
        )
        self._wake: WakeSource | None = None
        self._registration: Registration | None = None
        self._left_running: set[str] = set()  # stopped tasks whose thread the drain left behind
        self._schedule = _Schedule()
        self._gate_reason: str | None = None
        self._stop_requested = threading.Event()
        self._hurry = threading.Event()
        self._cycle_requested = threading.Event()
        self._boot_report: BootReport | None = None
        self._closed = False
        self.cycles = 0
        self.wakeups = 0
        self.claims = 0
        self.last_summary: CycleSummary | None = None

    # --- public ---------------------------------------------------------------------------------

    @property
    def session_id(self) -> str | None:
        return self._registration.session_id if self._registration else None

    @property
    def in_flight(self) -> int:
        """Attempts the process holds (running, or being reported)."""
        with self._ledger.lock:
            return self._ledger.holding()

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
            grant = self._transport.register(
                self.settings.worker_id, self.settings.capacity, self._pool.task_names
            )
            self._registration = grant
            report = self._startup.run()
            second_pass = self._schedule_second_pass(at_boot=True)
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
        """Ask for a claim and a cycle now (what a poke of the wake channel does).
        Thread-safe."""
        self._cycle_requested.set()
        self._poke_self()

    # --- the loop -------------------------------------------------------------------------------

    def _step(self) -> None:
        self._slots.deliver(self._ledger)
        self._stop_timed_out()
        self._exchange()
        if self._cycle_due():
            self._cycle()
            self._exchange()

    def _cycle_due(self) -> bool:
        schedule = self._schedule
        now = time.monotonic()
        if schedule.cycle_requested and (
            schedule.last_cycle_at is None or now >= schedule.last_cycle_at + MIN_CYCLE_GAP_S
        ):
            return True
        if any(
            at is not None and at <= now for at in (schedule.next_resident, schedule.retry_failed)
        ):
            return True
        store_due = self._store_due()
        return store_due is not None and store_due <= self._due_times.now_ms()

    def _cycle(self) -> None:
        schedule = self._schedule
        now = time.monotonic()
        schedule.cycle_requested = False
        schedule.retry_failed = None
        schedule.last_cycle_at = now
        cadence = self.settings.resident_cadence_s
        schedule.next_resident = now + cadence if cadence is not None else None
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
                schedule.claim_due = True
            summary = self._coordinator.run_cycle()
            self.last_summary = summary
            if not summary.ok:
                failed = summary.step(summary.aborted_at or "")
                self._emit(
                    f"cycle stopped at {summary.aborted_at}: {failed.error if failed else ''}"
                )
                schedule.retry_failed = time.monotonic() + RETRY_FAILED_CYCLE_S
            if self._wake is None or any(
                (step := summary.step(name)) is not None and step.counts.get(key, 0)
                for name, key in _QUEUED_WORK
            ):
                # Without a wake channel the loop cannot hear admissions: claim every cycle.
                schedule.claim_due = True
            self._refresh_due_times(summary)
        except Exception as error:  # the database stayed locked, and the like: try again soon
            self._emit(f"cycle failed: {describe_error(error)}")
            schedule.retry_failed = time.monotonic() + RETRY_FAILED_CYCLE_S

    # --- the worker protocol, through the ledger -------------------------------------------------

    def _stop_timed_out(self) -> None:
        """Every task that ran past its run's timeout fails as timed out at once: the ledger
        stops it (an async task is cancelled) and its failure is reported now; a plain
        function's thread cannot be stopped, it runs on and what it returns is dropped
        (ADR 0013)."""
        kills = self._ledger.timed_out(time.monotonic())
        for slot, attempt_id in kills:
            slot.kill(attempt_id)
            self._slots.detach(attempt_id)
        if kills:
            self._slots.deliver(self._ledger)

    def _stop_tasks(self, kills: Sequence[Kill]) -> None:
        """Stop the tasks whose renewal was refused (their Run was cancelled, or the lease is
        gone): an async task is cancelled; each is reported as stopped once it has ended."""
        for slot, attempt_id in kills:
            slot.kill(attempt_id)

    def _exchange(self) -> None:
        """The calls to the store that are due, in one pass: while something may be queued and
        a slot is free, one claim asks for the free slots and carries the completions ready now
        (``claim``, one transaction); then the reporter sends what is left (completions alone,
        hand-backs, abandons, renewals). A call that failed (the database stayed locked) is
        made again :data:`RETRY_FAILED_CYCLE_S` later; what it carried is kept."""
        schedule = self._schedule
        if schedule.call_retry_at is not None and time.monotonic() < schedule.call_retry_at:
            return
        schedule.call_retry_at = None
        unstarted = False
        if schedule.claim_due and not self._stop_requested.is_set():
            try:
                unstarted = self._claim()
            except Exception as error:
                self._call_failed("claiming", error)
                return
        self._claim_next()
        try:
            self._reporter.report(time.monotonic(), heartbeat=False)
        except Exception as error:
            self._call_failed("reporting to the store", error)
            return
        if unstarted:  # a grant could not start here: do not claim it again at once
            schedule.call_retry_at = time.monotonic() + RETRY_FAILED_CYCLE_S

    def _claim_next(self) -> None:
        """Tell the ledger whether the next call is a claim: then finished tasks wait for it,
        to ride it, instead of being reported alone."""
        with self._ledger.lock:
            self._ledger.claim_next = (
                self._schedule.claim_due
                and not self._stop_requested.is_set()
                and self._ledger.room() > 0
            )

    def _call_failed(self, what: str, error: BaseException) -> None:
        self._emit(f"{what} failed: {describe_error(error)}")
        self._schedule.call_retry_at = time.monotonic() + RETRY_FAILED_CYCLE_S

    def _claim(self) -> bool:
        """One claim for the free slots, if there are any; True when one of its grants could
        not start here (it is handed back)."""
        ledger = self._ledger
        with ledger.lock:
            plan = ledger.begin_claim(time.monotonic()) if ledger.room() > 0 else None
        if plan is None:
            return False
        result = claim_once(self._transport, ledger, plan, before_settle=self._stop_claims)
        self.claims += 1
        if result is None:  # a completion it carried was refused: each goes alone
            return False
        for attempt_id in result.released:
            self._emit(f"attempt {attempt_id} handed back: this process did not hold it")
        self._slots.deliver(ledger)  # grants the pool could not start
        granted = {g.attempt_id for g in result.grants}
        unstarted = any(h.attempt_id in granted for h in ledger.entries(Phase.UNSTARTED))
        # A claim that filled its limit may have left more behind; otherwise nothing is queued
        # for this process until a wake-up or a cycle says so.
        self._schedule.claim_due = len(result.grants) >= plan.limit and not unstarted
        if result.no_grant == NoGrant.GATE_CLOSED.value:
            if result.detail != self._gate_reason:
                self._emit(f"the dispatch gate is closed: {result.detail}")
            self._gate_reason = result.detail
        elif self._gate_reason is not None and result.grants:
            self._gate_reason = None
        return unstarted

    def _stop_claims(self) -> None:
        """Between a claim's answer and its settling: once a stop was asked for, what it
        granted is handed back unstarted."""
        if self._stop_requested.is_set():
            self._ledger.set_mode(Mode.DRAINING)

    def _on_event(self, event: Event, held: Held, detail: str) -> None:
        """What the ledger settled, as the process's lines. A finished task may let its
        workflow go on: the frontier runs soon."""
        if event in _FINISHED and not self._stop_requested.is_set():
            self._schedule.cycle_requested = True
        grant = held.grant
        label = f"run {grant.run_id} attempt {grant.attempt_number} ({grant.task})"
        outcome = held.outcome
        if event is Event.COMPLETED and outcome is not None:
            if outcome.succeeded:
                line = f"{label} succeeded"
            elif held.timed_out:
                line = f"{label} {timed_out_error(grant.timeout_ms or 0)}"
            else:
                # The first line: the error's type and message (its traceback stays on the run).
                first = (outcome.error or "").splitlines()[:1]
                line = f"{label} failed: {first[0] if first else ''}"
        elif event is Event.STOPPED_CANCELLED and held.attempt_id in self._left_running:
            line = f"{label} left running: its run was cancelled (outcome discarded)"
        elif event is Event.RELEASED:
            line = f"{label} handed back unstarted: {_CAUSES.get(detail, detail)}"
        else:
            line = _EVENT_LINES[event].format(label=label, detail=detail or held.detail)
        self._emit(line)

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

    def _schedule_second_pass(self, *, at_boot: bool = False) -> int | None:
        """Note when the leases left by another session expire, if some still hold. At boot a
        lease that startup recovery found live may have expired since: the pass is due at
        once. After the second pass, leases it left (expired, yet not to be recovered) call for
        no other."""
        grant = self._require_session()
        expiry = self._due_times.last_foreign_lease_expiry_ms(grant.session_id)
        now_ms = self._due_times.now_ms()
        if expiry is None or (expiry < now_ms and not at_boot):
            self._schedule.due_at_ms.pop("second_pass", None)
            return None
        at = max(expiry + 1, now_ms)
        self._schedule.due_at_ms["second_pass"] = at
        return at

    def _second_pass_due(self) -> bool:
        at = self._schedule.due_at_ms.get("second_pass")
        return at is not None and at <= self._due_times.now_ms()

    def _timeout(self) -> float | None:
        """Seconds the loop may sleep; None: until something wakes it. Every reason the loop
        wakes by itself is here: the resident cadence (Standalone), a failed cycle's retry, an
        asked-for cycle once ``MIN_CYCLE_GAP_S`` has passed, what the worker protocol has due
        (a claim, a report, a renewal, a task's timeout) and the store's next due time. With
        none of them (an idle Edge process), it sleeps until poked."""
        schedule = self._schedule
        now = time.monotonic()
        deadlines = [at for at in (schedule.next_resident, schedule.retry_failed) if at is not None]
        if schedule.cycle_requested:
            last = schedule.last_cycle_at
            deadlines.append(now if last is None else last + MIN_CYCLE_GAP_S)
        deadlines.extend(self._protocol_deadlines(now, claims=True))
        store_due = self._store_due()
        if store_due is not None:
            deadlines.append(now + max(0, store_due - self._due_times.now_ms()) / 1000)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - now)

    def _protocol_deadlines(self, now: float, *, claims: bool) -> list[float]:
        """When the worker protocol next needs the loop: a claim that may find work for a
        free slot, the reporter's next report or renewal, a running task's timeout. Calls wait
        for ``call_retry_at`` after one failed."""
        schedule = self._schedule
        ledger = self._ledger
        not_before = schedule.call_retry_at or now
        deadlines: list[float] = []
        self._claim_next()
        with ledger.lock:
            if claims and schedule.claim_due and ledger.room() > 0:
                deadlines.append(not_before)
            report = self._reporter.due_at(heartbeat=False)
        if report is not None and math.isfinite(report):  # inf: finished tasks await a claim
            deadlines.append(max(report, not_before))
        deadlines.extend(
            h.timeout_at for h in ledger.entries(Phase.RUNNING) if h.timeout_at is not None
        )
        return deadlines

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
        woken = False
        if self._cycle_requested.is_set():
            self._cycle_requested.clear()
            woken = True
        if self._wake is not None and self._wake.fileno() in ready:
            self._wake.drain()
            woken = True
        if woken:
            # A Run may have been queued (the store pokes on every such commit): claim at once;
            # the cadence follows (a workflow or a trigger may have been added).
            self._schedule.claim_due = True
            self._schedule.cycle_requested = True

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
        try:
            if self._registration is not None:
                self._drain()
        finally:
            self._release_resources()

    def _drain(self) -> None:
        ledger = self._ledger
        ledger.set_mode(Mode.DRAINING)
        with contextlib.suppress(DomainError):
            self._transport.drain()
        running = len(ledger.entries(Phase.RUNNING))
        if running:
            self._emit(f"draining: waiting for {running} running attempt(s)")
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._awaited() and time.monotonic() < deadline and not self._hurry.is_set():
            self._slots.deliver(ledger)
            self._stop_timed_out()
            self._exchange()  # stopping: completions, hand-backs and renewals only
            if not self._awaited():
                break
            now = time.monotonic()
            wake_at = [deadline, *self._protocol_deadlines(now, claims=False)]
            self._wait(max(0.0, min(wake_at) - now))
        # What still runs is stopped and reported abandoned; so is a task that ignores the
        # cancellation of its Run (its thread runs on, forgotten).
        for slot, attempt_id in ledger.stop_running(
            "the process stopped before the task finished", "worker_stopped"
        ):
            slot.kill(attempt_id)
            self._slots.detach(attempt_id)
        for held in ledger.entries(Phase.STOPPING):
            self._left_running.add(held.attempt_id)
            self._slots.detach(held.attempt_id)
        self._slots.deliver(ledger)
        self._report_last()
        with contextlib.suppress(DomainError):
            self._transport.close()
        self._emit("stopped")

    def _report_last(self) -> None:
        """Report what is left, trying again for a short while what the store could not
        decide yet."""
        ledger = self._ledger
        deadline = time.monotonic() + FINAL_REPORT_S
        while True:
            try:
                self._reporter.report(time.monotonic(), heartbeat=False)
            except Exception as error:
                self._emit(f"reporting to the store failed: {describe_error(error)}")
                return
            with ledger.lock:
                if ledger.settled() or time.monotonic() >= deadline:
                    return
            time.sleep(FINAL_REPORT_PAUSE_S)

    def _awaited(self) -> bool:
        """A drain waits for running tasks and their reports, but not for those whose Run was
        cancelled (a task that ignores its cancellation would hold the drain up for nothing),
        nor for a stop the store only recorded."""
        return any(
            h.phase is not Phase.RECORDED
            and not (h.phase is Phase.STOPPING and h.cause == CANCELLED)
            for h in self._ledger.entries()
        )

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

    def _require_session(self) -> Registration:
        if self._registration is None:
            raise RuntimeError("the runner has not booted")
        return self._registration


def _drain_pipe(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):
        while os.read(fd, 4096):
            pass


def _silent(_line: str) -> None:
    return None


def _no_grace() -> float:
    return 0.0


def _ignore(_why: str) -> None:
    return None
