"""Default identifiers and secrets."""

from __future__ import annotations

import os
import secrets
import threading
import time

_VERSION_7 = 0x7 << 76
_VARIANT = 0b10 << 62
_COUNTER_MAX = (1 << 12) - 1
_RAND_B = (1 << 62) - 1


class RandomIdentities:
    """UUIDv7 identifiers (RFC 9562: the Unix time in milliseconds, a 12-bit counter within the
    millisecond, then 62 random bits), as 32 hexadecimal digits; secrets of 256 random bits,
    URL-safe.

    The ids one instance makes increase in the order it makes them (the counter; past 4,096 in
    one millisecond the time moves on by one). So the Runs, Attempts and leases of one
    admission, which claims take in that order, sit side by side in every index keyed by an
    id, and a transaction that writes several of them touches a few index pages instead of
    one per row."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = 0
        self._counter = 0

    def new_id(self) -> str:
        now_ms = time.time_ns() // 1_000_000
        with self._lock:
            if now_ms > self._last_ms:
                self._last_ms, self._counter = now_ms, 0
            elif self._counter < _COUNTER_MAX:
                self._counter += 1
            else:
                self._last_ms, self._counter = self._last_ms + 1, 0
            ms, counter = self._last_ms, self._counter
        random = int.from_bytes(os.urandom(8), "big") & _RAND_B
        # As uuid.UUID(int=...).hex, without building the UUID object.
        return "%032x" % (ms << 80 | _VERSION_7 | counter << 64 | _VARIANT | random)

    def new_secret(self) -> str:
        return secrets.token_urlsafe(32)
