"""Bulk cancel and bulk run-again over a selection or over everything a filter matches
(ADR 0020): a preview count first, then batches, each Run through the one-Run command
(:class:`ConsoleActions`), so that each is audited with the operator's name as a single action
is. A job works through keyset pages of the filter, oldest first, bounded by the time it began:
a Run admitted later (a Run run again, say) is never taken. What a batch could not do to a Run
(finished meanwhile, not safe to repeat) is counted and said, never retried."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from ql3.application.console import COUNT_CAP, Count, RunBrowser, RunCursor, RunFilter, RunOrder
from ql3.application.console_actions import ConsoleActions
from ql3.domain.bulk import BulkAction, bulk_statuses
from ql3.domain.errors import DomainError, InvalidAdmission
from ql3.domain.rerun import needs_confirmation

BATCH_SIZE = 100
MAX_SELECTED = 1_000
MAX_NOTES = 20


@dataclass(frozen=True, slots=True)
class BulkRequest:
    """What an operator asked for: an action over a filter (``run_ids`` empty) or over the
    Runs selected (``run_ids``, each still checked against the action)."""

    action: BulkAction
    where: RunFilter
    run_ids: tuple[str, ...] = ()
    reason: str = ""

    def __post_init__(self) -> None:
        if len(self.run_ids) > MAX_SELECTED:
            raise InvalidAdmission(f"select at most {MAX_SELECTED} runs, or use the filter")


@dataclass
class BulkProgress:
    """How far a job got; ``done + skipped + failed`` Runs were looked at."""

    done: int = 0
    skipped: int = 0
    failed: int = 0
    batches: int = 0
    cursor: RunCursor | None = None
    finished: bool = False
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if len(self.notes) < MAX_NOTES:
            self.notes.append(text)


class BulkActions:
    def __init__(self, browser: RunBrowser, actions: ConsoleActions) -> None:
        self._browser = browser
        self._actions = actions

    def scope(self, request: BulkRequest, began_ms: int) -> RunFilter:
        """The filter a job walks: the request's, narrowed to the statuses the action takes
        and to Runs admitted before the job began."""
        statuses = bulk_statuses(request.action, request.where.statuses)
        until = request.where.created_to_ms
        return dataclasses.replace(
            request.where,
            statuses=statuses,
            created_to_ms=began_ms if until is None else min(until, began_ms),
        )

    def preview(self, request: BulkRequest, began_ms: int) -> Count:
        """How many Runs the job would take now (the selected ones: how many were selected)."""
        if request.run_ids:
            return Count(value=len(request.run_ids), exact=True)
        scope = self.scope(request, began_ms)
        if not scope.statuses:
            return Count(value=0, exact=True)
        return self._browser.count_runs(scope, COUNT_CAP)

    def run_batch(
        self, operator: str, request: BulkRequest, began_ms: int, progress: BulkProgress
    ) -> None:
        """One batch: the next page of the job's Runs, each through its command."""
        if progress.finished:
            return
        if request.run_ids:
            start = progress.done + progress.skipped + progress.failed
            picked: Sequence[str] = request.run_ids[start : start + BATCH_SIZE]
            progress.finished = start + len(picked) >= len(request.run_ids)
        else:
            scope = self.scope(request, began_ms)
            if not scope.statuses:
                progress.finished = True
                return
            page = self._browser.browse_runs(scope, RunOrder.OLDEST, progress.cursor, BATCH_SIZE)
            picked = [run.id for run in page.runs]
            progress.cursor = page.next_cursor
            progress.finished = page.next_cursor is None
        for run_id in picked:
            self._one(operator, request, run_id, progress)
        progress.batches += 1

    def _one(
        self, operator: str, request: BulkRequest, run_id: str, progress: BulkProgress
    ) -> None:
        try:
            if request.action is BulkAction.CANCEL:
                self._actions.cancel(operator, run_id, request.reason or "bulk cancel")
            else:
                run = self._actions.run_of(run_id)
                if run is not None and needs_confirmation(run):
                    progress.skipped += 1
                    progress.note(f"{run_id}: task {run.task} is not declared safe to repeat")
                    return
                self._actions.run_again(operator, run_id, run.input if run else None, None)
        except (DomainError, LookupError) as error:
            progress.skipped += 1
            progress.note(f"{run_id}: {error}")
            return
        except Exception as error:  # the store failed: count it, the next batch goes on
            progress.failed += 1
            progress.note(f"{run_id}: {type(error).__name__}")
            return
        progress.done += 1
