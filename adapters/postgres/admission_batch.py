"""The rows of the store's batch statements (:mod:`ql3.adapters.postgres.fenced`): one JSON document
per table, and the row counts each statement must report. A row leaves out its null columns:
``json_to_recordset`` gives NULL for a missing key as for a JSON null, and the documents of an
admission are less than half as long without them.

Nothing here needs SQLAlchemy: ``ql3 submit`` admits through the driver alone
(:mod:`ql3.adapters.postgres.submit`) with the same rows and the same checks as the store."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from psycopg.types.json import Json

from ql3.adapters.sql import rows
from ql3.domain.model import Run
from ql3.domain.states import CLAIMABLE_RUN_STATUSES
from ql3.domain.transitions import Change

# The documents without the blanks json.dumps puts after separators by default.
_compact = json.JSONEncoder(separators=(",", ":")).encode

# The documents of an admission (``add_many_sql``), one per table written, in that order.
ADDED = tuple(rows.ADMITTED_TABLES)


def queues_a_run(run: Run) -> bool:
    """Whether a write leaving ``run`` like this gives claims something to take."""
    return run.status in CLAIMABLE_RUN_STATUSES


class JsonRows:
    """The rows of a batch statement, one list per table, and the row counts it expects;
    :attr:`params` are the statement's parameters (one JSON document per table), each row
    without its null columns."""

    def __init__(self, names: Sequence[str]) -> None:
        self.rows: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        self.notify = False

    @property
    def expected(self) -> dict[str, int]:
        """The row count the statement must report for each table (``w_<name>``)."""
        return {f"w_{name}": len(items) for name, items in self.rows.items()}

    @property
    def params(self) -> dict[str, Any]:
        params: dict[str, Any] = {name: Json(items, _compact) for name, items in self.rows.items()}
        params["notify"] = self.notify
        return params

    def add(self, name: str, row: dict[str, Any]) -> None:
        self.rows[name].append({key: value for key, value in row.items() if value is not None})

    def all_written(self, result: Mapping[str, Any]) -> bool:
        """Whether the statement's counts (``w_<name>``) are the rows it was given."""
        return all(int(result[name]) == count for name, count in self.expected.items())


def add_many_statement(changes: Sequence[Change]) -> JsonRows:
    """The rows of ``add_many_sql`` for newly admitted Runs, in order."""
    batch = JsonRows(ADDED)
    add = batch.add
    for change in changes:
        for name, values in rows.admitted_rows(change):
            add(name, values)
    batch.notify = any(queues_a_run(change.run) for change in changes)
    return batch
