"""The operator console's reads and actions (ADR 0020).

The console reads through the ports here and the existing queries (:class:`RunQueries`,
:class:`Doctor`, :class:`TaskLimits`, :class:`CredentialCommands`), and acts only through the
existing commands: cancel, quarantine and unquarantine, attest-stopped, task limits, credential
revocation. Each action names the operator in what it records (the reason the command's own
event or audit line keeps), and answers with what changed. Nothing here knows about HTTP."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ql3.application.ports import HARD_PAGE_CAP, OperationsSource, OperationsView
from ql3.domain.errors import InvalidAdmission
from ql3.domain.model import JsonValue, Run, RunStatus

# A page of the runs list, and the most rows a count walks before it says "at least".
DEFAULT_RUNS_PAGE = 50
MAX_RUNS_PAGE = 200
COUNT_CAP = 10_000
MAX_FILTER_TEXT = 200
OPERATOR_MAX_LENGTH = 64


class RunOrder(enum.Enum):
    NEWEST = "newest"
    OLDEST = "oldest"


@dataclass(frozen=True, slots=True)
class RunCursor:
    """Where a keyset page of the runs list ends: the last Run's admission time and id."""

    created_at_ms: int
    run_id: str

    def token(self) -> str:
        return f"{self.created_at_ms}.{self.run_id}"

    @classmethod
    def parse(cls, token: str) -> RunCursor:
        at, sep, run_id = token.partition(".")
        if not sep or not at.isdigit() or not run_id or len(token) > MAX_FILTER_TEXT:
            raise InvalidAdmission(f"not a page cursor: {token[:40]!r}")
        return cls(created_at_ms=int(at), run_id=run_id)


@dataclass(frozen=True, slots=True)
class RunFilter:
    """What the runs list shows: every field given must match (``statuses``: any of them).
    ``input_contains`` is a JSON object the Run's input must contain (PostgreSQL ``@>``; the
    SQLite and memory stores compare its top-level keys for equality)."""

    statuses: tuple[RunStatus, ...] = ()
    task: str | None = None
    created_from_ms: int | None = None
    created_to_ms: int | None = None
    unique_key: str | None = None
    run_id: str | None = None
    input_contains: Mapping[str, JsonValue] | None = None
    workflows: bool = False  # only workflow aggregates

    def __post_init__(self) -> None:
        for text in (self.task, self.unique_key, self.run_id):
            if text is not None and (len(text) > MAX_FILTER_TEXT or "\x00" in text):
                raise InvalidAdmission(f"a filter is at most {MAX_FILTER_TEXT} characters")
        if self.input_contains is not None and not isinstance(self.input_contains, dict):
            raise InvalidAdmission("the input filter must be a JSON object")
        if (
            self.created_from_ms is not None
            and self.created_to_ms is not None
            and self.created_from_ms > self.created_to_ms
        ):
            raise InvalidAdmission("the time range ends before it begins")


@dataclass(frozen=True, slots=True)
class Count:
    """How many rows match: ``exact``, or at least ``value`` (a count stops at its cap), or
    ``estimated`` by the database's planner."""

    value: int
    exact: bool
    estimated: bool = False


@dataclass(frozen=True, slots=True)
class RunPage:
    runs: tuple[Run, ...]
    next_cursor: RunCursor | None
    observed_at_ms: int


@dataclass(frozen=True, slots=True)
class TaskWindow:
    """One task over a window: its Runs by status (queued and running now; succeeded and
    failed finished within the window), the durations of the Attempts finished in it."""

    task: str
    queued: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    p50_ms: int | None = None
    p95_ms: int | None = None
    limit: int | None = None


@dataclass(frozen=True, slots=True)
class FinishedBucket:
    """Runs that finished (by status) in one bucket of time starting at ``start_ms``."""

    start_ms: int
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0

    @property
    def total(self) -> int:
        return self.succeeded + self.failed + self.cancelled


class RunBrowser(Protocol):
    """What the console reads besides the operations view; every store implements it."""

    def browse_runs(
        self, where: RunFilter, order: RunOrder, after: RunCursor | None, limit: int
    ) -> RunPage:
        """Up to ``limit`` Runs matching ``where`` in ``order`` (admission time, then id),
        after the cursor; ``next_cursor`` when there are more."""

    def count_runs(self, where: RunFilter, cap: int) -> Count:
        """How many Runs match: exact up to ``cap``, beyond it an estimate or "at least"."""

    def finished_between(
        self, since_ms: int, bucket_ms: int
    ) -> tuple[int, Sequence[FinishedBucket]]:
        """The store's clock, and top-level Runs finished since ``since_ms`` by bucket."""

    def task_durations(self, since_ms: int, limit: int) -> Mapping[str, Sequence[int]]:
        """Per task, the durations (ms) of up to ``limit`` Attempts of Runs finished since."""

    def finished_counts(self, since_ms: int) -> Mapping[tuple[str, str], int]:
        """(task, status) -> top-level Runs that finished since ``since_ms``."""

    def status_counts(self, cap: int) -> Mapping[RunStatus, Count]:
        """:meth:`count_runs` of each status, in one read."""

    def last_event_sequence(self) -> int:
        """The sequence of the last event appended (0 for none): it grows with every change."""

    def runs_again_of(self, run_id: str, after_sequence: int) -> Sequence[str]:
        """The Runs admitted as ``run_id`` run again, found among the events after the old
        Run's last one (``after_sequence``); at most 20, oldest first."""


