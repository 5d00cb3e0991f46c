"""Prefetch: a worker accepts offers beyond its free slots, queues them in offer order, renews
them while they wait and activates them as slots free; a drain hands them back at once; a
self-fenced or killed worker leaves them to recovery, which needs no evidence for them because
they never started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.worker.client import (
    MAX_BATCH_ITEMS,
    BatchResult,
    Fence,
    IngressClient,
)
from adapters.worker.runtime import WorkerSettings
from domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus, SessionStatus
from domain.policy import Backoff, RetryPolicy, Safety
from tests.worker.conftest import (
    LEASE_TTL_S,
    Ledger,
    LocalNode,
    WorkerThread,
    worker_settings,
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
NO_WAIT = Backoff(initial_ms=0, cap_ms=0)
SAFE = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT, backoff=NO_WAIT)
UNSAFE = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.UNSAFE, backoff=NO_WAIT)
# Long on attempt 1 (the worker is stopped in the middle of it), quick on a retry.
BLOCK_FIRST: dict[str, Any] = {"seconds": 0.1, "first_attempt_seconds": 120}


class RecordingClient(IngressClient):
    """Records the fenced batches sent: (command, attempt ids) in the order they were sent."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self.calls: list[tuple[str, list[str]]] = []
        self._guard = threading.Lock()

    def _batch(self, command: str, items: list[dict[str, Any]]) -> BatchResult:
        with self._guard:
            self.calls.append((command, [i["attempt_id"] for i in items]))
        return super()._batch(command, items)

    def sent(self, command: str) -> list[str]:
        with self._guard:
            return [a for c, ids in self.calls if c == command for a in ids]

    def largest(self, *commands: str) -> int:
        with self._guard:
            return max((len(ids) for c, ids in self.calls if c in commands), default=0)


def _recording(settings: WorkerSettings) -> RecordingClient:
    return RecordingClient(settings.ingress_url)


def _accepted(node: LocalNode, run_id: str) -> bool:
    """Its attempt took the offer (token bound) and did not cross the start barrier."""
    (attempt,) = node.attempts(run_id)
    leases = node.leases(run_id)
    return (
        attempt.status is AttemptStatus.CLAIMED
        and len(leases) == 1
        and leases[0].status is LeaseStatus.LEASED
        and leases[0].token_hash is not None
        and node.run(run_id).status is RunStatus.DISPATCHING
    )


def _lost_event(node: LocalNode, run_id: str) -> dict[str, Any]:
    with node.store.unit_of_work() as uow:
        (lost,) = [e.event for e in uow.runs.events_of(run_id)
                   if e.event.type.value == "attempt_lost"]
    return dict(lost.data)


def _session(node: LocalNode, session_id: str | None) -> Any:
    assert session_id is not None
    with node.store.unit_of_work() as uow:
        return uow.sessions.get(session_id)


