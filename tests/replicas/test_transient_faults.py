"""Transient database faults during a Cluster scheduler cycle.

For each fault: the cycle ends cleanly (``run_cycle`` returns a summary that names the failed
step; no exception escapes), nothing is half-written (each Run is either lost as a whole, with its
lease released and one ``attempt_lost`` event, or untouched), the dispatch gate is closed (claims
grant nothing while lease authority is unknown, ADR 0007), and the next cycle goes on, recovers
the work and opens the gate again.

Faults: (a) a serialization failure and (b) a deadlock victim, (c) ``pg_terminate_backend`` of
the store's connections between cycles and in the middle of a cycle, (d) a restart of the server.
(a) is injected by a temporary trigger that raises SQLSTATE 40001 while a flag row exists; (b) is a
real deadlock between the recovery transaction and an outside transaction that takes the same
rows in the opposite order; (d) uses a private server that this module starts and restarts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from sqlalchemy.engine import make_url

from ql3.adapters.postgres.engine import connection_ended
from ql3.adapters.postgres.store import PostgresStore
from ql3.application.scheduler import CycleSummary
from ql3.application.worker_commands import ClaimAnswer, NoGrant
from ql3.bootstrap.cluster import ClusterContainer, build
from tests.postgres_server import (
    PostgresServer,
    PrivateServer,
    connect,
    private_database,
)
from tests.replicas.seeding import (
    SeededState,
    deadlocks,
    half_written,
    lost_events_per_attempt,
    seed_with_services,
)

pytestmark = pytest.mark.postgres

LEASE_TTL_S = 30.0
PAST_THE_TTL_MS = 60_000
SEEDED = 3
WAIT_S = 15.0

FAULT_TABLE = "ql3_test_fault_flag"
INSTALL_FAULT = f"""
CREATE TABLE IF NOT EXISTS {FAULT_TABLE} (sqlstate text PRIMARY KEY);
CREATE OR REPLACE FUNCTION ql3_test_fault() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    code text;
BEGIN
    SELECT sqlstate INTO code FROM {FAULT_TABLE} LIMIT 1;
    IF code IS NOT NULL THEN
        RAISE EXCEPTION 'injected fault %', code USING ERRCODE = code;
    END IF;
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS ql3_test_fault ON run_dispatch_leases;
CREATE TRIGGER ql3_test_fault BEFORE UPDATE ON run_dispatch_leases
    FOR EACH ROW EXECUTE FUNCTION ql3_test_fault();
