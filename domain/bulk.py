"""Which Runs a bulk action takes (ADR 0020): a bulk cancel takes the unfinished Runs a filter
matches, a bulk run-again the finished top-level Runs; the others are left as they are."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from ql3.domain.model import TERMINAL_RUN_STATUSES, RunStatus
from ql3.domain.states import NON_TERMINAL_RUN_STATUSES


class BulkAction(enum.Enum):
    CANCEL = "cancel"
    RUN_AGAIN = "run_again"


def bulk_statuses(action: BulkAction, chosen: Iterable[RunStatus]) -> tuple[RunStatus, ...]:
    """The statuses a bulk ``action`` picks among those a filter chose (none chosen: all),
    in their declared order; empty when the filter chose none the action applies to."""
    applies = TERMINAL_RUN_STATUSES if action is BulkAction.RUN_AGAIN else NON_TERMINAL_RUN_STATUSES
    wanted = set(chosen) or set(RunStatus)
    return tuple(status for status in RunStatus if status in applies and status in wanted)
