"""End to end with real processes on PostgreSQL: ``ql3 serve`` nodes, ``ql3 worker`` processes
that are SIGKILLed and SIGTERMed, an old worker's fence sent over HTTP after recovery, and
workers (in this process, on the real node) that are drained while holding work that never
began, or that lose a claim's answer.

The first node's ingress connects as its own least-privilege role; the second node (test e)
uses the node's own database URL for its ingress.

Lease TTL 2 s and cadence 0.5 s keep the module short; each test uses its own task names (a
prefix), so the workers of one test never take the runs of another."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import httpx
import pytest

from ql3.adapters.worker.client import IngressClient
from ql3.adapters.worker.ledger import Mode
from ql3.adapters.worker.settings import WorkerSettings
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.e2e.conftest import CADENCE_S, LEASE_TTL_S, Cluster, Ledger, alive, wait_for
from tests.worker.fakes import (
    DropsFirstGrantingClaimAnswer,
    PausesFirstGrantingClaimAnswer,
    WorkerThread,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

NO_WAIT = Backoff(initial_ms=0, cap_ms=0)
IDEMPOTENT = RetryPolicy(retry_on_lost=True, max_attempts=2, safety=Safety.IDEMPOTENT,
                         backoff=NO_WAIT)
UNSAFE = RetryPolicy(retry_on_lost=True, max_attempts=2, safety=Safety.UNSAFE, backoff=NO_WAIT)
# Long enough to be running when the worker dies; a retried attempt is quick.
BLOCK_FIRST = {"seconds": 0.1, "first_attempt_seconds": 120}


def _lost_lease(document: dict[str, Any], number: int = 1) -> dict[str, Any]:
    (attempt,) = [a for a in document["attempts"] if a["number"] == number]
    lease: dict[str, Any] = attempt["lease"]
    return lease


def _events(document: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in document["events"] if e["type"] == kind]


def test_a_quick_tasks_succeed_and_release_their_leases(cluster: Cluster, ledger: Ledger) -> None:
    run_ids = [cluster.submit("a.double", {"n": n}) for n in range(8)]
    worker = cluster.start_worker("a", "worker-a", ledger, concurrency=4)
    cluster.wait_status(run_ids, {"succeeded"})
    for n, run_id in enumerate(run_ids):
        document = cluster.show(run_id)
        assert document["output"] == {"doubled": 2 * n}
        (attempt,) = document["attempts"]
        assert attempt["status"] == "succeeded"
        assert attempt["lease"]["status"] == "released"
        assert attempt["lease"]["release_reason"] == "completed"
        assert attempt["lease"]["version"] == 2
    assert len(ledger.entries("double")) == 8
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0, worker.output()
    assert "drained and closed" in worker.output()


def test_b_sigkill_waits_for_evidence_then_retries_only_the_safe_run(
    cluster: Cluster, ledger: Ledger
) -> None:
    safe = cluster.submit("b.sleep", BLOCK_FIRST, IDEMPOTENT)
    unsafe = cluster.submit("b.sleep", BLOCK_FIRST, UNSAFE)
    bare = cluster.submit("b.sleep", BLOCK_FIRST)
    runs = [safe, unsafe, bare]
    worker = cluster.start_worker("b", "worker-b", ledger, concurrency=3)
    wait_for(lambda: len(ledger.entries("start")) == 3, what="three tasks to start")
    cluster.wait_status(runs, {"running"})
    slot_pids = {e["pid"] for e in ledger.entries("start")}

    worker.signal(signal.SIGKILL)
    worker.wait()
    # The tasks die with the worker: nothing of the old process keeps running.
    wait_for(lambda: not any(alive(pid) for pid in slot_pids), 5, "the slots to die")

    # Without evidence nothing is lost, retried or failed, however long we wait.
    time.sleep(LEASE_TTL_S + 3 * CADENCE_S)
    for run_id in runs:
        document = cluster.show(run_id)
        assert document["status"] == "running"
        (attempt,) = document["attempts"]
        assert attempt["status"] == "running"
        assert attempt["awaiting_evidence_since_ms"] is not None
        assert _events(document, "attempt_lost") == []
    shown = cluster.ql3("runs", "show", bare, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["attempts"][0]["awaiting_evidence_since_ms"] is not None
    text = cluster.ql3("runs", "show", bare)
    assert "waiting for not-running evidence since" in text.stdout

    # The same worker id registers again: its old process is gone.
    again = cluster.start_worker("b", "worker-b", ledger, concurrency=3)
    cluster.wait_status(runs, {"succeeded", "failed"})
    assert cluster.status(safe) == "succeeded"
    assert cluster.status(unsafe) == "failed"
    assert cluster.status(bare) == "failed"
    for run_id in runs:
        document = cluster.show(run_id)
        lease = _lost_lease(document)
        assert (lease["status"], lease["release_reason"], lease["version"]) == (
            "released", "lease_expired", 2
        )
        (lost,) = _events(document, "attempt_lost")
        assert lost["data"]["evidence"] == "session_replaced"
    safe_document = cluster.show(safe)
    assert [a["status"] for a in safe_document["attempts"]] == ["lost", "succeeded"]
    assert safe_document["output"] == {"slept": 0.1, "attempt": 2}
    assert [len(cluster.show(r)["attempts"]) for r in (unsafe, bare)] == [1, 1]
    # The side-effect ledger: the unsafe task ran once, the safe one twice (1 lost, 1 done).
    assert [e["attempt"] for e in ledger.entries("start", unsafe)] == [1]
    assert [e["attempt"] for e in ledger.entries("start", safe)] == [1, 2]
    assert [e["attempt"] for e in ledger.entries("end", safe)] == [2]
    assert ledger.entries("end", unsafe) == ledger.entries("end", bare) == []
    again.signal(signal.SIGTERM)
    assert again.wait() == 0, again.output()


class OldWorker:
    """A worker process as seen on the wire: it claimed an attempt, then stopped talking."""

    def __init__(self, node: str, worker_id: str, task: str) -> None:
        self.http = httpx.Client(base_url=node, timeout=10)
        body = self.http.post(
            "/v1/sessions", json={"worker_id": worker_id, "capacity": 1, "tasks": [task]}
        ).json()
        self.session = body["session_id"]
        self.auth = {"Authorization": f"Bearer {body['secret']}"}
        self.fence: dict[str, Any] = {}

    def post(self, command: str, body: Any = None) -> httpx.Response:
        return self.http.post(f"/v1/sessions/{self.session}/{command}", json=body,
                              headers=self.auth)

    def take_one(self) -> str:
        grants: list[dict[str, Any]] = []

        def granted() -> bool:
            answer = self.post("claim", {"limit": 1, "wait_ms": 1000})
            assert answer.status_code == 200, answer.text
            grants.extend(answer.json()["grants"])
            return bool(grants)

        wait_for(granted, 10, "a grant")
        (grant,) = grants
        self.fence = {k: grant[k] for k in ("attempt_id", "generation", "version", "token")}
        return str(grant["attempt_id"])

    def fenced(self, command: str, **extra: Any) -> tuple[int, str | None]:
        """Send the old fence: the call's status and error when it was refused as a whole,
        else its one item's."""
        response = self.post(command, {"items": [{**self.fence, **extra}]})
        body = response.json()
        if response.status_code != 200:
            return response.status_code, body.get("error")
        (item,) = body["results"]
        return int(item["status"]), item.get("error")


