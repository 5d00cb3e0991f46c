"""What tells the console's pages that something changed (ADR 0020).

A marker, the store's last event sequence, grows with every change of any Run (every change
appends an event). A page's server-sent event stream sends ``changed`` when it grew. On
PostgreSQL the store's notifications (``ql3_dispatch`` when a Run is queued, ``ql3_run_finished``
when one finishes) wake the stream at once; without them (SQLite, a lost listener) it looks at
the marker every ``poll_s`` seconds. The page polls too, slower, when it has no stream at all."""

from __future__ import annotations

import threading
from collections.abc import Callable

KEEPALIVE_S = 15.0


class ChangeFeed:
    def __init__(self, marker: Callable[[], int], poll_s: float = 1.0) -> None:
        self._marker = marker
        self._poll_s = poll_s
        self._woken = threading.Condition()
        self._wakes = 0
        self.notified = False  # whether notifications wake it (then it polls rarely)

    def marker(self) -> int:
        return self._marker()

    def wake(self) -> None:
        """Called by a notification listener, from its thread."""
        with self._woken:
            self._wakes += 1
            self._woken.notify_all()

    def _woken_since(self, seen: int) -> Callable[[], bool]:
        return lambda: self._wakes != seen

    def wait_past(self, marker: int, timeout_s: float = KEEPALIVE_S) -> tuple[bool, int]:
        """Wait until the marker is past ``marker`` or ``timeout_s`` passed; whether it
        changed, and the marker now."""
        waited = 0.0
        step = 5.0 if self.notified else self._poll_s
        while waited < timeout_s:
            with self._woken:
                self._woken.wait_for(self._woken_since(self._wakes), timeout=step)
            waited += step
            now = self._marker()
            if now != marker:
                return True, now
        return False, marker
