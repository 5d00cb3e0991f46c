"""The worker: one session, N execution slots, a local queue of prefetched attempts, batched
protocol calls, self-fencing, drain.

Threads and their jobs:

- the **control loop** (the caller's thread, :meth:`Worker.run`) talks to the ingress. Each turn
  it reports finished tasks (one ``complete`` batch) and stopped ones (one ``abandon`` batch),
  renews every held lease in one batch every third of the lease TTL, and asks for work (a
  heartbeat) while a slot is free or the local queue is below its low-water mark: offers that
  fit the free slots are started (one ``start`` batch), the others are accepted (one ``accept``
  batch) and queued;
- the **activator** hands queued attempts to the slots that freed up, in offer order, all that
  one wake-up finds in one ``activate`` batch. It has a thread of its own so that a slot waits
  for one round trip only, never behind a completion or a heartbeat;
- one **slot thread** per slot hands jobs to its child process (see :mod:`.slot`); when a job
  ends it frees the slot and wakes the activator and the control loop;
- the **watchdog** stops (kills) a task whose lease could not be renewed before its expiry
  minus a margin, whatever the control loop is doing (a hung call to the ingress included).
  The worker then reports ``abandon`` as soon as the ingress answers again: with the lease
  still live the attempt is lost at once, otherwise the report is kept as not-running evidence.
  A queued attempt in the same case is dropped from the queue: it never started, so recovery
  loses it on expiry without evidence.

**Prefetch.** The session registers ``concurrency + prefetch`` as its capacity, so the node
offers more than the free slots. The surplus is only *accepted* (the token is bound, the start
barrier is not crossed) and waits in the local queue, in offer order, renewed like a running
attempt, until a slot frees; then it is *activated*. An accepted attempt that never started
needs no not-running evidence: if the worker dies, recovery loses it once its lease expires and
the runtime retries it as its policy says (a Run that does not declare a retry on lost ends
``failed``, without having run).

Local deadlines are conservative: a lease that the ingress says expires in ``d`` ms (its own
clock: ``expires_at_ms - now_ms``) is taken to expire ``d`` ms after the request was *sent*.

A worker id names one execution slot group: registering it again (a restarted process) tells
the runtime that the older session's process is gone. Never run two processes with one id.

Drain (SIGTERM): the session stops getting new offers; queued attempts (accepted, never started
here) are handed back at once with ``abandon``; offers granted before the drain are started if a
slot is free, else accepted and handed back the same way; running tasks finish (or are stopped
after the drain timeout and abandoned); then the session is closed."""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from adapters.worker.client import (
    BatchResult,
    Fence,
    IngressClient,
    IngressRefused,
    IngressUnavailable,
    ItemAnswer,
    OfferData,
)
from adapters.worker.slot import Job, JobOutcome, SlotError, SlotProcess

log = logging.getLogger("ql3.worker")

POLL_MIN_S = 0.02
TOKEN_BYTES = 32
MAX_CAPACITY = 1024  # the most a session may register (slots plus prefetch)
EXPIRED = "expired"  # the fence reason of a lease past its expiry
COALESCE_MAX_S = 0.005  # the longest an activation waits for more slots to free


