"""The node's metrics after a scripted crash-and-recover story on PostgreSQL equal what the
events say (ADR 0010), and ``GET /metrics`` serves them with the store's gauges.

A worker claims six runs, completes two (one fails), renews the others and presents one stale
fence; then it "crashes" (a new session of the same worker id replaces it: not-running
evidence). Once the leases expired by the database's clock, the node's cycle marks the four
lost; lost retry schedules the two idempotent ones and fails the unsafe one and the one without
a policy; the retries are claimed again and succeed. Every counter is compared with the
``run_events`` rows of the same database."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from ql3.application.admission import AdmissionRequest
from ql3.application.worker_commands import Completion
from ql3.bootstrap import node
from ql3.domain.fence import LeaseFence
from ql3.domain.policy import Backoff, RetryPolicy, Safety

pytestmark = pytest.mark.postgres

TTL_S = 5.0
RETRY = RetryPolicy(
    retry_on_lost=True,
    max_attempts=3,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=1_000, cap_ms=1_000),
)
UNSAFE = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.UNSAFE)


@pytest.fixture
def container(pg_database_url: str) -> Iterator[node.NodeContainer]:
    built = node.build(database_url=pg_database_url, lease_ttl_s=TTL_S)
    built.cluster.store().testing_reset()
    try:
        yield built
    finally:
        node.close_stores(built)


def _samples(container: node.NodeContainer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry, _ = container.metrics_registry()
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_equal_the_events_after_a_crash_and_recovery(
    container: node.NodeContainer,
) -> None:
    store = container.cluster.store()
    admission = container.cluster.core.admission()
    commands = container.ingress_commands()
    coordinator = container.cluster.coordinator()
    policies = [None, None, RETRY, RETRY, UNSAFE, None]
    runs = admission.submit_many([AdmissionRequest(task="t", policy=p) for p in policies])
    session = commands.register("w-1", capacity=8, tasks=["t"])
    grants = commands.claim(session.session_id, session.secret, limit=8).grants
    assert len(grants) == 6
    by_run = {g.run_id: g for g in grants}
    done, failing = by_run[runs[0]], by_run[runs[1]]
    commands.complete_many(
        session.session_id,
        session.secret,
        [
            Completion(fence=done.fence, succeeded=True, output=1),
            Completion(fence=failing.fence, succeeded=False, error="boom"),
        ],
    )
    held = [by_run[r] for r in runs[2:]]
    renewed = commands.renew_many(session.session_id, session.secret, [g.fence for g in held])
    assert all(r.ok for r in renewed.results)
    stale = LeaseFence(
        attempt_id=held[0].attempt_id,
        generation=held[0].generation,
        version=held[0].version + 1,
        token=held[0].token,
    )
    (rejected,) = commands.renew_many(session.session_id, session.secret, [stale]).results
    assert rejected.reason == "version_mismatch"

    # The worker process dies; its replacement registers under the same worker id.
    replacement = commands.register("w-1", capacity=8, tasks=["t"])
    store.testing_advance_clock(round(TTL_S * 1000) + 1_000)
    first = coordinator.run_cycle()
    assert first.ok
    assert first.step("runtime_recovery").counts["recovered"] == 4  # type: ignore[union-attr]
    store.testing_advance_clock(2_000)
    assert coordinator.run_cycle().ok  # the due retries get their next attempt
    retried = commands.claim(replacement.session_id, replacement.secret, limit=8).grants
    assert {g.run_id for g in retried} == {runs[2], runs[3]}
    commands.complete_many(
        replacement.session_id,
        replacement.secret,
        [Completion(fence=g.fence, succeeded=True, output=2) for g in retried],
    )
    assert coordinator.run_cycle().ok

    with store.engine.connect() as connection:
        events = connection.execute(
            text(
                "SELECT type, data->>'evidence' AS evidence, data->>'reason' AS reason"
                " FROM run_events"
            )
        ).all()
    types = Counter(row.type for row in events)
    lost_by_evidence = Counter(row.evidence for row in events if row.type == "attempt_lost")
    failed_by_reason = Counter(row.reason for row in events if row.type == "run_failed")
    samples = _samples(container)

    assert lost_by_evidence == {"session_replaced": 4}
    for evidence, count in lost_by_evidence.items():
        assert _value(samples, "ql3_attempts_lost_total", evidence=evidence) == count
    assert failed_by_reason == {"no_policy": 1, "unsafe": 1}
    for reason, count in failed_by_reason.items():
        assert _value(samples, "ql3_runs_failed_total", reason=reason) == count
    assert (
        _value(samples, "ql3_runs_failed_total", reason="task_failed")
        == types["attempt_failed"]
        == 1
    )
    assert _value(samples, "ql3_retries_scheduled_total") == types["retry_scheduled"] == 2
    assert _value(samples, "ql3_attempts_claimed_total") == types["attempt_started"] == 8
    assert (
        _value(samples, "ql3_completions_total", outcome="succeeded")
        == types["attempt_succeeded"]
        == 3
    )
    assert _value(samples, "ql3_completions_total", outcome="failed") == 1
    assert _value(samples, "ql3_lease_renewals_total") == 4
    assert _value(samples, "ql3_fence_rejections_total", reason="version_mismatch") == 1
    assert _value(samples, "ql3_claims_total", result="granted") == 2
    assert _value(samples, "ql3_cycles_total", outcome="ok") == 3
    for step in ("runtime_recovery", "lost_retry", "task_attempt_admission"):
        assert _value(samples, "ql3_cycle_steps_total", step=step, outcome="ok") == 3
        assert _value(samples, "ql3_cycle_step_seconds_count", step=step) == 3
    # The gauges, read from the store on this scrape.
    assert _value(samples, "ql3_store_up") == 1
    assert _value(samples, "ql3_dispatch_gate_open") == 1
    assert _value(samples, "ql3_worker_sessions", state="active") == 1
    assert _value(samples, "ql3_evidence_waiting") == 0
    assert _value(samples, "ql3_quarantined_runs") == 0
    assert _value(samples, "ql3_cycle_last_timestamp_seconds") > 0


def test_the_node_serves_metrics_and_the_gauges_follow_the_store(
    container: node.NodeContainer,
) -> None:
    admission = container.cluster.core.admission()
    admission.submit_many([AdmissionRequest(task="mail")] * 3 + [AdmissionRequest(task="report")])
    commands = container.ingress_commands()
    session = commands.register("w-2", capacity=1, tasks=["report"])
    assert len(commands.claim(session.session_id, session.secret, limit=1).grants) == 1
    container.cluster.store().testing_advance_clock(round(TTL_S * 1000) + 1_000)
    app = node.create_node_app(container, run_startup_recovery=False)
    answer = TestClient(app).get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    body = answer.text
    assert 'ql3_queued{task="mail"} 3.0' in body
    assert 'ql3_queued_oldest_seconds{task="mail"}' in body
    assert "ql3_evidence_waiting 1.0" in body  # started, expired, its session still active
    assert 'ql3_worker_sessions{state="active"} 1.0' in body
    assert "ql3_worker_in_flight 1.0" in body
    assert session.secret not in body
