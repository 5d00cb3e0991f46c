"""Finished history on the shared SQL tables (ADR 0016): a prune's pick, its counts and its
deletes, for both SQL stores.

The pick mirrors :func:`ql3.domain.history.is_prunable`. Its filter on ``runs`` is the very
predicate of ``ix_runs_finished`` (:data:`ql3.adapters.sql.schema.PRUNABLE_RUN`), so that
PostgreSQL's generic plans and SQLite both read that partial index from the cutoff's oldest end and
stop after ``limit`` rows; PostgreSQL locks the rows it returns with ``FOR UPDATE OF runs SKIP
LOCKED``: a Run another transaction holds is passed over, never waited for, and no Run that is not
finished is ever locked. The deletes name tables and key columns only, never a column list, so
columns added to any table leave them as they are; they run children first, as the foreign keys
need.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Delete,
    Select,
    Table,
    and_,
    delete,
    exists,
    func,
    literal,
    not_,
    or_,
    select,
    text,
    tuple_,
    type_coerce,
)

from ql3.adapters.sql.schema import (
    PRUNABLE_RUN,
    EpochMillis,
    attempt_stop_reports,
    dispatch_gate,
    run_attempts,
    run_dispatch_leases,
    run_events,
    runs,
    trigger_firings,
    workflow_steps,
)
from ql3.adapters.sql.statements import Spelling
from ql3.adapters.sql.transaction import SqlTransaction
from ql3.application.ports import PrunableRun, PrunedRows, PruneMark
from ql3.domain.history import PRUNABLE_RUN_STATUSES, SETTLED_STEP_STATUSES


def prunable_query(
    finished_before_ms: int,
    limit: int,
    after: PruneMark | None,
    spelling: Spelling,
    *,
    skip_locked: bool,
) -> Select:
    """Top-level finished Runs a prune with this cutoff deletes, by ``(updated_at, id)`` after
    ``after``, at most ``limit``; ``skip_locked``: locked ``FOR UPDATE OF runs SKIP LOCKED``."""
    r = runs.c
    cutoff = literal(finished_before_ms, EpochMillis())
    step = workflow_steps.alias("step")
    step_run = runs.alias("step_run")
    # A step of this workflow that is not history yet: unsettled, changed since the cutoff, or
    # its Run not finished or changed since.
    live_step = exists(
        select(step.c.step_id)
        .select_from(step.outerjoin(step_run, step_run.c.id == step.c.run_id))
        .where(
            step.c.workflow_run_id == r.id,
            or_(
                not_(spelling.one_of(step.c.status, SETTLED_STEP_STATUSES)),
                step.c.updated_at >= cutoff,
                and_(
                    step.c.run_id.is_not(None),
                    or_(
                        step_run.c.id.is_(None),
                        not_(spelling.one_of(step_run.c.status, PRUNABLE_RUN_STATUSES)),
                        step_run.c.updated_at >= cutoff,
                    ),
                ),
            ),
        )
    )
    own_step = workflow_steps.alias("own_step")
    is_step = exists(select(own_step.c.step_id).where(own_step.c.run_id == r.id))
    failing = exists(select(dispatch_gate.c.id).where(dispatch_gate.c.failed_run_id == r.id))
    where: list[ColumnElement[bool]] = [
        type_coerce(text(PRUNABLE_RUN), Boolean()),
        r.updated_at < cutoff,
        not_(is_step),
        not_(failing),
        not_(live_step),
    ]
    if after is not None:
        where.append(
            tuple_(r.updated_at, spelling.by_id(r.id))
            > tuple_(literal(after.finished_at_ms, EpochMillis()), literal(after.run_id))
        )
    statement = (
        select(r.id, r.updated_at)
        .where(*where)
        .order_by(r.updated_at, spelling.by_id(r.id))
        .limit(limit)
    )
    if skip_locked:
        statement = statement.with_for_update(of=runs, skip_locked=True)
    return statement


def step_runs_of(workflow_run_ids: Sequence[str]) -> Select:
    s = workflow_steps.c
    return select(s.workflow_run_id, s.run_id).where(
        s.workflow_run_id.in_(list(workflow_run_ids)), s.run_id.is_not(None)
    )


def _targets(
    picked: Sequence[PrunableRun],
) -> list[tuple[str, Table, ColumnElement[bool]]]:
    """Each table a prune deletes from, children first, with the condition of its rows."""
    roots = [p.run_id for p in picked]
    ids = roots + [step for p in picked for step in p.step_run_ids]
    attempts_of = select(run_attempts.c.id).where(run_attempts.c.run_id.in_(ids))
    return [
        (
            "stop_reports",
            attempt_stop_reports,
            attempt_stop_reports.c.attempt_id.in_(attempts_of),
        ),
        ("events", run_events, run_events.c.run_id.in_(ids)),
        ("leases", run_dispatch_leases, run_dispatch_leases.c.run_id.in_(ids)),
        ("attempts", run_attempts, run_attempts.c.run_id.in_(ids)),
        ("trigger_firings", trigger_firings, trigger_firings.c.run_id.in_(ids)),
        ("workflow_steps", workflow_steps, workflow_steps.c.workflow_run_id.in_(roots)),
        ("runs", runs, runs.c.id.in_(ids)),
    ]


def delete_statements(picked: Sequence[PrunableRun]) -> list[tuple[str, Delete]]:
    return [(name, delete(table).where(where)) for name, table, where in _targets(picked)]


def count_statements(picked: Sequence[PrunableRun]) -> list[tuple[str, Select]]:
    return [
        (name, select(func.count()).select_from(table).where(where))
        for name, table, where in _targets(picked)
    ]


class SqlHistoryRepository:
    """:class:`ql3.application.ports.HistoryRepository` on any :class:`SqlTransaction`."""

    def __init__(self, tx: SqlTransaction, spelling: Spelling, *, skip_locked: bool) -> None:
        self._tx = tx
        self._spelling = spelling
        self._skip_locked = skip_locked

    def prunable(
        self, finished_before_ms: int, limit: int, after: PruneMark | None = None
    ) -> Sequence[PrunableRun]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        statement = prunable_query(
            finished_before_ms, limit, after, self._spelling, skip_locked=self._skip_locked
        )
        found = [(str(row[0]), int(row[1])) for row in self._tx.execute(statement)]
        if not found:
            return ()
        steps: dict[str, list[str]] = {}
        for workflow_run_id, run_id in self._tx.execute(step_runs_of([i for i, _ in found])):
            steps.setdefault(str(workflow_run_id), []).append(str(run_id))
        return tuple(
            PrunableRun(
                run_id=run_id,
                finished_at_ms=at,
                step_run_ids=tuple(sorted(steps.get(run_id, ()))),
            )
            for run_id, at in found
        )

    def count(self, picked: Sequence[PrunableRun]) -> PrunedRows:
        if not picked:
            return PrunedRows()
        counts = {
            name: int(self._tx.execute(statement).scalar_one())
            for name, statement in count_statements(picked)
        }
        return PrunedRows(**counts)

    def delete(self, picked: Sequence[PrunableRun]) -> PrunedRows:
        if not picked:
            return PrunedRows()
        counts = {
            name: self._tx.write(statement, f"{name} of {len(picked)} pruned runs")
            for name, statement in delete_statements(picked)
        }
        return PrunedRows(**counts)
