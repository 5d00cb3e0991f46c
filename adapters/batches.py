"""Batch methods of the runs repository port for stores that take them one at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ql3.application.ports import Snapshot
from ql3.domain.transitions import Change


class _OneByOne(Protocol):
    def lock_attempt(self, attempt_id: str, *, skip_locked: bool = False) -> Snapshot | None: ...

    def apply(self, before: Snapshot, change: Change) -> None: ...


class OneAtATime:
    """``lock_attempts`` and ``apply_many`` through the store's own ``lock_attempt`` and
    ``apply``. A refusal in ``apply_many`` leaves the earlier writes in the unit of work, which
    the caller then rolls back: the port promises all or nothing per transaction."""

    def lock_attempts(self: _OneByOne, attempt_ids: Sequence[str]) -> list[Snapshot | None]:
        return [self.lock_attempt(attempt_id) for attempt_id in attempt_ids]

    def apply_many(self: _OneByOne, writes: Sequence[tuple[Snapshot, Change]]) -> None:
        for before, change in writes:
            self.apply(before, change)
