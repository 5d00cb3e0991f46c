"""Pruning on PostgreSQL (ADR 0016): a prune neither waits for nor locks a row it does not
delete, and its pick reads a page of ``ix_runs_finished`` however long the history is.

The lock tests run the prune on a store whose sessions have a ``lock_timeout``: a prune that
waited for a lock would fail with it instead of hanging. The plan tests EXPLAIN the pick the store
runs beside 100,000 finished Runs (loaded as in ``test_pg_query_plans``), then prune them all."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from ql3.adapters.postgres.queries import POSTGRES
from ql3.adapters.postgres.store import PostgresStore
from ql3.adapters.sql.history import prunable_query
from ql3.adapters.sql.schema import metadata
from ql3.application.history import HistoryPruning
from ql3.application.ports import PruneMark
from tests.contract.builders import (
    committed,
    finish,
    given_session,
    given_started,
)
from tests.postgres import test_pg_query_plans as plans_of

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS


def _plain_url(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


def _finished(store: PostgresStore, run_id: str) -> None:
    attempt_id = given_started(store, run_id, "s1")
    with committed(store) as uow:
        finish(uow, attempt_id)


@pytest.fixture
def impatient(store: PostgresStore, pg_database_url: str) -> Iterator[PostgresStore]:
    """A second store on the same database whose sessions give up on a lock after 2 s."""
    patience = PostgresStore.from_url(
        pg_database_url + "?options=-c%20lock_timeout%3D2000", pool_size=1
    )
    try:
        yield patience
    finally:
        patience.close()


def test_every_foreign_key_is_the_head_of_an_index() -> None:
    """Deleting a referenced row looks its referencing rows up by the foreign key's columns."""
    missing = []
    for table in metadata.sorted_tables:
        heads = [tuple(c.name for c in index.columns) for index in table.indexes]
        heads += [tuple(c.name for c in u.columns) for u in table.constraints if u.columns]
        for key in table.foreign_key_constraints:
            columns = tuple(c.name for c in key.columns)
            if not any(head[: len(columns)] == columns for head in heads):
                missing.append(f"{table.name}{columns}")
    assert missing == []


def test_a_prune_skips_a_locked_finished_run_and_never_waits_for_a_live_one(
    store: PostgresStore, impatient: PostgresStore, pg_database_url: str
) -> None:
    given_session(store, "s1")
    for run_id in ("held", "free"):
        _finished(store, run_id)
    live = given_started(store, "live", "s1", ttl_ms=10 * DAY_MS)
    store.testing_advance_clock(2 * HOUR_MS)
    impatient.testing_advance_clock(2 * HOUR_MS)
    with psycopg.connect(_plain_url(pg_database_url)) as other:
        # a late command holds the finished Run, a worker the live one
        other.execute("SELECT 1 FROM runs WHERE id IN ('held', 'live') FOR UPDATE")
        report = HistoryPruning(impatient.unit_of_work).prune(HOUR_MS)
        other.rollback()
    assert report.removed.runs == 1
    with store.unit_of_work() as uow:
        assert uow.runs.get_run("free") is None
        assert uow.runs.get_run("held") is not None
        assert uow.runs.get_attempt(live) is not None
    assert HistoryPruning(store.unit_of_work).prune(HOUR_MS).removed.runs == 1


def test_a_batch_locks_the_runs_it_picked_and_nothing_else(
    store: PostgresStore, pg_database_url: str
) -> None:
    given_session(store, "s1")
    _finished(store, "old")
    given_started(store, "live", "s1", ttl_ms=10 * DAY_MS)
    store.testing_advance_clock(2 * HOUR_MS)
    _finished(store, "recent")
    with store.unit_of_work() as uow:
        (picked,) = uow.history.prunable(uow.now_ms() - HOUR_MS, 10)
        assert picked.run_id == "old"
        with psycopg.connect(_plain_url(pg_database_url), autocommit=True) as other:
            for run_id in ("live", "recent"):
                with other.transaction():
                    other.execute("SELECT 1 FROM runs WHERE id = %s FOR UPDATE NOWAIT", (run_id,))
            with pytest.raises(psycopg.errors.LockNotAvailable), other.transaction():
                other.execute("SELECT 1 FROM runs WHERE id = 'old' FOR UPDATE NOWAIT")
            # a second prune passes the picked Run over at once
            with store.unit_of_work() as rival:
                assert rival.history.prunable(rival.now_ms() - HOUR_MS, 10) == ()


