"""What the worker holds: every Attempt a claim granted it, in the phase it is in here, the free
slots, and the worker's mode. Every thread of the worker reads and changes it under its one
lock; :attr:`Ledger.changed` is notified on every change.

An Attempt stays in the ledger, and so in every claim's ``held`` statement, from the claim
answer that granted it until the node answered its completion, abandon or release (ADR 0007).
Leaving it out of ``held`` earlier would let the node hand it back as never begun.

Phases::

    RUNNING ---> FINISHED ---> COMPLETING ---> (gone)       the task returned
       |            (refused late) |
       |                           v
       +-------> STOPPING ---> STOPPED ---> ABANDONING ---> (gone)   began, then stopped
       |             |                            |
       |             |                            +--> RECORDED ---> (gone)
       +-------------+-----> UNSTARTED ---> RELEASING ---> (gone)    never began here

An abandon that reached the node after the lease expired is only *recorded* (not-running
evidence): the lease stays ``leased`` until recovery loses the Attempt. Until then the Attempt
stays ``RECORDED`` in the ledger, and so in ``held``, lest a claim hand it back as never begun;
a ``renew`` sent every :attr:`Ledger.probe_s` (refused ``expired`` while the lease is still
there, otherwise ``released``) tells when it is gone.

A grant that arrives while the worker drains or stops, or finds no free slot, is ``UNSTARTED``
at once; so is a job that never reached its slot's child (cancelled first, or the child was
gone).

A task that runs past its run's timeout (``timeout_ms`` of its grant, counted from the grant's
arrival) is stopped like a self-fenced one, by the watchdog; the outcome of that stop is a
failure that timed out, sent as a completion (``timed_out``), not an abandon (ADR 0013).

A renewal refused with reason ``cancelled`` (its Run was cancelled, ADR 0017) stops the task as
self-fencing does; its abandon (or hand-back) is then answered ``cancelled`` and the entry
leaves. A completion refused ``cancelled`` (the task ended first) is discarded.

The ledger knows the protocol, not how tasks run nor what carries the calls: a remote worker's
slots are child processes and its calls go over HTTP, Standalone's slots are threads of its
in-process pool and its calls go to the worker commands in the same process (ADR 0023). What
it settles is also told to :attr:`Ledger.on_event` (a process that reports to its operator line
by line, as Standalone does)."""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ql3.adapters.worker.protocol import (
    MAX_BATCH_ITEMS,
    MAX_CLAIM,
    Abandonment,
    BatchResult,
    ClaimResult,
    Completion,
    Fence,
    GrantData,
    ItemAnswer,
    Release,
)
from ql3.adapters.worker.settings import WorkerFailed
from ql3.adapters.worker.slot import Job, JobOutcome

log = logging.getLogger("ql3.worker")

RETRY_ITEM_S = 0.1  # the pause before an item the node did not decide is sent again
CLAIMER_PAUSE_S = 0.1  # the longest a finished task waits for a claim while none is in flight
EXPIRED = "expired"  # the fence reason of a lease past its expiry
CANCELLED = "cancelled"  # the fence reason (and stop outcome) of an Attempt whose Run was cancelled
CONFLICT = "conflict"  # an item refused by a concurrent change: it may be sent again
INVALID = "invalid"  # an item the ingress cannot take (its output, say)


class Phase(enum.Enum):
    RUNNING = "running"  # handed to a slot; its task runs (or is about to)
    STOPPING = "stopping"  # the worker is stopping its task
    FINISHED = "finished"  # the task returned; its completion is not sent yet
    COMPLETING = "completing"  # its completion was sent (in a claim or alone): no answer yet
    STOPPED = "stopped"  # began here and was stopped: its abandon is not sent yet
    ABANDONING = "abandoning"  # its abandon was sent: no answer yet
    UNSTARTED = "unstarted"  # never began here: its release is not sent yet
    RELEASING = "releasing"  # its release was sent: no answer yet
    RECORDED = "recorded"  # abandoned after its lease expired: held until recovery loses it


# Phases whose lease the worker keeps renewing.
RENEWED = frozenset({Phase.RUNNING, Phase.FINISHED})
# Phases with a call in flight, and the phase each goes back to when that call failed.
_UNTAKE = {
    Phase.COMPLETING: Phase.FINISHED,
    Phase.ABANDONING: Phase.STOPPED,
    Phase.RELEASING: Phase.UNSTARTED,
}