"""
REMOVE_FAULT = f"""
DROP TRIGGER IF EXISTS ql3_test_fault ON run_dispatch_leases;
DROP FUNCTION IF EXISTS ql3_test_fault();
DROP TABLE IF EXISTS {FAULT_TABLE};
"""


# --- fixtures and helpers ----------------------------------------------------------------------


def cluster_for(url: str) -> ClusterContainer:
    return build(
        database_url=url,
        lease_ttl_s=LEASE_TTL_S,
        recovery_page_size=16,
        # One recovery transaction at a time, so that "nothing after the failed candidate" is
        # exact (with more, the ones already under way finish on their own).
        recovery_concurrency=1,
        lost_retry_page_size=16,
    )


@pytest.fixture(scope="module")
def module_cluster(pg_database_url: str) -> Iterator[ClusterContainer]:
    container = cluster_for(pg_database_url)
    try:
        yield container
    finally:
        container.store().close()


@pytest.fixture
def cluster(module_cluster: ClusterContainer) -> ClusterContainer:
    """The module's container on an empty database, its store's clock offset back at zero."""
    store = module_cluster.store()
    assert isinstance(store, PostgresStore)
    store.testing_reset()
    return module_cluster


@pytest.fixture
def fault_trigger(pg_database_url: str) -> Iterator[Callable[[str | None], None]]:
    """Installs the fault trigger; the callable arms it with a SQLSTATE or disarms it (None)."""
    with connect(pg_database_url) as conn:
        conn.execute(INSTALL_FAULT)

    def arm(sqlstate: str | None) -> None:
        with connect(pg_database_url) as conn:
            conn.execute(f"DELETE FROM {FAULT_TABLE}")
            if sqlstate is not None:
                conn.execute(f"INSERT INTO {FAULT_TABLE} VALUES (%s)", (sqlstate,))

    try:
        yield arm
    finally:
        with connect(pg_database_url) as conn:
            conn.execute(REMOVE_FAULT)


def store_of(container: ClusterContainer) -> PostgresStore:
    store = container.store()
    assert isinstance(store, PostgresStore)
    return store


def seed_expired(container: ClusterContainer, count: int = SEEDED) -> SeededState:
    """``count`` claimed Runs (some leases renewed) whose sessions closed, and the store's
    clock moved past their lease TTL (the coordinator uses this very store)."""
    seeded = seed_with_services(container, count, workers=1)
    store_of(container).testing_advance_clock(PAST_THE_TTL_MS)
    return seeded


def counts(summary: CycleSummary, step: str) -> dict[str, int]:
    outcome = summary.step(step)
    assert outcome is not None, summary.as_dict()
    return dict(outcome.counts)


def assert_failed_cleanly(
    summary: CycleSummary,
    step: str,
    *signs: str,
    container: ClusterContainer | None = None,
) -> None:
    """The cycle ended at ``step``, reported an error there, and ran nothing after it; with
    ``container``, the dispatch gate is closed and says why."""
    assert summary.aborted_at == step, summary.as_dict()
    assert not summary.ok
    last = summary.steps[-1]
    assert last.name == step and last.error is not None, summary.as_dict()
    assert any(sign in last.error for sign in signs), last.error
    assert [s.name for s in summary.steps][-1] == step
    if container is not None:
        gate = store_of(container).dispatch_gate()
        assert not gate.open, gate
        assert gate.reason is not None and gate.reason.startswith(f"{step} failed: "), gate


def assert_recovers_all(
    summary: CycleSummary,
    url: str,
    seeded: SeededState,
    container: ClusterContainer | None = None,
) -> None:
    """The cycle recovered every seeded Attempt and reached step 5; with ``container``, the
    dispatch gate is open again."""
    assert summary.ok, summary.as_dict()
    assert counts(summary, "runtime_recovery")["recovered"] == len(seeded.attempt_ids)
    assert counts(summary, "lost_retry")["failed"] == len(seeded.attempt_ids)
    with connect(url) as conn:
        assert half_written(conn) == []
        assert lost_events_per_attempt(conn) == dict.fromkeys(seeded.attempt_ids, 1)
    if container is not None:
        assert store_of(container).dispatch_gate().open


def claim_one(container: ClusterContainer, worker: str) -> ClaimAnswer:
    """A fresh worker asks for one Attempt of a Run admitted for it."""
    commands = container.core.worker_commands()
    container.core.admission().submit("fault-claim", {"worker": worker})
    grant = commands.register(worker, capacity=1, tasks=["fault-claim"])
    return commands.claim(grant.session_id, grant.secret, limit=1)


def assert_untouched(url: str) -> None:
    with connect(url) as conn:
        assert half_written(conn) == []
        assert lost_events_per_attempt(conn) == {}
        rows = conn.execute("SELECT status, version FROM run_dispatch_leases").fetchall()
        assert {(str(s), int(str(v))) for s, v in rows} == {("leased", 1)}


def first_candidate(container: ClusterContainer) -> tuple[str, str]:
    page = store_of(container).recovery_candidates(16)
    assert page.items, "no recovery candidate"
    head = page.items[0]
    return head.run_id, head.attempt_id


@dataclass
class CycleThread:
    """A cycle running in a thread, so that the test can interfere while it is under way."""

    container: ClusterContainer
    summary: CycleSummary | None = None
    escaped: BaseException | None = None

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.summary = self.container.coordinator().run_cycle()
        except BaseException as error:  # the test asserts that this never happens
            self.escaped = error

    def start(self) -> CycleThread:
        self.thread.start()
        return self

    def join(self) -> CycleSummary:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the cycle did not end"
        assert self.escaped is None, f"run_cycle raised {self.escaped!r}"
        assert self.summary is not None
        return self.summary


def waiting_backend(observer: psycopg.Connection[tuple[object, ...]], dbname: str) -> int:
    """The pid of the store's backend blocked on a row lock of ``run_dispatch_leases`` (the
    only lock the test holds against it: the blocker's lease row)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        row = observer.execute(
            "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid"
            " WHERE a.datname = %s AND a.pid <> pg_backend_pid()"
            " AND a.wait_event_type = 'Lock' AND NOT l.granted"
            " AND l.locktype IN ('tuple', 'transactionid')",
            (dbname,),
        ).fetchone()
        if row is not None:
            return int(str(row[0]))
        time.sleep(0.01)
    raise AssertionError("the recovery transaction never blocked on the lease row")


