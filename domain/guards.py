"""The guards of the state machine, as data: each predicate a store must check where it reads or
writes (a claimable Run, a pristine or handed-back Attempt, a live or expired lease, the safety a
retry on error needs) and the compare-and-set fence of each kind of row.

A guard is a small expression over the fields of the domain's entities (``run``, ``attempt``,
``lease``, and a Run's ``policy``). The domain and the memory store evaluate it on entities
(:func:`holds`); every SQL text that checks it is rendered from it (``ql3.adapters.sql.guards``,
one renderer per dialect), never typed again. Changing a guard here changes every store, the
database functions and the schema's constraints (ADR 0025).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeAlias

from attrs import frozen

from ql3.domain.model import AttemptStatus, LeaseStatus
from ql3.domain.policy import RETRYABLE_SAFETY
from ql3.domain.states import CLAIMABLE_RUN_STATUSES


@frozen
class Field:
    """A field of one of the entities a guard reads: ``entity`` is ``run``, ``attempt``,
    ``lease`` or ``policy``; ``name`` the attribute's name on it. Its column is the name without
    the ``_ms`` of a time (``expires_at_ms`` is stored as ``expires_at``); a policy's fields are
    columns of ``runs``."""

    entity: str
    name: str

    @property
    def column(self) -> str:
        return self.name.removesuffix("_ms")


@frozen
class Now:
    """The store's clock at the time of the check (``now_ms``)."""


NOW = Now()
Value: TypeAlias = enum.Enum | bool | int | str


@frozen
class IsNull:
    field: Field


@frozen
class Is:
    """The field holds ``value`` (a status, a flag)."""

    field: Field
    value: Value


@frozen
class OneOf:
    """The field holds one of ``values``."""

    field: Field
    values: frozenset[enum.Enum]


@frozen
class Later:
    """``left`` is strictly later than ``right`` (another field, or the store's clock)."""

    left: Field
    right: Field | Now


@frozen
class NotLater:
    """``left`` is at or before ``right``: the negation of :class:`Later` on set values."""

    left: Field
    right: Field | Now


@frozen
class All:
    parts: tuple[Guard, ...]


@frozen
class Either:
    parts: tuple[Guard, ...]


Guard: TypeAlias = IsNull | Is | OneOf | Later | NotLater | All | Either


def run(name: str) -> Field:
    return Field("run", name)


def attempt(name: str) -> Field:
    return Field("attempt", name)


def lease(name: str) -> Field:
    return Field("lease", name)


def policy(name: str) -> Field:
    return Field("policy", name)


def negated(guard: Later | NotLater) -> Later | NotLater:
    """The negation of a comparison of set times: later becomes at-or-before, and back."""
    if isinstance(guard, Later):
        return NotLater(guard.left, guard.right)
    return Later(guard.left, guard.right)


# --- the guards ----------------------------------------------------------------------------------

CLAIMABLE_RUN: Guard = OneOf(run("status"), frozenset(CLAIMABLE_RUN_STATUSES))
"""A Run a worker's claim may start."""

PRISTINE_ATTEMPT: Guard = All(
    (
        Is(attempt("status"), AttemptStatus.CLAIMED),
        IsNull(attempt("session_id")),
        IsNull(attempt("worker_id")),
        IsNull(attempt("lease_generation")),
        IsNull(attempt("offered_at_ms")),
        IsNull(attempt("accepted_at_ms")),
        IsNull(attempt("started_at_ms")),
    )
)
"""A claimed dispatch slot with no worker, session, offer, lease or start facts."""

CHANGED_SINCE_MADE = Later(attempt("updated_at_ms"), attempt("created_at_ms"))
"""The Attempt was written again after it was made (a new one is written once, with equal
times)."""

UNCHANGED_SINCE_MADE: Guard = negated(CHANGED_SINCE_MADE)
"""The negation of :data:`CHANGED_SINCE_MADE`: as it was made."""

HANDED_BACK: Guard = All(
    (
        Is(attempt("status"), AttemptStatus.CLAIMED),
        IsNull(attempt("session_id")),
        CHANGED_SINCE_MADE,
    )
)
"""A claimed Attempt without a session that changed since it was made: a worker handed it back
unstarted and nobody claimed it since (the predicate of ``ix_run_attempts_handed_back``)."""

LEASE_UNEXPIRED = Later(lease("expires_at_ms"), NOW)
"""The lease's expiry has not passed by the store's clock."""

LEASE_EXPIRED: Guard = negated(LEASE_UNEXPIRED)
"""The lease's expiry has passed by the store's clock."""

LEASE_LIVE: Guard = All((Is(lease("status"), LeaseStatus.LEASED), LEASE_UNEXPIRED))
"""The lease is ``leased`` and its expiry has not passed: the authority to run its Attempt."""

RETRY_ON_ERROR_SAFETY: Guard = Either(
    (Is(policy("retry_on_error"), False), OneOf(policy("safety"), frozenset(RETRYABLE_SAFETY)))
)
"""A policy retries on error only an ``idempotent`` or ``deduplicated`` run (ADR 0013): an
unsafe task is never executed twice."""

FENCES: Mapping[str, tuple[str, ...]] = {
    "run": ("status", "attempt_count"),
    "attempt": ("status", "lease_version"),
    "lease": ("version", "status", "token_hash"),
}
"""The compare-and-set of each kind of row: an update of it applies only while these fields
still hold what the transaction read (a NULL matches a NULL); else it is a conflict."""


# --- evaluation ----------------------------------------------------------------------------------


def _value(field: Field, entities: Mapping[str, object]) -> object:
    return getattr(entities[field.entity], field.name)


def _operand(operand: Field | Now, entities: Mapping[str, object], now_ms: int | None) -> object:
    if isinstance(operand, Now):
        if now_ms is None:
            raise ValueError("this guard reads the store's clock: give now_ms")
        return now_ms
    return _value(operand, entities)


def holds(guard: Guard, entities: Mapping[str, object], now_ms: int | None = None) -> bool:
    """Whether ``guard`` holds for ``entities`` (``{"attempt": attempt, ...}``) at ``now_ms``."""
    if isinstance(guard, All):
        return all(holds(part, entities, now_ms) for part in guard.parts)
    if isinstance(guard, Either):
        return any(holds(part, entities, now_ms) for part in guard.parts)
    if isinstance(guard, IsNull):
        return _value(guard.field, entities) is None
    if isinstance(guard, Is):
        found = _value(guard.field, entities)
        return found is guard.value if isinstance(guard.value, bool) else found == guard.value
    if isinstance(guard, OneOf):
        return _value(guard.field, entities) in guard.values
    left = _value(guard.left, entities)
    right = _operand(guard.right, entities, now_ms)
    if not isinstance(left, int) or not isinstance(right, int):
        return False  # an unset time is neither later nor earlier than anything
    if isinstance(guard, Later):
        return left > right
    return left <= right


def fence_matches(entity: str, stored: object, read: object) -> bool:
    """The stored row still holds the fence fields the transaction read."""
    return all(getattr(stored, name) == getattr(read, name) for name in FENCES[entity])
