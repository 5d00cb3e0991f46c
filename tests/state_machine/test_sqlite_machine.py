"""The state-machine contract run on the SQLite store.

One ``SqliteStore`` on a database file serves the test; every example starts from
``testing_reset()`` (no rows, clock offset back to zero) and moves time with
``testing_advance_clock``. The host's clock also moves between statements, which the machine
tolerates. Fewer examples than on the memory store: every step commits to a real file."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ql3.adapters.sql.sqlite import SqliteStore
from tests.state_machine.machine import STATS, make_machine

EXAMPLES = 40


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SqliteStore]:
    store = SqliteStore(tmp_path / "machine.sqlite", synchronous="NORMAL")
    try:
        yield store
    finally:
        store.close()


# Shrinking a failing sequence takes far longer than a passing run.
@pytest.mark.timeout(1_800)
def test_sqlite_store_keeps_every_design_invariant(sqlite_store: SqliteStore) -> None:
    def factory():  # type: ignore[no-untyped-def]
        sqlite_store.testing_reset()
        return sqlite_store, sqlite_store.testing_advance_clock

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
    print(f"\nstate machine (sqlite): {STATS['examples']} examples, "
          f"{STATS['steps']} checked states, {elapsed:.1f}s")
    for key in sorted(STATS):
        print(f"  {key}: {STATS[key]}")
    assert STATS["examples"] >= EXAMPLES
    assert STATS["steps"] > STATS["examples"]