def percentile(values: Sequence[int], fraction: float) -> int | None:
    """The nearest-rank percentile of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * fraction // 1))
    return ordered[int(rank) - 1]


HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
LIVE_STATUSES = (
    RunStatus.CREATED,
    RunStatus.QUEUED,
    RunStatus.DISPATCHING,
    RunStatus.RUNNING,
    RunStatus.RETRY_WAIT,
    RunStatus.LOST,
)


@dataclass(frozen=True, slots=True)
class Overview:
    operations: OperationsView
    status_counts: Mapping[RunStatus, Count]
    last_hour: Sequence[FinishedBucket]
    last_day: Sequence[FinishedBucket]
    findings: tuple[object, ...] = field(default=())


class ConsoleQueries:
    """The console's reads, each a bounded query of the store."""

    def __init__(self, browser: RunBrowser, operations: OperationsSource) -> None:
        self._browser = browser
        self._operations = operations

    def overview(self) -> Overview:
        from ql3.application.operations import diagnose

        view = self._operations.operations_view(HARD_PAGE_CAP)
        counts = self._browser.status_counts(COUNT_CAP)
        now, hour = self._browser.finished_between(
            self._since(view.observed_at_ms, HOUR_MS), 60_000
        )
        _, day = self._browser.finished_between(self._since(now, DAY_MS), HOUR_MS)
        return Overview(
            operations=view,
            status_counts=counts,
            last_hour=_filled(hour, now, HOUR_MS, 60_000),
            last_day=_filled(day, now, DAY_MS, HOUR_MS),
            findings=tuple(diagnose(view)),
        )

    @staticmethod
    def _since(now_ms: int, window_ms: int) -> int:
        return now_ms - window_ms

    def runs(
        self,
        where: RunFilter,
        order: RunOrder = RunOrder.NEWEST,
        after: RunCursor | None = None,
        limit: int = DEFAULT_RUNS_PAGE,
    ) -> tuple[RunPage, Count]:
        if not 1 <= limit <= MAX_RUNS_PAGE:
            raise InvalidAdmission(f"a page holds 1..{MAX_RUNS_PAGE} runs")
        page = self._browser.browse_runs(where, order, after, limit)
        return page, self._browser.count_runs(where, COUNT_CAP)

    def tasks(self, window_ms: int, limits: Mapping[str, int]) -> list[TaskWindow]:
        view = self._operations.operations_view(HARD_PAGE_CAP)
        since = view.observed_at_ms - window_ms
        finished = self._browser.finished_counts(since)
        durations = self._browser.task_durations(since, 5_000)
        queued = {q.task: q.queued for q in view.queues}
        names = sorted({*queued, *limits, *(task for task, _ in finished)})
        running = {
            task: self._browser.count_runs(
                RunFilter(statuses=(RunStatus.DISPATCHING, RunStatus.RUNNING), task=task),
                COUNT_CAP,
            ).value
            for task in names
        }
        rows = []
        for task in names:
            spans = durations.get(task, ())
            rows.append(
                TaskWindow(
                    task=task,
                    queued=queued.get(task, 0),
                    running=running[task],
                    succeeded=finished.get((task, RunStatus.SUCCEEDED.value), 0),
                    failed=finished.get((task, RunStatus.FAILED.value), 0),
                    p50_ms=percentile(spans, 0.5),
                    p95_ms=percentile(spans, 0.95),
                    limit=limits.get(task),
                )
            )
        return rows


def _filled(
    buckets: Sequence[FinishedBucket], now_ms: int, window_ms: int, bucket_ms: int
) -> list[FinishedBucket]:
    """Every bucket of the window, the empty ones too, oldest first."""
    by_start = {b.start_ms: b for b in buckets}
    last = now_ms - now_ms % bucket_ms
    count = window_ms // bucket_ms
    starts = [last - bucket_ms * i for i in range(count - 1, -1, -1)]
    return [by_start.get(start, FinishedBucket(start_ms=start)) for start in starts]


def operator_reason(operator: str, reason: str) -> str:
    """The reason an action records, naming the operator who took it."""
    name = operator.strip()
    if not name or len(name) > OPERATOR_MAX_LENGTH:
        raise InvalidAdmission("an action needs the operator's name")
    text = reason.strip()
    return f"[console: {name}] {text}" if text else f"[console: {name}]"
