"""What the worker tells the node besides claims, from a thread of its own so that none of it
waits behind a claim parked at the node:

- **completions** the next claim cannot carry soon: while a claim is parked (a completion that
  waited the claimer's grace), once the worker no longer claims (drain), and those that must go
  alone (a claim that carried them was refused). A ``complete`` call also wakes the parked
  claim at the node, which then claims again for the freed slot;
- **abandons** of tasks that began and were stopped (self-fence, drain timeout, renewal
  refused, their Run cancelled), and **releases** of Attempts that never began here (granted
  while draining, no free slot, cancelled before their job reached the child, a slot that
  failed), as soon as they occur;
- **renewals** of every held lease in one batch, once the first of them has less than two
  thirds of the TTL left, and probes of the leases whose abandon was only recorded (see
  :mod:`.ledger`);
- a **heartbeat** once per the interval the node asked for (one lease TTL): the session's
  recorded liveness, which an idle worker's claims, writing nothing, do not move (ADR 0012).

A refusal of the session (gone, replaced) or an ingress that stays away for the whole retry
budget fails the worker.

The Standalone runner, which has no reporter thread, calls :meth:`Reporter.report` from its own
loop (without heartbeats) and sleeps until :meth:`Reporter.due_at` (ADR 0023)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ql3.adapters.worker.ledger import Held, Kill, Ledger, Phase
from ql3.adapters.worker.protocol import IngressRefused, Transport
from ql3.adapters.worker.settings import Timings

log = logging.getLogger("ql3.worker")

MAX_IDLE_WAIT_S = 0.25
RENEW_RETRY_S = 0.1  # the pause after a renewal that the node partly refused


class Reporter:
    def __init__(
        self,
        client: Transport,
        ledger: Ledger,
        timings: Timings,
        *,
        grace_s: Callable[[], float],
        kill: Callable[[Sequence[Kill]], None],
        on_node_drain: Callable[[str], None],
    ) -> None:
        self._client = client
        self._ledger = ledger
        self._timings = timings
        self._grace_s = grace_s
        self._kill = kill
        self._on_node_drain = on_node_drain
        self._next_heartbeat = time.monotonic() + timings.heartbeat_s
        self._renew_after = 0.0  # no renewal before this (after a partly refused one)
        self._done = False

    def stop(self) -> None:
        with self._ledger.changed:
            self._done = True
            self._ledger.changed.notify_all()

    def run(self) -> None:
        """The thread's body: reports until stopped or the worker fails."""
        try:
            while not self._wait():
                self.report(time.monotonic())
        except BaseException as error:
            self._ledger.fail(error)

    def _wait(self) -> bool:
        """Wait until something is due; True when the reporter should end."""
        ledger = self._ledger
        with ledger.changed:
            while True:
                if self._done or ledger.failure is not None:
                    return True
                now = time.monotonic()
                next_due = self.due_at()
                due = now + MAX_IDLE_WAIT_S
                if next_due is not None:
                    due = min(due, next_due)
                if due <= now:
                    return False
                ledger.changed.wait(due - now)

    def due_at(self, *, heartbeat: bool = True) -> float | None:
        """When the next report is due (hold the lock); None: nothing is (no heartbeats, and
        nothing to report or renew)."""
        ledger = self._ledger
        dues = [self._next_heartbeat] if heartbeat else []
        reports = ledger.next_report_at(self._grace_s())
        if reports is not None:
            dues.append(reports)
        renewal = ledger.renewal_due_at(self._timings.renew_ahead_s)
        if renewal is not None:
            dues.append(max(renewal, self._renew_after))
        return min(dues) if dues else None

    def report(self, now: float, *, heartbeat: bool = True) -> None:
        """Send everything due at ``now``."""
        ledger = self._ledger
        stopped = ledger.take(Phase.STOPPED, now)
        if stopped:
            self._send(stopped, self._abandon)
        unstarted = ledger.take(Phase.UNSTARTED, now)
        if unstarted:
            self._send(unstarted, self._release)
        finished = ledger.take_completions(now, self._grace_s())
        if finished:
            self._send(finished, self._complete)
        self._renew(now)
        probes = ledger.take_probes(now)
        if probes:
            ledger.settle_probes(probes, self._client.renew([h.fence for h in probes]))
        if heartbeat and now >= self._next_heartbeat:
            self._heartbeat()

    def _send(self, entries: list[Held], call: Callable[[list[Held]], None]) -> None:
        try:
            call(entries)
        except BaseException:
            self._ledger.untake(entries)
            raise

    def _abandon(self, entries: list[Held]) -> None:
        answer = self._client.abandon([h.abandonment() for h in entries])
        self._ledger.settle_abandons(entries, answer)

    def _release(self, entries: list[Held]) -> None:
        answer = self._client.release([h.release() for h in entries])
        self._ledger.settle_releases(entries, answer)

    def _complete(self, entries: list[Held]) -> None:
        batch = [h for h in entries if not h.alone]
        alone = [h for h in entries if h.alone]
        if batch:
            try:
                answer = self._client.complete([h.completion() for h in batch])
            except IngressRefused as error:
                if error.session_lost:
                    raise
                if len(batch) == 1:
                    self._ledger.completion_refused(batch[0], error.error)
                else:  # one of them is refused: tell which by sending each alone
                    self._ledger.untake(batch, alone=True)
            else:
                self._ledger.settle_completions(batch, answer)
        for held in alone:
            try:
                answer = self._client.complete([held.completion()])
            except IngressRefused as error:
                if error.session_lost:
                    raise
                self._ledger.completion_refused(held, error.error)
            else:
                self._ledger.settle_completions([held], answer)

    def _renew(self, now: float) -> None:
        due = self._ledger.renewal_due_at(self._timings.renew_ahead_s)
        if due is None or now < max(due, self._renew_after):
            return
        live = self._ledger.renewable()
        if not live:
            return
        answer = self._client.renew([h.fence for h in live])
        kills = self._ledger.settle_renewals(live, answer)
        if kills:
            self._kill(kills)
        if not all(item.ok for item in answer.items.values()):
            self._renew_after = time.monotonic() + RENEW_RETRY_S

    def _heartbeat(self) -> None:
        beat = self._client.heartbeat()
        self._next_heartbeat = time.monotonic() + self._timings.heartbeat_s
        if beat.status == "draining":
            self._on_node_drain("the node drains the session")
