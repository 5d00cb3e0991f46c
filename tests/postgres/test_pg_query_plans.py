"""The candidate queries cost what the live work costs, not what the finished history costs.

A history of 100,000 succeeded Runs (each with a succeeded Attempt and a released lease) is loaded
with one ``INSERT ... SELECT generate_series`` per table beside a handful of live candidates. The
exact statements the store runs are EXPLAINed: none may scan ``runs``, ``run_attempts`` or
``run_dispatch_leases`` sequentially, each must stay below a fixed cost bound far under the cost
of reading the history, and each must cost about what it costs with no history at all.

The claim's two statements (``fenced.lock_session_sql`` and ``fenced.claim_sql``) and the batch of
writes (``fenced.apply_many_sql``) are EXPLAINed as the driver runs them, with their parameters; the
claim's candidates must come from the index of claimable Runs in queue order, not from a sort of
every queued Run. The batch's absolute cost is not bounded (each of its record sets is priced at
100 rows), only its growth with the history.
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

from ql3.adapters.postgres import fenced
from ql3.adapters.postgres.store import (
    PostgresStore,
    due_retries_query,
    lost_runs_query,
    orphaned_runs_query,
    recovery_candidates_query,
)
from ql3.domain.policy import RetryPolicy, Safety
from tests.postgres.pg_helpers import (
    admit_run,
    claim_attempt,
    close_session,
    dispatched,
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
    deep_claim: dict[str, Any]


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
}
# The claim's statements as the store sends them: SQL text and driver parameters.
_CLAIM_PARAMS = fenced.claim_params("s1", ["mail", "report"], 16, 0)
# A batch of writes (two Runs, their Attempts and leases) as the claim and completions send it:
# the rows are found through the keys' indexes, never by a scan hashed against the batch.
_BATCH = fenced.ApplyMany()
for _n in (5, 6):
    _BATCH.add("runs", {"id": f"hist-{_n}"})
    _BATCH.add("attempts", {"id": f"hist-{_n}-1"})
    _BATCH.add("leases", {"run_id": f"hist-{_n}", "generation": 1})
DRIVER_QUERIES: dict[str, tuple[str, dict[str, Any]]] = {
    "lock_session": (fenced.lock_session_sql(), _CLAIM_PARAMS),
    "claim": (fenced.claim_sql(), _CLAIM_PARAMS),
    "apply_many": (fenced.apply_many_sql(), _BATCH.params),
}
ALL_QUERIES = sorted([*QUERIES, *DRIVER_QUERIES])
# The planner prices each JSON record set of a batch at 100 rows, whatever the batch holds: the
# batch's absolute cost says nothing about the history, only its growth with it does.
BOUNDED_QUERIES = [name for name in ALL_QUERIES if name != "apply_many"]

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


DEEP_QUEUE = 5_000
# Every this many of the deep queue has priority 1, the others 0 (and a few -1): the claim still
# reads the first entries of the index.
DEEP_PRIORITY_EVERY = 1_000
# A deep queue of one task: pristine Attempts of queued Runs, queued one millisecond apart.
LOAD_DEEP_QUEUE = [
    f"""
    INSERT INTO runs (id, task, owner, status, has_policy, attempt_count, priority,
                      created_at, updated_at)
    SELECT 'deep-' || g, 'deep', 'runtime', 'queued', false, 1,
           CASE WHEN g % {DEEP_PRIORITY_EVERY} = 0 THEN 1 WHEN g % 7 = 0 THEN -1 ELSE 0 END,
           t, t
    FROM generate_series(1, {DEEP_QUEUE}) AS g,
         LATERAL (SELECT now() - interval '1 hour' + g * interval '1 millisecond' AS t) AS at
    """,
    f"""
    INSERT INTO run_attempts (id, run_id, number, status, created_at, updated_at)
    SELECT 'deep-' || g || '-1', 'deep-' || g, 1, 'claimed', t, t
    FROM generate_series(1, {DEEP_QUEUE}) AS g,
         LATERAL (SELECT now() - interval '1 hour' + g * interval '1 millisecond' AS t) AS at
    """,
    # The oldest of all, of the highest priority, handed back just now: first in the queue,
    # though its Run moved last.
    """
    INSERT INTO runs (id, task, owner, status, has_policy, attempt_count, priority,
                      created_at, updated_at)
    VALUES ('deep-0', 'deep', 'runtime', 'queued', false, 1, 2, now() - interval '2 hours',
            now())
    """,
    """
    INSERT INTO run_attempts (id, run_id, number, status, created_at, updated_at)
    VALUES ('deep-0-1', 'deep-0', 1, 'claimed', now() - interval '2 hours', now())
    """,
]


def _live_candidates(store: PostgresStore) -> None:
    """A few Runs of every kind a source looks for."""
    policy = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)
    gone = open_session(store, "s0", "w0", tasks=("mail", "report"))
    session = open_session(store, "s1", "w1", tasks=("mail", "report"))
    dispatched(store, "expired-gone", "expired-gone-1", gone, ttl_ms=1_000)
    dispatched(store, "expired-started", "expired-started-1", session, ttl_ms=1_000)
    dispatched(store, "live", "live-1", session, ttl_ms=3_600_000)
    admit_run(store, "retry", "retry-1", policy=policy)
    claim_attempt(store, "retry-1", gone, 1_000)
    dispatched(store, "lost", "lost-1", gone, ttl_ms=1_000)
    close_session(store, "s0")
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
        for name, (sql, params) in DRIVER_QUERIES.items():
            document = connection.exec_driver_sql("EXPLAIN (FORMAT JSON) " + sql, params)
            plans[name] = document.scalar_one()[0]["Plan"]
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
        with store.unit_of_work() as uow:
            claim = uow.runs.lock_for_claim("s1", ["report", "mail"], 2)
        pages = {
            "recovery_candidates": store.recovery_candidates(16),
            "lost_runs": store.lost_runs(16),
            "due_retries": store.due_retries(16),
            "orphaned_runs": store.orphaned_runs(2),
            "claim": claim,
        }
        with engine.begin() as connection:
            for statement in LOAD_DEEP_QUEUE:
                connection.execute(text(statement))
        with engine.begin() as connection:
            _analyze(connection)
        with engine.connect() as connection:
            params = fenced.claim_params("s1", ["deep", "mail"], 16, 0)
            explain = "EXPLAIN (FORMAT JSON) " + fenced.claim_sql()
            deep_claim = connection.exec_driver_sql(explain, params).scalar_one()[0]["Plan"]
        with store.unit_of_work() as uow:
            pages["deep_claim"] = uow.runs.lock_for_claim("s1", ["deep"], 3)
        yield Plans(
            empty=empty,
            small=small,
            loaded=loaded,
            full_scan=full_scan,
            pages=pages,
            deep_claim=deep_claim,
        )
    finally:
        store.testing_reset()
        store.close()
        engine.dispose()


def test_the_history_is_really_there(plans: Plans) -> None:
    assert plans.full_scan > 10 * COST_BOUND


@pytest.mark.parametrize("name", ALL_QUERIES)
def test_no_sequential_scan_of_the_history(plans: Plans, name: str) -> None:
    assert _seq_scans(plans.small[name]) == set()
    assert _seq_scans(plans.loaded[name]) == set()


@pytest.mark.parametrize("name", ALL_QUERIES)
def test_cost_does_not_grow_with_the_history(plans: Plans, name: str) -> None:
    # Ten times the history, (about) the same cost: nothing reads the finished rows.
    cost = float(plans.loaded[name]["Total Cost"])
    assert cost <= float(plans.small[name]["Total Cost"]) * GROWTH_BOUND


@pytest.mark.parametrize("name", BOUNDED_QUERIES)
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


def test_the_sources_find_the_live_candidates_among_the_history(plans: Plans) -> None:
    pages = plans.pages
    candidates = pages["recovery_candidates"]
    assert [c.attempt_id for c in candidates.items] == ["expired-gone-1", "expired-started-1"]
    assert [c.resolvable for c in candidates.items] == [True, False]
    assert [c.run_id for c in pages["lost_runs"].items] == ["lost"]
    assert [(c.run_id, c.attempt_id) for c in pages["due_retries"].items] == [("retry", "retry-1")]
    assert [c.run_id for c in pages["orphaned_runs"].items] == ["orphan-0", "orphan-1"]
    assert pages["orphaned_runs"].has_more
    claim = pages["claim"]
    assert claim.gate.open and claim.capacity is not None
    assert (claim.capacity.session.id, claim.capacity.in_flight) == ("s1", 2)
    assert [c.run.id for c in claim.candidates] == ["queued-0", "queued-1", "report-0", "report-1"]
    # Leased: expired-gone (s0, not recovered here), expired-started and live (s1).
    assert claim.in_flight_by_task == {"mail": 3}


def _index_scans(plan: dict[str, Any]) -> set[str]:
    return {
        node["Index Name"]
        for node in _nodes(plan)
        if node["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Index Scan")
    }


def plan_rows(node: dict[str, Any]) -> int:
    return int(node["Plan Rows"])


def test_the_claim_reads_a_deep_queue_from_its_index_in_queue_order(plans: Plans) -> None:
    plan = plans.deep_claim
    assert "ix_runs_claimable" in _index_scans(plan)
    assert _seq_scans(plan) == set()
    # The candidates never changed come out of the index in claim order (priority, then age),
    # so the row locks take the first few and stop: no sort of the queue below them. The
    # handed-back ones (few at any time) are read from their own index and sorted.
    limits = [
        node
        for node in _nodes(plan)
        if node["Node Type"] == "Limit"
        and any(child["Node Type"] == "LockRows" for child in node.get("Plans", ()))
    ]
    # Two parts, each under its limit: never-changed Attempts and handed-back ones.
    assert len(limits) == 2, "the candidates are locked under their limits"
    read: set[str] = set()
    for limit in limits:
        (lock,) = [child for child in limit["Plans"] if child["Node Type"] == "LockRows"]
        sorts = [n for n in _nodes(lock) if n["Node Type"] in ("Sort", "Incremental Sort")]
        indexes = _index_scans(lock)
        read |= indexes
        if "ix_run_attempts_handed_back" not in indexes:
            assert not sorts
        if "ix_runs_claimable" in indexes:
            # Reading the first 16 costs a small part of locking the whole queue (which the
            # LockRows node prices): the scan stops at the limit.
            print(
                f"claim with a queue of {DEEP_QUEUE}: {limit['Total Cost']:.2f} for the first"
                f" {plan_rows(limit)}, {lock['Total Cost']:.2f} for the whole queue"
            )
            assert float(limit["Total Cost"]) * 20 < float(lock["Total Cost"])
    assert {"ix_runs_claimable", "ix_run_attempts_handed_back"} <= read
    deep = plans.pages["deep_claim"]
    # Priority 2 (handed back), then priority 1 oldest first.
    assert [c.run.id for c in deep.candidates] == ["deep-0", "deep-1000", "deep-2000"]
