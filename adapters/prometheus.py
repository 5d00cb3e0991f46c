"""Prometheus metrics (ADR 0010).

:class:`PrometheusMetrics` implements :class:`ql3.application.ports.Metrics`: counters of what this
process did, as it did it. :class:`OperationsCollector` is the gauges: on each scrape, and only
then, it reads the store's :meth:`~ql3.application.ports.OperationsSource.operations_view` (bounded
queries over live rows; never on the cadence). Label values come from the domain's enums, the
step names and the task names; no secret, token or input ever becomes a label."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ql3.application.ports import OperationsSource, OperationsView
from ql3.domain.events import EventType, RunEvent
from ql3.domain.model import SessionStatus
from ql3.domain.states import OPEN_SESSION_STATUSES

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Never-started Attempts are lost without evidence: they need none.
NO_EVIDENCE = "none"
TASK_FAILED = "task_failed"


class PrometheusMetrics:
    """The counters of one process, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._step_seconds = Histogram(
            "ql3_cycle_step_seconds",
            "Seconds one step of a scheduler cycle took.",
            ["step"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self._steps = Counter(
            "ql3_cycle_steps",
            "Steps of scheduler cycles by outcome (ok, failed, skipped after a failure).",
            ["step", "outcome"],
            registry=registry,
        )
        self._cycles = Counter(
            "ql3_cycles", "Scheduler cycles by outcome.", ["outcome"], registry=registry
        )
        self._last_cycle = Gauge(
            "ql3_cycle_last_timestamp_seconds",
            "When this node's last scheduler cycle ended (Unix time).",
            registry=registry,
        )
        self._lost = Counter(
            "ql3_attempts_lost",
            "Attempts this process marked lost, by not-running evidence.",
            ["evidence"],
            registry=registry,
        )
        self._retries = Counter(
            "ql3_retries_scheduled",
            "Runs this process put in retry_wait: lost, or failed and retried on error.",
            registry=registry,
        )
        self._failed = Counter(
            "ql3_runs_failed",
            "Runs this process failed: a lost-retry reason, or task_failed for a task's failure.",
            ["reason"],
            registry=registry,
        )
        self._claims = Counter(
            "ql3_claims",
            "Claims answered, by result (granted, or why nothing was granted).",
            ["result"],
            registry=registry,
        )
        self._claimed = Counter(
            "ql3_attempts_claimed", "Attempts started by claims.", registry=registry
        )
        self._completions = Counter(
            "ql3_completions", "Completions recorded, by outcome.", ["outcome"], registry=registry
        )
        self._released = Counter(
            "ql3_attempts_released", "Attempts handed back unstarted.", registry=registry
        )
        self._fence = Counter(
            "ql3_fence_rejections",
            "Worker calls refused for a stale or wrong fence, by reason.",
            ["reason"],
            registry=registry,
        )
        self._renewals = Counter("ql3_lease_renewals", "Leases renewed.", registry=registry)

    def step_finished(self, step: str, outcome: str, seconds: float) -> None:
        self._steps.labels(step=step, outcome=outcome).inc()
        if outcome != "skipped":
            self._step_seconds.labels(step=step).observe(seconds)

    def cycle_finished(self, ok: bool) -> None:
        self._cycles.labels(outcome="ok" if ok else "failed").inc()
        self._last_cycle.set(time.time())

    def committed(self, events: Sequence[RunEvent]) -> None:
        for event in events:
            kind = event.type
            if kind is EventType.ATTEMPT_LOST:
                self._lost.labels(evidence=str(event.data.get("evidence") or NO_EVIDENCE)).inc()
            elif kind is EventType.RETRY_SCHEDULED:
                self._retries.inc()
            elif kind is EventType.RUN_FAILED:
                self._failed.labels(reason=str(event.data.get("reason"))).inc()
            elif kind is EventType.ATTEMPT_STARTED:
                self._claimed.inc()
            elif kind is EventType.ATTEMPT_SUCCEEDED:
                self._completions.labels(outcome="succeeded").inc()
            elif kind is EventType.ATTEMPT_FAILED:
                self._completions.labels(outcome="failed").inc()
                if event.data.get("retry"):  # retried on error (ADR 0013): not a failed run
                    self._retries.inc()
                else:
                    self._failed.labels(reason=TASK_FAILED).inc()
            elif kind is EventType.ATTEMPT_RELEASED:
                self._released.inc()

    def fence_rejected(self, reason: str) -> None:
        self._fence.labels(reason=reason).inc()

    def leases_renewed(self, count: int) -> None:
        self._renewals.inc(count)

    def claim_answered(self, granted: int, no_grant: str | None) -> None:
        self._claims.labels(result="granted" if granted else (no_grant or "none")).inc()


def _seconds(now_ms: int, since_ms: int | None) -> float:
    return 0.0 if since_ms is None else max(0, now_ms - since_ms) / 1000


class OperationsCollector(Collector):
    """The gauges, read from the store on each scrape. A store that cannot answer is reported
    by ``ql3_store_up 0`` instead of failing the scrape."""

    def __init__(self, source: OperationsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily("ql3_store_up", "Whether the store answered this scrape.")
        try:
            view = self._source.operations_view(1)
        except Exception:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from operations_gauges(view)


def operations_gauges(view: OperationsView) -> Iterator[GaugeMetricFamily]:
    now = view.observed_at_ms
    gate = GaugeMetricFamily(
        "ql3_dispatch_gate_open", "1 while claims may grant work, 0 while the gate is closed."
    )
    gate.add_metric([], 1 if view.gate.open else 0)
    yield gate
    cycles = GaugeMetricFamily(
        "ql3_step_failure_cycles",
        "Cycles in a row a step failed on the same candidate run (any replica).",
        labels=["step", "run_id"],
    )
    age = GaugeMetricFamily(
        "ql3_step_failure_seconds",
        "Seconds since a step first failed on the candidate it still fails on.",
        labels=["step", "run_id"],
    )
    failure = view.gate.failure
    if failure is not None:
        cycles.add_metric([failure.step, failure.run_id], failure.cycles)
        age.add_metric([failure.step, failure.run_id], _seconds(now, failure.since_ms))
    yield cycles
    yield age
    waiting = GaugeMetricFamily(
        "ql3_evidence_waiting", "Started attempts past their lease waiting for evidence."
    )
    waiting.add_metric([], view.evidence.count)
    yield waiting
    oldest = GaugeMetricFamily(
        "ql3_evidence_waiting_oldest_seconds", "Seconds the oldest of them has waited."
    )
    oldest.add_metric([], _seconds(now, view.evidence.oldest_ms))
    yield oldest
    queued = GaugeMetricFamily("ql3_queued", "Queued runs per task.", labels=["task"])
    queued_age = GaugeMetricFamily(
        "ql3_queued_oldest_seconds", "Seconds the oldest queued run has waited.", labels=["task"]
    )
    for queue in view.queues:
        queued.add_metric([queue.task], queue.queued)
        queued_age.add_metric([queue.task], _seconds(now, queue.oldest_ms))
    yield queued
    yield queued_age
    sessions = GaugeMetricFamily(
        "ql3_worker_sessions", "Open worker sessions by state.", labels=["state"]
    )
    by_state = {status.value: 0 for status in SessionStatus if status in OPEN_SESSION_STATUSES}
    for found in view.sessions:
        by_state[found.session.status.value] = by_state.get(found.session.status.value, 0) + 1
    for state, count in sorted(by_state.items()):
        sessions.add_metric([state], count)
    yield sessions
    in_flight = GaugeMetricFamily(
        "ql3_worker_in_flight", "Leased attempts held by open worker sessions."
    )
    in_flight.add_metric([], sum(found.in_flight for found in view.sessions))
    yield in_flight
    quarantined = GaugeMetricFamily(
        "ql3_quarantined_runs", "Unfinished runs an operator quarantined."
    )
    quarantined.add_metric([], view.quarantined_count)
    yield quarantined


def node_registry(source: OperationsSource) -> tuple[CollectorRegistry, PrometheusMetrics]:
    """A node's registry: its counters and the store's gauges."""
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    registry.register(OperationsCollector(source))
    return registry, metrics


class WorkerCollector(Collector):
    """A worker process's metrics, read from its ledger on each scrape (``ql3 worker
    --metrics-port``): what it finished, abandoned and handed back, what it holds, its slots."""

    def __init__(self, worker: WorkerState) -> None:
        self._worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ledger = self._worker.ledger
        for name, doc, value in (
            ("ql3_worker_completed", "Attempts this worker completed.", ledger.completed),
            ("ql3_worker_abandoned", "Attempts this worker abandoned.", ledger.abandoned),
            ("ql3_worker_released", "Attempts this worker handed back.", ledger.released),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], value)
            yield counter
        for name, doc, gauge_value in (
            ("ql3_worker_holding", "Attempts this worker holds.", len(ledger.held_ids())),
            ("ql3_worker_slots_free", "Execution slots free.", ledger.free_slots),
            ("ql3_worker_slots_live", "Execution slots alive.", ledger.live_slots),
        ):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], gauge_value)
            yield gauge


class WorkerLedger(Protocol):
    completed: int
    abandoned: int
    released: int

    def held_ids(self) -> tuple[str, ...]: ...

    @property
    def free_slots(self) -> int: ...

    @property
    def live_slots(self) -> int: ...


class WorkerState(Protocol):
    @property
    def ledger(self) -> WorkerLedger: ...


def serve_worker_metrics(worker: WorkerState, host: str, port: int) -> CollectorRegistry:
    """Serve a worker's metrics at ``http://host:port/metrics`` from a daemon thread."""
    registry = CollectorRegistry()
    registry.register(WorkerCollector(worker))
    start_http_server(port, addr=host, registry=registry)
    return registry