def test_c_after_recovery_the_old_fence_gets_409_and_changes_nothing(
    cluster: Cluster, ledger: Ledger
) -> None:
    # 1. The worker id comes back (a restarted process): its old session is replaced.
    safe = cluster.submit("c.sleep", {"seconds": 0.1}, IDEMPOTENT)
    old = OldWorker(cluster.nodes[0], "worker-c", "c.sleep")
    old.take_one()
    restarted = cluster.start_worker("c", "worker-c", ledger)
    cluster.wait_status([safe], {"succeeded"}, timeout=30)
    before = cluster.show(safe)
    assert [a["status"] for a in before["attempts"]] == ["lost", "succeeded"]
    for command, extra in (("renew", {}), ("complete", {"succeeded": True, "output": "late"})):
        status, error = old.fenced(command, **extra)
        assert (status, error) == (409, "session_rejected")  # its session was replaced
    assert cluster.show(safe) == before

    # 2. The session is still open, an operator attests the attempt stopped: the fence is void.
    bare = cluster.submit("c2.sleep", {"seconds": 0.1})
    partitioned = OldWorker(cluster.nodes[0], "worker-c2", "c2.sleep")
    attempt_id = partitioned.take_one()
    time.sleep(LEASE_TTL_S + CADENCE_S)
    assert cluster.status(bare) == "running"  # expired, but no evidence yet
    attested = cluster.ql3("attempts", "attest-stopped", attempt_id, "--reason", "host is off")
    assert attested.returncode == 0, attested.stderr
    cluster.wait_status([bare], {"failed"})
    before = cluster.show(bare)
    (lost,) = _events(before, "attempt_lost")
    assert lost["data"]["evidence"] == "operator_attested"
    for command, extra in (("renew", {}), ("complete", {"succeeded": True})):
        assert partitioned.fenced(command, **extra) == (409, "fence_rejected")
    assert cluster.show(bare) == before
    restarted.signal(signal.SIGTERM)
    assert restarted.wait() == 0