class Event(enum.Enum):
    """What the ledger tells :attr:`Ledger.on_event` about an entry, as it settles."""

    STARTED = "started"  # a grant went into a slot
    COMPLETED = "completed"  # its completion was taken
    COMPLETION_CANCELLED = "completion_cancelled"  # it ended after its Run was cancelled
    COMPLETION_REFUSED = "completion_refused"  # its outcome was refused (discarded)
    STOPPED_CANCELLED = "stopped_cancelled"  # its stop was taken: its Run was cancelled
    ABANDONED = "abandoned"  # its stop was taken (lost, or recorded)
    ABANDON_REFUSED = "abandon_refused"
    RELEASED = "released"  # handed back unstarted
    RELEASE_CANCELLED = "release_cancelled"  # never started: its Run was cancelled
    RELEASE_REFUSED = "release_refused"
    RUN_CANCELLED = "run_cancelled"  # a renewal said its Run was cancelled: its task is stopped
    LEASE_REFUSED = "lease_refused"  # a renewal was refused: its task is stopped


EventSink = Callable[[Event, "Held", str], None]


def _no_event(_event: Event, _held: Held, _detail: str) -> None:
    return None


class Mode(enum.Enum):
    WORKING = "working"  # claims for its free slots
    DRAINING = "draining"  # claims no more; running tasks finish
    STOPPING = "stopping"  # stops every task now


class SlotHandle(Protocol):
    """A slot as the ledger sees it: it takes a job, and can stop one."""

    @property
    def index(self) -> int: ...

    def put(self, job: Job) -> None: ...

    def kill(self, attempt_id: str) -> bool: ...


@dataclass(eq=False)
class Held:
    grant: GrantData
    deadline: float  # monotonic: when its lease expires, conservatively
    phase: Phase
    since: float  # monotonic: when it entered its phase
    slot: SlotHandle | None = None
    outcome: JobOutcome | None = None
    detail: str = ""  # why its task was stopped: the abandon's detail
    cause: str = ""  # why it never began: the release's cause
    alone: bool = False  # its completion goes in a call of its own (a batch was refused)
    failed_over: bool = False  # its result was refused once and replaced by a failure
    retry_at: float = 0.0  # not sent again before this (monotonic)
    renewed: bool = True  # its lease is renewed (false once the node refused a renewal)
    timeout_at: float | None = None  # monotonic: when its task has run past its run's timeout
    timed_out: bool = False  # its task was stopped at that timeout

    @property
    def attempt_id(self) -> str:
        return self.grant.attempt_id

    @property
    def fence(self) -> Fence:
        return self.grant.fence

    def job(self) -> Job:
        grant = self.grant
        return Job(
            attempt_id=grant.attempt_id,
            run_id=grant.run_id,
            attempt_number=grant.attempt_number,
            idempotency_key=grant.idempotency_key,
            task=grant.task,
            input=grant.input,
        )

    def completion(self) -> Completion:
        outcome = self.outcome
        assert outcome is not None
        return Completion(
            fence=self.fence,
            succeeded=outcome.succeeded,
            output=outcome.output,
            error=outcome.error,
            timed_out=self.timed_out and not outcome.succeeded,
        )

    def abandonment(self) -> Abandonment:
        return Abandonment(fence=self.fence, detail=self.detail or "stopped by the worker")

    def release(self) -> Release:
        return Release(fence=self.fence, cause=self.cause or "not_started")


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """One claim about to be sent: how many Attempts it asks for, the completions it carries
    and the worker's ``held`` statement."""

    limit: int
    completions: tuple[Held, ...]
    held: tuple[str, ...]


Kill = tuple[SlotHandle, str]  # a slot and the attempt whose task it must stop


