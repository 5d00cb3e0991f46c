"""The console's reads on the memory store (ADR 0020): the same answers as the SQL stores',
computed over a committed snapshot."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from ql3.application.console import (
    Count,
    FinishedBucket,
    RunCursor,
    RunFilter,
    RunOrder,
    RunPage,
)
from ql3.domain.model import TERMINAL_RUN_STATUSES, Attempt, Run, RunOwner, RunStatus


def matches(run: Run, where: RunFilter) -> bool:
    if where.statuses and run.status not in where.statuses:
        return False
    if where.task is not None and run.task != where.task:
        return False
    if where.unique_key is not None and run.unique_key != where.unique_key:
        return False
    if where.run_id is not None and run.id != where.run_id:
        return False
    if where.created_from_ms is not None and run.created_at_ms < where.created_from_ms:
        return False
    if where.created_to_ms is not None and run.created_at_ms > where.created_to_ms:
        return False
    if where.workflows and run.owner is not RunOwner.WORKFLOW:
        return False
    if where.input_contains:
        document = run.input
        if not isinstance(document, dict):
            return False
        for key, value in where.input_contains.items():
            if key not in document or document[key] != value:
                return False
            if isinstance(value, bool) is not isinstance(document[key], bool):
                return False
    return True


def browse(
    all_runs: Iterable[Run],
    now_ms: int,
    where: RunFilter,
    order: RunOrder,
    after: RunCursor | None,
    limit: int,
) -> RunPage:
    newest = order is RunOrder.NEWEST
    selected = sorted(
        (r for r in all_runs if matches(r, where)),
        key=lambda r: (r.created_at_ms, r.id),
        reverse=newest,
    )
    if after is not None:
        mark = (after.created_at_ms, after.run_id)
        selected = [
            r
            for r in selected
            if ((r.created_at_ms, r.id) < mark if newest else (r.created_at_ms, r.id) > mark)
        ]
    items = tuple(selected[:limit])
    cursor = (
        RunCursor(created_at_ms=items[-1].created_at_ms, run_id=items[-1].id)
        if len(selected) > limit and items
        else None
    )
    return RunPage(runs=items, next_cursor=cursor, observed_at_ms=now_ms)


def count(all_runs: Iterable[Run], where: RunFilter, cap: int) -> Count:
    found = sum(1 for r in all_runs if matches(r, where))
    return Count(value=found, exact=True) if found <= cap else Count(value=cap, exact=False)


def _finished(all_runs: Iterable[Run], since_ms: int) -> list[Run]:
    return [
        r
        for r in all_runs
        if r.status in TERMINAL_RUN_STATUSES
        and r.parent_run_id is None
        and r.updated_at_ms >= since_ms
    ]


def buckets(all_runs: Iterable[Run], since_ms: int, bucket_ms: int) -> list[FinishedBucket]:
    counts: dict[int, dict[RunStatus, int]] = {}
    for run in _finished(all_runs, since_ms):
        start = run.updated_at_ms - run.updated_at_ms % bucket_ms
        by_status = counts.setdefault(start, {})
        by_status[run.status] = by_status.get(run.status, 0) + 1
    return [
        FinishedBucket(
            start_ms=start,
            succeeded=c.get(RunStatus.SUCCEEDED, 0),
            failed=c.get(RunStatus.FAILED, 0),
            cancelled=c.get(RunStatus.CANCELLED, 0),
        )
        for start, c in sorted(counts.items())
    ]


def finished_counts(all_runs: Iterable[Run], since_ms: int) -> Mapping[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for run in _finished(all_runs, since_ms):
        key = (run.task, run.status.value)
        found[key] = found.get(key, 0) + 1
    return found


def durations(
    all_runs: Iterable[Run],
    attempts_of: Callable[[str], Sequence[Attempt]],
    since_ms: int,
    limit: int,
) -> Mapping[str, Sequence[int]]:
    recent = sorted(_finished(all_runs, since_ms), key=lambda r: r.updated_at_ms, reverse=True)
    found: dict[str, list[int]] = {}
    for run in recent[:limit]:
        for attempt in attempts_of(run.id):
            if attempt.started_at_ms is not None and attempt.finished_at_ms is not None:
                found.setdefault(run.task, []).append(
                    max(0, attempt.finished_at_ms - attempt.started_at_ms)
                )
    return found
