"""The console's statements walk indexes beside a large history (ADR 0020).

A few live Runs of every kind, then 1,000,000 finished Runs (admitted over the days before
the last one, as a long history is), ANALYZEd: every statement a console page sends is
EXPLAINed, none may read ``runs`` sequentially (the table that holds the history here), and
each stays under a cost bound far below what reading the history costs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from ql3.adapters.postgres import browse as pg
from ql3.adapters.postgres.queries import POSTGRES
from ql3.adapters.postgres.store import PostgresStore
from ql3.adapters.sql import browse
from ql3.application.console import COUNT_CAP, RunCursor, RunFilter, RunOrder
from ql3.domain.model import RunStatus
from tests.postgres import test_pg_query_plans as plans_of

pytestmark = pytest.mark.slow

FINISHED = 1_000_000
# A sequential read of a million Runs costs tens of thousands; a capped count reads at most
# COUNT_CAP index entries.
COST_BOUND = 3_000.0
DAY_MS = 86_400_000

HISTORY = f"""
INSERT INTO runs (id, task, owner, status, input, output, has_policy, attempt_count,
                  created_at, updated_at)
SELECT 'hist-' || g, 'mail', 'runtime', 'succeeded', jsonb_build_object('n', g), '{{}}'::jsonb,
       false, 1, now() - interval '40 days' + g * interval '2 seconds',
       now() - interval '40 days' + g * interval '2 seconds' + interval '5 seconds'
FROM generate_series(1, {FINISHED}) AS g
"""


def _statements(now_ms: int) -> dict[str, Callable[[], Any]]:
    def listed(where: RunFilter, order: RunOrder = RunOrder.NEWEST, after: Any = None) -> Any:
        return browse.browse_statement(where, order, after, 50, POSTGRES, pg.contains)

    cursor = RunCursor(created_at_ms=now_ms - 20 * DAY_MS, run_id="hist-500000")
    return {
        "runs_newest": lambda: listed(RunFilter()),
        "runs_oldest_next_page": lambda: listed(RunFilter(), RunOrder.OLDEST, cursor),
        "runs_succeeded": lambda: listed(RunFilter(statuses=(RunStatus.SUCCEEDED,))),
        "runs_succeeded_next_page": lambda: listed(
            RunFilter(statuses=(RunStatus.SUCCEEDED,)), RunOrder.NEWEST, cursor
        ),
        "runs_failed": lambda: listed(RunFilter(statuses=(RunStatus.FAILED,))),
        "runs_by_id": lambda: listed(RunFilter(run_id="hist-7")),
        "runs_workflows": lambda: listed(RunFilter(workflows=True)),
        "status_counts": lambda: browse.status_counts_statement(COUNT_CAP, POSTGRES, pg.contains),
        "count_failed": lambda: browse.capped_count_statement(
            RunFilter(statuses=(RunStatus.FAILED,)), COUNT_CAP, POSTGRES, pg.contains
        ),
        "finished_last_hour": lambda: browse.finished_buckets_statement(
            now_ms - 3_600_000, 60_000, POSTGRES, pg.millis
        ),
        "finished_last_day": lambda: browse.finished_buckets_statement(
            now_ms - DAY_MS, 3_600_000, POSTGRES, pg.millis
        ),
        "task_counts_last_hour": lambda: browse.finished_counts_statement(
            now_ms - 3_600_000, POSTGRES
        ),
        "task_recent_finished": lambda: browse.recent_finished_statement(
            now_ms - 3_600_000, 5_000, POSTGRES
        ),
        "task_durations": lambda: browse.durations_statement(["hist-1", "hist-2"], pg.millis),
        "runs_again_of": lambda: browse.again_statement("hist-9", FINISHED, pg.data_is),
    }


@pytest.fixture(scope="module")
def plans(pg_database_url: str) -> Iterator[dict[str, dict[str, Any]]]:
    store = PostgresStore.from_url(pg_database_url)
    engine = create_engine(pg_database_url, poolclass=NullPool)
    try:
        store.testing_reset()
        plans_of._live_candidates(store)
        with engine.begin() as connection:
            connection.execute(text(HISTORY))
        with engine.begin() as connection:
            connection.execute(text("ANALYZE runs"))
            now_ms = int(
                connection.execute(
                    text("SELECT (extract(epoch FROM now()) * 1000)::bigint")
                ).scalar_one()
            )
        found: dict[str, dict[str, Any]] = {}
        with engine.connect() as connection:
            for name, statement in _statements(now_ms).items():
                document = connection.execute(plans_of.Explain(statement())).scalar_one()
                found[name] = document[0]["Plan"]
        yield found
    finally:
        store.testing_reset()
        store.close()
        engine.dispose()


NAMES = sorted(_statements(0))


def _summary(plan: dict[str, Any]) -> list[str]:
    """Each node of the plan: its type, relation and index, for a failure's message."""
    return [
        f"{node['Node Type']} {node.get('Relation Name', '')} {node.get('Index Name', '')}"
        for node in plans_of._nodes(plan)
    ]


@pytest.mark.parametrize("name", NAMES)
def test_no_page_reads_the_history_sequentially(
    plans: dict[str, dict[str, Any]], name: str
) -> None:
    # The history is in ``runs`` only here: the other tables hold the few live rows, which a
    # planner rightly reads whole (their plans are the candidate queries' tests' business).
    assert "runs" not in plans_of._seq_scans(plans[name]), _summary(plans[name])


@pytest.mark.parametrize("name", NAMES)
def test_each_statement_costs_what_its_page_shows(
    plans: dict[str, dict[str, Any]], name: str
) -> None:
    assert float(plans[name]["Total Cost"]) < COST_BOUND, _summary(plans[name])
