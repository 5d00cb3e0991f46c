"""Default identifiers and secrets."""

from __future__ import annotations

import os
import secrets
import time
import uuid

_VERSION_7 = 0x7 << 76
_VARIANT = 0b10 << 62
_RAND_A = (1 << 12) - 1
_RAND_B = (1 << 62) - 1


class RandomIdentities:
    """UUIDv7 identifiers (RFC 9562: the Unix time in milliseconds, then 74 random bits), as 32
    hexadecimal digits; secrets of 256 random bits, URL-safe.

    Ids made together sort together: the Runs, Attempts and leases of one admission, which
    claims take in that order, sit side by side in every index keyed by an id, so a transaction
    that writes several of them touches a few index pages instead of one per row."""

    def new_id(self) -> str:
        random = int.from_bytes(os.urandom(10), "big")
        value = (
            (time.time_ns() // 1_000_000) << 80
            | _VERSION_7
            | ((random >> 62) & _RAND_A) << 64
            | _VARIANT
            | (random & _RAND_B)
        )
        return uuid.UUID(int=value).hex

    def new_secret(self) -> str:
        return secrets.token_urlsafe(32)
