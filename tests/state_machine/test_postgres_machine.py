"""The state-machine contract run on the PostgreSQL store.

One ``PostgresStore`` serves the whole module; every example starts from ``testing_reset()``
(empty tables, clock offset back to zero) and moves time with ``testing_advance_clock``. The
database's real clock also moves between statements, which the machine tolerates."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.state_machine.machine import STATS, make_machine

EXAMPLES = 40


@pytest.fixture(scope="module")
def pg_store(pg_database_url: str) -> Iterator[object]:
    from ql3.adapters.postgres.store import PostgresStore

    store = PostgresStore.from_url(pg_database_url, create_schema=True)
    try:
        yield store
    finally:
        store.close()


# Shrinking a failing sequence takes far longer than a passing run.
@pytest.mark.timeout(1_800)
def test_postgres_store_keeps_every_design_invariant(pg_store) -> None:  # type: ignore[no-untyped-def]
    def factory():  # type: ignore[no-untyped-def]
        pg_store.testing_reset()
        return pg_store, pg_store.testing_advance_clock

    machine = make_machine(factory)
    STATS.clear()
    started = time.monotonic()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        ),
    )
    elapsed = time.monotonic() - started
    print(f"\nstate machine (postgres): {STATS['examples']} examples, "
          f"{STATS['steps']} checked states, {elapsed:.1f}s")
    for key in sorted(STATS):
        print(f"  {key}: {STATS[key]}")
    assert STATS["examples"] >= EXAMPLES
    assert STATS["steps"] > STATS["examples"]