def test_d_sigterm_drains_without_losing_a_run(cluster: Cluster, ledger: Ledger) -> None:
    running = [cluster.submit("d.sleep", {"seconds": 1.5}) for _ in range(3)]
    worker = cluster.start_worker("d", "worker-d", ledger, concurrency=3)
    wait_for(lambda: len(ledger.entries("start")) == 3, what="three tasks to start")
    waiting = [cluster.submit("d.sleep", {"seconds": 0.1}) for _ in range(2)]
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.output()
    for run_id in running:
        document = cluster.show(run_id)
        assert document["status"] == "succeeded"
        assert [a["status"] for a in document["attempts"]] == ["succeeded"]
    assert [cluster.status(r) for r in waiting] == ["queued", "queued"]
    # Another worker takes what the drained one left.
    other = cluster.start_worker("d", "worker-d2", ledger, concurrency=2)
    cluster.wait_status(waiting, {"succeeded"})
    for run_id in [*running, *waiting]:
        assert len(ledger.entries("start", run_id)) == 1
        assert _events(cluster.show(run_id), "attempt_lost") == []
    other.signal(signal.SIGTERM)
    assert other.wait() == 0


def test_e_two_nodes_recover_each_attempt_exactly_once(cluster: Cluster, ledger: Ledger) -> None:
    if len(cluster.nodes) < 2:
        cluster.start_node()
    runs = [cluster.submit("e.sleep", BLOCK_FIRST, IDEMPOTENT) for _ in range(4)]
    first = cluster.start_worker("e", "worker-e", ledger, concurrency=4, node=0)
    wait_for(lambda: len(ledger.entries("start")) == 4, what="four tasks to start")
    first.signal(signal.SIGKILL)
    first.wait()
    moved = cluster.start_worker("e", "worker-e", ledger, concurrency=4, node=1)
    cluster.wait_status(runs, {"succeeded"}, timeout=30)
    for run_id in runs:
        document = cluster.show(run_id)
        assert [a["status"] for a in document["attempts"]] == ["lost", "succeeded"]
        assert len(_events(document, "attempt_lost")) == 1
        assert len(_events(document, "retry_scheduled")) == 1
        assert len(_events(document, "attempt_created")) == 1
        lease = _lost_lease(document)
        assert (lease["status"], lease["release_reason"], lease["version"]) == (
            "released", "lease_expired", 2
        )
        assert [e["attempt"] for e in ledger.entries("start", run_id)] == [1, 2]
    moved.signal(signal.SIGTERM)
    assert moved.wait() == 0
    # A node stops gracefully on SIGTERM too.
    (second,) = [p for p in cluster.processes if p.name == "node-1"]
    second.signal(signal.SIGTERM)
    assert second.wait() == 0, second.output()
    assert "Finished server process" in second.output()


def _in_process_worker(
    cluster: Cluster, prefix: str, worker_id: str, transport: httpx.BaseTransport,
    concurrency: int,
) -> WorkerThread:
    settings = WorkerSettings(
        ingress_url=cluster.nodes[0],
        app_spec="tests.e2e.tasks:app",
        worker_id=worker_id,
        tasks=tuple(f"{prefix}.{name}" for name in ("double", "sleep")),
        concurrency=concurrency,
    )
    return WorkerThread(
        settings, client_factory=lambda s: IngressClient(s.ingress_url, transport=transport)
    ).start()


