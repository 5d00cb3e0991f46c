"""A controllable clock for the memory store."""

from __future__ import annotations

import threading

DEFAULT_START_MS = 1_700_000_000_000


class FakeClock:
    """The memory store's database clock: it moves only when it is told to. Thread-safe."""

    def __init__(self, start_ms: int = DEFAULT_START_MS) -> None:
        self._lock = threading.Lock()
        self._now_ms = start_ms

    def now_ms(self) -> int:
        with self._lock:
            return self._now_ms

    def set(self, ms: int) -> None:
        with self._lock:
            self._now_ms = ms

    def advance(self, ms: int) -> int:
        """Move the clock forward by ``ms`` (never backwards) and return the new time."""
        if ms < 0:
            raise ValueError("a clock only advances; use set() to move it anywhere")
        with self._lock:
            self._now_ms += ms
            return self._now_ms
