"""The claim loop and the ledger against a fake node (its HTTP API in memory, behind the real
client): completions travel with the next claim, the ``held`` statement is exact, a lost claim
answer leaves nothing held, a drain hands back what never began, a self-fence kills and
abandons, a slot that cannot take its job hands it back, and the client repeats only what the
node did not refuse."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from ql3.adapters.worker.client import IngressClient, IngressRefused, IngressUnavailable
from ql3.adapters.worker.ledger import Ledger, Mode, Phase
from ql3.adapters.worker.settings import WorkerFailed, WorkerSettings
from tests.worker.fakes import URL, FakeChildren, FakeNode, WorkerThread


def _settings(concurrency: int = 1, **extra: Any) -> WorkerSettings:
    values: dict[str, Any] = {"poll_interval_s": 1.0, "give_up_s": 5.0, **extra}
    return WorkerSettings(
        ingress_url=URL,
        app_spec="unused:app",
        worker_id="w1",
        tasks=("t.double", "t.sleep", "t.fail", "t.big"),
        concurrency=concurrency,
        **values,
    )


def _start(
    node: FakeNode, children: FakeChildren, concurrency: int = 1, **extra: Any
) -> WorkerThread:
    return WorkerThread(
        _settings(concurrency, **extra),
        client_factory=node.client_factory(),
        child_factory=children.factory,
    ).start()


def _done(node: FakeNode, attempt_ids: list[str]) -> bool:
    return all(node.run(a).status in ("succeeded", "failed") for a in attempt_ids)


def _drain(worker: WorkerThread) -> Any:
    worker.worker.request_drain()
    return worker.join(timeout=15)


def test_completions_travel_with_the_next_claim() -> None:
    node, children = FakeNode(), FakeChildren()
    attempts = [node.submit("t.double", {"n": n}) for n in range(4)]
    worker = _start(node, children, concurrency=1)
    node.wait_for(lambda: _done(node, attempts))
    assert _drain(worker) == 0
    assert [node.run(a).output for a in attempts] == [{"doubled": 2 * n} for n in range(4)]
    # One slot: each claim carries the completion of the task the previous one granted, and
    # no completion needed a call of its own.
    granting = [c for c in node.claims if c.grants]
    assert [c.grants for c in granting] == [[a] for a in attempts]
    carried = [c.completions for c in node.claims]
    assert carried[0] == []
    assert carried[1:5] == [[a] for a in attempts]
    assert node.commands("complete") == []
    assert worker.worker.completed == 4


def test_a_completion_while_a_claim_is_parked_goes_alone_and_frees_its_slot() -> None:
    node, children = FakeNode(), FakeChildren()
    # The completion's answer reaches the worker after the parked claim's (the node ends that
    # claim as soon as the completion is in): the next claim waits for it.
    node.before_answer = lambda command, body, answer: (
        time.sleep(0.02) if command == "complete" else None
    )
    sleeper = node.submit("t.sleep", {"seconds": 0.3})
    worker = _start(node, children, concurrency=2, poll_interval_s=20.0)
    node.wait_for(lambda: children.ran(sleeper) == 1)
    node.wait_for(lambda: len(node.claims) == 2)
    parked = node.claims[1]
    assert parked.limit == 1 and parked.completions == []
    node.wait_for(lambda: node.run(sleeper).status == "succeeded")
    (completion,) = node.items("complete")
    assert completion["attempt_id"] == sleeper and completion["succeeded"] is True
    # The completion ended the parked claim; the next one asks for both slots at once.
    node.wait_for(lambda: len(node.claims) == 3)
    assert parked.answered and parked.grants == []
    assert node.claims[2].limit == 2 and node.claims[2].held == []
    quick = node.submit("t.double", {"n": 1})
    node.wait_for(lambda: node.run(quick).status == "succeeded")
    assert node.claims[2].grants == [quick]
    assert _drain(worker) == 0


def test_the_held_statement_is_exact() -> None:
    node, children = FakeNode(), FakeChildren()
    attempts = [
        node.submit("t.sleep", {"seconds": 0.02 * (n % 4)})
        if n % 3
        else node.submit("t.double", {"n": n})
        for n in range(30)
    ]
    worker = _start(node, children, concurrency=4)
    node.wait_for(lambda: _done(node, attempts), timeout=20)
    assert _drain(worker) == 0
    granted: set[str] = set()
    for claim in node.claims:
        assert claim.held is not None
        held = set(claim.held)
        # Nothing the session holds is left out (the node would hand it back unstarted) and
        # nothing is named that this worker was never granted.
        assert claim.leased_on_arrival <= held | set(claim.completions)
        assert held <= granted
        assert claim.released == []
        granted |= set(claim.grants)
    assert all(node.run(a).events[0] == ("started", 1) for a in attempts)
    assert all(children.ran(a) == 1 for a in attempts)


def test_a_lost_claim_answer_leaves_nothing_held() -> None:
    node, children = FakeNode(), FakeChildren()
    attempts = [node.submit("t.double", {"n": n}) for n in range(2)]
    dropped: list[list[str]] = []

    def drop_first_grants(command: str, body: Any, answer: Any) -> None:
        if command == "claim" and answer["grants"] and not dropped:
            dropped.append([g["attempt_id"] for g in answer["grants"]])
            raise httpx.ReadError("connection reset by peer")

    node.before_answer = drop_first_grants
    worker = _start(node, children, concurrency=2)
    node.wait_for(lambda: _done(node, attempts))
    assert _drain(worker) == 0
    assert dropped == [attempts]
    # The client repeated the claim with the same statement: it names neither attempt, so the
    # node handed both back (not lost), and they were granted again under a new generation.
    first, repeat = node.claims[0], node.claims[1]
    assert first.held == repeat.held == []
    assert repeat.released == attempts
    for attempt_id in attempts:
        run = node.run(attempt_id)
        assert run.status == "succeeded"
        assert run.events == [
            ("started", 1),
            ("released", "not_held"),
            ("started", 2),
            ("succeeded", None),
        ]
        assert children.ran(attempt_id) == 1  # the lost grant never ran


def test_drain_hands_back_grants_that_never_reached_a_slot() -> None:
    node, children = FakeNode(), FakeChildren()
    attempts = [node.submit("t.double", {"n": n}) for n in range(3)]
    holder: list[WorkerThread] = []

    def drain_before_the_answer(command: str, body: Any, answer: Any) -> None:
        if command == "claim" and answer["grants"]:
            node.wait_for(lambda: bool(holder))  # the first answer may come before _start returns
            worker = holder[0].worker
            worker.request_drain()
            node.wait_for(lambda: worker.ledger.mode is Mode.DRAINING)

    node.before_answer = drain_before_the_answer
    holder.append(_start(node, children, concurrency=3))
    assert holder[0].join(timeout=15) == 0
    releases = node.items("release")
    assert sorted(r["attempt_id"] for r in releases) == attempts
    assert {r["cause"] for r in releases} == {"drain"}
    assert children.began == []
    for attempt_id in attempts:
        run = node.run(attempt_id)
        assert run.status == "queued"
        assert run.events == [("started", 1), ("released", "drain")]
    assert holder[0].worker.released == 3
    assert node.commands("close") != []


def test_drain_lets_running_tasks_finish_and_frees_the_parked_claim() -> None:
    node, children = FakeNode(), FakeChildren()
    sleeper = node.submit("t.sleep", {"seconds": 0.4})
    worker = _start(node, children, concurrency=2, poll_interval_s=20.0)
    node.wait_for(lambda: children.ran(sleeper) == 1)
    node.wait_for(lambda: bool(node.claims) and not node.claims[-1].answered)
    started = time.monotonic()
    assert _drain(worker) == 0
    assert time.monotonic() - started < 5  # the parked claim did not hold the drain
    assert node.run(sleeper).status == "succeeded"
    waiting = node.submit("t.double", {"n": 1})
    assert node.run(waiting).status == "queued"


def test_self_fencing_kills_the_task_and_abandons_it() -> None:
    node, children = FakeNode(lease_ttl_ms=1000), FakeChildren()
    sleeper = node.submit("t.sleep", {"seconds": 30})
    worker = _start(node, children, concurrency=2, poll_interval_s=0.2)
    node.wait_for(lambda: children.ran(sleeper) == 1)
    node.unavailable.add("*")  # renewals fail from now on
    granted_at = time.monotonic()
    node.wait_for(lambda: children.killed == [sleeper], timeout=5)
    assert time.monotonic() - granted_at < 1.0  # before the lease could have expired
    lease = node.run(sleeper).lease
    assert lease is not None
    time.sleep(max(0.0, (lease.expires_at_ms - time.time() * 1000) / 1000) + 0.05)
    node.unavailable.clear()  # back after the expiry: the abandon is only recorded
    node.wait_for(lambda: node.items("abandon") != [])
    (abandon,) = node.items("abandon")
    assert abandon["attempt_id"] == sleeper
    assert abandon["detail"] == "its lease could not be renewed before it expired"
    assert node.items("complete") == [] and node.items("release") == []
    assert ("abandoned", abandon["detail"]) in node.run(sleeper).events
    # The lease stays until recovery loses the Attempt: the claims that follow keep stating
    # it, so it is never handed back as if it had not begun.
    claims = len(node.claims)
    node.wait_for(lambda: len(node.claims) >= claims + 1)
    assert sleeper in (node.claims[-1].held or [])
    assert node.run(sleeper).lease.status == "leased"  # type: ignore[union-attr]
    # Recovery loses it: the next probe of its lease finds it gone, and it is held no more.
    node.recover(sleeper)
    node.wait_for(lambda: worker.worker.ledger.empty(), timeout=5)
    claims = len(node.claims)
    node.wait_for(lambda: len(node.claims) >= claims + 1)
    assert node.claims[-1].held == []
    assert _drain(worker) == 0
    assert all(event[0] != "released" for event in node.run(sleeper).events)
    assert children.ran(sleeper) == 1


def test_a_slot_that_cannot_take_its_job_hands_it_back() -> None:
    node, children = FakeNode(), FakeChildren()
    children.dead.add("slot-1")  # its child died while idle
    children.failing_starts = 0
    worker = _start(node, children, concurrency=2)
    node.wait_for(lambda: len(node.claims) >= 1)
    children.failing_starts = 1  # and it cannot be started again
    attempts = [node.submit("t.sleep", {"seconds": 0.2}) for _ in range(2)]
    node.wait_for(lambda: _done(node, attempts))
    releases = node.items("release")
    assert [r["cause"] for r in releases] == ["slot_failed"]
    (handed_back,) = [r["attempt_id"] for r in releases]
    assert node.run(handed_back).events == [
        ("started", 1),
        ("released", "slot_failed"),
        ("started", 2),
        ("succeeded", None),
    ]
    assert all(children.ran(a) == 1 for a in attempts)
    assert worker.worker.ledger.live_slots == 1  # the worker goes on with the other slot
    assert _drain(worker) == 0


def test_an_output_the_ingress_refuses_fails_the_attempt() -> None:
    node, children = FakeNode(), FakeChildren()
    big = node.submit("t.big", {"bytes": 10})
    refused: list[int] = []

    original = node.handle

    def handle(request: httpx.Request) -> httpx.Response:
        if b'"xxxxxxxxxx"' in request.content:
            refused.append(1)
            return httpx.Response(413, json={"error": "body_too_large", "message": "too large"})
        return original(request)

    node.handle = handle  # type: ignore[method-assign]
    worker = _start(node, children, concurrency=1)
    node.wait_for(lambda: _done(node, [big]))
    assert _drain(worker) == 0
    run = node.run(big)
    assert (run.status, run.error) == ("failed", "the ingress refused the result: body_too_large")
    assert len(refused) == 2  # the claim that carried it, then the completion alone


# --- the client -------------------------------------------------------------------------------


def test_the_client_repeats_5xx_and_gives_up_after_its_budget() -> None:
    node = FakeNode()
    client = IngressClient(URL, transport=node.transport(), retry_budget_s=0.6)
    node.unavailable_status = 502
    node.unavailable.add("register")
    started = time.monotonic()
    with pytest.raises(IngressUnavailable, match=r"did not answer sessions within 0\.6 s"):
        client.register("w1", 1, ["t.double"])
    assert 0.6 <= time.monotonic() - started < 1.5
    assert len(node.commands("register")) >= 3
    node.unavailable.clear()
    client.register("w1", 1, ["t.double"])
    assert client.heartbeat().status == "active"


@pytest.mark.parametrize("status", [503, 502])
def test_a_sessions_call_is_repeated_past_its_budget_until_answered(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    node = FakeNode()
    client = IngressClient(URL, transport=node.transport(), retry_budget_s=0.3)
    client.register("w1", 1, ["t.double"])
    # 503: the node is there, its database is not; 502: no node behind a proxy.
    node.unavailable_status = status
    node.unavailable.add("heartbeat")
    back = threading.Timer(1.2, node.unavailable.clear)
    back.start()
    started = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="ql3.worker"):
            assert client.heartbeat().status == "active"
    finally:
        back.cancel()
    assert time.monotonic() - started >= 1.2  # four budgets and more: still trying
    warned = [
        r.getMessage() for r in caplog.records if "has not answered heartbeat" in r.getMessage()
    ]
    assert 2 <= len(warned) <= 5, warned
    # Once the worker stops it no longer keeps trying.
    client.keep_trying = False
    node.unavailable.add("heartbeat")
    with pytest.raises(IngressUnavailable, match=r"did not answer heartbeat within 0\.3 s"):
        client.heartbeat()


def test_the_client_moves_to_the_next_url_when_one_does_not_answer() -> None:
    node = FakeNode()
    down = {"http://node-a"}
    tried: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        tried.append(base)
        if base in down:
            raise httpx.ConnectError("connection refused", request=request)
        return node.handle(request)

    client = IngressClient(
        ["http://node-a", "http://node-b/"], transport=httpx.MockTransport(handle), retry_budget_s=5
    )
    client.register("w1", 1, ["t.double"])
    assert tried == ["http://node-a", "http://node-b"]
    assert client.base_url == "http://node-b"
    assert client.heartbeat().status == "active"
    assert tried[-1] == "http://node-b"
    # Node b goes away, node a is back: the session goes on at node a.
    down = {"http://node-b"}
    assert client.heartbeat().status == "active"
    assert tried[-2:] == ["http://node-b", "http://node-a"]
    assert client.base_url == "http://node-a"
    assert len(node.sessions) == 1


def test_the_client_never_repeats_a_4xx() -> None:
    node = FakeNode()
    client = IngressClient(URL, transport=node.transport(), retry_budget_s=5)
    client.register("w1", 1, ["t.double"])
    client._secret = "wrong-" + "x" * 30
    with pytest.raises(IngressRefused) as refused:
        client.heartbeat()
    assert refused.value.status == 401 and refused.value.session_lost
    assert len(node.commands("heartbeat")) == 1


def test_a_worker_whose_ingress_stays_away_stops_its_tasks_keeps_its_session_and_goes_on() -> None:
    node, children = FakeNode(lease_ttl_ms=1000), FakeChildren()
    sleeper = node.submit("t.sleep", {"seconds": 30})
    worker = _start(node, children, concurrency=1, give_up_s=0.5, poll_interval_s=0.2)
    node.wait_for(lambda: children.ran(sleeper) == 1)
    node.unavailable_status = 502  # no node answers
    node.unavailable.add("*")
    # The lease ends meanwhile: the watchdog stops the task; the worker waits for its node.
    node.wait_for(lambda: sleeper in children.killed, timeout=5)
    time.sleep(1.0)  # two give-up times more
    assert worker.thread.is_alive() and worker.result is None
    node.unavailable.clear()
    # Back: the stop is reported (past the lease: recorded), recovery loses the Attempt, and
    # the same session takes new work.
    node.wait_for(lambda: [i["attempt_id"] for i in node.items("abandon")] == [sleeper])
    node.recover(sleeper)
    doubled = node.submit("t.double", {"n": 4})
    node.wait_for(lambda: node.run(doubled).status == "succeeded")
    assert len(node.commands("register")) == 1
    assert _drain(worker) == 0


def test_a_worker_rides_out_a_database_outage_and_completes_what_finished_meanwhile() -> None:
    node, children = FakeNode(lease_ttl_ms=6000), FakeChildren()
    sleeper = node.submit("t.sleep", {"seconds": 0.4})
    worker = _start(node, children, concurrency=1, give_up_s=0.5, poll_interval_s=0.2)
    node.wait_for(lambda: children.ran(sleeper) == 1)
    node.unavailable.add("*")  # 503 from now on: the node is up, its database is not
    time.sleep(1.6)  # the task ends meanwhile; three give-up times pass
    assert worker.thread.is_alive() and worker.result is None
    assert node.run(sleeper).status == "running"
    node.unavailable.clear()
    node.wait_for(lambda: node.run(sleeper).status == "succeeded")
    assert node.items("abandon") == [] and node.items("release") == []
    assert _drain(worker) == 0


def test_a_refused_session_fails_the_worker_at_once() -> None:
    node, children = FakeNode(), FakeChildren()
    worker = _start(node, children, concurrency=1)
    node.wait_for(lambda: len(node.claims) >= 1)
    with node.cond:
        for session in node.sessions.values():
            session["status"] = "replaced"
        node.cond.notify_all()
    result = worker.join(timeout=10)
    assert isinstance(result, WorkerFailed) and "session lost" in str(result)


def test_a_drain_during_an_outage_stops_at_its_timeout() -> None:
    node, children = FakeNode(lease_ttl_ms=1000), FakeChildren()
    worker = _start(
        node, children, concurrency=1, give_up_s=0.3, poll_interval_s=0.2, drain_timeout_s=0.8
    )
    node.wait_for(lambda: len(node.claims) >= 1)
    node.unavailable_status = 502
    node.unavailable.add("*")
    started = time.monotonic()
    worker.worker.request_drain()
    result = worker.join(timeout=10)
    assert isinstance(result, WorkerFailed) and "cannot reach the ingress" in str(result)
    assert 0.8 <= time.monotonic() - started < 5


# --- the ledger -------------------------------------------------------------------------------


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.jobs: list[str] = []
        self.kills: list[str] = []

    def put(self, job: Any) -> None:
        self.jobs.append(job.attempt_id)

    def kill(self, attempt_id: str) -> bool:
        self.kills.append(attempt_id)
        return True


def _grant(attempt_id: str, expires_in_ms: int = 3000) -> Any:
    from ql3.adapters.worker.client import GrantData

    return GrantData(
        run_id="r-" + attempt_id,
        attempt_id=attempt_id,
        attempt_number=1,
        task="t.double",
        input=None,
        generation=1,
        version=1,
        token="t" * 30,
        expires_at_ms=1_000 + expires_in_ms,
        idempotency_key="k",
    )


def _answer(grants: list[Any], completed: dict[str, Any] | None = None) -> Any:
    from ql3.adapters.worker.client import ClaimResult

    return ClaimResult(
        now_ms=1_000,
        status="active",
        completed=completed or {},
        released=(),
        grants=tuple(grants),
        no_grant=None,
        detail=None,
        sent_at=time.monotonic(),
    )


def test_the_ledger_asks_for_free_slots_within_the_capacity() -> None:
    from ql3.adapters.worker.slot import JobOutcome

    ledger = Ledger(capacity=2)
    slots = [_Slot(0), _Slot(1)]
    ledger.add_slots(slots)
    with ledger.lock:
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None and plan.limit == 2 and plan.held == ()
    ledger.end_claim(plan, _answer([_grant("a1"), _grant("a2")]))
    assert sorted(s.jobs[0] for s in slots) == ["a1", "a2"]
    with ledger.lock:
        assert ledger.room() == 0
    # a1 was stopped: its slot is free, but its lease is held until its abandon is answered.
    slot_a1 = next(s for s in slots if s.jobs == ["a1"])
    ledger.on_outcome(slot_a1, "a1", JobOutcome(False, killed=True), reusable=True)
    assert ledger.get("a1").phase is Phase.STOPPED  # type: ignore[union-attr]
    with ledger.lock:
        assert ledger.room() == 0
    # a2 finished: its completion rides the next claim, which may refill its slot.
    slot_a2 = next(s for s in slots if s.jobs == ["a2"])
    ledger.on_outcome(slot_a2, "a2", JobOutcome(True, output=1), reusable=True)
    with ledger.lock:
        assert ledger.room() == 1
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None
    assert plan.limit == 1 and [h.attempt_id for h in plan.completions] == ["a2"]
    assert plan.held == ("a1", "a2")


def test_the_ledger_keeps_an_attempt_held_until_its_report_is_answered() -> None:
    from ql3.adapters.worker.client import ItemAnswer
    from ql3.adapters.worker.slot import JobOutcome

    ledger = Ledger(capacity=1)
    slot = _Slot(0)
    ledger.add_slots([slot])
    with ledger.lock:
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None
    ledger.end_claim(plan, _answer([_grant("a1")]))
    ledger.on_outcome(slot, "a1", JobOutcome(True, output=1), reusable=True)
    with ledger.lock:
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None
    # No answer (the claim failed): it is still held, and its completion goes again.
    ledger.claim_failed(plan, refused=False)
    assert ledger.held_ids() == ("a1",)
    assert ledger.get("a1").phase is Phase.FINISHED  # type: ignore[union-attr]
    # Its lease had expired: the task ran, so it is abandoned (evidence), never dropped.
    with ledger.lock:
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None
    expired = ItemAnswer("a1", 409, None, None, "fence_rejected", "expired")
    ledger.end_claim(plan, _answer([], {"a1": expired}))
    assert ledger.get("a1").phase is Phase.STOPPED  # type: ignore[union-attr]
    assert ledger.held_ids() == ("a1",)


def test_a_grant_that_arrives_while_draining_is_handed_back() -> None:
    ledger = Ledger(capacity=1)
    slot = _Slot(0)
    ledger.add_slots([slot])
    with ledger.lock:
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None
    ledger.set_mode(Mode.DRAINING)
    ledger.end_claim(plan, _answer([_grant("a1")]))
    held = ledger.get("a1")
    assert held is not None and held.phase is Phase.UNSTARTED and held.cause == "drain"
    assert slot.jobs == []


def test_the_watchdog_stops_only_overdue_tasks() -> None:
    ledger = Ledger(capacity=2)
    slots = [_Slot(0), _Slot(1)]
    ledger.add_slots(slots)
    with ledger.lock:
        plan = ledger.begin_claim(time.monotonic())
    assert plan is not None
    ledger.end_claim(plan, _answer([_grant("a1", 200), _grant("a2", 60_000)]))
    assert ledger.overdue(time.monotonic(), margin_s=0.05) == []
    time.sleep(0.2)
    (kill,) = ledger.overdue(time.monotonic(), margin_s=0.05)
    assert kill[1] == "a1"
    held = ledger.get("a1")
    assert held is not None and held.phase is Phase.STOPPING and held.cause == "self_fenced"
    assert ledger.get("a2").phase is Phase.RUNNING  # type: ignore[union-attr]


def test_threads_do_not_leak() -> None:
    before = threading.active_count()
    node, children = FakeNode(), FakeChildren()
    worker = _start(node, children, concurrency=2, poll_interval_s=0.2)
    node.wait_for(lambda: len(node.claims) >= 1)
    assert _drain(worker) == 0
    deadline = time.monotonic() + 3
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
