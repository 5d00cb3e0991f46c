"""A task's limit holds across replicas (ADR 0014): several runtime stores, each with its own
engine and connections, claim and complete the same task's Runs from many sessions at once;
the Attempts of that task holding a ``leased`` lease never exceed its limit, as a reader
sampling the committed state sees it throughout and as the grants held add up to."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from ql3.adapters.postgres.store import PostgresStore
from ql3.application.admission import Admission, AdmissionRequest
from ql3.application.identities import RandomIdentities
from ql3.application.task_limits import TaskLimits
from ql3.application.worker_commands import Completion, WorkerCommands

pytestmark = pytest.mark.slow

REPLICAS = 3
SESSIONS_PER_REPLICA = 3
LIMIT = 3
RUNS = 60
ROUNDS = 12

LEASED_OF_TASK = text(
    "SELECT count(*) FROM run_dispatch_leases l JOIN runs r ON r.id = l.run_id"
    " WHERE l.status = 'leased' AND r.task = :task"
)


@pytest.fixture
def replicas(pg_database_url: str) -> Iterator[list[PostgresStore]]:
    stores = [
        PostgresStore.from_url(pg_database_url, pool_size=SESSIONS_PER_REPLICA + 1)
        for _ in range(REPLICAS)
    ]
    stores[0].testing_reset()
    try:
        yield stores
    finally:
        stores[0].testing_reset()
        for store in stores:
            store.close()


def test_concurrent_claims_of_several_replicas_never_exceed_the_limit(
    replicas: list[PostgresStore],
) -> None:
    first = replicas[0]
    identities = RandomIdentities()
    TaskLimits(first.unit_of_work).set("limited", LIMIT)
    Admission(first.unit_of_work, identities).submit_many(
        [AdmissionRequest(task="limited", priority=i % 3) for i in range(RUNS)]
        + [AdmissionRequest(task="free") for _ in range(RUNS // 4)]
    )
    commands = [
        WorkerCommands(store.unit_of_work, identities, lease_ttl_ms=60_000) for store in replicas
    ]
    sessions = [
        (workers, workers.register(f"w{r}-{s}", 4, ["limited", "free"]))
        for r, workers in enumerate(commands)
        for s in range(SESSIONS_PER_REPLICA)
    ]
    barrier = threading.Barrier(len(sessions))
    errors: list[BaseException] = []
    done = threading.Event()
    samples: list[int] = []
    granted_limited: list[str] = []
    lock = threading.Lock()

    def sample() -> None:
        with first.engine.connect() as connection:
            while not done.is_set():
                found = connection.execute(LEASED_OF_TASK, {"task": "limited"}).scalar_one()
                samples.append(int(found))
                connection.commit()

    def work(workers: WorkerCommands, session: object) -> None:
        session_id, secret = session.session_id, session.secret  # type: ignore[attr-defined]
        held: list[Completion] = []
        try:
            for _ in range(ROUNDS):
                barrier.wait(timeout=60)
                answer = workers.claim(
                    session_id,
                    secret,
                    limit=4 - len(held),
                    completions=tuple(held),
                    held=[c.fence.attempt_id for c in held],
                )
                held = [
                    Completion(fence=grant.fence, succeeded=True, output=None)
                    for grant in answer.grants
                ]
                with lock:
                    granted_limited.extend(g.run_id for g in answer.grants if g.task == "limited")
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=work, args=pair) for pair in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    sampler.join()

    assert errors == []
    assert samples and max(samples) <= LIMIT, max(samples)
    with first.engine.connect() as connection:
        assert connection.execute(LEASED_OF_TASK, {"task": "limited"}).scalar_one() <= LIMIT
        # Every grant of the limited task was held by one session for one round: rounds of
        # several replicas granted more than the limit in total, never more at once.
        assert len(granted_limited) == len(set(granted_limited))
        assert len(granted_limited) > LIMIT
        deadlocks = connection.execute(
            text("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
        ).scalar_one()
    assert deadlocks == 0


def test_setting_or_clearing_a_limit_wakes_parked_claims(
    replicas: list[PostgresStore], pg_database_url: str
) -> None:
    """A raised or cleared limit may make queued Runs claimable: its commit notifies the
    dispatch channel, as an admission does."""
    import psycopg

    from ql3.adapters.postgres.queries import DISPATCH_CHANNEL

    dsn = pg_database_url.replace("postgresql+psycopg://", "postgresql://", 1)
    limits = TaskLimits(replicas[0].unit_of_work)
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {DISPATCH_CHANNEL}")
        for change in (lambda: limits.set("t", 1), lambda: limits.clear("t")):
            change()
            woken = list(listener.notifies(timeout=5, stop_after=1))
            assert [n.channel for n in woken] == [DISPATCH_CHANNEL]
        assert limits.clear("t") is False  # nothing changed: nothing sent
        assert list(listener.notifies(timeout=0.5, stop_after=1)) == []
