"""Pruning finished history (ADR 0016): ``ql3 runs prune`` and ``Runtime.prune_finished``.

An operator's command, run from cron, never a step of the cadence. It deletes the finished Runs
whose last change is older than a cutoff, with everything that records them, in bounded batches:
each batch is one short transaction that picks at most ``batch_size`` Runs (locking only those,
skipping any another transaction holds), deletes them and commits, and the next batch goes on
after the last Run picked until nothing is left. The cutoff is the store's clock at the first
batch minus the age asked for, and stays the same for every batch. A dry run counts the same
batches and deletes nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ql3.application.budgets import DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE
from ql3.application.ports import PrunedRows, PruneMark, SchedulerUnitOfWorkFactory
from ql3.domain.errors import Error
from ql3.domain.history import batch_take, finished_before
from ql3.domain.model import JsonValue

_UNITS_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000}
_DURATION = re.compile(r"(\d{1,9})([dhms])")


class InvalidDuration(Error, ValueError):
    """An age that is not a whole number of days, hours, minutes or seconds."""


class InvalidBatchSize(Error, ValueError):
    """A batch size outside 1..MAX_BATCH_SIZE."""


def parse_duration(text: str) -> int:
    """``30d``, ``12h``, ``90m`` or ``3600s`` as milliseconds."""
    found = _DURATION.fullmatch(text.strip())
    if found is None:
        raise InvalidDuration(
            f"not a duration: {text!r} (a whole number and d, h, m or s, such as 30d or 12h)"
        )
    return int(found.group(1)) * _UNITS_MS[found.group(2)]


def check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int):
        raise InvalidBatchSize(f"the batch size must be an integer, got {batch_size!r}")
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise InvalidBatchSize(f"the batch size must be within 1..{MAX_BATCH_SIZE}")
    return batch_size


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What a prune removed (a dry run: would remove), in how many batches, and its cutoff
    (the store's clock at its start minus the age asked for). ``batch_runs`` holds how many
    Runs each batch took."""

    finished_before_ms: int
    dry_run: bool
    removed: PrunedRows
    batch_runs: tuple[int, ...] = field(default=())

    @property
    def batches(self) -> int:
        return len(self.batch_runs)

    def as_dict(self) -> dict[str, JsonValue]:
        return {
            "finished_before_ms": self.finished_before_ms,
            "dry_run": self.dry_run,
            "batches": self.batches,
            "removed": dict(self.removed.as_dict()),
        }


class HistoryPruning:
    """Prunes finished history in bounded batches, one short transaction each."""

    def __init__(
        self, uow_factory: SchedulerUnitOfWorkFactory, batch_size: int = DEFAULT_BATCH_SIZE
    ) -> None:
        self._uow_factory = uow_factory
        self._batch_size = check_batch_size(batch_size)

    def prune(
        self, older_than_ms: int, *, dry_run: bool = False, batch_size: int | None = None
    ) -> PruneReport:
        """Delete (``dry_run``: count) the finished Runs whose last change is more than
        ``older_than_ms`` before the store's clock now, with every row that records them."""
        if older_than_ms < 0:
            raise InvalidDuration(f"an age is not negative, got {older_than_ms} ms")
        limit = self._batch_size if batch_size is None else check_batch_size(batch_size)
        cutoff: int | None = None
        after: PruneMark | None = None
        removed = PrunedRows()
        batches: list[int] = []
        while True:
            with self._uow_factory() as uow:
                if cutoff is None:
                    cutoff = finished_before(uow.now_ms(), older_than_ms)
                picked = uow.history.prunable(cutoff, limit, after)
                taken = list(picked[: batch_take((p.runs for p in picked), limit)])
                if not taken:
                    break
                if dry_run:
                    batch = uow.history.count(taken)
                else:
                    batch = uow.history.delete(taken)
                    uow.commit()
            removed += batch
            batches.append(batch.runs)
            after = taken[-1].mark
        assert cutoff is not None  # the first batch read the store's clock
        return PruneReport(
            finished_before_ms=cutoff,
            dry_run=dry_run,
            removed=removed,
            batch_runs=tuple(batches),
        )
