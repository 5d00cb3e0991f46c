"""The candidate queries cost what the live work costs, not what the finished history costs.

A history of 100,000 succeeded Runs (each with a succeeded Attempt and a released lease) is loaded
with one ``INSERT ... SELECT generate_series`` per table beside a handful of live candidates. The
exact statements the store runs are EXPLAINed: none may scan ``runs``, ``run_attempts`` or
``run_dispatch_leases`` sequentially, each must stay below a fixed cost bound far under the cost
of reading the history, and each must cost about what it costs with no history at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.pool import NullPool
from sqlalchemy.sql import ClauseElement, Executable
from sqlalchemy.sql.compiler import SQLCompiler

from adapters.postgres.store import (
    PostgresStore,
    due_retries_query,
    lost_runs_query,
    orphaned_runs_query,
    queued_attempts_query,
    recovery_candidates_query,
)
from domain.policy import RetryPolicy, Safety
from tests.postgres.pg_helpers import (
    accept_offer,
    admit_run,
    dispatched,
    offer,
    open_session,
    recover,
    settle,
)

HISTORY = 100_000
SMALL_HISTORY = 10_000
HISTORY_TABLES = frozenset({"runs", "run_attempts", "run_dispatch_leases"})
# A sequential read of the history costs thousands (pages + rows * cpu_tuple_cost); the live
# candidates cost a few dozen at most.
COST_BOUND = 200.0
# How much dearer a plan may get when the history arrives (deeper B-trees, larger estimates).
COST_RATIO_BOUND = 3.0
# From 10,000 to 100,000 finished runs: a plan that read the history would cost ~10 times more.
GROWTH_BOUND = 1.5

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Plans:
    """The plans without history, with a small and with the full history, and the cost of a
    sequential read of ``runs`` with the full history."""

    empty: dict[str, dict[str, Any]]
    small: dict[str, dict[str, Any]]
    loaded: dict[str, dict[str, Any]]
    full_scan: float
    pages: dict[str, Any]


class Explain(Executable, ClauseElement):
    """``EXPLAIN (FORMAT JSON) <statement>``, with the statement's own bound parameters."""

    inherit_cache = False

    def __init__(self, statement: ClauseElement) -> None:
        self.statement = statement


@compiles(Explain, "postgresql")
def _compile_explain(element: Explain, compiler: SQLCompiler, **kw: Any) -> str:
    return "EXPLAIN (FORMAT JSON) " + compiler.process(element.statement, **kw)


QUERIES: dict[str, Callable[[], Any]] = {
    "recovery_candidates": lambda: recovery_candidates_query(16),
    "lost_runs": lambda: lost_runs_query(16),
    "due_retries": lambda: due_retries_query(16, clock_offset_ms=3_600_000),
    "orphaned_runs": lambda: orphaned_runs_query(16),
    "queued_attempts": lambda: queued_attempts_query(16, ["mail", "report"]),
}

LOAD_HISTORY = [
    """
    INSERT INTO runs (id, task, owner, status, input, output, has_policy, attempt_count,
                      created_at, updated_at)
    SELECT 'hist-' || g, 'mail', 'runtime', 'succeeded', '{{}}'::jsonb, '{{}}'::jsonb, false, 1,
           now() - interval '30 days' + g * interval '1 second',
           now() - interval '30 days' + g * interval '1 second' + interval '5 seconds'
    FROM generate_series({first}, {last}) AS g
    """,
    """
    INSERT INTO run_attempts (id, run_id, number, status, session_id, worker_id,
                              lease_generation, lease_version, offered_at, accepted_at,
                              started_at, finished_at, created_at, updated_at)
    SELECT 'hist-' || g || '-1', 'hist-' || g, 1, 'succeeded', 'old-session', 'old-worker', 1, 2,
           t, t, t, t + interval '5 seconds', t, t + interval '5 seconds'
    FROM generate_series({first}, {last}) AS g,
         LATERAL (SELECT now() - interval '30 days' + g * interval '1 second' AS t) AS at
    """,
    """
    INSERT INTO run_dispatch_leases (run_id, generation, attempt_id, version, status,
                                     holder_session_id, token_hash, expires_at, granted_at,
                                     release_reason, released_at)
    SELECT 'hist-' || g, 1, 'hist-' || g || '-1', 2, 'released', 'old-session', md5(g::text),
           t + interval '30 seconds', t, 'completed', t + interval '5 seconds'
    FROM generate_series({first}, {last}) AS g,
         LATERAL (SELECT now() - interval '30 days' + g * interval '1 second' AS t) AS at
    """,
]


def _live_candidates(store: PostgresStore) -> None:
    """A few Runs of every kind a source looks for."""
    policy = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)
    session = open_session(store, "s1", "w1", tasks=("mail", "report"))
    dispatched(store, "expired-claimed", "expired-claimed-1", session, ttl_ms=1_000)
    dispatched(store, "expired-started", "expired-started-1", session, ttl_ms=1_000, started=True)
    dispatched(store, "live", "live-1", session, ttl_ms=3_600_000, started=True)
    admit_run(store, "retry", "retry-1", policy=policy)
    offer(store, "retry-1", session, 1_000)
    accept_offer(store, "retry-1", session, 1_000)
    dispatched(store, "lost", "lost-1", session, ttl_ms=1_000)
    store.testing_advance_clock(5_000)
    assert recover(store, "retry-1") and recover(store, "lost-1")
    settle(store, "retry")
    for n in range(3):
        admit_run(store, f"queued-{n}", f"queued-{n}-1", task="mail")
        admit_run(store, f"report-{n}", f"report-{n}-1", task="report")
        admit_run(store, f"orphan-{n}")


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


