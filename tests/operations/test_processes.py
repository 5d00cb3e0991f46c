"""Real processes on PostgreSQL (ADR 0010): a node and a worker logging JSON, the worker serving
its metrics (``--metrics-port``), a worker SIGKILLed mid-task and restarted under its worker id.
The node's ``/metrics`` counts what the events say, ``ql3 status`` and ``ql3 doctor`` report a
healthy cluster, every log line is one JSON object with the fields that apply, and none of the
secrets the test handed out (the registration token, the ingress role's password) is in any
log."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.e2e.conftest import (
    CADENCE_S,
    LEASE_TTL_S,
    Cluster,
    Ledger,
    run_ql3,
    wait_for,
)
from tests.postgres_server import random_name

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TOKEN = "reg-" + "7" * 40
PASSWORD = "pw-" + "9" * 30
RETRY = RetryPolicy(
    retry_on_lost=True,
    max_attempts=2,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=0, cap_ms=0),
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class JsonCluster(Cluster):
    def start_json_node(self, ingress_url: str) -> str:
        argv = [
            "serve",
            "--port",
            "0",
            "--lease-ttl",
            str(LEASE_TTL_S),
            "--cadence",
            str(CADENCE_S),
            "--log-format",
            "json",
            "--ingress-database-url",
            ingress_url,
        ]
        process = self._spawn("node-json", argv, env={"QL3_REGISTRATION_TOKEN": TOKEN})
        found: list[str] = []

        def ready() -> bool:
            assert process.popen.poll() is None, process.output()
            for line in process.output().splitlines():
                if line.startswith("ql3 node listening on "):
                    found.append(line.rsplit(" ", 1)[1])
                    return True
            return False

        wait_for(ready, 30, "the node to listen")
        self.nodes.append(found[0])
        return found[0]

    def start_json_worker(self, ledger: Ledger, port: int) -> Any:
        return self._spawn(
            f"worker-json-{len(self.processes)}",
            [
                "worker",
                "--ingress",
                self.nodes[0],
                "--app",
                "tests.e2e.tasks:app",
                "--worker-id",
                "w-json",
                "--concurrency",
                "2",
                "--log-format",
                "json",
                "--metrics-port",
                str(port),
            ],
            env={
                "QL3_E2E_LEDGER": str(ledger.path),
                "QL3_E2E_PREFIX": "ops",
                "QL3_REGISTRATION_TOKEN": TOKEN,
            },
        )


@pytest.fixture
def json_cluster(pg_database_url: str, tmp_path: Path) -> Iterator[JsonCluster]:
    built = JsonCluster(database_url=pg_database_url, workdir=tmp_path)
    role = random_name("ql3_ops_ingress_")
    granted = run_ql3(
        ["db", "grant-ingress", role, "--password-env", "QL3_TEST_INGRESS_PW"],
        {"QL3_DATABASE_URL": pg_database_url, "QL3_TEST_INGRESS_PW": PASSWORD},
    )
    assert granted.returncode == 0, granted.stderr
    built.roles.append(role)
    try:
        ingress = make_url(pg_database_url).set(username=role, password=PASSWORD)
        built.start_json_node(ingress.render_as_string(hide_password=False))
        yield built
    finally:
        built.stop_all()
        built.container.store().close()
        built.drop_roles()


def _metrics(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    body = httpx.get(url, timeout=5).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every log line; the node's one "listening" line is the command's own output."""
    lines = [line for line in text.splitlines() if line and not line.startswith("ql3 node")]
    return [json.loads(line) for line in lines]


def test_json_logs_metrics_status_and_doctor_after_a_worker_is_killed(
    json_cluster: JsonCluster, tmp_path: Path
) -> None:
    ledger = Ledger(tmp_path / "ledger.jsonl")
    quick = json_cluster.submit("ops.double", {"n": 2})
    slow = json_cluster.submit("ops.sleep", {"seconds": 0.1, "first_attempt_seconds": 120}, RETRY)
    port = _free_port()
    worker = json_cluster.start_json_worker(ledger, port)
    json_cluster.wait_status([quick], {"succeeded"})
    wait_for(lambda: bool(ledger.entries("start", slow)), 20, "the slow task to start")
    scrape = f"http://127.0.0.1:{port}/metrics"

    def settled() -> bool:
        found = _metrics(scrape)
        return (
            _value(found, "ql3_worker_completed_total") == 1
            and _value(found, "ql3_worker_holding") == 1
        )

    wait_for(settled, 20, "the worker's metrics to show one completed, one held")
    assert _value(_metrics(scrape), "ql3_worker_slots_live") == 2
    worker.signal(signal.SIGKILL)
    worker.wait()
    restarted = json_cluster.start_json_worker(ledger, _free_port())
    json_cluster.wait_status([slow], {"succeeded"}, timeout=30)

    node = json_cluster.nodes[0]
    samples = _metrics(f"{node}/metrics")
    document = json_cluster.show(slow)
    (lost,) = [e for e in document["events"] if e["type"] == "attempt_lost"]
    evidence = lost["data"]["evidence"]
    assert evidence == "session_replaced"
    assert _value(samples, "ql3_attempts_lost_total", evidence=evidence) == 1
    assert _value(samples, "ql3_retries_scheduled_total") == 1
    assert _value(samples, "ql3_completions_total", outcome="succeeded") == 2
    assert _value(samples, "ql3_dispatch_gate_open") == 1
    assert _value(samples, "ql3_worker_sessions", state="active") == 1

    status = json_cluster.ql3("status", "--json")
    assert status.returncode == 0, status.stderr
    document = json.loads(status.stdout)
    assert [w["worker_id"] for w in document["workers"]] == ["w-json"]
    (recorded,) = document["nodes"]
    assert recorded["ok"] and recorded["cycles"] >= 1
    doctor = json_cluster.ql3("doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr

    restarted.signal(signal.SIGTERM)
    assert restarted.wait() == 0
    json_cluster.stop_all()
    logs = {p.name: p.output() for p in json_cluster.processes}
    for name, text in logs.items():
        assert TOKEN not in text and PASSWORD not in text, name
        lines = _json_lines(text)
        assert lines, name
        for line in lines:
            assert {"time", "level", "logger", "message"} <= set(line), line
            if name.startswith("worker"):
                assert line["worker_id"] == "w-json", line
    worker_lines = [
        line
        for name, text in logs.items()
        if name.startswith("worker")
        for line in _json_lines(text)
    ]
    assert any(line.get("session_id") for line in worker_lines)  # "registered session %s"
    node_lines = _json_lines(logs["node-json"])
    assert any(line["message"].startswith("startup recovery") for line in node_lines)
    assert any("cycle:" in line["message"] for line in node_lines)
