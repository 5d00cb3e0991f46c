"""The merge of a batch of ``(before snapshot, change)`` writes per Run, shared by the SQL
stores' set-based ``apply_many`` (ADR 0006): the first write's ``before`` of each row is its
fence, the last write's result is what is written, and events are appended in the order given.
A later change of a Run must start from the earlier one's result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ql3.domain.events import RunEvent
from ql3.domain.model import Attempt, DispatchLease, Run

T = TypeVar("T")


@dataclass(slots=True)
class FirstAndLast(Generic[T]):
    """A row's state as the batch read it (``None``: the batch inserts it) and as it leaves it."""

    first: T | None
    last: T


@dataclass(slots=True)
class RunWrites:
    """What a batch writes of one Run."""

    before: Run
    run: Run
    attempts: dict[str, FirstAndLast[Attempt]] = field(default_factory=dict)
    leases: dict[tuple[str, int], FirstAndLast[DispatchLease]] = field(default_factory=dict)


@dataclass(slots=True)
class MergedWrites:
    runs: dict[str, RunWrites]
    events: list[RunEvent]


def merge_by_run(
    writes: Sequence[tuple[Any, Any]], *, out_of_order: type[Exception]
) -> MergedWrites:
    """Merge ``writes`` per Run; a change that does not start from the Run as the one before it
    left it raises ``out_of_order``."""
    merged = MergedWrites(runs={}, events=[])
    for before, change in writes:
        run_id = before.run.id
        if change.run.id != run_id:
            raise ValueError(f"change of run {change.run.id} applied to run {run_id}")
        group = merged.runs.get(run_id)
        if group is None:
            group = merged.runs[run_id] = RunWrites(before=before.run, run=before.run)
        elif before.run != group.run:
            raise out_of_order(f"run {run_id}: a change does not start from the one before it")
        group.run = change.run
        for attempt in change.attempts:
            slot = group.attempts.get(attempt.id)
            if slot is None:
                old = before.attempt
                first = old if old is not None and old.id == attempt.id else None
                group.attempts[attempt.id] = FirstAndLast(first, attempt)
            else:
                slot.last = attempt
        lease = change.lease
        if lease is not None:
            key = (lease.run_id, lease.generation)
            held = group.leases.get(key)
            if held is None:
                old_lease = before.lease
                same = old_lease is not None and (old_lease.run_id, old_lease.generation) == key
                group.leases[key] = FirstAndLast(old_lease if same else None, lease)
            else:
                held.last = lease
        merged.events.append(change.event)
    return merged
