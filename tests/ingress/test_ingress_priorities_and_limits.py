"""The ingress's claim (``ql3_ingress_claim_lock`` and ``ql3_ingress_claim_one`` of migration
0011) takes a task's highest priority first and keeps within its limit across sessions, under
the same locks as the runtime's store (ADR 0014)."""

from __future__ import annotations

import threading

import pytest

from ql3.application.admission import AdmissionRequest
from ql3.application.task_limits import TaskLimits
from ql3.application.worker_commands import NoGrant
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.transitions import claim
from tests.ingress.support import Env, Worker, register


def _submit(env: Env, task: str, priority: int = 0) -> str:
    (run_id,) = env.admission.submit_many([AdmissionRequest(task=task, priority=priority)])
    return run_id


def test_the_ingress_claims_the_highest_priority_first(env: Env) -> None:
    low = _submit(env, "t", 0)
    high = _submit(env, "t", 4)
    mid = _submit(env, "t", 2)
    worker = register(env, capacity=1)
    order = []
    for _ in range(3):
        (grant,) = worker.claim(limit=1).grants
        order.append(grant.run_id)
        worker.complete(grant.fence)
    assert order == [high, mid, low]


def test_the_ingress_keeps_within_a_limit_across_sessions(env: Env) -> None:
    TaskLimits(env.admin.unit_of_work).set("t", 2)
    runs = [_submit(env, "t") for _ in range(8)]
    workers = [register(env, f"w{i}", capacity=4) for i in range(4)]
    barrier = threading.Barrier(len(workers))
    granted: dict[str, list[str]] = {}

    def take(worker: Worker) -> None:
        barrier.wait()
        granted[worker.session_id] = [g.run_id for g in worker.claim(limit=4).grants]

    threads = [threading.Thread(target=take, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = [run_id for found in granted.values() for run_id in found]
    assert sorted(claimed) == sorted(runs[:2])  # the two oldest, by whichever sessions
    assert all(worker.claim(limit=4).no_grant is NoGrant.NOTHING_QUEUED for worker in workers)


def test_a_limit_of_zero_through_the_ingress_and_clearing_it(env: Env) -> None:
    limits = TaskLimits(env.admin.unit_of_work)
    limits.set("t", 0)
    run_id = _submit(env, "t")
    worker = register(env)
    assert worker.claim(limit=4).grants == ()
    limits.clear("t")
    assert [g.run_id for g in worker.claim(limit=4).grants] == [run_id]


def test_a_claim_past_the_limit_is_refused_by_the_ingress_function(env: Env) -> None:
    """A claim decided before the limit was set (or sent without the claim's locks) is
    refused by ``ql3_ingress_claim_one``, which counts under the limit's lock."""
    _submit(env, "t")
    worker = register(env)
    refused = pytest.raises(ConcurrencyConflict, match="its limit is 0")
    with refused, env.ingress.unit_of_work() as uow:
        session = uow.sessions.get(worker.session_id)
        assert session is not None
        lock = uow.runs.lock_for_claim(worker.session_id, ["t"], 4)
        assert lock.limits == {}
        (candidate,) = lock.candidates
        TaskLimits(env.admin.unit_of_work).set("t", 0)  # no lock of the claim holds it
        assert candidate.attempt is not None
        change = claim(
            run=candidate.run,
            attempt=candidate.attempt,
            previous_lease=candidate.lease,
            session=session,
            token_hash="0" * 64,
            ttl_ms=30_000,
            now_ms=lock.observed_at_ms,
        )
        uow.runs.apply_many([(candidate, change)])