def dbname_of(url: str) -> str:
    name = make_url(url).database
    assert name is not None
    return name


# --- (a) serialization failure -----------------------------------------------------------------


def test_serialization_failure_ends_the_cycle_and_the_next_one_recovers(
    cluster: ClusterContainer,
    pg_database_url: str,
    fault_trigger: Callable[[str | None], None],
) -> None:
    seeded = seed_expired(cluster)
    fault_trigger("40001")

    failed = cluster.coordinator().run_cycle()

    assert_failed_cleanly(
        failed, "runtime_recovery", "SerializationFailure", "40001", container=cluster
    )
    # The Run and Attempt updates before the refused lease update were rolled back with it.
    assert_untouched(pg_database_url)
    # Fail closed: while lease authority is unknown, a claim grants nothing and says why.
    refused = claim_one(cluster, "fault-worker-1")
    assert (refused.grants, refused.no_grant) == ((), NoGrant.GATE_CLOSED)
    assert refused.detail == store_of(cluster).dispatch_gate().reason
    assert_untouched(pg_database_url)

    fault_trigger(None)
    assert_recovers_all(cluster.coordinator().run_cycle(), pg_database_url, seeded, cluster)
    granted = claim_one(cluster, "fault-worker-2")
    assert len(granted.grants) == 1 and granted.no_grant is None


# --- (b) deadlock victim -----------------------------------------------------------------------


def test_deadlock_victim_ends_the_cycle_and_the_next_one_recovers(
    cluster: ClusterContainer, pg_database_url: str, pg_server: PostgresServer
) -> None:
    seeded = seed_expired(cluster)
    run_id, attempt_id = first_candidate(cluster)
    dbname = dbname_of(pg_database_url)
    with pg_server.connect_admin() as admin:
        deadlocks_before = deadlocks(admin, dbname)

    with connect(pg_database_url) as rival, connect(pg_database_url) as observer:
        # The rival waits far longer than the default deadlock_timeout (1 s) of the store's
        # backend, so the store's backend runs the deadlock check first and is the victim.
        rival.execute("SET deadlock_timeout = '20s'")
        with rival.transaction():
            rival.execute(
                "SELECT 1 FROM run_dispatch_leases WHERE run_id = %s FOR UPDATE", (run_id,)
            )
            cycle = CycleThread(cluster).start()
            # Recovery holds the Attempt's advisory lock and the Run and Attempt rows, and
            # waits for the lease row; now the rival asks for the Attempt row: a cycle.
            waiting_backend(observer, dbname)
            rival.execute("SELECT 1 FROM run_attempts WHERE id = %s FOR UPDATE", (attempt_id,))
        summary = cycle.join()

    assert_failed_cleanly(
        summary, "runtime_recovery", "DeadlockDetected", "deadlock", container=cluster
    )
    assert_untouched(pg_database_url)
    time.sleep(0.6)  # statistics are flushed at most once a second per backend
    with pg_server.connect_admin() as admin:
        assert deadlocks(admin, dbname) > deadlocks_before

    assert_recovers_all(cluster.coordinator().run_cycle(), pg_database_url, seeded, cluster)


# --- (c) pg_terminate_backend ------------------------------------------------------------------


def terminate_all_but(
    observer: psycopg.Connection[tuple[object, ...]], dbname: str, keep: set[int]
) -> int:
    """Terminate every backend of ``dbname`` except ``keep`` and wait until they are gone."""
    keep_list = sorted(keep)
    rows = observer.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> ALL(%s)"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend'",
        (dbname, keep_list),
    ).fetchall()
    pids = [int(str(row[0])) for row in rows]
    for pid in pids:
        observer.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    return len(pids)