def test_queued_attempts_are_renewed_and_activated_in_offer_order(
    node: LocalNode, ledger: Ledger
) -> None:
    blocker = node.admission.submit("e2e.sleep", {"seconds": 2 * LEASE_TTL_S})
    worker = WorkerThread(
        worker_settings(node, concurrency=1, prefetch=3), client_factory=_recording
    ).start()
    node.wait_for(lambda: len(ledger.entries("start")) == 1)
    waiting = [node.admission.submit("e2e.double", {"n": n}) for n in range(3)]

    # The one slot is busy: the three offers are accepted and wait; none has run.
    node.wait_for(lambda: all(_accepted(node, r) for r in waiting))
    assert ledger.entries("double") == []
    assert node.run(blocker).status is RunStatus.RUNNING
    assert _session(node, worker.worker.session_id).capacity == 4  # concurrency + prefetch

    node.wait_for(lambda: all(node.run(r).status.is_terminal for r in [blocker, *waiting]),
                  timeout=20)
    worker.worker.request_drain()
    assert worker.join() == 0
    client = worker.worker._client
    assert isinstance(client, RecordingClient)

    for run_id in [blocker, *waiting]:
        assert node.run(run_id).status is RunStatus.SUCCEEDED
        assert len(node.attempts(run_id)) == 1  # nothing was lost on the way
        (lease,) = node.leases(run_id)
        assert (lease.status, lease.release_reason, lease.version) == (
            LeaseStatus.RELEASED, ReleaseReason.COMPLETED, 2
        )
    for run_id in waiting:
        assert node.events(run_id)[-5:] == [
            "attempt_offered", "attempt_accepted", "attempt_activated", "attempt_running",
            "attempt_succeeded",
        ]
    # They waited longer than a lease lives: their leases were renewed while queued.
    waiting_attempts = {node.attempts(r)[0].id for r in waiting}
    assert waiting_attempts <= set(client.sent("renew"))
    # Accepted in offer order, activated in the same order, one slot at a time.
    accepted = [a for a in client.sent("accept") if a in waiting_attempts]
    assert sorted(accepted) == sorted(waiting_attempts)
    assert client.sent("activate") == accepted
    assert client.largest("start", "activate") == 1
    assert [e["run_id"] for e in ledger.entries("double")] == _runs_of(node, accepted, waiting)


def test_many_short_tasks_move_in_batches(node: LocalNode, ledger: Ledger) -> None:
    run_ids = [node.admission.submit("e2e.double", {"n": n}) for n in range(40)]
    worker = WorkerThread(
        worker_settings(node, concurrency=4, prefetch=12), client_factory=_recording
    ).start()
    node.wait_for(lambda: all(node.run(r).status is RunStatus.SUCCEEDED for r in run_ids))
    worker.worker.request_drain()
    assert worker.join() == 0
    client = worker.worker._client
    assert isinstance(client, RecordingClient)
    assert sorted(e["run_id"] for e in ledger.entries("double")) == sorted(run_ids)
    assert all(len(node.attempts(r)) == 1 for r in run_ids)
    started = client.sent("start") + client.sent("activate")
    assert len(started) == len(set(started)) == len(run_ids)
    # Never more at once than there are slots; several freed slots share one call.
    assert client.largest("start", "activate") <= 4
    calls = [ids for command, ids in client.calls if command in ("start", "activate")]
    assert len(calls) < len(run_ids)
    assert len(client.sent("complete")) == len(run_ids)
    assert sum(1 for c, _ in client.calls if c == "complete") < len(run_ids)


def _runs_of(node: LocalNode, attempt_ids: Sequence[str], run_ids: Sequence[str]) -> list[str]:
    by_attempt = {node.attempts(r)[0].id: r for r in run_ids}
    return [by_attempt[a] for a in attempt_ids]


def test_a_drain_hands_back_queued_attempts_at_once(node: LocalNode, ledger: Ledger) -> None:
    blocker = node.admission.submit("e2e.sleep", {"seconds": 3.0})
    worker = WorkerThread(worker_settings(node, concurrency=1, prefetch=2)).start()
    node.wait_for(lambda: len(ledger.entries("start")) == 1)
    safe = node.admission.submit("e2e.double", {"n": 1}, SAFE)
    bare = node.admission.submit("e2e.double", {"n": 2})
    node.wait_for(lambda: _accepted(node, safe) and _accepted(node, bare))

    worker.worker.request_drain()
    # Handed back while the running task is still running, not after it.
    node.wait_for(lambda: all(node.leases(r)[0].status is LeaseStatus.RELEASED
                              for r in (safe, bare)), timeout=2.0)
    assert node.run(blocker).status is RunStatus.RUNNING
    assert ledger.entries("end") == []
    assert worker.join() == 0

    assert node.run(blocker).status is RunStatus.SUCCEEDED
    for run_id in (safe, bare):
        first = node.attempts(run_id)[0]
        assert first.status is AttemptStatus.LOST
        assert first.lost_evidence is not None
        assert first.lost_evidence.value == "worker_abandoned"
        lease = node.leases(run_id)[0]
        assert (lease.status, lease.release_reason, lease.version) == (
            LeaseStatus.RELEASED, ReleaseReason.ABANDONED, 2
        )
        assert _lost_event(node, run_id)["previous_status"] == "claimed"
    # What happens next is the run's policy: the safe run waits for another worker with a
    # fresh attempt; the run without a policy ends failed, without having run.
    node.wait_for(lambda: node.run(safe).status is RunStatus.QUEUED)
    assert [a.status for a in node.attempts(safe)] == [AttemptStatus.LOST, AttemptStatus.CLAIMED]
    node.wait_for(lambda: node.run(bare).status is RunStatus.FAILED)
    assert ledger.entries("double") == []
    assert _session(node, worker.worker.session_id).status is SessionStatus.CLOSED


