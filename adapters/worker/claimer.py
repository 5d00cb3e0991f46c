"""The claim loop: the one thread that claims work for the worker (ADR 0007).

Whenever a slot is free it sends one claim: the completions ready at that moment, the ``held``
statement (every Attempt in the ledger) and ``limit`` = the free slots, with a long ``wait_ms``
so that the node answers as soon as work is queued. Each grant goes straight into a free slot.
There is at most one claim in flight, so the ``held`` statement is exact: an Attempt whose
grant was in an answer that never arrived is not in it, and the node hands it back.

Before a claim it gives busy slots a moment (a quarter of a claim's round trip, at most
:data:`COALESCE_MAX_S`) to free as well, so that their completions share the claim and their
slots are refilled by it: without it, short tasks settle into waves of half the slots each.

:func:`claim_once` sends one claim and settles its answer in the ledger: the claimer's thread
calls it, and so does the Standalone runner's loop, which has no claimer thread (ADR 0023)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ql3.adapters.worker.ledger import ClaimPlan, Ledger, Mode
from ql3.adapters.worker.protocol import ClaimResult, IngressRefused, Transport
from ql3.adapters.worker.settings import Timings

log = logging.getLogger("ql3.worker")

COALESCE_MAX_S = 0.005  # the longest a claim waits for more slots to free
ROUND_TRIP_CAP_S = 0.04  # a claim's round trip as counted for the pauses (a parked one is long)
IDLE_PAUSE_MIN_S = 0.02  # after a claim that came back empty at once: the first pause
IDLE_PAUSE_MAX_S = 0.5
NO_CAPACITY_PAUSE_S = 0.1  # the node counts more leases held than the worker: wait for a change
GATE_CLOSED = "dispatch_gate_closed"
NOT_ACTIVE = "session_not_active"
NO_CAPACITY = "no_capacity"


def claim_once(
    transport: Transport,
    ledger: Ledger,
    plan: ClaimPlan,
    *,
    wait_ms: int = 0,
    before_settle: Callable[[], None] | None = None,
) -> ClaimResult | None:
    """Send the claim ``plan`` took and settle its answer (its completions, then its grants,
    each straight into a free slot). None when one of its completions made the claim
    unacceptable (an output too large, say): each then goes alone, where a refused one can be
    told apart. ``before_settle`` runs between the answer and its settling."""
    try:
        result = transport.claim(
            plan.limit, wait_ms, plan.held, [h.completion() for h in plan.completions]
        )
    except IngressRefused as error:
        if error.session_lost or not plan.completions:
            ledger.claim_failed(plan, refused=False)
            raise
        log.warning("a claim with %d completion(s) was refused: %s", len(plan.completions), error)
        ledger.claim_failed(plan, refused=True)
        return None
    except BaseException:
        ledger.claim_failed(plan, refused=False)
        raise
    if before_settle is not None:
        before_settle()
    ledger.end_claim(plan, result)
    return result


class Claimer:
    def __init__(
        self,
        client: Transport,
        ledger: Ledger,
        timings: Timings,
        on_node_drain: Callable[[str], None],
    ) -> None:
        self._client = client
        self._ledger = ledger
        self._timings = timings
        self._on_node_drain = on_node_drain
        self._round_trip_s = 0.0  # a moving average over claims that were answered at once
        self._not_before = 0.0  # no claim before this (monotonic)
        self._idle_pause_s = IDLE_PAUSE_MIN_S
        self._gate_reason: str | None = None
        self.claims = 0

    @property
    def completion_grace_s(self) -> float:
        """How long a finished task waits for a claim to carry its completion before the
        reporter sends it alone: a claim in flight longer than this is parked at the node."""
        return min(0.05, max(2 * COALESCE_MAX_S, 3 * self._round_trip_s))

    def run(self) -> None:
        """The thread's body: claims until the worker no longer claims or fails."""
        try:
            while True:
                plan = self._next_plan()
                if plan is None:
                    return
                self._claim(plan)
        except BaseException as error:
            self._ledger.fail(error)
        finally:
            self._ledger.claimer_finished()

    def _next_plan(self) -> ClaimPlan | None:
        """Wait until a claim is due, then take what it carries; None when claiming is over."""
        ledger = self._ledger
        with ledger.changed:
            while True:
                if ledger.mode is not Mode.WORKING or ledger.failure is not None:
                    return None
                now = time.monotonic()
                if ledger.claim_due() and now >= self._not_before:
                    break
                wait = self._not_before - now if ledger.claim_due() else 1.0
                ledger.changed.wait(max(0.001, wait))
            # A completion sent alone (it ended the parked claim) is about to settle: the lease
            # and the slot it frees join this claim.
            until = now + ROUND_TRIP_CAP_S
            while (
                ledger.mode is Mode.WORKING
                and ledger.completions_in_flight()
                and (left := until - time.monotonic()) > 0
            ):
                ledger.changed.wait(left)
            # Busy slots that are about to free join this claim.
            until = time.monotonic() + min(COALESCE_MAX_S, self._round_trip_s / 4)
            while (
                ledger.mode is Mode.WORKING
                and ledger.free_slots < ledger.live_slots
                and (left := until - time.monotonic()) > 0
            ):
                ledger.changed.wait(left)
            return ledger.begin_claim(time.monotonic())

    def _claim(self, plan: ClaimPlan) -> None:
        wait_ms = self._timings.claim_wait_ms if plan.limit > 0 else 0
        calls = self._client.other_calls
        result = claim_once(self._client, self._ledger, plan, wait_ms=wait_ms)
        if result is None:  # its completions go alone; the claim is made again
            return
        self.claims += 1
        elapsed = time.monotonic() - result.sent_at
        self._after(plan, result, elapsed, woken=self._client.other_calls != calls)

    def _after(self, plan: ClaimPlan, result: ClaimResult, elapsed: float, woken: bool) -> None:
        """Learn from the answer: the round trip, why nothing was granted, the session's
        status. ``woken``: another call of the session went out meanwhile, which ends a
        parked claim."""
        now = time.monotonic()
        if result.grants or plan.limit == 0:  # answered without waiting at the node
            sample = min(elapsed, ROUND_TRIP_CAP_S)
            self._round_trip_s = (
                sample if self._round_trip_s == 0 else 0.8 * self._round_trip_s + 0.2 * sample
            )
        if result.status == "draining" or result.no_grant == NOT_ACTIVE:
            self._on_node_drain(result.detail or f"the session is {result.status}")
            return
        if result.grants or plan.limit == 0:
            self._idle_pause_s = IDLE_PAUSE_MIN_S
            self._gate(None)
            return
        if result.no_grant == GATE_CLOSED:
            self._gate(result.detail or "closed")
        else:
            self._gate(None)
        if result.no_grant == NO_CAPACITY:
            self._not_before = now + NO_CAPACITY_PAUSE_S
        elif not woken and elapsed < min(self._timings.claim_wait_s / 2, 0.05):
            # Empty at once although it could wait: do not hammer a node that does not park.
            self._not_before = now + self._idle_pause_s
            self._idle_pause_s = min(IDLE_PAUSE_MAX_S, self._idle_pause_s * 2)
        else:
            self._idle_pause_s = IDLE_PAUSE_MIN_S

    def _gate(self, reason: str | None) -> None:
        if reason != self._gate_reason:
            if reason is None:
                log.info("the dispatch gate is open again")
            else:
                log.warning("the node grants no work: the dispatch gate is closed (%s)", reason)
            self._gate_reason = reason
