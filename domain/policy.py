"""The admission-time retry policy and its deterministic backoff."""

from __future__ import annotations

import enum
import hashlib

from attrs import field, frozen

from ql3.domain.errors import InvalidRetryPolicy

MAX_ATTEMPTS_LIMIT = 1000
# A backoff delay (initial or cap) of at most 30 days, and a growth of at most 100 times a step.
MAX_BACKOFF_MS = 30 * 24 * 3_600_000
MAX_BACKOFF_MULTIPLIER = 100.0


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
        if not _is_int(self.initial_ms) or not 0 <= self.initial_ms <= MAX_BACKOFF_MS:
            raise InvalidRetryPolicy(
                f"backoff initial delay must be an integer within 0..{MAX_BACKOFF_MS} ms"
            )
        if not _is_real(self.multiplier) or not 1.0 <= self.multiplier <= MAX_BACKOFF_MULTIPLIER:
            raise InvalidRetryPolicy(
                f"backoff multiplier must be a number within 1..{MAX_BACKOFF_MULTIPLIER:g}"
            )
        if not _is_int(self.cap_ms) or not self.initial_ms <= self.cap_ms <= MAX_BACKOFF_MS:
            raise InvalidRetryPolicy(
                f"backoff cap must be an integer within the initial delay..{MAX_BACKOFF_MS} ms"
            )
        if not _is_real(self.jitter) or not 0.0 <= self.jitter <= 1.0:
            raise InvalidRetryPolicy("backoff jitter must be a number within [0, 1]")

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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_max_attempts(_instance: object, _attribute: object, value: int) -> None:
    if not _is_int(value) or not 1 <= value <= MAX_ATTEMPTS_LIMIT:
        raise InvalidRetryPolicy(f"max_attempts must be within 1..{MAX_ATTEMPTS_LIMIT}")


def _to_safety(value: Safety | str | None) -> Safety | None:
    """A safety given by its value (``"idempotent"``) is that safety; anything else is refused."""
    if value is None or isinstance(value, Safety):
        return value
    try:
        return Safety(value)
    except ValueError:
        choices = ", ".join(s.value for s in Safety)
        raise InvalidRetryPolicy(f"safety must be one of {choices}, got {value!r}") from None


@frozen(kw_only=True)
class RetryPolicy:
    """Snapshotted on the Run at admission and never inferred later. ``retry_on_lost`` retries
    an Attempt that was lost, ``retry_on_error`` one whose task failed (raised or timed out);
    both only for ``idempotent`` or ``deduplicated`` work."""

    retry_on_lost: bool = False
    retry_on_error: bool = False
    max_attempts: int = field(default=1, validator=_check_max_attempts)
    safety: Safety | None = field(default=None, converter=_to_safety)
    backoff: Backoff = field(factory=Backoff)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.retry_on_lost, bool) or not isinstance(self.retry_on_error, bool):
            raise InvalidRetryPolicy("retry_on_lost and retry_on_error must be true or false")
        if not isinstance(self.backoff, Backoff):
            raise InvalidRetryPolicy("backoff must be a Backoff")
        # An unsafe task is never executed twice: a task error is no evidence that its side
        # effects did not happen, so retrying it on error is refused at admission (ADR 0013).
        from ql3.domain.guards import RETRY_ON_ERROR_SAFETY, holds

        if not holds(RETRY_ON_ERROR_SAFETY, {"policy": self}):
            raise InvalidRetryPolicy(
                "retry on error needs safety idempotent or deduplicated, got "
                + (self.safety.value if self.safety is not None else "no safety")
            )


# --- the policy as a JSON document (templates of triggers and workflow steps) --------------------

_POLICY_KEYS = frozenset(
    {"retry_on_lost", "retry_on_error", "max_attempts", "safety", "backoff"}
)
_BACKOFF_KEYS = frozenset({"initial_ms", "multiplier", "cap_ms", "jitter"})


def policy_to_document(policy: RetryPolicy) -> dict[str, object]:
    """The policy as plain JSON values; :func:`policy_from_document` reads it back."""
    return {
        "retry_on_lost": policy.retry_on_lost,
        "retry_on_error": policy.retry_on_error,
        "max_attempts": policy.max_attempts,
        "safety": policy.safety.value if policy.safety is not None else None,
        "backoff": {
            "initial_ms": policy.backoff.initial_ms,
            "multiplier": policy.backoff.multiplier,
            "cap_ms": policy.backoff.cap_ms,
            "jitter": policy.backoff.jitter,
        },
    }


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRetryPolicy(f"{name} must be an integer")
    if isinstance(value, float) and not value.is_integer():
        raise InvalidRetryPolicy(f"{name} must be an integer")
    return int(value)


def _real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRetryPolicy(f"{name} must be a number")
    return float(value)


def policy_from_document(document: object) -> RetryPolicy | None:
    """A retry policy from a JSON object such as ``{"retry_on_lost": true, "max_attempts": 3,
    "safety": "idempotent", "backoff": {"initial_ms": 1000}}``; ``None`` stays no policy.
    Unknown keys and wrong types are refused, never ignored."""
    if document is None:
        return None
    if not isinstance(document, dict):
        raise InvalidRetryPolicy("a policy must be a JSON object")
    unknown = sorted(set(document) - _POLICY_KEYS)
    if unknown:
        raise InvalidRetryPolicy(f"unknown policy keys: {', '.join(map(str, unknown))}")
    retry_on_lost = document.get("retry_on_lost", False)
    if not isinstance(retry_on_lost, bool):
        raise InvalidRetryPolicy("retry_on_lost must be true or false")
    retry_on_error = document.get("retry_on_error", False)
    if not isinstance(retry_on_error, bool):
        raise InvalidRetryPolicy("retry_on_error must be true or false")
    max_attempts = _integer(document.get("max_attempts", 1), "max_attempts")
    safety_value = document.get("safety")
    safety: Safety | None = None
    if safety_value is not None:
        try:
            safety = Safety(safety_value)
        except ValueError:
            choices = ", ".join(s.value for s in Safety)
            raise InvalidRetryPolicy(f"safety must be one of {choices}") from None
    backoff_document = document.get("backoff") or {}
    if not isinstance(backoff_document, dict):
        raise InvalidRetryPolicy("backoff must be a JSON object")
    unknown = sorted(set(backoff_document) - _BACKOFF_KEYS)
    if unknown:
        raise InvalidRetryPolicy(f"unknown backoff keys: {', '.join(map(str, unknown))}")
    default = Backoff()
    initial_ms = _integer(backoff_document.get("initial_ms", default.initial_ms), "initial_ms")
    backoff = Backoff(
        initial_ms=initial_ms,
        multiplier=_real(backoff_document.get("multiplier", default.multiplier), "multiplier"),
        cap_ms=_integer(
            backoff_document.get("cap_ms", max(default.cap_ms, initial_ms)), "cap_ms"
        ),
        jitter=_real(backoff_document.get("jitter", default.jitter), "jitter"),
    )
    return RetryPolicy(
        retry_on_lost=retry_on_lost,
        retry_on_error=retry_on_error,
        max_attempts=max_attempts,
        safety=safety,
        backoff=backoff,
    )
