"""The Standalone and Edge process: boot with startup recovery, then one loop that claims work
for the in-process pool through the worker protocol and runs the cadence.

Boot
    1. Take the database's exclusive lock (:mod:`ql3.adapters.standalone.exclusive`): from here on
    no
       other process executes work on this database.
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
    store, through the worker protocol's commands
    (:class:`ql3.application.worker_commands.WorkerCommands`), so the same transitions apply as for
    a remote worker (ADR 0007):

    - Work is pulled: one ``claim`` asks for the pool's free capacity, carries the completions of
      the tasks that finished since the last call and states what the pool holds (``held``), all
      in one transaction; every Attempt it grants is started on the pool at once. The loop claims
      when something may be queued for it (after boot, a wake-up, a cycle that queued work, or a
      claim that filled its whole limit) and it has free capacity. Finished tasks otherwise
      complete with ``complete_many``.
    - Leases of running Attempts are renewed (``renew_many``) every third of the TTL. The
      session sends no heartbeat: the process owns the database (the exclusive lock), so its
      liveness concerns nobody else and a restart replaces its session; an idle process writes
      nothing (ADR 0012).
    - The cadence (:class:`ql3.adapters.standalone.steps.StandaloneCoordinator`: due retries,
      trigger schedule, workflow frontier, task attempt admission, the dispatch gate step) runs
      on the resident cadence, when a due time the store names is reached, and after wake-ups
      and finished tasks (a workflow's next step), but at most once per ``MIN_CYCLE_GAP_S``:
      a busy loop pays for the cadence a few times a second, not once per Run.

    Between passes the loop blocks in ``select`` on the database's wake channel and its own
    pipe. A commit that queues a Run pokes the wake channel (the store does), so an admission
    from any process is claimed within milliseconds, without polling. Standalone
    (``resident_cadence_s`` set) also wakes on that cadence. Edge (``resident_cadence_s`` None)
    has no resident wake-up: an idle Edge process sleeps until the wake channel is poked, a task
    finishes, a lease needs renewing, or the next due time (a retry's ``next_attempt_at_ms``, a
    trigger's next firing, the boot's second recovery pass) arrives.

Stop
    :meth:`StandaloneRunner.request_stop` (signal-safe) ends the loop: the session drains (no new
    claims), a grant that arrives meanwhile is handed back unstarted (``release_many``), running
    tasks get up to ``drain_timeout_s`` to finish (a second request cuts this short), any still
    running are abandoned (lost with the worker's own report as evidence), and the session is
    closed.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ql3.adapters.execution import TaskMapping
from ql3.adapters.standalone.pool import Execution, InProcessPool, Outcome, describe_error
from ql3.application.scheduler import Coordinator, CycleSummary
from ql3.application.startup import StartupRecovery, StartupReport
from ql3.application.worker_commands import (
    MAX_BATCH_ITEMS,
    MAX_CLAIM,
    Abandonment,
    BatchOutcome,
    ClaimAnswer,
    Completion,
    ItemResult,
    NoGrant,
    Release,
    SessionGrant,
    WorkerCommands,
)
from ql3.domain.errors import DomainError, FenceReason
from ql3.domain.retry import timed_out_error

Emit = Callable[[str], None]

# After a failed cycle or call (say, the database stayed locked), try again this much later.
RETRY_FAILED_CYCLE_S = 1.0
# Something is due but a cycle could not start it (a broken trigger, say): look again this much
# later instead of spinning.
NO_PROGRESS_BACKOFF_S = 5.0
# Cycles asked for by wake-ups and finished tasks run at most this often.
MIN_CYCLE_GAP_S = 0.25
# The count of a cycle step that says it queued a Run: the loop claims after such a cycle.
_QUEUED_WORK = (
    ("due_retries", "attempts_created"),
    ("trigger_schedule", "runs_admitted"),
    ("workflow_frontier", "steps_admitted"),
    ("task_attempt_admission", "gate_opened"),
)


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
        self._commands = commands
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
        self._wake: WakeSource | None = None
        self._grant: SessionGrant | None = None
        self._in_flight: dict[str, Execution] = {}
        self._unreported: list[Outcome] = []
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
        self._unreported.extend(self._finished())
        self._stop_timed_out()
        self._renew_due_leases()
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

    # --- claims and completions -------------------------------------------------------------------

    def _finished(self) -> list[Outcome]:
        """What the pool's tasks returned, but for those already reported as timed out."""
        return [
            o
            for o in self._pool.finished()
            if not ((e := self._in_flight.get(o.attempt_id)) is not None and e.timed_out)
        ]

    def _stop_timed_out(self) -> None:
        """Every task that ran past its run's timeout fails as timed out at once: an async task
        is cancelled; a plain function's thread cannot be stopped, it runs on and what it
        returns is dropped (ADR 0013)."""
        now = time.monotonic()
        ended = {o.attempt_id for o in self._unreported}
        for execution in self._in_flight.values():
            at = execution.timeout_at
            attempt_id = execution.grant.attempt_id
            if execution.timed_out or at is None or now < at or attempt_id in ended:
                continue
            execution.timed_out = True
            self._pool.cancel(attempt_id)
            self._unreported.append(
                Outcome(attempt_id=attempt_id, succeeded=False, error="timed out", timed_out=True)
            )

    def _free(self, reporting: int) -> int:
        """Free slots of the pool once ``reporting`` finished tasks are reported."""
        return self.settings.capacity - (len(self._in_flight) - reporting)

    def _exchange(self) -> None:
        """One call to the store for the pool: report what finished and, while something may
        be queued and a slot is free, claim as many Attempts as there are free slots, in the
        same transaction (``claim``); otherwise report with ``complete_many``. Outcomes that
        could not be reported (the database stayed locked) are kept for the next call."""
        schedule = self._schedule
        now = time.monotonic()
        if schedule.call_retry_at is not None and now < schedule.call_retry_at:
            return
        outcomes = [o for o in self._unreported if o.attempt_id in self._in_flight]
        stopped = [o for o in outcomes if self._in_flight[o.attempt_id].cancelled]
        if stopped:
            self._report_stopped(stopped)
            outcomes = [o for o in outcomes if o.attempt_id in self._in_flight]
            stopped = [o for o in outcomes if self._in_flight[o.attempt_id].cancelled]
            outcomes = [o for o in outcomes if not self._in_flight[o.attempt_id].cancelled]
        batch, rest = outcomes[:MAX_BATCH_ITEMS], outcomes[MAX_BATCH_ITEMS:]
        self._unreported = stopped + rest
        stopping = self._stop_requested.is_set()
        limit = 0
        if schedule.claim_due and not stopping:
            limit = min(MAX_CLAIM, self._free(len(batch)))
        if not batch and limit <= 0:
            return
        grant = self._require_session()
        completions = [
            Completion(
                fence=self._in_flight[o.attempt_id].fence,
                succeeded=o.succeeded,
                output=o.output,
                error=o.error,
                timed_out=o.timed_out,
            )
            for o in batch
        ]
        answer: ClaimAnswer | None = None
        try:
            if limit > 0:
                held = sorted(self._in_flight)
                answer = self._commands.claim(
                    grant.session_id,
                    grant.secret,
                    limit=limit,
                    completions=completions,
                    held=held if len(held) <= MAX_CLAIM * 4 else None,
                )
                self.claims += 1
                results: Sequence[ItemResult] = answer.completed
            else:
                results = self._commands.complete_many(
                    grant.session_id, grant.secret, completions
                ).results
        except Exception as error:
            self._unreported = batch + self._unreported
            what = "claiming" if limit > 0 else "reporting outcomes"
            self._emit(f"{what} failed: {describe_error(error)}")
            schedule.call_retry_at = now + RETRY_FAILED_CYCLE_S
            return
        schedule.call_retry_at = None
        self._settle(batch, results)
        if answer is not None:
            self._take(answer, limit)

    def _report_stopped(self, outcomes: Sequence[Outcome]) -> None:
        """Tasks whose Run was cancelled ended (an async task let itself be cancelled, or any
        task returned): their stop is reported with ``abandon`` instead of a completion, and
        whatever they returned is discarded (ADR 0017). Kept for the next call if it fails."""
        grant = self._require_session()
        chosen = outcomes[:MAX_BATCH_ITEMS]
        executions = [self._in_flight[o.attempt_id] for o in chosen]
        try:
            self._commands.abandon_many(
                grant.session_id,
                grant.secret,
                [Abandonment(fence=e.fence, detail="its run was cancelled") for e in executions],
            )
        except Exception as error:
            self._emit(f"reporting stopped tasks failed: {describe_error(error)}")
            return
        for execution in executions:
            del self._in_flight[execution.grant.attempt_id]
            self._emit(f"{execution.label} ended: its run was cancelled (outcome discarded)")

    def _settle(self, outcomes: Sequence[Outcome], results: Sequence[ItemResult]) -> None:
        for outcome, result in zip(outcomes, results, strict=True):
            execution = self._in_flight.pop(outcome.attempt_id)
            label = execution.label
            if result.reason == FenceReason.CANCELLED.value:
                self._emit(f"{label} finished after its run was cancelled: outcome discarded")
            elif not result.ok:
                self._emit(f"{label} finished, but its outcome was refused: {result.message}")
            elif outcome.succeeded:
                self._emit(f"{label} succeeded")
            elif outcome.timed_out:
                self._emit(f"{label} {timed_out_error(execution.grant.timeout_ms or 0)}")
            else:
                # The first line: the error's type and message (its traceback stays on the run).
                first = (outcome.error or "").splitlines()[:1]
                self._emit(f"{label} failed: {first[0] if first else ''}")
        if outcomes and not self._stop_requested.is_set():
            # A finished step may let its workflow go on: the frontier runs soon.
            self._schedule.cycle_requested = True

    def _take(self, answer: ClaimAnswer, limit: int) -> None:
        """Start every granted Attempt on the pool; hand back those that cannot start."""
        schedule = self._schedule
        for attempt_id in answer.released:
            self._emit(f"attempt {attempt_id} handed back: this process did not hold it")
        now = time.monotonic()
        renew_at = now + self._renew_every()
        unstarted: list[tuple[Execution, str]] = []
        for grant in answer.grants:
            execution = Execution(
                grant=grant,
                renew_at=renew_at,
                timeout_at=now + grant.timeout_ms / 1000 if grant.timeout_ms else None,
            )
            if self._stop_requested.is_set():
                unstarted.append((execution, "the process is stopping"))
                continue
            try:
                self._pool.start(execution)
            except Exception as error:  # no thread to be had
                unstarted.append((execution, f"slot failed to start: {describe_error(error)}"))
                continue
            self._in_flight[grant.attempt_id] = execution
            self._emit(f"{execution.label} started")
        if unstarted:
            self._hand_back(unstarted)
            schedule.call_retry_at = time.monotonic() + RETRY_FAILED_CYCLE_S
        # A claim that filled its limit may have left more behind; otherwise nothing is queued
        # for this process until a wake-up or a cycle says so.
        schedule.claim_due = len(answer.grants) >= limit and not unstarted
        if answer.no_grant is NoGrant.GATE_CLOSED:
            if answer.detail != self._gate_reason:
                self._emit(f"the dispatch gate is closed: {answer.detail}")
            self._gate_reason = answer.detail
        elif self._gate_reason is not None and answer.grants:
            self._gate_reason = None

    def _hand_back(self, unstarted: Sequence[tuple[Execution, str]]) -> None:
        """Give granted Attempts back unstarted: each Run is queued again, with no verdict. If
        this fails, the next claim's ``held`` statement hands them back."""
        grant = self._require_session()
        try:
            answer = self._commands.release_many(
                grant.session_id,
                grant.secret,
                [Release(fence=e.fence, cause=cause) for e, cause in unstarted],
            )
        except Exception as error:
            self._emit(f"handing back {len(unstarted)} attempt(s) failed: {describe_error(error)}")
            return
        for (execution, cause), result in zip(unstarted, answer.results, strict=True):
            if result.ok:
                self._emit(f"{execution.label} handed back unstarted: {cause}")
            else:
                self._emit(f"{execution.label} not handed back: {result.message}")

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
            # The lease's authority is gone: an async task is cancelled; any other task keeps
            # running, but the fence will refuse its outcome.
            execution.orphaned = True
            self._pool.cancel(execution.grant.attempt_id)
            if result.reason == FenceReason.CANCELLED.value:
                execution.cancelled = True
                self._emit(f"{execution.label}: its run was cancelled; stopping the task")
            else:
                self._emit(f"{execution.label} lost its lease: {result.message}")

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
        """Seconds the loop may sleep; None: until something wakes it."""
        schedule = self._schedule
        now = time.monotonic()
        deadlines = [at for at in (schedule.next_resident, schedule.retry_failed) if at is not None]
        if schedule.cycle_requested:
            last = schedule.last_cycle_at
            deadlines.append(now if last is None else last + MIN_CYCLE_GAP_S)
        if self._unreported or (schedule.claim_due and self._free(0) > 0):
            # Outcomes left to report, or a claim that filled its limit with slots still free.
            deadlines.append(schedule.call_retry_at or now)
        deadlines.extend(
            execution.renew_at for execution in self._in_flight.values() if not execution.orphaned
        )
        deadlines.extend(
            e.timeout_at
            for e in self._in_flight.values()
            if e.timeout_at is not None and not e.timed_out
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
        while self._awaited() and time.monotonic() < deadline and not self._hurry.is_set():
            self._unreported.extend(self._finished())
            self._stop_timed_out()
            self._exchange()  # stopping: completions only
            self._renew_due_leases()
            if not self._awaited():
                break
            wake_at = [deadline]
            wake_at.extend(e.renew_at for e in self._in_flight.values() if not e.orphaned)
            wake_at.extend(
                e.timeout_at
                for e in self._in_flight.values()
                if e.timeout_at is not None and not e.timed_out
            )
            if self._unreported:
                wake_at.append(self._schedule.call_retry_at or time.monotonic())
            self._wait(max(0.0, min(wake_at) - time.monotonic()))
        self._unreported.extend(self._finished())
        self._schedule.call_retry_at = None
        self._exchange()
        left = list(self._in_flight.values())
        if left:
            detail = "the process stopped before the task finished"
            answer = self._commands.abandon_many(
                grant.session_id,
                grant.secret,
                [Abandonment(fence=e.fence, detail=detail) for e in left],
            )
            for execution, result in zip(left, answer.results, strict=True):
                what = "abandoned" if result.ok else f"not abandoned: {result.message}"
                if result.outcome is BatchOutcome.CANCELLED:
                    what = "left running: its run was cancelled (outcome discarded)"
                self._emit(
                    f"run {execution.grant.run_id} attempt {execution.grant.attempt_number} {what}"
                )
        self._in_flight.clear()
        with contextlib.suppress(DomainError):
            self._commands.close(grant.session_id, grant.secret)
        self._emit("stopped")

    def _awaited(self) -> bool:
        """A drain waits for running tasks, but not for those whose Run was cancelled (a task
        that ignores its cancellation would hold the drain up for nothing)."""
        return any(not e.cancelled for e in self._in_flight.values())

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