class WorkerFailed(Exception):
    """The worker cannot go on (its session is gone, its slots cannot start...)."""


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    ingress_url: str
    app_spec: str
    worker_id: str
    tasks: tuple[str, ...]
    concurrency: int = 1
    prefetch: int = 0  # attempts accepted beyond the free slots, queued locally
    drain_timeout_s: float = 30.0
    poll_interval_s: float = 0.5  # the longest wait between polls while the worker wants work
    request_timeout_s: float = 5.0
    register_timeout_s: float = 30.0
    drain_settle_s: float = 0.5
    registration_token: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.concurrency <= MAX_CAPACITY:
            raise ValueError(f"concurrency must be within 1..{MAX_CAPACITY}")
        if not 0 <= self.prefetch <= MAX_CAPACITY - self.concurrency:
            raise ValueError(f"prefetch must be within 0..{MAX_CAPACITY} minus the concurrency")
        if not self.tasks:
            raise ValueError("a worker needs at least one task")
        for name, value in (
            ("drain timeout", self.drain_timeout_s),
            ("poll interval", self.poll_interval_s),
            ("request timeout", self.request_timeout_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def capacity(self) -> int:
        """What the session registers: the node offers it at most this many attempts."""
        return self.concurrency + self.prefetch

    @property
    def low_water(self) -> int:
        """Below this many queued attempts the worker asks for more work."""
        return (self.prefetch + 1) // 2


class Phase(enum.Enum):
    ACCEPTING = "accepting"  # its accept was sent; the answer is not in yet
    QUEUED = "queued"  # accepted, waiting for a free slot; it never ran here
    ACTIVATING = "activating"  # its start or activation was sent; a slot is reserved for it
    RUNNING = "running"  # the task executes in a slot
    FINISHED = "finished"  # the task returned; its completion is not acknowledged yet
    STOPPING = "stopping"  # the worker is stopping the task
    STOPPED = "stopped"  # stopped or handed back; its abandon is not acknowledged yet


# Phases whose lease the worker knows it holds and keeps renewing.
RENEWED = frozenset({Phase.QUEUED, Phase.RUNNING, Phase.FINISHED})


@dataclass
class Held:
    offer: OfferData
    fence: Fence
    deadline: float
    phase: Phase
    slot: _Slot | None
    outcome: JobOutcome | None = None
    stop_reason: str = ""
    accepted: bool = False  # its token is bound to the lease (it was queued)
    unanswered: bool = False  # an accept/start/activate got no answer: repeat it

    def job(self) -> Job:
        offer = self.offer
        return Job(
            attempt_id=offer.attempt_id,
            run_id=offer.run_id,
            attempt_number=offer.attempt_number,
            idempotency_key=offer.idempotency_key,
            task=offer.task,
            input=offer.input,
        )


class _Slot:
    """A slot thread and its child process."""

    def __init__(
        self,
        index: int,
        app_spec: str,
        on_done: Callable[[_Slot, str, JobOutcome, bool], None],
        events: queue.Queue[tuple[Any, ...]],
    ) -> None:
        self.index = index
        self.process = SlotProcess(app_spec, name=f"slot-{index}")
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.ready = threading.Event()
        self.error: str | None = None
        self._on_done = on_done
        self._events = events
        self.thread = threading.Thread(target=self._loop, name=f"ql3-slot-{index}", daemon=True)

    def _loop(self) -> None:
        # The child is started from this thread, which lives as long as the slot: the child's
        # parent-death signal follows the thread that started it.
        try:
            self.process.start()
        except (SlotError, OSError) as error:
            self.error = str(error)
            self.ready.set()
            return
        self.ready.set()
        while True:
            job = self.jobs.get()
            if job is None:
                break
            outcome = self.process.run(job)
            if self.process.pid is None:  # the child was killed or died: start a fresh one
                try:
                    self.process.start()
                except (SlotError, OSError) as error:
                    self._on_done(self, job.attempt_id, outcome, False)
                    self._events.put(("slot_failed", self.index, str(error)))
                    return
            self._on_done(self, job.attempt_id, outcome, True)
        self.process.close()


@dataclass
class _Due:
    """When the control loop next does each thing (monotonic seconds)."""

    poll: float = 0.0
    poll_wait: float = POLL_MIN_S
    heartbeat: float = 0.0
    retry_reports: float = 0.0
    retry_renew: float = 0.0
    retry_unanswered: float = 0.0
    drain_sent_at: float | None = None
    settled_poll_done: bool = False


class Worker:
    """Runs tasks for one session until drained or stopped. ``run()`` returns the exit status:
    0 after a clean drain, 1 when the session was lost or the worker was stopped hard."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        client_factory: Callable[[WorkerSettings], IngressClient] | None = None,
    ) -> None:
        self.settings = settings
        self._client = (client_factory or _default_client)(settings)
        self._events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        # Guards ``_held`` (and the phases, deadlines and slots of its entries), ``_free`` and
        # the activator's state; the other fields belong to the control loop alone.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot freed, an attempt queued...
        self._held: dict[str, Held] = {}  # insertion order is offer order: the queue's order
        self._slots = [
            _Slot(i, settings.app_spec, self._on_done, self._events)
            for i in range(settings.concurrency)
        ]
        self._free: list[_Slot] = []
        self._activations_halted = False
        self._activation_in_flight = False
        self._drain_requested = threading.Event()
        self._stop_requested = threading.Event()
        self._closing = threading.Event()
        self._drain_started_at: float | None = None
        self._ttl_s = 0.0
        self._margin_s = 0.0
        self._heartbeat_s = 1.0
        self._due = _Due()
        self.session_id: str | None = None
        self.completed = 0
        self.abandoned = 0

    # --- control from other threads (signal handlers) -------------------------------------------

    def request_drain(self) -> None:
        """Finish what runs, hand back what is queued, take no new work, close the session."""
        self._drain_requested.set()
        self._events.put(("wake",))

    def request_stop(self) -> None:
        """Stop every task now, report them abandoned, close the session."""
        self._stop_requested.set()
        self._drain_requested.set()
        self._events.put(("wake",))

    def _on_done(self, slot: _Slot, attempt_id: str, outcome: JobOutcome, reusable: bool) -> None:
        """A slot's job ended (called from the slot's thread)."""
        with self._lock:
            if reusable:
                self._free.append(slot)
            held = self._held.get(attempt_id)
            if held is not None:
                held.slot = None
                if outcome.killed:
                    held.phase = Phase.STOPPED
                else:
                    held.phase = Phase.FINISHED
                    held.outcome = outcome
            self._changed.notify_all()
        self._events.put(("done",))

    # --- the control loop -----------------------------------------------------------------------

    def run(self) -> int:
        watchdog = threading.Thread(target=self._watch, name="ql3-watchdog", daemon=True)
        activator = threading.Thread(target=self._activations, name="ql3-activator", daemon=True)
        try:
            self._start_slots()
            self._register()
            watchdog.start()
            activator.start()
            return self._loop()
        finally:
            self._closing.set()
            with self._lock:
                self._changed.notify_all()
            for slot in self._slots:
                slot.process.kill()
                slot.jobs.put(None)
            for slot in self._slots:
                slot.thread.join(timeout=5)
            if activator.is_alive():
                activator.join(timeout=self.settings.request_timeout_s + 1)
            self._client.close_connection()

    def _start_slots(self) -> None:
        for slot in self._slots:
            slot.thread.start()
        for slot in self._slots:
            slot.ready.wait()
        failed = [s.error for s in self._slots if s.error]
        if failed:
            raise WorkerFailed(f"a slot could not start: {failed[0]}")
        self._free = list(self._slots)

    def _register(self) -> None:
        deadline = time.monotonic() + self.settings.register_timeout_s
        wait = 0.1
        while True:
            try:
                grant = self._client.register(
                    self.settings.worker_id, self.settings.capacity, self.settings.tasks
                )
                break
            except IngressUnavailable as error:
                if time.monotonic() + wait > deadline or self._drain_requested.is_set():
                    raise WorkerFailed(f"cannot reach the ingress: {error}") from None
                time.sleep(wait)
                wait = min(wait * 2, 2.0)
            except IngressRefused as error:
                raise WorkerFailed(f"registration refused: {error.message}") from None
        self.session_id = grant.session_id
        self._ttl_s = grant.lease_ttl_ms / 1000
        self._margin_s = max(0.05, min(1.0, self._ttl_s * 0.1))
        self._heartbeat_s = grant.heartbeat_interval_ms / 1000
        self._client.set_timeout(min(self.settings.request_timeout_s, max(0.5, self._ttl_s / 3)))
        replaced = (
            f", replacing {len(grant.replaced_session_ids)} older session(s)"
            if grant.replaced_session_ids
            else ""
        )
        log.info(
            "worker %s registered session %s (%d slot(s), prefetch %d, lease ttl %.1fs)%s",
            self.settings.worker_id,
            grant.session_id,
            self.settings.concurrency,
            self.settings.prefetch,
            self._ttl_s,
            replaced,
        )

    def _loop(self) -> int:
        while True:
            try:
                self._take_events(block_s=self._wait_s())
                if self._stop_requested.is_set():
                    return self._stop_hard("stopped")
                self._drain_step()
                self._report()
                self._renew()
                if self._drained():
                    self._client.close()
                    log.info(
                        "session %s drained and closed (%d completed, %d abandoned)",
                        self.session_id,
                        self.completed,
                        self.abandoned,
                    )
                    return 0
                self._poll()
            except WorkerFailed:
                self._stop_hard("failing")
                raise
            except IngressRefused as error:
                if not error.session_lost:
                    log.error("the ingress refused a call: %s", error)
                    self._stop_hard("failing")
                    raise WorkerFailed(f"the ingress refused a call: {error}") from None
                log.error("session %s is gone: %s", self.session_id, error.message)
                self._stop_hard("the session is gone", close=False)
                raise WorkerFailed(f"session lost: {error.message}") from None

    def _in(self, *phases: Phase) -> list[Held]:
        """The held attempts in these phases, in offer order (hold the lock)."""
        return [h for h in self._held.values() if h.phase in phases]

    def _wait_s(self) -> float:
        now = time.monotonic()
        dues = [self._due.heartbeat]
        with self._lock:
            if self._wants_work():
                dues.append(self._due.poll)
            if any(h.unanswered for h in self._held.values()):
                dues.append(self._due.retry_unanswered)
            if self._in(Phase.FINISHED, Phase.STOPPED):
                dues.append(self._due.retry_reports)
            renewable = [h.deadline for h in self._in(*RENEWED)]
        if renewable:
            dues.append(max(min(renewable) - self._ttl_s * 2 / 3, self._due.retry_renew))
        if self._drain_requested.is_set():
            dues.append(now + 0.05)
        return min(max(min(dues) - now, 0.0), 0.25)

    def _take_events(self, block_s: float) -> None:
        try:
            event = self._events.get(timeout=block_s) if block_s > 0 else self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._on_event(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _on_event(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "slot_failed":
            _, index, message = event
            raise WorkerFailed(f"slot {index} cannot start a new child: {message}")
        if kind == "refused":  # the activator's call was refused as a whole
            raise event[1]
        if kind == "failed":
            raise WorkerFailed(event[1])

    # --- starting: queued attempts into free slots ---------------------------------------------

    def _activations(self) -> None:
        """The activator: whenever slots are free and attempts queued, activate as many as
        there are free slots, in offer order, in one call.

        Before a call it gives the busy slots a moment (a quarter of the last call's round
        trip, at most ``COALESCE_MAX_S``) to free up as well: a slot that frees just after a
        call left would wait for that whole call and then one of its own, and short tasks
        would settle into waves of half the slots each."""
        round_trip_s = 0.0
        while True:
            with self._lock:
                while True:
                    while not self._closing.is_set() and not self._can_activate():
                        self._changed.wait(0.25)
                    until = time.monotonic() + min(COALESCE_MAX_S, round_trip_s / 4)
                    while (
                        not self._closing.is_set()
                        and len(self._free) < len(self._slots)
                        and (left := until - time.monotonic()) > 0
                    ):
                        self._changed.wait(left)
                    if self._closing.is_set():
                        return
                    if self._can_activate():  # still: the lock was let go while waiting
                        break
                chosen = self._in(Phase.QUEUED)[: len(self._free)]
                for held in chosen:
                    held.phase = Phase.ACTIVATING  # from here on the watchdog leaves it alone
                    held.slot = self._free.pop()
                self._activation_in_flight = True
            sent = time.monotonic()
            try:
                if self._send_start(chosen, self._client.activate):
                    round_trip_s = time.monotonic() - sent
                else:  # the ingress is away: do not hammer it
                    self._closing.wait(min(0.2, max(0.05, self._ttl_s / 10)))
            except IngressRefused as error:
                with self._lock:
                    for held in chosen:  # refused as a whole: nothing changed, nothing ran
                        self._release_reservation(held)
                        self._held.pop(held.fence.attempt_id, None)
                self._events.put(("refused", error))
                return
            except Exception as error:  # a bug or a garbled answer: stop, do not hang
                log.exception("activating queued attempts failed")
                self._events.put(("failed", f"activation failed: {error}"))
                return
            finally:
                with self._lock:
                    self._activation_in_flight = False
                    self._changed.notify_all()

    def _can_activate(self) -> bool:
        """Hold the lock."""
        return (
            not self._activations_halted
            and not self._drain_requested.is_set()
            and bool(self._free)
            and any(h.phase is Phase.QUEUED for h in self._held.values())
        )

    def _halt_activations(self) -> None:
        """No activation starts from now on; wait for the one in flight (its call is bounded
        by the request timeout)."""
        deadline = time.monotonic() + self.settings.request_timeout_s + 1
        with self._lock:
            self._activations_halted = True
            while self._activation_in_flight and time.monotonic() < deadline:
                self._changed.wait(0.05)

    def _release_reservation(self, held: Held) -> None:
        """Give back the slot reserved for ``held`` (hold the lock)."""
        if held.slot is not None:
            self._free.append(held.slot)
            held.slot = None
            self._changed.notify_all()

    def _send_start(
        self, entries: Sequence[Held], call: Callable[[Sequence[Fence]], BatchResult]
    ) -> bool:
        """Cross the start barrier of ``entries`` (each has a reserved slot); a started one
        runs at once. A call without an answer is repeated with the same fences. False when
        the ingress did not answer."""
        sent = time.monotonic()
        try:
            answer = call([h.fence for h in entries])
        except IngressUnavailable as error:
            # The answer is lost, not necessarily the start: repeat it with the same tokens (a
            # start is idempotent) until the ingress answers, so that no attempt is started
            # without the worker knowing its fence. A call that never left changed nothing.
            log.warning(
                "starting %d attempt(s) got no answer, will repeat: %s", len(entries), error
            )
            self._mark_unanswered(entries, sent, error)
            return False
        started = []
        with self._lock:
            for held in entries:
                item = answer.items.get(held.fence.attempt_id)
                if held.phase is not Phase.ACTIVATING:
                    continue
                if item is not None and item.ok and item.expires_in_s is not None:
                    held.phase = Phase.RUNNING
                    held.deadline = sent + item.expires_in_s
                    held.unanswered = False
                    started.append(held)
                    continue
                self._release_reservation(held)
                if held.unanswered and item is not None and item.reason == EXPIRED:
                    # An earlier try may have crossed the barrier: say it never ran here.
                    held.phase = Phase.STOPPED
                    held.unanswered = False
                    held.stop_reason = "never ran: the answer to its start was lost"
                else:
                    self._held.pop(held.fence.attempt_id, None)
                    log.info("attempt %s not started: %s", held.fence.attempt_id, _why(item))
        for held in started:
            assert held.slot is not None
            held.slot.jobs.put(held.job())
        return True

    def _send_accept(self, entries: Sequence[Held]) -> None:
        """Accept offers for the local queue; nothing is started."""
        sent = time.monotonic()
        try:
            answer = self._client.accept([h.fence for h in entries])
        except IngressUnavailable as error:
            log.warning("accepting %d offer(s) got no answer, will repeat: %s", len(entries), error)
            self._mark_unanswered(entries, sent, error)
            return
        with self._lock:
            for held in entries:
                item = answer.items.get(held.fence.attempt_id)
                if item is not None and item.ok and item.expires_in_s is not None:
                    held.phase = Phase.QUEUED
                    held.deadline = sent + item.expires_in_s
                    held.accepted = True
                    held.unanswered = False
                    self._changed.notify_all()
                else:
                    # Refused, or its lease ran out while the answer was lost: either way it
                    # never started, and recovery needs no evidence for it.
                    self._held.pop(held.fence.attempt_id, None)
                    log.info("offer %s not accepted: %s", held.fence.attempt_id, _why(item))

    def _mark_unanswered(
        self, entries: Sequence[Held], sent: float, error: IngressUnavailable
    ) -> None:
        """The control loop repeats them (see :meth:`_retry_unanswered`). Those whose only
        call never left the worker changed nothing: a queued one goes back to the queue (and
        under the watchdog), an offer is dropped (the next heartbeat lists it again)."""
        with self._lock:
            for held in entries:
                if error.sent or held.unanswered:
                    held.unanswered = True
                    continue
                self._release_reservation(held)
                if held.accepted:
                    held.phase = Phase.QUEUED
                else:
                    self._held.pop(held.fence.attempt_id, None)
            self._due.retry_unanswered = sent + min(0.2, max(0.05, self._ttl_s / 10))
        self._events.put(("wake",))

    def _retry_unanswered(self) -> None:
        """Repeat the accepts and starts whose answers were lost, with the same tokens."""
        with self._lock:
            starting = [h for h in self._in(Phase.ACTIVATING) if h.unanswered]
            accepting = [h for h in self._in(Phase.ACCEPTING) if h.unanswered]
        if starting:
            # ``start`` takes an accepted attempt as far as ``activate`` does, and one whose
            # accept never arrived too.
            self._send_start(starting, self._client.start)
        if accepting:
            self._send_accept(accepting)

    # --- reporting ------------------------------------------------------------------------------

    def _report(self) -> None:
        now = time.monotonic()
        if now < self._due.retry_reports:
            return
        with self._lock:
            finished = self._in(Phase.FINISHED)
            stopped = self._in(Phase.STOPPED)
        try:
            if finished:
                self._complete(finished)
            if stopped:
                self._abandon(stopped)
        except IngressUnavailable as error:
            log.warning("reporting to the ingress failed, will retry: %s", error)
            self._due.retry_reports = now + 0.2

    def _complete(self, finished: Sequence[Held]) -> None:
        items = []
        for held in finished:
            outcome = held.outcome
            assert outcome is not None
            items.append((held.fence, outcome.succeeded, outcome.output, outcome.error))
        try:
            answer = self._client.complete(items)
        except IngressRefused as error:
            if error.session_lost:
                raise
            self._complete_refused(finished, error)
            return
        with self._lock:
            for held in finished:
                item = answer.items.get(held.fence.attempt_id)
                if item is None:
                    continue
                if item.ok:
                    self._held.pop(held.fence.attempt_id, None)
                    self.completed += 1
                elif item.reason == EXPIRED:
                    held.phase = Phase.STOPPED
                    held.stop_reason = "finished after its lease expired; result discarded"
                    log.warning(
                        "attempt %s finished after its lease expired: result discarded",
                        held.fence.attempt_id,
                    )
                else:
                    self._held.pop(held.fence.attempt_id, None)
                    log.warning(
                        "completion of attempt %s refused (%s %s): result discarded",
                        held.fence.attempt_id,
                        item.error,
                        item.reason or "",
                    )
        self._due.poll = time.monotonic()  # capacity was freed: ask for work now
        self._due.poll_wait = POLL_MIN_S

    def _complete_refused(self, finished: Sequence[Held], error: IngressRefused) -> None:
        """The ingress refused a whole batch of completions (an output too large, say): report
        them one by one, and a refused one as failed without its output."""
        if len(finished) > 1:
            for held in finished:
                self._complete([held])
            return
        (held,) = finished
        outcome = held.outcome
        assert outcome is not None
        if outcome.succeeded:
            held.outcome = JobOutcome(
                succeeded=False, error=f"the ingress refused the result: {error.error}"
            )
            self._complete([held])
            return
        with self._lock:
            held.phase = Phase.STOPPED
            held.stop_reason = f"the ingress refused the completion: {error.error}"

    def _abandon(self, stopped: Sequence[Held]) -> None:
        answer = self._client.abandon(
            [(h.fence, h.stop_reason or "stopped by the worker") for h in stopped]
        )
        with self._lock:
            for held in stopped:
                item = answer.items.get(held.fence.attempt_id)
                if item is None:
                    continue
                self._held.pop(held.fence.attempt_id, None)
                self.abandoned += 1
                log.warning(
                    "attempt %s abandoned (%s): %s",
                    held.fence.attempt_id,
                    item.outcome or item.reason or item.error,
                    held.stop_reason,
                )
        self._due.poll = time.monotonic()
        self._due.poll_wait = POLL_MIN_S

    # --- renewals and self-fencing ----------------------------------------------------------------

    def _renew(self) -> None:
        now = time.monotonic()
        if now < self._due.retry_renew:
            return
        with self._lock:
            live = self._in(*RENEWED)
        if not live or min(h.deadline for h in live) - now > self._ttl_s * 2 / 3:
            return
        sent = time.monotonic()
        try:
            answer = self._client.renew([h.fence for h in live])
        except IngressUnavailable as error:
            log.warning("renewing %d lease(s) failed, will retry: %s", len(live), error)
            self._due.retry_renew = now + min(0.2, self._ttl_s / 10)
            return
        self._apply_deadlines(answer, live, sent, refused_reason="lease refused at renewal")

    def _apply_deadlines(
        self, answer: BatchResult, helds: Sequence[Held], sent: float, refused_reason: str
    ) -> None:
        to_stop = []
        with self._lock:
            for held in helds:
                item = answer.items.get(held.fence.attempt_id)
                if item is None:
                    continue
                if item.ok and item.expires_in_s is not None:
                    # An activation may have answered meanwhile: expiries only move forward.
                    held.deadline = max(held.deadline, sent + item.expires_in_s)
                elif not item.ok and held.phase is Phase.RUNNING:
                    held.phase = Phase.STOPPING
                    held.stop_reason = f"{refused_reason}: {item.reason or item.error}"
                    to_stop.append(held)
                elif not item.ok and held.phase is Phase.QUEUED:
                    # It never started here; with its lease gone there is nothing to report.
                    self._held.pop(held.fence.attempt_id, None)
                    log.warning(
                        "queued attempt %s dropped, %s: %s",
                        held.fence.attempt_id,
                        refused_reason,
                        item.reason or item.error,
                    )
        for held in to_stop:
            self._stop_task(held)

    def _stop_task(self, held: Held) -> None:
        log.warning("stopping attempt %s: %s", held.fence.attempt_id, held.stop_reason)
        slot = held.slot
        if slot is not None:
            slot.process.kill(held.fence.attempt_id)

    def _watch(self) -> None:
        """Self-fencing, independent of the control loop and of the ingress."""
        interval = max(0.01, min(0.05, self._ttl_s / 40))
        while not self._closing.wait(interval):
            now = time.monotonic()
            to_stop = []
            with self._lock:
                for held in list(self._held.values()):
                    if now < held.deadline - self._margin_s:
                        continue
                    if held.phase is Phase.RUNNING:
                        held.phase = Phase.STOPPING
                        held.stop_reason = "its lease could not be renewed before it expired"
                        to_stop.append(held)
                    elif held.phase is Phase.QUEUED:
                        # Never started: drop it; recovery loses it on expiry, no evidence
                        # needed, and the runtime retries it as its policy says.
                        self._held.pop(held.fence.attempt_id, None)
                        log.warning(
                            "queued attempt %s dropped: its lease could not be renewed",
                            held.fence.attempt_id,
                        )
            for held in to_stop:
                self._stop_task(held)

    # --- offers ---------------------------------------------------------------------------------

    def _wants_work(self) -> bool:
        """A slot is free and nothing is queued for it, or the local queue is below its
        low-water mark (hold the lock)."""
        if self._taking_no_work():
            return False
        if self._drain_requested.is_set():
            return not self._due.settled_poll_done
        queued = len(self._in(Phase.ACCEPTING, Phase.QUEUED))
        return (bool(self._free) and not queued) or queued < self.settings.low_water

    def _poll(self) -> None:
        now = time.monotonic()
        with self._lock:
            unanswered = any(h.unanswered for h in self._held.values())
            wants_work = self._wants_work()
        if unanswered:
            if now >= self._due.retry_unanswered:
                self._retry_unanswered()
            return
        if not (now >= self._due.heartbeat or (wants_work and now >= self._due.poll)):
            return
        try:
            beat = self._client.heartbeat()
        except IngressUnavailable as error:
            log.warning("heartbeat failed, will retry: %s", error)
            self._due.heartbeat = now + min(1.0, self._heartbeat_s)
            self._due.poll = now + self.settings.poll_interval_s
            return
        self._due.heartbeat = now + self._heartbeat_s
        if self._due.drain_sent_at is not None and (
            now - self._due.drain_sent_at >= self.settings.drain_settle_s
        ):
            self._due.settled_poll_done = not beat.offers
        if self._take(beat.offers):
            self._due.poll = time.monotonic()
            self._due.poll_wait = POLL_MIN_S
        else:
            self._due.poll = now + self._due.poll_wait
            self._due.poll_wait = min(self._due.poll_wait * 2, self.settings.poll_interval_s)

    def _take(self, offers: Sequence[OfferData]) -> bool:
        """Start the offers that fit the free slots if nothing is queued, accept the others
        into the queue (behind what it holds: offer order). Every offer is taken: the node never
        offers more than the session's capacity, and an offer left alone would be lost when its
        lease expires."""
        with self._lock:
            startable = 0 if self._in(Phase.ACCEPTING, Phase.QUEUED) else len(self._free)
            fresh = [o for o in offers if o.attempt_id not in self._held]
            entries = [
                Held(
                    offer=offer,
                    fence=Fence(
                        attempt_id=offer.attempt_id,
                        generation=offer.generation,
                        version=offer.version,
                        token=secrets.token_urlsafe(TOKEN_BYTES),
                    ),
                    deadline=time.monotonic(),
                    phase=Phase.ACTIVATING,
                    slot=None,
                )
                for offer in fresh
            ]
            to_start = entries[:startable]
            to_accept = entries[len(to_start) :]
            for held in to_start:
                held.slot = self._free.pop()
            for held in to_accept:
                held.phase = Phase.ACCEPTING
            for held in entries:
                self._held[held.fence.attempt_id] = held
        if to_start:
            self._send_start(to_start, self._client.start)
        if to_accept:
            self._send_accept(to_accept)
        return bool(entries)

    def _taking_no_work(self) -> bool:
        """While draining, only offers granted before the drain are taken."""
        return self._drain_requested.is_set() and self._due.drain_sent_at is None

    # --- drain and stop ---------------------------------------------------------------------------

    def _drain_step(self) -> None:
        if not self._drain_requested.is_set():
            return
        now = time.monotonic()
        if self._drain_started_at is None:
            self._drain_started_at = now
            log.info("draining session %s", self.session_id)
        if self._due.drain_sent_at is None:
            try:
                self._client.drain()
            except IngressUnavailable as error:
                log.warning("drain request failed, will retry: %s", error)
            else:
                self._due.drain_sent_at = time.monotonic()
                self._due.poll = self._due.drain_sent_at  # collect offers granted before it
        with self._lock:
            # Hand back what never started here, so that another worker can take it.
            for held in self._in(Phase.QUEUED):
                held.phase = Phase.STOPPED
                held.stop_reason = "handed back by the drain; it never ran here"
            if now - self._drain_started_at > self.settings.drain_timeout_s:
                running = self._in(Phase.RUNNING)
                for held in running:
                    held.phase = Phase.STOPPING
                    held.stop_reason = "the worker drained and its drain timeout passed"
            else:
                running = []
        for held in running:
            self._stop_task(held)

    def _drained(self) -> bool:
        if self._due.drain_sent_at is None or not self._due.settled_poll_done:
            return False
        with self._lock:
            return not self._held

    def _stop_hard(self, why: str, *, close: bool = True) -> int:
        """Stop every task, report what can be reported, close the session."""
        self._halt_activations()
        with self._lock:
            for held in self._held.values():
                if held.phase is Phase.RUNNING:
                    held.phase = Phase.STOPPING
                    held.stop_reason = f"the worker was {why}"
                    if held.slot is not None:
                        held.slot.process.kill(held.fence.attempt_id)
                elif held.phase in (Phase.ACCEPTING, Phase.QUEUED, Phase.ACTIVATING):
                    # Not handed to a slot: nothing runs here. Abandoning it releases a live
                    # lease now instead of at its expiry.
                    self._release_reservation(held)
                    held.phase = Phase.STOPPED
                    held.unanswered = False
                    held.stop_reason = f"the worker was {why}; it never ran here"
        deadline = time.monotonic() + min(5.0, max(1.0, self._ttl_s))
        while time.monotonic() < deadline:
            with contextlib.suppress(WorkerFailed, IngressRefused):  # already stopping
                self._take_events(block_s=0.05)
            with self._lock:
                if not self._held:
                    break
            try:
                self._due.retry_reports = 0.0
                self._report()
            except IngressRefused:
                break
        if close:
            try:
                self._client.close()
            except (IngressUnavailable, IngressRefused) as error:
                log.warning("closing the session failed: %s", error)
        log.info("worker stopped (%s)", why)
        return 1


def _why(item: ItemAnswer | None) -> str:
    if item is None:
        return "no answer"
    return str(item.reason or item.error or item.status)


def _default_client(settings: WorkerSettings) -> IngressClient:
    return IngressClient(
        settings.ingress_url,
        timeout_s=settings.request_timeout_s,
        registration_token=settings.registration_token,
    )
