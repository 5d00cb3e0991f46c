"""The admission-time retry policy and its deterministic backoff."""

from __future__ import annotations

import enum
import hashlib

from attrs import field, frozen

from domain.errors import InvalidRetryPolicy

MAX_ATTEMPTS_LIMIT = 1000


class Safety(enum.Enum):
    """What the caller declared about repeating the task's side effects."""

    IDEMPOTENT = "idempotent"
    DEDUPLICATED = "deduplicated"
    UNSAFE = "unsafe"


RETRYABLE_SAFETY = frozenset({Safety.IDEMPOTENT, Safety.DEDUPLICATED})


@frozen(kw_only=True)
class Backoff:
    """Exponential backoff: ``initial * multiplier**(n-1)`` capped at ``cap``, with a jitter that
    is derived from the run id and attempt number so that every store computes the same delay."""

    initial_ms: int = 1_000
    multiplier: float = 2.0
    cap_ms: int = 300_000
    jitter: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.initial_ms < 0:
            raise InvalidRetryPolicy("backoff initial delay must be >= 0")
        if self.multiplier < 1.0:
            raise InvalidRetryPolicy("backoff multiplier must be >= 1")
        if self.cap_ms < self.initial_ms:
            raise InvalidRetryPolicy("backoff cap must be >= the initial delay")
        if not 0.0 <= self.jitter <= 1.0:
            raise InvalidRetryPolicy("backoff jitter must be within [0, 1]")

    def delay_ms(self, run_id: str, attempt_number: int) -> int:
        """Delay before the attempt that follows ``attempt_number``."""
        exponent = max(attempt_number - 1, 0)
        base = float(self.initial_ms)
        for _ in range(exponent):  # stops growing at the cap: no overflow for large numbers
            if base >= self.cap_ms or self.multiplier == 1.0:
                break
            base *= self.multiplier
        base = min(float(self.cap_ms), base)
        if self.jitter:
            digest = hashlib.sha256(f"{run_id}:{attempt_number}".encode()).digest()
            fraction = int.from_bytes(digest[:8], "big") / 2**64  # in [0, 1)
            base *= 1.0 + self.jitter * (2.0 * fraction - 1.0)
        return max(0, min(self.cap_ms, round(base)))


def _check_max_attempts(_instance: object, _attribute: object, value: int) -> None:
    if not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise InvalidRetryPolicy(f"max_attempts must be within 1..{MAX_ATTEMPTS_LIMIT}")


@frozen(kw_only=True)
class RetryPolicy:
    """Snapshotted on the Run at admission and never inferred later."""

    retry_on_lost: bool = False
    max_attempts: int = field(default=1, validator=_check_max_attempts)
    safety: Safety | None = None
    backoff: Backoff = field(factory=Backoff)