def test_terminated_connections_between_cycles_are_replaced(
    cluster: ClusterContainer, pg_database_url: str
) -> None:
    seeded = seed_with_services(cluster, SEEDED, workers=1)
    # A cycle while every lease is live: nothing to recover, but the pool now holds
    # connections that were used.
    idle = cluster.coordinator().run_cycle()
    assert idle.ok, idle.as_dict()
    assert counts(idle, "runtime_recovery")["examined"] == 0
    dbname = dbname_of(pg_database_url)
    with connect(pg_database_url) as observer:
        assert terminate_all_but(observer, dbname, set()) >= 1

    store_of(cluster).testing_advance_clock(PAST_THE_TTL_MS)
    # The pool sees at checkout that the server ended them, and replaces them.
    assert_recovers_all(cluster.coordinator().run_cycle(), pg_database_url, seeded, cluster)


def test_terminated_connection_during_a_cycle_ends_it_and_the_next_one_recovers(
    cluster: ClusterContainer, pg_database_url: str
) -> None:
    seeded = seed_expired(cluster)
    run_id, _ = first_candidate(cluster)
    dbname = dbname_of(pg_database_url)

    with (
        connect(pg_database_url) as blocker,
        connect(pg_database_url) as observer,
        blocker.transaction(),
    ):
        blocker.execute("SELECT 1 FROM run_dispatch_leases WHERE run_id = %s FOR UPDATE", (run_id,))
        cycle = CycleThread(cluster).start()
        victim = waiting_backend(observer, dbname)
        observer.execute("SELECT pg_terminate_backend(%s, 5000)", (victim,))
        summary = cycle.join()

    assert_failed_cleanly(
        summary,
        "runtime_recovery",
        "AdminShutdown",
        "terminat",
        "OperationalError",
        container=cluster,
    )
    assert_untouched(pg_database_url)

    assert_recovers_all(cluster.coordinator().run_cycle(), pg_database_url, seeded, cluster)


# --- (d) server restart ------------------------------------------------------------------------


@dataclass
class RestartableServer:
    private: PrivateServer
    url: str

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection is cut, the data directory stays."""
        self.private.restart()


@pytest.fixture(scope="module")
def restartable_server() -> Iterator[RestartableServer]:
    with private_database("ql3_restart") as (private, url):
        yield RestartableServer(private=private, url=url)


def test_server_restart_between_cycles(restartable_server: RestartableServer) -> None:
    url = restartable_server.url
    container = cluster_for(url)
    try:
        seeded = seed_with_services(container, SEEDED, workers=1)
        before = container.coordinator().run_cycle()
        assert before.ok, before.as_dict()
        assert counts(before, "runtime_recovery")["examined"] == 0

        restartable_server.restart()
        store_of(container).testing_advance_clock(PAST_THE_TTL_MS)

        summaries = [container.coordinator().run_cycle()]
        # The first cycle after the restart either works or fails cleanly, untouched (its
        # gate close may have met a connection the restart ended too: not asserted here).
        if not summaries[0].ok:
            assert_failed_cleanly(
                summaries[0], "runtime_recovery", "OperationalError", "terminat", "connection"
            )
            assert_untouched(url)
            summaries.append(container.coordinator().run_cycle())
        assert_recovers_all(summaries[-1], url, seeded, container)
    finally:
        store_of(container).close()


def test_a_pooled_connection_the_server_ended_is_seen_without_a_round_trip(
    cluster: ClusterContainer, pg_database_url: str
) -> None:
    store = store_of(cluster)
    store.engine.dispose()  # one connection in the pool: the next checkout must meet it again
    with store.engine.connect() as connection:
        raw = connection.connection.driver_connection
        pid = int(connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
        connection.rollback()
        assert not connection_ended(raw)
    with connect(pg_database_url) as observer:
        observer.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
    assert connection_ended(raw)
    # The pool hands out a live connection in its place, on a new backend.
    with store.engine.connect() as connection:
        assert int(connection.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()) != pid
