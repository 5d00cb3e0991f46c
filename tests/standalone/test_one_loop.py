"""Standalone executes through the worker SDK's loop (ADR 0023): the in-process transport speaks
the worker protocol as the HTTP client does, to the worker commands of the process's own store,
and the pool's slots give the ledger what a child-process slot would (a task's outcome, a stop,
a task that could not start), with tasks on threads of this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ql3.adapters.standalone.pool import InProcessPool, PoolSlots
from ql3.adapters.worker.inprocess import InProcessTransport
from ql3.adapters.worker.ledger import Ledger, Phase
from ql3.adapters.worker.protocol import ClaimResult, Completion, GrantData
from ql3.application.queries import RunQueries
from ql3.bootstrap import standalone
from ql3.domain.model import RunStatus
from tests.standalone.support import wait_for
from tests.worker.async_tasks import TASKS


@pytest.fixture
def container(tmp_path: Path) -> Iterator[Any]:
    built = standalone.build(database_path=str(tmp_path / "ql3.sqlite"))
    try:
        yield built
    finally:
        built.store().close()


def test_the_in_process_transport_claims_renews_and_completes_through_the_worker_commands(
    container: Any,
) -> None:
    transport = InProcessTransport(container.core.worker_commands())
    registration = transport.register("standalone", 2, ["plain"])
    assert registration.lease_ttl_ms == container.core.worker_commands().lease_ttl_ms
    run_id = container.core.admission().submit("plain", 1)

    claimed = transport.claim(2, held=())
    (grant,) = claimed.grants
    assert (grant.run_id, grant.task, grant.input, claimed.status) == (run_id, "plain", 1, "active")
    assert claimed.expires_in_s(grant) > 0 and claimed.sent_at > 0

    renewed = transport.renew([grant.fence]).items[grant.attempt_id]
    assert renewed.ok and renewed.outcome == "renewed" and (renewed.expires_in_s or 0) > 0

    finished = transport.claim(
        1, held=(grant.attempt_id,), completions=[Completion(grant.fence, True, output=2)]
    )
    assert finished.completed[grant.attempt_id].ok and finished.grants == ()
    assert finished.no_grant == "nothing_queued"
    view = RunQueries(container.store().unit_of_work).show(run_id)
    assert view is not None and view.run.status is RunStatus.SUCCEEDED and view.run.output == 2

    # A fence that is no longer live is refused per item, as the ingress answers it.
    refused = transport.renew([grant.fence]).items[grant.attempt_id]
    assert not refused.ok and refused.status == 409
    assert refused.error == "fence_rejected" and refused.reason and refused.message
    assert transport.other_calls == 2  # the two renewals; claims are not counted
    transport.close()


def _grant(attempt_id: str, task: str, payload: Any, timeout_ms: int | None = None) -> GrantData:
    return GrantData(
        run_id=f"run-{attempt_id}",
        attempt_id=attempt_id,
        attempt_number=1,
        task=task,
        input=payload,
        generation=1,
        version=1,
        token="t" * 22,
        expires_at_ms=60_000,
        idempotency_key=f"run-{attempt_id}",
        timeout_ms=timeout_ms,
    )


class Loop:
    """A ledger over the pool's slots, as the runner builds it, fed by hand."""

    def __init__(self, capacity: int) -> None:
        self.ended = threading.Event()
        self.pool = InProcessPool(TASKS, self.ended.set)
        self.slots = PoolSlots(self.pool, capacity, self.ended.set)
        self.ledger = Ledger(capacity, claims_alongside=False)
        self.ledger.add_slots(self.slots.handles)

    def grant(self, *grants: GrantData) -> None:
        with self.ledger.lock:
            plan = self.ledger.begin_claim(time.monotonic())
        assert plan is not None and plan.limit >= len(grants)
        answer = ClaimResult(
            now_ms=0,
            status="active",
            completed={},
            released=(),
            grants=grants,
            no_grant=None,
            detail=None,
            sent_at=time.monotonic(),
        )
        self.ledger.end_claim(plan, answer)

    def phase(self, attempt_id: str) -> Phase | None:
        self.slots.deliver(self.ledger)
        held = self.ledger.get(attempt_id)
        return held.phase if held is not None else None


def test_the_pool_slots_give_the_ledger_outcomes_and_stops(tmp_path: Path) -> None:
    loop = Loop(2)
    marker = tmp_path / "nap"
    loop.grant(_grant("a1", "plain", 1), _grant("a2", "nap", {"marker": str(marker)}))
    assert loop.ledger.free_slots == 0
    wait_for(lambda: loop.phase("a1") is Phase.FINISHED, 10, "the plain task to finish")
    held = loop.ledger.get("a1")
    assert held is not None and held.outcome is not None and held.outcome.output == 2
    assert loop.ledger.free_slots == 1  # its slot takes the next grant

    # A stop cancels the async task on its thread; however it ends, the ledger is told it was
    # stopped (it is then abandoned, not completed).
    wait_for(marker.exists, 10, "the async task to start")
    kills = loop.ledger.stop_running("stopped by the test", "worker_stopped")
    assert [attempt for _, attempt in kills] == ["a2"]
    for slot, attempt_id in kills:
        assert slot.kill(attempt_id)
    wait_for(lambda: loop.phase("a2") is Phase.STOPPED, 10, "the stop to be reported")
    assert Path(f"{marker}.cancelled").exists()
    assert loop.ledger.free_slots == 2


def test_a_task_past_its_timeout_is_reported_at_once_and_its_thread_is_forgotten(
    tmp_path: Path,
) -> None:
    loop = Loop(1)
    marker = tmp_path / "stubborn"
    loop.grant(_grant("a1", "stubborn", {"marker": str(marker)}, timeout_ms=1))
    wait_for(marker.exists, 10, "the task to start")
    kills = loop.ledger.timed_out(time.monotonic() + 1)
    assert len(kills) == 1
    for slot, attempt_id in kills:
        slot.kill(attempt_id)  # the task ignores its cancellation: its thread runs on
        loop.slots.detach(attempt_id)
    assert loop.phase("a1") is Phase.FINISHED
    held = loop.ledger.get("a1")
    assert held is not None
    completion = held.completion()
    assert completion.timed_out and not completion.succeeded
    assert loop.ledger.free_slots == 1


def test_a_grant_the_pool_cannot_start_is_handed_back(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = Loop(1)

    def no_thread(self: InProcessPool, execution: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(InProcessPool, "start", no_thread)
    loop.grant(_grant("a1", "plain", 1))
    assert loop.phase("a1") is Phase.UNSTARTED
    held = loop.ledger.get("a1")
    assert held is not None and held.release().cause == "slot_failed"
    assert loop.ledger.free_slots == 1
