"""The operations view of both SQL stores (ADR 0010): what ``ql3 status``, ``ql3 doctor`` and
the metrics read on demand, never on the cadence.

Each statement walks a partial index of live rows (queued Runs, active Attempts, open sessions,
quarantined Runs) or the dispatch gate's one row, so that its cost follows the live work and not
the finished history; a test EXPLAINs them beside 100,000 finished Runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import (
    ColumnElement,
    Insert,
    Select,
    Update,
    and_,
    func,
    insert,
    not_,
    select,
    update,
)

from ql3.adapters.sql import rows, statements
from ql3.adapters.sql.schema import (
    run_attempts,
    run_dispatch_leases,
    runs,
    scheduler_nodes,
    worker_sessions,
)
from ql3.adapters.sql.statements import Spelling
from ql3.application.ports import (
    EvidenceWaits,
    NodeCycle,
    OperationsView,
    QueueDepth,
    SessionCapacity,
)
from ql3.domain.model import LeaseStatus
from ql3.domain.states import (
    CLAIMABLE_RUN_STATUSES,
    NON_TERMINAL_RUN_STATUSES,
    OPEN_SESSION_STATUSES,
    STARTED_ATTEMPT_STATUSES,
)

Execute = Callable[[Select], Sequence[rows.Row]]


def queue_depths(spelling: Spelling) -> Select:
    """Per task, the ``queued`` Runs and the oldest queue time (``ix_runs_claimable``)."""
    r = runs.c
    return (
        select(r.task, func.count().label("queued"), func.min(r.updated_at).label("oldest"))
        .where(spelling.one_of(r.status, CLAIMABLE_RUN_STATUSES))
        .group_by(r.task)
        .order_by(r.task)
    )


def evidence_waits(now: ColumnElement[int] | int, spelling: Spelling) -> Select:
    """Started recovery candidates without not-running evidence: how many, the earliest lease
    expiry (the Attempt's last change when it has no lease)."""
    a = run_attempts.c
    l = run_dispatch_leases.c  # noqa: E741
    source = statements.recovery_source(now, spelling)
    return (
        select(
            func.count().label("waiting"),
            func.min(func.coalesce(l.expires_at, a.updated_at)).label("oldest"),
        )
        .select_from(source.tables)
        .where(
            *source.where,
            spelling.one_of(a.status, STARTED_ATTEMPT_STATUSES),
            not_(source.resolvable),
        )
    )


def open_sessions(spelling: Spelling) -> Select:
    """Active and draining sessions with the number of leases each holds."""
    s = worker_sessions.c
    l = run_dispatch_leases.c  # noqa: E741
    held = (
        select(func.count())
        .where(l.holder_session_id == s.id, spelling.is_(l.status, LeaseStatus.LEASED))
        .correlate(worker_sessions)
        .scalar_subquery()
    )
    return (
        select(worker_sessions, held.label("in_flight"))
        .where(spelling.one_of(s.status, OPEN_SESSION_STATUSES))
        .order_by(spelling.by_id(s.worker_id))
    )


def _quarantined(spelling: Spelling) -> ColumnElement[bool]:
    return and_(
        runs.c.quarantined_at.is_not(None),
        spelling.one_of(runs.c.status, NON_TERMINAL_RUN_STATUSES),
    )


def quarantined_runs(limit: int, spelling: Spelling) -> Select:
    """Quarantined Runs that are not finished, oldest quarantine first (``ix_runs_quarantined``)."""
    return (
        select(runs)
        .where(_quarantined(spelling))
        .order_by(runs.c.quarantined_at, spelling.by_id(runs.c.id))
        .limit(limit)
    )


def quarantined_count(spelling: Spelling) -> Select:
    return select(func.count()).select_from(runs).where(_quarantined(spelling))


def latest_nodes(limit: int) -> Select:
    """The nodes by their last cycle, latest first (a handful of rows, one per node id)."""
    n = scheduler_nodes.c
    return select(scheduler_nodes).order_by(n.last_cycle_at.desc(), n.id).limit(limit)


def _node_values(cycle: NodeCycle, now: ColumnElement[int] | int) -> dict[str, object]:
    return {
        "last_cycle_at": now,
        "last_ok": cycle.ok,
        "aborted_at": cycle.aborted_at,
        "cycles": cycle.cycles,
        "anonymous_workers": cycle.anonymous_workers,
    }


def update_node(cycle: NodeCycle, now: ColumnElement[int] | int) -> Update:
    return (
        update(scheduler_nodes)
        .where(scheduler_nodes.c.id == cycle.node_id)
        .values(_node_values(cycle, now))
    )


def insert_node(cycle: NodeCycle, now: ColumnElement[int] | int) -> Insert:
    return insert(scheduler_nodes).values(
        id=cycle.node_id, started_at=now, **_node_values(cycle, now)
    )


def node_from_row(row: rows.Row) -> NodeCycle:
    return NodeCycle(
        node_id=row["id"],
        ok=bool(row["last_ok"]),
        aborted_at=row["aborted_at"],
        cycles=int(row["cycles"]),
        started_at_ms=int(row["started_at"]),
        last_cycle_at_ms=int(row["last_cycle_at"]),
        anonymous_workers=bool(row["anonymous_workers"]),
    )


def operations_view(
    execute: Execute,
    *,
    now: ColumnElement[int] | int,
    observed_at_ms: int,
    limit: int,
    spelling: Spelling,
) -> OperationsView:
    """Run every statement of the view through ``execute`` (one read transaction)."""
    gate = statements.gate_from_row(next(iter(execute(statements.get_gate())), None))
    queues = tuple(
        QueueDepth(task=row["task"], queued=int(row["queued"]), oldest_ms=int(row["oldest"]))
        for row in execute(queue_depths(spelling))
    )
    (waits,) = execute(evidence_waits(now, spelling))
    sessions = tuple(
        SessionCapacity(session=rows.session_from_row(row), in_flight=int(row["in_flight"]))
        for row in execute(open_sessions(spelling))
    )
    quarantined = tuple(
        rows.run_from_row(row) for row in execute(quarantined_runs(limit, spelling))
    )
    (count,) = execute(quarantined_count(spelling))
    nodes = tuple(node_from_row(row) for row in execute(latest_nodes(limit)))
    return OperationsView(
        observed_at_ms=observed_at_ms,
        gate=gate,
        queues=queues,
        evidence=EvidenceWaits(
            count=int(waits["waiting"]),
            oldest_ms=None if waits["oldest"] is None else int(waits["oldest"]),
        ),
        sessions=sessions,
        quarantined=quarantined,
        quarantined_count=int(next(iter(count.values()))),
        nodes=nodes,
    )
