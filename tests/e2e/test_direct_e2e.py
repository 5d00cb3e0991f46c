"""The end-to-end suite again with direct workers (ADR 0026): each worker calls the fenced
functions on the database as a login role of ``ql3 db grant-ingress``, with no node between;
the node still runs the scheduler (recovery, retries, timeouts' verdicts). The tests are the
HTTP suite's own, collected here once more on a cluster whose workers are direct; those that are
about a node (a lost claim answer, two nodes, a node that stays away) stay HTTP-only. A direct
worker's own outage is its database going away (ADR 0028)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from ql3.adapters.postgres.listen import libpq_conninfo
from tests.e2e.conftest import LEASE_TTL_S, Cluster, Ledger, torn_down, wait_for
from tests.e2e.test_cancel_e2e import (
    test_a_running_task_is_stopped_when_its_run_is_cancelled as test_cancel,
)
from tests.e2e.test_e2e import (
    test_a_quick_tasks_succeed_and_release_their_leases as test_a,
)
from tests.e2e.test_e2e import (
    test_b_sigkill_waits_for_evidence_then_retries_only_the_safe_run as test_b,
)
from tests.e2e.test_e2e import (
    test_c_after_recovery_the_old_fence_gets_409_and_changes_nothing as test_c,
)
from tests.e2e.test_e2e import test_d_sigterm_drains_without_losing_a_run as test_d
from tests.e2e.test_e2e import (
    test_f_a_drain_hands_back_work_that_never_began as test_f,
)
from tests.e2e.test_outcomes_e2e import (
    test_a_task_past_its_timeout_is_stopped_retried_and_failed as test_timeout,
)
from tests.e2e.test_outcomes_e2e import (
    test_a_task_raising_twice_succeeds_on_attempt_3 as test_retry,
)
from tests.e2e.test_outcomes_e2e import (
    test_an_unsafe_run_that_raises_is_not_retried as test_unsafe,
)

__all__ = [
    "test_a",
    "test_b",
    "test_c",
    "test_cancel",
    "test_d",
    "test_f",
    "test_retry",
    "test_timeout",
    "test_unsafe",
]


@pytest.fixture(scope="module")
def cluster(pg_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("e2e-direct")
    built = Cluster(database_url=pg_database_url, workdir=workdir, worker_form="direct")
    with torn_down(built):
        built.start_node(ingress_database_url=built.grant_ingress_role())
        built.direct_url = built.grant_ingress_role()
        yield built


def _worker(cluster: Cluster, *reach: str) -> subprocess.CompletedProcess[str]:
    """``ql3 worker`` in a process of its own, started with ``reach``; its exit and output."""
    return subprocess.run(
        [sys.executable, "-m", "ql3", "worker", *reach, "--app", "tests.e2e.tasks:app",
         "--worker-id", "direct-refused"],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "QL3_DATABASE_URL": cluster.database_url},
    )


def test_z_a_direct_worker_on_a_role_that_may_write_is_refused(cluster: Cluster) -> None:
    done = _worker(cluster, "--database-url", cluster.database_url)
    assert done.returncode == 1, done.stderr
    assert "may write the runtime's tables" in done.stderr
    assert "ql3 db grant-ingress" in done.stderr
    assert "Traceback" not in done.stderr
    sessions = cluster.ql3("workers", "list", "--json")
    assert "direct-refused" not in sessions.stdout, "a refused worker registered nothing"


@pytest.mark.parametrize(
    "reach",
    [(), ("--ingress", "http://127.0.0.1:9", "--database-url", "postgresql://x@127.0.0.1/x")],
    ids=["neither", "both"],
)
def test_z_a_worker_reaches_the_work_one_way(cluster: Cluster, reach: tuple[str, ...]) -> None:
    done = _worker(cluster, *reach)
    assert done.returncode == 2, done.stderr
    assert "--ingress URL or --database-url URL" in done.stderr
    assert "Traceback" not in done.stderr


def test_z_a_direct_workers_role_writes_no_table_and_reads_no_credential(
    cluster: Cluster,
) -> None:
    assert cluster.direct_url is not None
    with psycopg.connect(libpq_conninfo(cluster.direct_url), autocommit=True) as conn:
        first_columns = {
            str(row[0]): str(row[1])
            for row in conn.execute(
                "SELECT c.relname, a.attname FROM pg_class AS c"
                " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
                " JOIN pg_attribute AS a ON a.attrelid = c.oid AND a.attnum = 1"
                " WHERE c.relkind = 'r' AND n.nspname = current_schema()"
            )
        }
        assert {"runs", "run_attempts", "run_dispatch_leases", "worker_credentials"} <= set(
            first_columns
        )
        for table, column in sorted(first_columns.items()):
            name, col = sql.Identifier(table), sql.Identifier(column)
            for statement in (
                sql.SQL("UPDATE {} SET {} = {} WHERE false").format(name, col, col),
                sql.SQL("DELETE FROM {} WHERE false").format(name),
            ):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)
        for table in ("worker_credentials", "worker_credential_events"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(sql.SQL("SELECT 1 FROM {} LIMIT 1").format(sql.Identifier(table)))


def test_y_a_direct_worker_rides_out_its_database_going_away(
    cluster: Cluster, ledger: Ledger
) -> None:
    """The worker's role may not log in and its connections are cut for longer than the lease
    TTL (at least 5 s): the worker keeps trying, then goes on with the same session."""
    assert cluster.direct_url is not None
    role = make_url(cluster.direct_url).username
    worker = cluster.start_worker("y", "worker-y", ledger)
    wait_for(lambda: "registered session" in worker.output(), 20, "the worker to register")
    with psycopg.connect(libpq_conninfo(cluster.database_url), autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))
        try:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            runs = [cluster.submit("y.double", {"n": n}) for n in range(3)]
            time.sleep(max(LEASE_TTL_S, 5.0) + 1.5)
            assert worker.popen.poll() is None, worker.output()
            assert "has not answered" in worker.output()
            assert {cluster.status(r) for r in runs} == {"queued"}
        finally:
            admin.execute(sql.SQL("ALTER ROLE {} LOGIN").format(sql.Identifier(role)))
    cluster.wait_status(runs, {"succeeded"})
    assert worker.output().count("registered session") == 1, worker.output()
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.output()
    assert "Traceback" not in worker.output()
