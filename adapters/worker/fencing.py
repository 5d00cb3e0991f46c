"""Self-fencing: a watchdog thread stops (SIGKILL of its slot's process group) every task whose
lease could not be renewed before its expiry minus a margin, whatever the other threads are
doing (a call to the ingress that hangs included). The reporter then reports it: ``abandon``
when the task had begun (with the lease still live the Attempt is lost at once, otherwise the
report is kept as not-running evidence), ``release`` when its job had not reached the child
yet.

The same watchdog, with the same stop, ends a task that has run past its run's timeout; that
one is reported as a failing completion that timed out (ADR 0013)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from ql3.adapters.worker.ledger import Kill, Ledger

log = logging.getLogger("ql3.worker")


def kill_tasks(kills: Sequence[Kill], why: str = "") -> None:
    """Stop each named task in its slot; a job that has not reached the child will not run."""
    for slot, attempt_id in kills:
        log.warning("stopping attempt %s%s", attempt_id, f": {why}" if why else "")
        slot.kill(attempt_id)


class Watchdog:
    def __init__(self, ledger: Ledger, margin_s: float, interval_s: float) -> None:
        self._ledger = ledger
        self._margin_s = margin_s
        self._interval_s = interval_s
        self._closing = threading.Event()

    def check(self, now: float) -> int:
        """Stop the overdue tasks; how many there were."""
        kills = self._ledger.overdue(now, self._margin_s)
        kill_tasks(kills, "its lease could not be renewed before it expired")
        late = self._ledger.timed_out(now)
        kill_tasks(late, "it ran past its timeout")
        return len(kills) + len(late)

    def run(self) -> None:
        while not self._closing.wait(self._interval_s):
            try:
                self.check(time.monotonic())
            except BaseException as error:
                self._ledger.fail(error)
                return

    def stop(self) -> None:
        self._closing.set()