def test_self_fencing_drops_queued_attempts_without_reporting_them(
    node: LocalNode, ledger: Ledger
) -> None:
    blocker = node.admission.submit("e2e.sleep", BLOCK_FIRST, SAFE)
    worker = WorkerThread(worker_settings(node, concurrency=1, prefetch=1)).start()
    node.wait_for(lambda: len(ledger.entries("start")) == 1)
    (started,) = ledger.entries("start")
    queued = node.admission.submit("e2e.double", {"n": 3}, SAFE)
    node.wait_for(lambda: _accepted(node, queued))

    node.stop()  # renewals fail from now on
    deadline = time.monotonic() + LEASE_TTL_S
    while _alive(started["pid"]):  # the running task is stopped before its lease expires
        assert time.monotonic() < deadline, "the task was not stopped before its lease expired"
        time.sleep(0.02)
    expires_at_ms = node.leases(queued)[0].expires_at_ms
    while time.time() * 1000 < expires_at_ms + 100:  # the queued attempt's lease expires too
        time.sleep(0.05)
    node.start()

    # The running task is abandoned (evidence); the queued attempt, which never started, is
    # recovered without evidence. Both safe runs get a second attempt and succeed.
    node.wait_for(lambda: all(node.run(r).status is RunStatus.SUCCEEDED
                              for r in (blocker, queued)), timeout=20)
    lost = node.attempts(queued)[0]
    assert lost.status is AttemptStatus.LOST
    assert lost.lost_evidence is None
    assert "evidence_recorded" not in node.events(queued)
    assert "evidence" not in _lost_event(node, queued)
    first = node.attempts(blocker)[0]
    assert first.lost_evidence is not None and first.lost_evidence.value == "worker_abandoned"
    assert [e["attempt"] for e in ledger.entries("double")] == [2]
    worker.worker.request_drain()
    assert worker.join() == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_sigkill_with_queued_attempts_loses_nothing(node: LocalNode, ledger: Ledger) -> None:
    blocker = node.admission.submit("e2e.sleep", BLOCK_FIRST, SAFE)
    process = subprocess.Popen(
        [sys.executable, "-m", "adapters.cli.main", "worker", "--ingress", node.url,
         "--app", "tests.e2e.tasks:app", "--worker-id", "killed", "--concurrency", "1",
         "--prefetch", "3", "--poll-interval", "0.1", "--log-level", "warning"],
        cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        node.wait_for(lambda: len(ledger.entries("start")) == 1, timeout=30)
        (started,) = ledger.entries("start")
        safe = node.admission.submit("e2e.sleep", {"seconds": 0.1}, SAFE)
        unsafe = node.admission.submit("e2e.sleep", {"seconds": 0.1}, UNSAFE)
        bare = node.admission.submit("e2e.sleep", {"seconds": 0.1})
        queued = [safe, unsafe, bare]
        node.wait_for(lambda: all(_accepted(node, r) for r in queued))
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    node.wait_for(lambda: not _alive(started["pid"]), timeout=5)  # its task died with it

    # Without any evidence, the queued attempts are lost once their leases expire, and each
    # run goes as its policy says. The running one waits for evidence.
    node.wait_for(lambda: all(node.attempts(r)[0].status is AttemptStatus.LOST
                              for r in queued), timeout=10)
    for run_id in queued:
        first = node.attempts(run_id)[0]
        assert first.lost_evidence is None
        lease = node.leases(run_id)[0]
        assert (lease.status, lease.release_reason, lease.version) == (
            LeaseStatus.RELEASED, ReleaseReason.LEASE_EXPIRED, 2
        )
        lost = _lost_event(node, run_id)
        assert lost["previous_status"] == "claimed" and "evidence" not in lost
    node.wait_for(lambda: node.run(safe).status is RunStatus.QUEUED)
    node.wait_for(lambda: node.run(unsafe).status is RunStatus.FAILED)
    node.wait_for(lambda: node.run(bare).status is RunStatus.FAILED)
    assert node.run(blocker).status is RunStatus.RUNNING
    assert node.attempts(blocker)[0].status is AttemptStatus.RUNNING

    # The same worker id comes back: the blocker gets its evidence; both safe runs finish.
    again = WorkerThread(worker_settings(node, worker_id="killed", prefetch=2)).start()
    node.wait_for(lambda: all(node.run(r).status is RunStatus.SUCCEEDED
                              for r in (blocker, safe)), timeout=20)
    again.worker.request_drain()
    assert again.join() == 0
    starts = {r: [e["attempt"] for e in ledger.entries("start") if e["run_id"] == r]
              for r in [blocker, *queued]}
    assert starts == {blocker: [1, 2], safe: [2], unsafe: [], bare: []}


# --- settings, command line and client -----------------------------------------------------


def test_settings_bound_the_capacity() -> None:
    base: dict[str, Any] = {
        "ingress_url": "http://x", "app_spec": "m:a", "worker_id": "w", "tasks": ("t",)
    }
    settings = WorkerSettings(**base, concurrency=8, prefetch=56)
    assert (settings.capacity, settings.low_water) == (64, 28)
    assert WorkerSettings(**base, concurrency=2).low_water == 0
    bad_ones: list[dict[str, Any]] = [{"prefetch": -1}, {"concurrency": 1000, "prefetch": 25}]
    for bad in bad_ones:
        with pytest.raises(ValueError, match="prefetch"):
            WorkerSettings(**base, **bad)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [(["--prefetch", "-1"], "--prefetch"),
     (["--concurrency", "1000", "--prefetch", "25"], "concurrency + prefetch")],
)
def test_the_command_refuses_a_bad_prefetch(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from adapters.cli.main import main

    argv = ["worker", "--ingress", "http://127.0.0.1:9", "--app", "tests.e2e.tasks:app",
            "--worker-id", "w", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("ql3: ")]
    assert needle in line


def test_a_long_batch_travels_in_calls_the_ingress_takes() -> None:
    seen: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/sessions":
            return httpx.Response(201, json={
                "session_id": "s", "secret": "k", "replaced_session_ids": [],
                "lease_ttl_ms": 30_000, "heartbeat_interval_ms": 10_000, "now_ms": 0,
            })
        items = json.loads(request.content)["items"]
        seen.append(len(items))
        now_ms = 1_000 * len(seen)
        return httpx.Response(200, json={"now_ms": now_ms, "results": [
            {"attempt_id": i["attempt_id"], "status": 200, "expires_at_ms": now_ms + 5_000}
            for i in items
        ]})

    client = IngressClient("http://ingress", transport=httpx.MockTransport(answer))
    client.register("w", 1, ["t"])
    fences = [Fence(attempt_id=f"a{n:04d}", generation=1, version=1, token="t" * 32)
              for n in range(MAX_BATCH_ITEMS + 44)]
    result = client.renew(fences)
    assert seen == [MAX_BATCH_ITEMS, 44]
    assert len(result.items) == len(fences)
    # Each item keeps its own call's clock: the time its lease had left is exact.
    assert {item.expires_in_s for item in result.items.values()} == {5.0}
