"""The worker: one session, N execution slots, and the threads that keep them busy (ADR 0007).

- the **claimer** (:mod:`.claimer`) makes every claim: one in flight at most, carrying the
  completions ready at that moment and the exact ``held`` statement, asking for the free slots,
  parked at the node (long poll) until work is queued; each grant goes straight into a slot;
- the **reporter** (:mod:`.reporter`) sends the rest: completions while a claim is parked,
  abandons, releases, renewals on the leases' schedule, heartbeats;
- the **watchdog** (:mod:`.fencing`) stops a task whose lease could not be renewed in time;
- one **slot thread** per slot (:mod:`.pool`) feeds its child process;
- the caller's thread (:meth:`Worker.run`) registers, then watches the lifecycle: drain, stop,
  failure.

Every thread shares one :class:`~.ledger.Ledger`: what the worker holds, phase by phase.

A worker id names one execution slot group: registering it again (a restarted process) tells
the runtime that the older session's process is gone. Never run two processes with one id.

**Drain** (SIGTERM): no new claims (the ``drain`` call also frees a claim parked at the node);
running tasks finish, their completions are sent alone; anything granted that never reached a
slot is handed back with ``release``, so its Run is queued again for another worker with no
``lost`` verdict; a task still running after the drain timeout is stopped and abandoned; then
the session is closed. **Stop** (a second signal, or a failure): every task is stopped and
reported, the session closed.

**Outages** (ADR 0028): a call of the session that gets no answer (the node is down or cut
off, its database is down, a direct worker's database restarts) is repeated until it is
answered, at the next of the ingress's URLs when it has several, with a warning every give-up
time (the lease TTL, at least 5 s, see :class:`~.settings.Timings`); meanwhile the watchdog
stops each task when its lease ends, and the worker reports those stops once it is answered
again. The session lives in the database and nothing ends it for silence, so the worker goes on
with it. :meth:`Worker.run` raises :class:`WorkerFailed` when the session is refused (closed,
replaced by a process with the same worker id, or its credential revoked), when the first
registration gets no answer within the register timeout, or when a drain outlasts its timeout
without an answer; a second signal stops the worker at once."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

from ql3.adapters.worker.claimer import Claimer
from ql3.adapters.worker.client import IngressClient, IngressRefused, IngressUnavailable
from ql3.adapters.worker.fencing import Watchdog, kill_tasks
from ql3.adapters.worker.ledger import Ledger, Mode
from ql3.adapters.worker.pool import ChildFactory, SlotPool
from ql3.adapters.worker.protocol import RemoteTransport
from ql3.adapters.worker.reporter import Reporter
from ql3.adapters.worker.settings import MAX_CAPACITY, Timings, WorkerFailed, WorkerSettings

__all__ = ["MAX_CAPACITY", "Worker", "WorkerFailed", "WorkerSettings"]

log = logging.getLogger("ql3.worker")

SUPERVISE_POLL_S = 0.05  # how often the lifecycle looks at requests from signal handlers
FINAL_BUDGET_S = 1.0  # the retry budget of the calls made while stopping
THREAD_JOIN_S = 2.0


class Worker:
    """Runs tasks for one session until drained or stopped. ``run()`` returns the exit status:
    0 after a clean drain, 1 when the worker was stopped hard; it raises
    :class:`WorkerFailed` when the worker cannot go on."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        client_factory: Callable[[WorkerSettings], RemoteTransport] | None = None,
        child_factory: ChildFactory | None = None,
    ) -> None:
        self.settings = settings
        self._client = (client_factory or _default_client)(settings)
        self.ledger = Ledger(settings.concurrency)
        self._pool = SlotPool(settings.concurrency, settings.app_spec, self.ledger, child_factory)
        # Set from signal handlers: plain attributes, read by the lifecycle loop (a handler
        # must not wait for a lock the interrupted thread may hold).
        self._drain_requested = False
        self._drain_requested_at = 0.0
        self._stop_requested = False
        self._node_drain: str | None = None
        self._registering = False
        self._client.give_up = self._gives_up
        self.timings: Timings | None = None
        self.session_id: str | None = None
        self.claimer: Claimer | None = None
        self.reporter: Reporter | None = None
        self._watchdog: Watchdog | None = None
        self._threads: list[threading.Thread] = []

    @property
    def completed(self) -> int:
        return self.ledger.completed

    @property
    def abandoned(self) -> int:
        return self.ledger.abandoned

    @property
    def released(self) -> int:
        return self.ledger.released

    # --- control from other threads (signal handlers) -------------------------------------------

    def request_drain(self) -> None:
        """Finish what runs, hand back what never began, take no new work, close the session."""
        self._drain_requested_at = time.monotonic()
        self._drain_requested = True

    def request_stop(self) -> None:
        """Stop every task now, report them, close the session."""
        self._stop_requested = True

    def _gives_up(self) -> bool:
        """Whether the client stops repeating a call: the worker stops, a drain was asked
        before the session exists, or a drain has outlasted its timeout."""
        if self._stop_requested:
            return True
        if not self._drain_requested:
            return False
        return self._registering or (
            time.monotonic() - self._drain_requested_at > self.settings.drain_timeout_s
        )

    def _on_node_drain(self, why: str) -> None:
        if self._node_drain is None:
            self._node_drain = why

    # --- the lifecycle --------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self._pool.start()
            timings = self._register()
            self._start_threads(timings)
            return self._supervise(timings)
        finally:
            self._shutdown()

    def _register(self) -> Timings:
        settings = self.settings
        self._registering = True
        try:
            grant = self._client.register(
                settings.worker_id,
                settings.concurrency,
                settings.tasks,
                budget_s=settings.register_timeout_s,
            )
        except IngressUnavailable as error:
            raise WorkerFailed(f"cannot reach the ingress: {error}") from None
        except IngressRefused as error:
            raise WorkerFailed(f"registration refused: {error.message}") from None
        finally:
            self._registering = False
        timings = Timings.of(settings, grant.lease_ttl_ms, grant.heartbeat_interval_ms)
        self.timings = timings
        self.session_id = grant.session_id
        self.ledger.probe_s = timings.ttl_s / 3
        self._client.set_timeout(timings.request_timeout_s)
        self._client.retry_budget_s = timings.give_up_s
        replaced = (
            f", replacing {len(grant.replaced_session_ids)} older session(s)"
            if grant.replaced_session_ids
            else ""
        )
        log.info(
            "worker %s registered session %s (%d slot(s), lease ttl %.1fs, claims wait %.1fs)%s",
            settings.worker_id,
            grant.session_id,
            settings.concurrency,
            timings.ttl_s,
            timings.claim_wait_s,
            replaced,
        )
        return timings

    def _start_threads(self, timings: Timings) -> None:
        self.claimer = Claimer(self._client, self.ledger, timings, self._on_node_drain)
        self.reporter = Reporter(
            self._client,
            self.ledger,
            timings,
            grace_s=lambda: self.claimer.completion_grace_s if self.claimer else 0.0,
            kill=kill_tasks,
            on_node_drain=self._on_node_drain,
        )
        self._watchdog = Watchdog(self.ledger, timings.margin_s, timings.watchdog_interval_s)
        for name, target in (
            ("ql3-watchdog", self._watchdog.run),
            ("ql3-reporter", self.reporter.run),
            ("ql3-claimer", self.claimer.run),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _supervise(self, timings: Timings) -> int:
        ledger = self.ledger
        drain_started: float | None = None
        drain_timed_out = False
        while True:
            ledger.wait(lambda: ledger.failure is not None or self._drained(), SUPERVISE_POLL_S)
            try:
                if ledger.failure is not None:
                    return self._fail(ledger.failure, timings)
                if self._stop_requested:
                    return self._stop_hard("stopped", timings)
                if drain_started is None and (self._drain_requested or self._node_drain):
                    drain_started = time.monotonic()
                    self._begin_drain()
                if drain_started is None:
                    continue
                if (
                    not drain_timed_out
                    and time.monotonic() - drain_started > self.settings.drain_timeout_s
                ):
                    drain_timed_out = True
                    kill_tasks(
                        ledger.stop_running(
                            "the worker drained and its drain timeout passed", "drain_timeout"
                        ),
                        "the drain timeout passed",
                    )
                with ledger.lock:
                    drained = self._drained()
                if drained:
                    self._client.close()
                    log.info(
                        "session %s drained and closed (%d completed, %d abandoned, "
                        "%d handed back, %d cancelled; %d claims, %d other calls)",
                        self.session_id,
                        self.completed,
                        self.abandoned,
                        self.released,
                        self.ledger.cancelled,
                        self.claimer.claims if self.claimer else 0,
                        self._client.other_calls,
                    )
                    return 0
            except (IngressRefused, IngressUnavailable) as error:
                ledger.fail(error)

    def _drained(self) -> bool:
        """Hold the lock."""
        ledger = self.ledger
        return ledger.mode is Mode.DRAINING and ledger.claimer_done and ledger.settled()

    def _begin_drain(self) -> None:
        why = "" if self._drain_requested else f" ({self._node_drain})"
        log.info("draining session %s%s", self.session_id, why)
        self.ledger.set_mode(Mode.DRAINING)
        self._client.drain()  # the node grants no more, and answers a parked claim now

    def _fail(self, error: BaseException, timings: Timings) -> int:
        """Stop, report what can be reported, and raise :class:`WorkerFailed`."""
        if isinstance(error, IngressRefused) and error.session_lost:
            log.error("session %s is gone: %s", self.session_id, error.message)
            self._stop_hard("the session is gone", timings, close=False)
            raise WorkerFailed(f"session lost: {error.message}") from None
        self._stop_hard("failing", timings)
        if isinstance(error, WorkerFailed):
            raise error
        if isinstance(error, IngressUnavailable):
            raise WorkerFailed(f"cannot reach the ingress: {error}") from None
        if isinstance(error, IngressRefused):
            raise WorkerFailed(f"the ingress refused a call: {error}") from None
        log.error("the worker failed", exc_info=error)
        raise WorkerFailed(f"the worker failed: {type(error).__name__}: {error}") from error

    def _stop_hard(self, why: str, timings: Timings, *, close: bool = True) -> int:
        """Stop every task, report what can be reported within a short time, close the
        session."""
        ledger = self.ledger
        ledger.set_mode(Mode.STOPPING)
        self._client.retry_budget_s = min(self._client.retry_budget_s, FINAL_BUDGET_S)
        self._client.keep_trying = False
        kill_tasks(ledger.stop_running(f"the worker was {why}", "worker_stopped"), why)
        deadline = time.monotonic() + min(5.0, max(1.0, timings.ttl_s))
        with ledger.lock:
            parked = ledger.claim_sent_at is not None
        if parked and close:
            # Any call of the session answers its parked claim: what it grants is released.
            with contextlib.suppress(IngressRefused, IngressUnavailable):
                self._client.heartbeat()
            ledger.wait(lambda: ledger.claimer_done, min(1.0, deadline - time.monotonic()))
        reporter = self.reporter
        while reporter is not None and time.monotonic() < deadline:
            try:
                reporter.report(time.monotonic(), heartbeat=False)
            except (IngressRefused, IngressUnavailable) as error:
                log.warning("reporting while stopping failed: %s", error)
                break
            if ledger.wait(ledger.settled, min(0.05, deadline - time.monotonic())):
                break
        if close:
            try:
                self._client.close()
            except (IngressUnavailable, IngressRefused) as error:
                log.warning("closing the session failed: %s", error)
        log.info("worker stopped (%s)", why)
        return 1

    def _shutdown(self) -> None:
        self._stop_requested = True  # no call is repeated any more
        self.ledger.set_mode(Mode.STOPPING)
        if self.reporter is not None:
            self.reporter.stop()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._pool.shutdown()
        for thread in self._threads:
            if thread.name != "ql3-claimer":  # a parked claim ends with the connection
                thread.join(timeout=THREAD_JOIN_S)
        self._client.close_connection()


def _default_client(settings: WorkerSettings) -> RemoteTransport:
    return IngressClient(
        settings.ingress_urls,
        timeout_s=settings.request_timeout_s,
        registration_token=settings.registration_token,
        ca_file=settings.ca_file,
    )
