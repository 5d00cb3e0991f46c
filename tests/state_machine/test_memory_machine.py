"""The state-machine contract run on the memory store."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from ql3.adapters.memory import FakeClock, MemoryStore
from tests.state_machine.machine import STATS, make_machine

EXAMPLES = 200


def memory_store_factory():  # type: ignore[no-untyped-def]
    clock = FakeClock()
    return MemoryStore(clock), clock.advance


MemoryRuntimeMachine = make_machine(memory_store_factory)


# Shrinking a failing sequence takes far longer than a passing run.
@pytest.mark.timeout(1_800)
def test_memory_store_keeps_every_design_invariant() -> None:
    STATS.clear()
    started = time.monotonic()
    run_state_machine_as_test(
        MemoryRuntimeMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        ),
    )
    elapsed = time.monotonic() - started
    print(f"\nstate machine: {STATS['examples']} examples, {STATS['steps']} checked states, "
          f"{elapsed:.1f}s")
    for key in sorted(STATS):
        print(f"  {key}: {STATS[key]}")
    assert STATS["examples"] >= EXAMPLES
    assert STATS["steps"] > STATS["examples"]