class Ledger:
    """``claims_alongside``: a claimer thread claims beside the reporter, so a finished task
    waits a moment for a claim to carry its completion; false when one loop makes every call
    (Standalone): a finished task waits for the next claim while the loop says one is due
    (:attr:`claim_next`), and is sent at once otherwise."""

    def __init__(self, capacity: int, *, claims_alongside: bool = True) -> None:
        self.capacity = capacity
        self.claims_alongside = claims_alongside
        self.claim_next = False  # without a claimer alongside: the loop's next call is a claim
        # Called under the lock: it must not call the ledger back.
        self.on_event: EventSink = _no_event
        # Where it logs what it settles; a process that reports through ``on_event`` instead
        # may pass a quiet one.
        self.log: logging.Logger = log
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self._held: dict[str, Held] = {}
        self._free: list[SlotHandle] = []
        self._slots = 0  # slots alive
        self.mode = Mode.WORKING
        self.failure: BaseException | None = None
        self.probe_s = 1.0  # how often a RECORDED entry's lease is probed
        self.claim_sent_at: float | None = None  # a claim is in flight, sent then
        self.claimer_done = False
        self.completed = 0
        self.abandoned = 0
        self.released = 0
        self.cancelled = 0  # tasks stopped (or never begun) because their Run was cancelled

    # --- the worker's mode ----------------------------------------------------------------------

    def set_mode(self, mode: Mode) -> None:
        """Modes only move forward: working, draining, stopping."""
        order = list(Mode)
        with self.changed:
            if order.index(mode) > order.index(self.mode):
                self.mode = mode
            self.changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """The worker cannot go on; the first failure is the one reported."""
        with self.changed:
            if self.failure is None:
                self.failure = error
            self.changed.notify_all()

    def claimer_finished(self) -> None:
        with self.changed:
            self.claimer_done = True
            self.claim_sent_at = None
            self.changed.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until ``predicate`` holds; it runs under the lock."""
        with self.changed:
            return self.changed.wait_for(predicate, timeout=max(0.0, timeout_s))

    # --- what it holds --------------------------------------------------------------------------

    def held_ids(self) -> tuple[str, ...]:
        """The ``held`` statement: every Attempt the ledger holds."""
        with self.lock:
            return tuple(sorted(self._held))

    def entries(self, *phases: Phase) -> list[Held]:
        """The entries in these phases (all of them without a phase), in grant order."""
        with self.lock:
            return self._in(*phases)

    def get(self, attempt_id: str) -> Held | None:
        with self.lock:
            return self._held.get(attempt_id)

    def empty(self) -> bool:
        with self.lock:
            return not self._held

    def holding(self) -> int:
        """How many Attempts it holds (hold the lock)."""
        return len(self._held)

    def settled(self) -> bool:
        """Nothing is left to report (hold the lock): every entry, if any, is ``RECORDED``,
        which only a claim could harm."""
        return all(h.phase is Phase.RECORDED for h in self._held.values())

    def _in(self, *phases: Phase) -> list[Held]:
        if not phases:
            return list(self._held.values())
        return [h for h in self._held.values() if h.phase in phases]

    def _move(self, held: Held, phase: Phase, now: float | None = None) -> None:
        held.phase = phase
        held.since = time.monotonic() if now is None else now

    def _drop(self, held: Held) -> None:
        self._held.pop(held.attempt_id, None)

    # --- slots ----------------------------------------------------------------------------------

    def add_slots(self, slots: Sequence[SlotHandle]) -> None:
        with self.changed:
            self._free.extend(slots)
            self._slots += len(slots)
            self.changed.notify_all()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def live_slots(self) -> int:
        return self._slots

    def slot_lost(self, slot: SlotHandle, message: str) -> None:
        """A slot's child died and could not be started again: the worker goes on with the
        others, and fails when none is left."""
        self.log.error("slot %d is out of service: %s", slot.index, message)
        with self.changed:
            if slot in self._free:
                self._free.remove(slot)
            self._slots -= 1
            if self._slots <= 0 and self.failure is None:
                self.failure = WorkerFailed(f"no slot can start a task: {message}")
            self.changed.notify_all()

    def slot_free(self, slot: SlotHandle) -> None:
        """A slot whose child was replaced takes jobs again."""
        with self.changed:
            self._free.append(slot)
            self.changed.notify_all()

    def on_outcome(
        self, slot: SlotHandle, attempt_id: str, outcome: JobOutcome, reusable: bool
    ) -> None:
        """A slot's job ended (called from the slot's thread); ``reusable``: the slot is free
        again at once."""
        with self.changed:
            if reusable:
                self._free.append(slot)
            held = self._held.get(attempt_id)
            if held is not None and held.phase in (Phase.RUNNING, Phase.STOPPING):
                held.slot = None
                if not outcome.started:
                    held.cause = held.cause or "slot_failed"
                    self._move(held, Phase.UNSTARTED)
                elif outcome.killed and held.timed_out:
                    # Stopped at its timeout: a failure to complete, not an abandon.
                    held.outcome = JobOutcome(succeeded=False, error=held.detail)
                    self._move(held, Phase.FINISHED)
                elif outcome.killed:
                    held.detail = held.detail or "stopped by the worker"
                    self._move(held, Phase.STOPPED)
                else:
                    held.timed_out = False  # it ended by itself before the stop took hold
                    held.outcome = outcome
                    self._move(held, Phase.FINISHED)
            self.changed.notify_all()

    # --- claims ---------------------------------------------------------------------------------

    def _claimable_completions(self) -> list[Held]:
        ready = [h for h in self._held.values() if h.phase is Phase.FINISHED and not h.alone]
        return ready[:MAX_BATCH_ITEMS]

    def room(self) -> int:
        """How many Attempts a claim sent now would ask for (hold the lock): one per free slot,
        within the session's capacity less the leases held (a completion the claim carries
        frees its lease first)."""
        held = len(self._held) - len(self._claimable_completions())
        return max(0, min(len(self._free), self.capacity - held, MAX_CLAIM))

    def completions_in_flight(self) -> bool:
        """A completion sent by the reporter awaits its answer (hold the lock): the lease and
        the slot it frees count again once it settles."""
        return self.claim_sent_at is None and bool(self._in(Phase.COMPLETING))

    def claim_due(self) -> bool:
        """A claim is worth sending (hold the lock)."""
        return self.mode is Mode.WORKING and self.failure is None and self.room() > 0

    def begin_claim(self, now: float) -> ClaimPlan | None:
        """Take what the next claim carries (hold the lock); None when the worker no longer
        claims. Its completions are ``COMPLETING`` from here on."""
        if self.mode is not Mode.WORKING or self.failure is not None:
            return None
        limit = self.room()
        completions = self._claimable_completions()
        for held in completions:
            self._move(held, Phase.COMPLETING, now)
        self.claim_sent_at = now
        return ClaimPlan(
            limit=limit, completions=tuple(completions), held=tuple(sorted(self._held))
        )

    def claim_failed(self, plan: ClaimPlan, *, refused: bool) -> None:
        """The claim got no answer (or was refused: then its completions go alone)."""
        with self.changed:
            self.claim_sent_at = None
            for held in plan.completions:
                if held.phase is Phase.COMPLETING:
                    held.alone = held.alone or refused
                    self._move(held, Phase.FINISHED)
            self.changed.notify_all()

    def end_claim(self, plan: ClaimPlan, result: ClaimResult) -> list[Held]:
        """Settle a claim's answer: its completions, then its grants, each straight into a free
        slot. Returns the new entries."""
        now = time.monotonic()
        with self.changed:
            self.claim_sent_at = None
            for held in plan.completions:
                self._settle_completion(held, result.completed.get(held.attempt_id), now)
            if result.released:
                self.log.warning(
                    "the node handed back %d attempt(s) this worker did not hold (a claim "
                    "answer was lost): %s",
                    len(result.released),
                    ", ".join(result.released),
                )
            fresh = []
            for grant in result.grants:
                if grant.attempt_id in self._held:
                    self.log.error("attempt %s was granted twice; ignored", grant.attempt_id)
                    continue
                held = Held(
                    grant=grant,
                    deadline=result.sent_at + result.expires_in_s(grant),
                    phase=Phase.RUNNING,
                    since=now,
                )
                self._held[grant.attempt_id] = held
                fresh.append(held)
                if self.mode is not Mode.WORKING:
                    held.cause = "drain" if self.mode is Mode.DRAINING else "worker_stopped"
                    held.phase = Phase.UNSTARTED
                elif not self._free:  # granted beyond the free slots: never started here
                    held.cause = "no_free_slot"
                    held.phase = Phase.UNSTARTED
                else:
                    held.slot = self._free.pop()
                    if grant.timeout_s is not None:
                        held.timeout_at = now + grant.timeout_s
                    held.slot.put(held.job())
                    self.on_event(Event.STARTED, held, "")
            self.changed.notify_all()
        return fresh

    # --- stopping tasks -------------------------------------------------------------------------

    def _stop(self, held: Held, detail: str, cause: str) -> Kill | None:
        held.detail, held.cause = detail, cause
        if held.slot is None:  # no slot has it: it cannot have begun
            self._move(held, Phase.UNSTARTED)
            return None
        self._move(held, Phase.STOPPING)
        return held.slot, held.attempt_id

    def stop_running(self, detail: str, cause: str) -> list[Kill]:
        """Stop every running task; a job that has not reached its child yet is handed back
        with ``cause`` instead."""
        with self.changed:
            kills = [self._stop(h, detail, cause) for h in self._in(Phase.RUNNING)]
            self.changed.notify_all()
        return [k for k in kills if k is not None]

    def overdue(self, now: float, margin_s: float) -> list[Kill]:
        """Self-fencing: stop every task whose lease could not be renewed before its expiry
        minus ``margin_s``."""
        with self.changed:
            late = [h for h in self._in(Phase.RUNNING) if now >= h.deadline - margin_s]
            kills = [
                self._stop(h, "its lease could not be renewed before it expired", "self_fenced")
                for h in late
            ]
            if late:
                self.changed.notify_all()
        return [k for k in kills if k is not None]

    def timed_out(self, now: float) -> list[Kill]:
        """Stop every task that has run past its run's timeout; each is reported as a failure
        that timed out once its slot stopped it."""
        with self.changed:
            late = [
                h
                for h in self._in(Phase.RUNNING)
                if h.timeout_at is not None and now >= h.timeout_at
            ]
            kills = []
            for held in late:
                timeout_s = held.grant.timeout_s or 0.0
                kill = self._stop(held, f"timed out after {timeout_s:.1f} s", "timed_out")
                held.timed_out = kill is not None
                if kill is not None:
                    kills.append(kill)
            if late:
                self.changed.notify_all()
        return kills

    # --- reports --------------------------------------------------------------------------------

    def take(self, phase: Phase, now: float, *, limit: int = MAX_BATCH_ITEMS) -> list[Held]:
        """Take the entries of ``phase`` due for sending (``STOPPED`` or ``UNSTARTED``): they
        move to their in-flight phase."""
        to = {Phase.STOPPED: Phase.ABANDONING, Phase.UNSTARTED: Phase.RELEASING}[phase]
        with self.lock:
            taken = [h for h in self._in(phase) if h.retry_at <= now][:limit]
            for held in taken:
                self._move(held, to, now)
        return taken

    def _completion_waits_s(self, grace_s: float) -> float | None:
        """How long a finished task waits for a claim to carry its completion (hold the lock):
        ``grace_s`` while a claim is in flight (it may be parked at the node), longer while the
        claimer is about to send one (it may pause after a claim that found nothing); None
        once the worker no longer claims. Without a claimer alongside: until the next claim
        while one is due (:attr:`claim_next`), otherwise not at all."""
        if self.mode is not Mode.WORKING or self.claimer_done:
            return None
        if not self.claims_alongside:
            return math.inf if self.claim_next else None
        return grace_s if self.claim_sent_at is not None else max(grace_s, CLAIMER_PAUSE_S)

    def take_completions(self, now: float, grace_s: float) -> list[Held]:
        """Take the finished tasks whose completion should not wait for the next claim: those
        that must go alone, and those that waited for a claim (see :meth:`_completion_waits_s`)
        or whose worker no longer claims."""
        with self.lock:
            waits = self._completion_waits_s(grace_s)
            taken = [
                h
                for h in self._in(Phase.FINISHED)
                if h.retry_at <= now and (h.alone or waits is None or now - h.since >= waits)
            ][:MAX_BATCH_ITEMS]
            for held in taken:
                self._move(held, Phase.COMPLETING, now)
        return taken

    def untake(self, entries: Sequence[Held], *, alone: bool = False) -> None:
        """Their call got no answer (or, ``alone``, a batch of them was refused and each goes
        in a call of its own): they go back to be sent again."""
        with self.changed:
            for held in entries:
                back = _UNTAKE.get(held.phase)
                if back is not None and self._held.get(held.attempt_id) is held:
                    held.alone = held.alone or alone
                    self._move(held, back)
            self.changed.notify_all()

    def next_report_at(self, grace_s: float) -> float | None:
        """When something is next due for sending (hold the lock)."""
        dues = []
        waits = self._completion_waits_s(grace_s)
        for held in self._held.values():
            if held.phase in (Phase.STOPPED, Phase.UNSTARTED, Phase.RECORDED):
                dues.append(held.retry_at)
            elif held.phase is Phase.FINISHED:
                start = held.since + (0.0 if held.alone or waits is None else waits)
                dues.append(max(start, held.retry_at))
        return min(dues) if dues else None

    def settle_completions(self, entries: Sequence[Held], result: BatchResult) -> None:
        now = time.monotonic()
        with self.changed:
            for held in entries:
                self._settle_completion(held, result.items.get(held.attempt_id), now)
            self.changed.notify_all()

    def completion_refused(self, held: Held, error: str) -> None:
        """The ingress refused a completion sent alone (its output is too large, say): it is
        reported as failed without its output; if even that is refused, the task is reported
        stopped."""
        with self.changed:
            self._refuse_result(held, error)
            self.changed.notify_all()

    def _refuse_result(self, held: Held, error: str) -> None:
        outcome = held.outcome
        if outcome is not None and outcome.succeeded and not held.failed_over:
            held.outcome = JobOutcome(
                succeeded=False, error=f"the ingress refused the result: {error}"
            )
            held.failed_over = True
            held.alone = True
            self._move(held, Phase.FINISHED)
            return
        held.detail = f"the ingress refused the completion: {error}"
        self._move(held, Phase.STOPPED)

    def _settle_completion(self, held: Held, item: ItemAnswer | None, now: float) -> None:
        if held.phase is not Phase.COMPLETING:
            return
        if item is None or (not item.ok and item.error == CONFLICT):
            held.retry_at = now + RETRY_ITEM_S
            self._move(held, Phase.FINISHED, now)
        elif item.ok:
            self._drop(held)
            self.completed += 1
            self.on_event(Event.COMPLETED, held, item.outcome or "")
        elif item.error == INVALID:
            self._refuse_result(held, item.reason or item.error)
        elif item.reason == CANCELLED:
            self._drop(held)
            self.cancelled += 1
            self.on_event(Event.COMPLETION_CANCELLED, held, "")
            self.log.warning(
                "attempt %s finished after its run was cancelled: result discarded",
                held.attempt_id,
            )
        elif item.reason == EXPIRED:
            # It ran: the report keeps the lease's Attempt from being handed back unstarted.
            held.detail = "finished after its lease expired; result discarded"
            self._move(held, Phase.STOPPED, now)
            self.on_event(Event.COMPLETION_REFUSED, held, item.message or EXPIRED)
            self.log.warning(
                "attempt %s finished after its lease expired: result discarded",
                held.attempt_id,
            )
        else:
            self._drop(held)
            self.on_event(
                Event.COMPLETION_REFUSED, held, item.message or item.reason or item.error or ""
            )
            self.log.warning(
                "completion of attempt %s refused (%s %s): result discarded",
                held.attempt_id,
                item.error,
                item.reason or "",
            )

    def settle_abandons(self, entries: Sequence[Held], result: BatchResult) -> None:
        now = time.monotonic()
        with self.changed:
            for held in entries:
                item = result.items.get(held.attempt_id)
                if held.phase is not Phase.ABANDONING:
                    continue
                if item is None or (not item.ok and item.error == CONFLICT):
                    held.retry_at = now + RETRY_ITEM_S
                    self._move(held, Phase.STOPPED, now)
                    continue
                if item.ok and item.outcome == CANCELLED:
                    self._drop(held)
                    self.cancelled += 1
                    self.on_event(Event.STOPPED_CANCELLED, held, "")
                    self.log.warning("attempt %s stopped: its run was cancelled", held.attempt_id)
                    continue
                if item.ok:
                    self.abandoned += 1
                    self.on_event(Event.ABANDONED, held, item.outcome or "")
                else:
                    self.on_event(
                        Event.ABANDON_REFUSED, held, item.message or item.reason or item.error or ""
                    )
                if item.ok and item.outcome == "recorded":
                    held.retry_at = now + self.probe_s
                    self._move(held, Phase.RECORDED, now)
                else:
                    self._drop(held)
                self.log.warning(
                    "attempt %s abandoned (%s): %s",
                    held.attempt_id,
                    item.outcome or item.reason or item.error,
                    held.detail,
                )
            self.changed.notify_all()

    def take_probes(self, now: float) -> list[Held]:
        """The ``RECORDED`` entries whose lease is due for a probe."""
        with self.lock:
            due = [h for h in self._in(Phase.RECORDED) if h.retry_at <= now][:MAX_BATCH_ITEMS]
            for held in due:
                held.retry_at = now + self.probe_s
        return due

    def settle_probes(self, entries: Sequence[Held], result: BatchResult) -> None:
        """A probe refused ``expired`` finds the lease still there; any other refusal finds it
        gone (recovery lost the Attempt): the entry leaves the ledger. A renewed lease is live
        after all: the task is abandoned again, to be lost at once."""
        with self.changed:
            for held in entries:
                item = result.items.get(held.attempt_id)
                if held.phase is not Phase.RECORDED or item is None:
                    continue
                if item.ok:
                    self._move(held, Phase.STOPPED)
                elif item.reason != EXPIRED and item.error != CONFLICT:
                    self._drop(held)
            self.changed.notify_all()

    def settle_releases(self, entries: Sequence[Held], result: BatchResult) -> None:
        now = time.monotonic()
        with self.changed:
            for held in entries:
                item = result.items.get(held.attempt_id)
                if held.phase is not Phase.RELEASING:
                    continue
                if item is None or (not item.ok and item.error == CONFLICT):
                    held.retry_at = now + RETRY_ITEM_S
                    self._move(held, Phase.UNSTARTED, now)
                    continue
                self._drop(held)
                if item.ok and item.outcome == CANCELLED:
                    self.cancelled += 1
                    self.on_event(Event.RELEASE_CANCELLED, held, "")
                    self.log.info("attempt %s not started: its run was cancelled", held.attempt_id)
                elif item.ok:
                    self.released += 1
                    self.on_event(Event.RELEASED, held, held.cause)
                    self.log.info("attempt %s handed back (%s)", held.attempt_id, held.cause)
                else:
                    self.on_event(
                        Event.RELEASE_REFUSED, held, item.message or item.reason or item.error or ""
                    )
                    self.log.info(
                        "hand-back of attempt %s refused (%s %s): it is not held any more",
                        held.attempt_id,
                        item.error,
                        item.reason or "",
                    )
            self.changed.notify_all()

    # --- renewals -------------------------------------------------------------------------------

    def renewal_due_at(self, ahead_s: float) -> float | None:
        """When the held leases are next renewed (hold the lock): once the first of them has
        less than ``ahead_s`` left."""
        deadlines = [h.deadline for h in self._renewable()]
        return min(deadlines) - ahead_s if deadlines else None

    def _renewable(self) -> list[Held]:
        return [h for h in self._in(*RENEWED) if h.renewed]

    def renewable(self) -> list[Held]:
        with self.lock:
            return self._renewable()

    def settle_renewals(self, entries: Sequence[Held], result: BatchResult) -> list[Kill]:
        """Move each renewed lease's deadline; a running task whose lease was refused is
        stopped."""
        kills = []
        with self.changed:
            for held in entries:
                item = result.items.get(held.attempt_id)
                if item is None or self._held.get(held.attempt_id) is not held:
                    continue
                if item.ok and item.expires_in_s is not None:
                    held.deadline = max(held.deadline, result.sent_at + item.expires_in_s)
                elif not item.ok and item.error != CONFLICT:
                    held.renewed = False  # the lease is not (or no longer) its to renew
                    if held.phase is Phase.RUNNING and item.reason == CANCELLED:
                        self.on_event(Event.RUN_CANCELLED, held, "")
                        self.log.warning(
                            "attempt %s: its run was cancelled; stopping the task",
                            held.attempt_id,
                        )
                        kill = self._stop(held, "its run was cancelled", CANCELLED)
                        if kill is not None:
                            kills.append(kill)
                    elif held.phase is Phase.RUNNING:
                        self.on_event(
                            Event.LEASE_REFUSED,
                            held,
                            item.message or item.reason or item.error or "",
                        )
                        kill = self._stop(
                            held,
                            f"lease refused at renewal: {item.reason or item.error}",
                            "renewal_refused",
                        )
                        if kill is not None:
                            kills.append(kill)
            self.changed.notify_all()
        return kills
