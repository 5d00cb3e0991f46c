"""A failure retried on error counts as a scheduled retry, not a failed run (ADR 0013)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from ql3.adapters.prometheus import TASK_FAILED, PrometheusMetrics
from ql3.domain.events import EventType, RunEvent


def _failed(retry: bool) -> RunEvent:
    data = {"error": "boom", "cause": "error", "retry": retry}
    return RunEvent(run_id="r", attempt_id="a", type=EventType.ATTEMPT_FAILED, at_ms=1, data=data)


def test_a_retried_failure_is_a_retry_and_a_final_one_a_failed_run() -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    metrics.committed([_failed(True), _failed(True), _failed(False)])

    def value(name: str, **labels: str) -> float:
        found = registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    assert value("ql3_retries_scheduled_total") == 2
    assert value("ql3_runs_failed_total", reason=TASK_FAILED) == 1
    assert value("ql3_completions_total", outcome="failed") == 3