def _explain(engine: Engine, *, index_paths_only: bool = False) -> dict[str, dict[str, Any]]:
    plans: dict[str, dict[str, Any]] = {}
    with engine.connect() as connection:
        if index_paths_only:
            # On tiny tables a sequential scan is costed at about one page; forcing the index
            # paths makes the empty-history plan the same plan as the one with history.
            connection.execute(text("SET enable_seqscan = off"))
        for name, query in QUERIES.items():
            document = connection.execute(Explain(query())).scalar_one()
            plans[name] = document[0]["Plan"]
    return plans


def _analyze(connection: Connection) -> None:
    # A sample as large as the tables: exact statistics, so the estimates (and these tests) do
    # not depend on which rows ANALYZE happened to sample.
    connection.execute(text("SET LOCAL default_statistics_target = 1000"))
    connection.execute(text("ANALYZE"))


def _load_history(engine: Engine, first: int, last: int) -> None:
    with engine.begin() as connection:
        for statement in LOAD_HISTORY:
            connection.execute(text(statement.format(first=first, last=last)))
    with engine.begin() as connection:
        _analyze(connection)


def _seq_scans(plan: dict[str, Any]) -> set[str]:
    return {
        node["Relation Name"]
        for node in _nodes(plan)
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in HISTORY_TABLES
    }


@pytest.fixture(scope="module")
def plans(pg_database_url: str) -> Iterator[Plans]:
    store = PostgresStore.from_url(pg_database_url)
    engine = create_engine(pg_database_url, poolclass=NullPool)
    try:
        store.testing_reset()
        _live_candidates(store)
        with engine.begin() as connection:
            _analyze(connection)
        empty = _explain(engine, index_paths_only=True)
        _load_history(engine, 1, SMALL_HISTORY)
        small = _explain(engine)
        _load_history(engine, SMALL_HISTORY + 1, HISTORY)
        loaded = _explain(engine)
        with engine.connect() as connection:
            document = connection.execute(
                text("EXPLAIN (FORMAT JSON) SELECT * FROM runs")
            ).scalar_one()
        full_scan = float(document[0]["Plan"]["Total Cost"])
        store.testing_advance_clock(60_000)  # past the retry's backoff, well before "live" expires
        pages = {
            "recovery_candidates": store.recovery_candidates(16),
            "lost_runs": store.lost_runs(16),
            "due_retries": store.due_retries(16),
            "orphaned_runs": store.orphaned_runs(2),
            "queued_attempts": store.queued_attempts(2, ["mail", "report"]),
        }
        yield Plans(empty=empty, small=small, loaded=loaded, full_scan=full_scan, pages=pages)
    finally:
        store.testing_reset()
        store.close()
        engine.dispose()


def test_the_history_is_really_there(plans: Plans) -> None:
    assert plans.full_scan > 10 * COST_BOUND


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_no_sequential_scan_of_the_history(plans: Plans, name: str) -> None:
    assert _seq_scans(plans.small[name]) == set()
    assert _seq_scans(plans.loaded[name]) == set()


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_cost_stays_bounded_with_history(plans: Plans, name: str) -> None:
    cost = float(plans.loaded[name]["Total Cost"])
    small = float(plans.small[name]["Total Cost"])
    empty = float(plans.empty[name]["Total Cost"])
    print(
        f"{name}: cost {empty:.2f} with no history, {small:.2f} with {SMALL_HISTORY},"
        f" {cost:.2f} with {HISTORY} finished runs;"
        f" a sequential read of runs costs {plans.full_scan:.2f}"
    )
    assert cost < COST_BOUND
    assert cost < plans.full_scan / 10
    assert cost <= max(empty, 1.0) * COST_RATIO_BOUND
    # Ten times the history, (about) the same cost: nothing reads the finished rows.
    assert cost <= small * GROWTH_BOUND


def test_the_sources_find_the_live_candidates_among_the_history(plans: Plans) -> None:
    pages = plans.pages
    candidates = pages["recovery_candidates"]
    assert [c.attempt_id for c in candidates.items] == ["expired-claimed-1", "expired-started-1"]
    assert [c.resolvable for c in candidates.items] == [True, False]
    assert [c.run_id for c in pages["lost_runs"].items] == ["lost"]
    assert [(c.run_id, c.attempt_id) for c in pages["due_retries"].items] == [("retry", "retry-1")]
    assert [c.run_id for c in pages["orphaned_runs"].items] == ["orphan-0", "orphan-1"]
    assert pages["orphaned_runs"].has_more
    queued = pages["queued_attempts"]
    assert [q.run_id for q in queued.items] == ["queued-0", "report-0", "queued-1", "report-1"]
    assert queued.has_more
