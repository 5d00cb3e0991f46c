"""The store's connection hold (``PostgresStore.holding_connection``): the units of work one
thread opens inside run on one pooled connection, each in its own transaction."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from ql3.adapters.postgres.store import PostgresStore, PostgresUnitOfWork


def _pid(uow: PostgresUnitOfWork) -> int:
    (row,) = uow.execute_sql("SELECT pg_backend_pid() AS pid", {}, "backend")
    return int(row["pid"])


def _in_transaction(uow: PostgresUnitOfWork) -> bool:
    (row,) = uow.execute_sql(
        "SELECT count(*) AS n FROM pg_stat_activity"
        " WHERE pid = pg_backend_pid() AND xact_start IS NOT NULL",
        {},
        "transaction",
    )
    return int(row["n"]) == 1


def test_units_of_work_inside_a_hold_share_one_connection_and_not_one_transaction(
    store: PostgresStore,
) -> None:
    with store.holding_connection():
        with store.unit_of_work() as first:
            pid = _pid(first)
            first.execute_sql("SELECT set_config('ql3.probe', 'set', true) AS s", {}, "set")
            first.commit()
        # Between the two, the connection stays with this thread rather than in the pool.
        assert store.engine.pool.checkedout() == 1  # type: ignore[attr-defined]
        with store.unit_of_work() as second:
            assert _pid(second) == pid
            assert _in_transaction(second)
            # The setting was local to the first transaction, which has ended.
            (row,) = second.execute_sql(
                "SELECT current_setting('ql3.probe', true) AS v", {}, "read"
            )
            assert row["v"] in (None, "")
    assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_without_a_hold_each_unit_of_work_returns_its_connection(store: PostgresStore) -> None:
    with store.unit_of_work() as uow:
        _pid(uow)
        assert store.engine.pool.checkedout() == 1  # type: ignore[attr-defined]
    assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def test_a_held_connection_the_server_ended_is_replaced(
    store: PostgresStore, pg_database_url: str
) -> None:
    admin: Any = psycopg.connect(
        pg_database_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    )
    try:
        with store.holding_connection():
            with store.unit_of_work() as first:
                pid = _pid(first)
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            for _ in range(100):  # the backend ends soon after it is told to
                left = admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,))
                if left.fetchone() is None:
                    break
                time.sleep(0.01)
            with store.unit_of_work() as second:
                assert _pid(second) != pid
    finally:
        admin.close()
