"""The trigger schedule's and the workflow frontier's candidate queries cost what the live work
costs, not what the finished history costs: with 10,000 finished workflows (30,000 finished
steps) and 10,000 deleted triggers, neither reads a table sequentially."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.pool import NullPool
from sqlalchemy.sql import ClauseElement, Executable
from sqlalchemy.sql.compiler import SQLCompiler

from ql3.adapters.postgres.queries import due_triggers_statement, workflow_candidates_statement
from ql3.adapters.postgres.store import PostgresStore
from ql3.application.triggers import TriggerDefinition
from tests.scheduling_support import runtime

HISTORY = 10_000
HISTORY_TABLES = frozenset({"runs", "workflow_steps", "triggers", "trigger_firings"})
COST_BOUND = 300.0

pytestmark = pytest.mark.slow

LOAD_HISTORY = [
    """
    INSERT INTO runs (id, task, owner, status, input, output, has_policy, attempt_count,
                      created_at, updated_at)
    SELECT 'wf-' || g, 'etl', 'workflow', 'succeeded', NULL, '{}'::jsonb, false, 0,
           now() - interval '30 days', now() - interval '29 days'
    FROM generate_series(1, :n) AS g
    """,
    """
    INSERT INTO runs (id, task, owner, status, input, output, has_policy, attempt_count,
                      parent_run_id, created_at, updated_at)
    SELECT 'wf-' || g || '-' || k, 't', 'runtime', 'succeeded', NULL, '{}'::jsonb, false, 1,
           'wf-' || g, now() - interval '30 days', now() - interval '29 days'
    FROM generate_series(1, :n) AS g, generate_series(1, 3) AS k
    """,
    """
    INSERT INTO workflow_steps (workflow_run_id, step_id, position, task, input, after_steps,
                                policy, status, run_id, updated_at)
    SELECT 'wf-' || g, 's' || k, k, 't', NULL, '[]'::jsonb, NULL, 'succeeded',
           'wf-' || g || '-' || k, now() - interval '29 days'
    FROM generate_series(1, :n) AS g, generate_series(1, 3) AS k
    """,
    """
    INSERT INTO triggers (id, name, task, every_ms, catch_up, catch_up_limit, status,
                          next_fire_at, version, created_at, updated_at)
    SELECT 'old-' || g, 'old-' || g, 't', 60000, 'skip', 10, 'deleted',
           now() - interval '29 days', 2, now() - interval '30 days', now() - interval '29 days'
    FROM generate_series(1, :n) AS g
    """,
]


class Explain(Executable, ClauseElement):
    """``EXPLAIN (FORMAT JSON) <statement>``, with the statement's own bound parameters."""

    inherit_cache = False

    def __init__(self, statement: ClauseElement) -> None:
        self.statement = statement


@compiles(Explain, "postgresql")
def _compile_explain(element: Explain, compiler: SQLCompiler, **kw: Any) -> str:
    return "EXPLAIN (FORMAT JSON) " + compiler.process(element.statement, **kw)


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


@pytest.fixture(scope="module")
def engine(pg_database_url: str) -> Iterator[Engine]:
    store = PostgresStore.from_url(pg_database_url)
    engine = create_engine(pg_database_url, poolclass=NullPool)
    try:
        store.testing_reset()
        rt = runtime(store, store.testing_advance_clock)
        for n in range(3):  # live work: workflows not started, running, and due triggers
            rt.workflows.submit({"name": f"live{n}", "steps": [{"id": "a", "task": "t"}]})
            rt.triggers.add(TriggerDefinition(name=f"live{n}", task="t", every_ms=60_000))
        rt.cycle()
        rt.workflows.submit({"name": "waiting", "steps": [{"id": "a", "task": "t"}]})
        with engine.begin() as connection:
            for statement in LOAD_HISTORY:
                connection.execute(text(statement), {"n": HISTORY})
        with engine.begin() as connection:
            connection.execute(text("SET LOCAL default_statistics_target = 1000"))
            connection.execute(text("ANALYZE"))
        yield engine
    finally:
        store.close()
        engine.dispose()


@pytest.mark.parametrize(
    "statement",
    [
        pytest.param(lambda: due_triggers_statement(16, clock_offset_ms=120_000), id="triggers"),
        pytest.param(lambda: workflow_candidates_statement(16), id="workflows"),
    ],
)
def test_candidate_queries_read_no_history(engine: Engine, statement: Any) -> None:
    with engine.connect() as connection:
        plan = connection.execute(Explain(statement())).scalar_one()[0]["Plan"]
        rows = connection.execute(statement()).mappings().all()
    scans = {
        node["Relation Name"]
        for node in _nodes(plan)
        if node["Node Type"] == "Seq Scan" and node.get("Relation Name") in HISTORY_TABLES
    }
    assert scans == set(), plan
    assert plan["Total Cost"] < COST_BOUND, plan
    assert 1 <= len([r for r in rows if any(v is not None for k, v in r.items()
                                             if k != "observed_at")]) <= 4
