"""The differential test of the memory and PostgreSQL stores, run on the memory and SQLite
stores: after every command both must agree on its outcome and on the normalised state."""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ql3.adapters.sql.sqlite import SqliteStore
from tests.state_machine.test_differential import STATS, Side, make_differential

EXAMPLES = 15


def test_memory_and_sqlite_agree_on_every_command(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "differential.sqlite", synchronous="NORMAL")

    def sqlite_side() -> Side:
        store.testing_reset()
        return Side("sqlite", store, store.testing_advance_clock)

    STATS.clear()
    started = time.monotonic()
    try:
        run_state_machine_as_test(
            make_differential(sqlite_side),
            settings=settings(
                max_examples=EXAMPLES,
                stateful_step_count=25,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                database=None,
            ),
        )
    finally:
        store.close()
    elapsed = time.monotonic() - started
    print(f"\ndifferential (sqlite): {STATS.get('examples', 0)} examples, "
          f"{STATS.get('steps', 0)} compared states, {elapsed:.1f}s")
    assert STATS["examples"] >= EXAMPLES
    assert STATS["steps"] > STATS["examples"]