def test_f_a_drain_hands_back_work_that_never_began(
    cluster: Cluster, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QL3_E2E_LEDGER", str(ledger.path))
    monkeypatch.setenv("QL3_E2E_PREFIX", "f")
    runs = [cluster.submit("f.double", {"n": n}) for n in range(3)]  # no retry policy
    workers: list[WorkerThread] = []

    def drain_first() -> None:
        # The worker is told to drain while the answer granting all three is on its way.
        worker = workers[0].worker
        worker.request_drain()
        wait_for(lambda: worker.ledger.mode is Mode.DRAINING, 5, "the worker to drain")

    transport = PausesFirstGrantingClaimAnswer(drain_first)
    workers.append(_in_process_worker(cluster, "f", "worker-f", transport, concurrency=3))
    assert workers[0].join(timeout=30) == 0
    assert sorted(transport.paused[0]) == sorted(
        cluster.show(r)["attempts"][0]["id"] for r in runs
    )
    assert workers[0].worker.released == 3
    assert ledger.entries() == []  # none of them began
    for run_id in runs:
        document = cluster.show(run_id)
        assert document["status"] == "queued"
        (attempt,) = document["attempts"]
        # Pristine again (same attempt, no lease of its own): its lease was released.
        assert (attempt["status"], attempt["session_id"], attempt["lease"]) == (
            "claimed", None, None
        )
        (released,) = _events(document, "attempt_released")
        assert released["data"]["cause"] == "drain"
        assert released["data"]["lease_version"] == 2
        assert _events(document, "attempt_lost") == []
    # Another worker runs them, each once, as the same attempt under a new lease generation.
    other = cluster.start_worker("f", "worker-f2", ledger, concurrency=3)
    cluster.wait_status(runs, {"succeeded"})
    for n, run_id in enumerate(runs):
        document = cluster.show(run_id)
        assert document["output"] == {"doubled": 2 * n}
        (attempt,) = document["attempts"]
        assert (attempt["number"], attempt["status"]) == (1, "succeeded")
        assert attempt["lease"]["generation"] == 2
        assert len(ledger.entries("double", run_id)) == 1
        assert _events(document, "attempt_lost") == []
    other.signal(signal.SIGTERM)
    assert other.wait() == 0, other.output()


def test_g_a_lost_claim_answer_is_handed_back_while_the_worker_lives(
    cluster: Cluster, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QL3_E2E_LEDGER", str(ledger.path))
    monkeypatch.setenv("QL3_E2E_PREFIX", "g")
    runs = [cluster.submit("g.sleep", {"seconds": 0.1}) for _ in range(2)]  # no retry policy
    transport = DropsFirstGrantingClaimAnswer()
    worker = _in_process_worker(cluster, "g", "worker-g", transport, concurrency=2)
    cluster.wait_status(runs, {"succeeded", "failed"})
    worker.worker.request_drain()
    assert worker.join(timeout=30) == 0
    attempt_ids = sorted(cluster.show(r)["attempts"][0]["id"] for r in runs)
    assert sorted(transport.dropped[0]) == attempt_ids
    for run_id in runs:
        document = cluster.show(run_id)
        assert document["status"] == "succeeded"
        (attempt,) = document["attempts"]
        assert (attempt["number"], attempt["status"]) == (1, "succeeded")
        started = _events(document, "attempt_started")
        (released,) = _events(document, "attempt_released")
        assert released["data"]["cause"] == "not_held"
        # The worker's next claim did not name it: handed back at once, not at lease expiry.
        assert released["at"] - started[0]["at"] < LEASE_TTL_S * 1000
        assert len(started) == 2
        assert _events(document, "attempt_lost") == []
        assert [e["attempt"] for e in ledger.entries("start", run_id)] == [1]


def test_h_a_worker_outlives_its_nodes(cluster: Cluster, ledger: Ledger) -> None:
    """Two nodes: the first is killed, the worker moves to the second; the second stops too,
    the worker waits past the lease TTL (at least 5 s) for a node, and goes on with the same
    session once a node listens at the first's address again."""
    first, second = len(cluster.nodes), len(cluster.nodes) + 1
    cluster.start_node()
    cluster.start_node()
    nodes = {p.name: p for p in cluster.processes}
    worker = cluster.start_worker("h", "worker-h", ledger, node=(first, second))
    wait_for(lambda: "registered session" in worker.output(), 20, "the worker to register")
    nodes[f"node-{first}"].signal(signal.SIGKILL)
    nodes[f"node-{first}"].wait()
    runs = [cluster.submit("h.double", {"n": n}) for n in range(3)]
    cluster.wait_status(runs, {"succeeded"})
    assert "moving to " + cluster.nodes[second] in worker.output()

    nodes[f"node-{second}"].signal(signal.SIGTERM)
    assert nodes[f"node-{second}"].wait() == 0
    later = [cluster.submit("h.double", {"n": n}) for n in range(3, 6)]
    time.sleep(max(LEASE_TTL_S, 5.0) + 1.5)
    assert worker.popen.poll() is None, worker.output()
    assert "has not answered" in worker.output()
    port = int(cluster.nodes[first].rsplit(":", 1)[1])
    cluster.start_node(port=port)
    cluster.wait_status(later, {"succeeded"})
    output = worker.output()
    assert output.count("registered session") == 1, output
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.output()
    assert "Traceback" not in worker.output()