# --- the pick's plan beside a long history -------------------------------------------------------


def _explain(engine: Any, statement: Any) -> dict[str, Any]:
    with engine.connect() as connection:
        document = connection.execute(plans_of.Explain(statement)).scalar_one()
    return dict(document[0]["Plan"])


def _pick(cutoff: int, after: PruneMark | None) -> Any:
    return prunable_query(cutoff, 500, after, POSTGRES, skip_locked=True)


def _now_ms(store: PostgresStore) -> int:
    with store.unit_of_work() as uow:
        return int(uow.now_ms())


@pytest.fixture(scope="module")
def history(pg_database_url: str) -> Iterator[dict[str, Any]]:
    store = PostgresStore.from_url(pg_database_url)
    engine = create_engine(pg_database_url, poolclass=NullPool)
    try:
        store.testing_reset()
        plans_of._live_candidates(store)
        with store.unit_of_work() as uow:
            recent = {run.id for run in uow.runs.list_runs(None, 1_000)}
        plans_of._load_history(engine, 1, plans_of.HISTORY)
        cutoff = _now_ms(store) - DAY_MS
        with engine.connect() as connection:
            full_scan = connection.execute(
                text("EXPLAIN (FORMAT JSON) SELECT * FROM runs")
            ).scalar_one()[0]["Plan"]["Total Cost"]
            lease_lookup = connection.execute(
                text(
                    "EXPLAIN (FORMAT JSON) SELECT 1 FROM run_dispatch_leases"
                    " WHERE attempt_id = 'hist-5-1'"
                )
            ).scalar_one()[0]["Plan"]
        mark = PruneMark(finished_at_ms=cutoff - 2 * DAY_MS, run_id="hist-50000")
        yield {
            "store": store,
            "recent": recent,
            "full_scan": float(full_scan),
            "first": _explain(engine, _pick(cutoff, None)),
            "after": _explain(engine, _pick(cutoff, mark)),
            "lease_lookup": lease_lookup,
        }
    finally:
        store.testing_reset()
        store.close()
        engine.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["first", "after"])
def test_the_pick_reads_a_page_of_the_finished_index(history: dict[str, Any], name: str) -> None:
    plan = history[name]
    assert plan["Node Type"] == "Limit"
    (lock,) = plan["Plans"]
    assert lock["Node Type"] == "LockRows", "rows are locked under the limit"
    assert "ix_runs_finished" in plans_of._index_scans(plan)
    assert plans_of._seq_scans(plan) == set()
    assert not [n for n in plans_of._nodes(plan) if n["Node Type"] in ("Sort", "Incremental Sort")]
    # the limit stops the scan: a page costs a small part of reading the history
    print(f"pick ({name}): {plan['Total Cost']:.2f}; reading runs costs {history['full_scan']:.2f}")
    assert float(plan["Total Cost"]) * 20 < history["full_scan"]


@pytest.mark.slow
def test_deleting_an_attempt_finds_its_leases_by_index(history: dict[str, Any]) -> None:
    assert plans_of._index_scans(history["lease_lookup"]) == {"ix_run_dispatch_leases_attempt_id"}


@pytest.mark.slow
def test_a_long_history_is_pruned_in_batches_and_the_recent_runs_stay(
    history: dict[str, Any],
) -> None:
    store: PostgresStore = history["store"]
    report = HistoryPruning(store.unit_of_work).prune(DAY_MS, batch_size=5_000)
    assert report.removed.runs == plans_of.HISTORY
    assert (report.removed.attempts, report.removed.leases) == (plans_of.HISTORY,) * 2
    assert report.batch_runs == (5_000,) * (plans_of.HISTORY // 5_000)
    with store.unit_of_work() as uow:
        left = {run.id for run in uow.runs.list_runs(None, 1_000)}
    assert left == history["recent"] and len(left) > 10
