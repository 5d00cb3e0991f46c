"""The chaos benchmark's figures, computed from a made-up ledger: what counts as lost, as a
duplicate, and how long a dip in the completion rate lasted."""

from __future__ import annotations

from benchmarks.chaos import (
    RECOVERED_FRACTION,
    WINDOW_S,
    Job,
    Ledger,
    PhaseWindow,
    baseline_rate,
    completion_rates,
    figures,
    recovery_seconds,
)
from benchmarks.chaos_systems import FINISHED, UNFINISHED, WAITING


def _steady(start: float, end: float, per_s: int) -> list[float]:
    return [start + n / per_s for n in range(round((end - start) * per_s))]


def test_the_completion_rate_counts_a_trailing_window() -> None:
    ends = _steady(0.0, 20.0, 10)
    rates = dict(completion_rates(ends, 0.0, 20.0))
    assert rates[10.0] == 10.0  # 10 a second in (10 - WINDOW_S, 10]
    assert rates[0.0] == 1 / WINDOW_S  # only the one at t = 0


def test_recovery_is_the_time_until_the_rate_is_back_for_good() -> None:
    clean = PhaseWindow(name="clean", start=0.0, end=10.0)
    fault = PhaseWindow(name="kill-worker", start=10.0, fault_end=20.0, end=30.0)
    # Nothing completes from 12 s to 15 s, then the rate is steady again.
    ends = _steady(0.0, 12.0, 10) + _steady(15.0, 30.0, 10)
    baseline = baseline_rate(ends, clean)
    assert baseline == 10.0
    recovered = recovery_seconds(ends, fault, baseline)
    assert recovered is not None
    # Back at 90 % once the window after the gap holds 90 % of its completions again.
    expected = 15.0 + RECOVERED_FRACTION * WINDOW_S - fault.start
    assert abs(recovered - expected) <= 0.5, (recovered, expected)

    assert recovery_seconds(_steady(0.0, 30.0, 10), fault, baseline) == 0.0
    assert recovery_seconds(_steady(0.0, 25.0, 10), fault, baseline) is None


def test_lost_and_duplicates_are_counted_per_phase_of_submission() -> None:
    clean = PhaseWindow(name="clean", start=0.0, fault_end=5.0, end=10.0)
    fault = PhaseWindow(name="kill-worker", start=10.0, fault_end=15.0, end=20.0)
    jobs = [
        Job("a", "idempotent", 1.0, True),  # ran twice: allowed for an idempotent Run
        Job("b", "unsafe", 2.0, True),  # ran twice: a duplicate
        Job("c", "none", 11.0, True),  # never finished: lost
        Job("d", "unsafe", 12.0, True),  # waits for evidence: not lost
        Job("e", "none", 13.0, False),  # refused at submit: not a job
    ]
    ledger = Ledger(
        starts={"a": [1.1, 3.0], "b": [2.1, 4.0], "c": [11.1], "d": [12.1]},
        ends={"a": 3.2, "b": 4.2},
    )
    verdicts = {"a": FINISHED, "b": FINISHED, "c": UNFINISHED, "d": WAITING}

    rows, details = figures("ql3", [clean, fault], jobs, ledger, verdicts, frozenset({"unsafe"}))
    assert [(r.phase, r.lost, r.duplicates) for r in rows] == [
        ("clean", 0, 1),
        ("kill-worker", 1, 0),
    ]
    assert rows[0].pickup_p99_ms is not None and 99 <= rows[0].pickup_p99_ms <= 101
    assert details[1]["lost_keys"] == ["c"]
    assert (details[1]["waiting_for_evidence"], details[1]["refused"]) == (1, 1)

    peers, _ = figures("pgqueuer", [clean, fault], jobs, ledger, verdicts, None)
    assert [r.duplicates for r in peers] == [2, 0]  # any job run twice, for a peer
