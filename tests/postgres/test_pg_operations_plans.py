"""A scrape, ``ql3 status`` and ``ql3 doctor`` cost what the live work costs (ADR 0010).

The statements of the operations view (``ql3.adapters.sql.operations``) are EXPLAINed beside a few
live Runs of every kind, then with 10,000 and 100,000 finished Runs (each with its Attempt and
released lease): none may read ``runs``, ``run_attempts`` or ``run_dispatch_leases``
sequentially, each stays under the cost bound of the candidate queries, and the tenfold history
leaves its cost (about) where it was. The view read through the store finds the live rows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from ql3.adapters.postgres.queries import POSTGRES, store_now
from ql3.adapters.postgres.store import PostgresStore
from ql3.adapters.sql import operations, statements
from ql3.application.operations import Quarantines
from ql3.application.ports import HARD_PAGE_CAP, OperationsView
from tests.postgres import test_pg_query_plans as plans_of

pytestmark = pytest.mark.slow

QUERIES: dict[str, Callable[[], Any]] = {
    "gate": statements.get_gate,
    "queue_depths": lambda: operations.queue_depths(POSTGRES),
    "evidence_waits": lambda: operations.evidence_waits(store_now(0), POSTGRES),
    "open_sessions": lambda: operations.open_sessions(POSTGRES),
    "quarantined_runs": lambda: operations.quarantined_runs(HARD_PAGE_CAP, POSTGRES),
    "quarantined_count": lambda: operations.quarantined_count(POSTGRES),
    "latest_nodes": lambda: operations.latest_nodes(HARD_PAGE_CAP),
}


def _explain(engine: Any, *, index_paths_only: bool = False) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    with engine.connect() as connection:
        if index_paths_only:
            connection.execute(text("SET enable_seqscan = off"))
        for name, query in QUERIES.items():
            document = connection.execute(plans_of.Explain(query())).scalar_one()
            found[name] = document[0]["Plan"]
    return found


@pytest.fixture(scope="module")
def measured(pg_database_url: str) -> Iterator[dict[str, Any]]:
    store = PostgresStore.from_url(pg_database_url)
    engine = create_engine(pg_database_url, poolclass=NullPool)
    try:
        store.testing_reset()
        plans_of._live_candidates(store)
        Quarantines(store.unit_of_work).quarantine("lost", "held for the test")
        with engine.begin() as connection:
            plans_of._analyze(connection)
        empty = _explain(engine, index_paths_only=True)
        plans_of._load_history(engine, 1, plans_of.SMALL_HISTORY)
        small = _explain(engine)
        plans_of._load_history(engine, plans_of.SMALL_HISTORY + 1, plans_of.HISTORY)
        loaded = _explain(engine)
        view = store.operations_view(HARD_PAGE_CAP)
        yield {"empty": empty, "small": small, "loaded": loaded, "view": view}
    finally:
        store.testing_reset()
        store.close()
        engine.dispose()


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_no_sequential_scan_of_the_history(measured: dict[str, Any], name: str) -> None:
    assert plans_of._seq_scans(measured["small"][name]) == set()
    assert plans_of._seq_scans(measured["loaded"][name]) == set()


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_a_scrape_costs_no_more_with_the_history(measured: dict[str, Any], name: str) -> None:
    cost = float(measured["loaded"][name]["Total Cost"])
    small = float(measured["small"][name]["Total Cost"])
    empty = float(measured["empty"][name]["Total Cost"])
    print(f"{name}: cost {empty:.2f} empty, {small:.2f} small history, {cost:.2f} full history")
    assert cost < plans_of.COST_BOUND
    assert cost <= max(empty, 1.0) * plans_of.COST_RATIO_BOUND
    assert cost <= small * plans_of.GROWTH_BOUND


def test_the_view_finds_the_live_rows_among_the_history(measured: dict[str, Any]) -> None:
    view: OperationsView = measured["view"]
    assert view.gate.open
    assert {(q.task, q.queued) for q in view.queues} == {("mail", 3), ("report", 3)}
    # expired-started: started, lease expired, its session s1 still active, no report.
    assert view.evidence.count == 1
    assert [c.session.id for c in view.sessions] == ["s1"]
    assert [r.id for r in view.quarantined] == ["lost"] and view.quarantined_count == 1
