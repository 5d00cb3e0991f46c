"""Several scheduler replicas, each in its own process with its own engine and connections,
recover the same 1,000 expired candidates at the same moment.

Every Attempt must be recovered exactly once (one ``attempt_lost`` event, its lease ``released``
at version 2 for ``lease_expired``), no cycle may fail, PostgreSQL must report no deadlock, and the
``recovered`` counts of all replicas must add up to 1,000.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from ql3.adapters.postgres.queries import truncate_all
from tests.postgres_server import PostgresServer, connect
from tests.replicas.seeding import (
    clone_runs,
    deadlocks,
    half_written,
    leases_by_attempt,
    lost_events_per_attempt,
    seed_container,
    seed_with_services,
    wait_until_leases_expired,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = 1_000
TEMPLATES = 8  # Runs built through the services; the rest are set-based copies of them
SEED_LEASE_TTL_S = 2.0
SEED_BUDGET_S = 20.0
REPLICA_TIMEOUT_S = 180.0


def _reset(url: str) -> None:
    with connect(url) as conn:
        conn.execute(truncate_all())


def _seed(url: str) -> tuple[list[str], float]:
    """1,000 expired candidates (claimed, half of them renewed once) with closed sessions;
    returns their attempt ids and seconds."""
    started = time.monotonic()
    container = seed_container(url, SEED_LEASE_TTL_S)
    try:
        seeded = seed_with_services(container, TEMPLATES, workers=2)
    finally:
        container.store().close()
    assert sorted(seeded.shapes.values()) == [4, 4], seeded.shapes
    added = clone_runs(url, CANDIDATES)
    assert added == CANDIDATES - TEMPLATES
    wait_until_leases_expired(url)
    with connect(url) as conn:
        rows = conn.execute(
            "SELECT a.id FROM run_attempts a"
            " JOIN runs r ON r.id = a.run_id"
            " JOIN run_dispatch_leases l"
            "   ON l.run_id = a.run_id AND l.generation = a.lease_generation"
            " JOIN worker_sessions s ON s.id = a.session_id"
            " WHERE a.status = 'running' AND a.started_at IS NOT NULL"
            "   AND r.status = 'running' AND r.owner = 'runtime'"
            "   AND l.status = 'leased' AND l.version = 1 AND l.expires_at <= now()"
            "   AND s.status = 'closed'"
        ).fetchall()
        assert half_written(conn) == []
        shapes = dict(
            conn.execute(
                "SELECT CASE WHEN l.expires_at > l.granted_at + %s * interval '1 second'"
                " THEN 'renewed' ELSE 'claimed' END, count(*)"
                " FROM run_dispatch_leases l GROUP BY 1",
                (SEED_LEASE_TTL_S,),
            ).fetchall()
        )
    assert len(rows) == CANDIDATES
    assert shapes == {"claimed": CANDIDATES // 2, "renewed": CANDIDATES // 2}, shapes
    return [str(row[0]) for row in rows], time.monotonic() - started


def _start_replicas(url: str, count: int, barrier: Path) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.replicas.replica_main",
                "--url",
                url,
                "--barrier",
                str(barrier),
                "--name",
                f"replica-{i}",
            ],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]


def _run_replicas(url: str, count: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="ql3-replicas-") as directory:
        barrier = Path(directory)
        processes = _start_replicas(url, count, barrier)
        try:
            deadline = time.monotonic() + 60
            while len(list(barrier.glob("ready-*"))) < count:
                crashed = [p for p in processes if p.poll() is not None]
                assert not crashed, [p.communicate() for p in crashed]
                assert time.monotonic() < deadline, "replicas never became ready"
                time.sleep(0.01)
            (barrier / "go").touch()
            outputs = [p.communicate(timeout=REPLICA_TIMEOUT_S) for p in processes]
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    reports = []
    for process, (stdout, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
        lines = [line for line in stdout.splitlines() if line.strip()]
        assert lines, f"no report on stdout; stderr: {stderr[-3000:]}"
        reports.append(json.loads(lines[-1]))
    return reports


def _recovered(cycle: dict[str, Any]) -> int:
    for step in cycle["steps"]:
        if step["name"] == "runtime_recovery":
            return int(step["counts"].get("recovered", 0))
    return 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_recover_every_candidate_exactly_once(
    pg_server: PostgresServer, pg_database_url: str, replicas: int
) -> None:
    dbname = make_url(pg_database_url).database
    assert dbname is not None
    _reset(pg_database_url)
    attempt_ids, seed_s = _seed(pg_database_url)
    assert seed_s < SEED_BUDGET_S, f"seeding took {seed_s:.1f}s"

    with pg_server.connect_admin() as admin:
        deadlocks_before = deadlocks(admin, dbname)

    started = time.monotonic()
    reports = _run_replicas(pg_database_url, replicas)
    wall_s = time.monotonic() - started

    # Every replica ran, finished by itself, and no cycle failed or raised.
    assert len(reports) == replicas
    for report in reports:
        assert report["escaped"] is None, report["escaped"]
        cycles = report["cycles"]
        assert cycles, report
        failed = [c for c in cycles if c["aborted_at"] is not None or not c["ok"]]
        assert failed == [], failed[:3]
        errors = [s for c in cycles for s in c["steps"] if s["error"] is not None]
        assert errors == [], errors[:3]
        last = cycles[-1]
        assert _recovered(last) == 0 and last["steps"][0]["counts"]["examined"] == 0, last

    per_replica = [sum(_recovered(c) for c in report["cycles"]) for report in reports]
    assert sum(per_replica) == CANDIDATES, per_replica

    with connect(pg_database_url) as conn:
        lost_events = lost_events_per_attempt(conn)
        leases = leases_by_attempt(conn)
        attempt_states = dict(
            conn.execute("SELECT status, count(*) FROM run_attempts GROUP BY status").fetchall()
        )
        run_states = dict(
            conn.execute("SELECT status, count(*) FROM runs GROUP BY status").fetchall()
        )
        assert half_written(conn) == []

    # Exactly one attempt_lost event per Attempt, and none for anything else.
    assert set(lost_events) == set(attempt_ids)
    assert {n for n in lost_events.values()} == {1}
    # Each lease released once: version 1 -> 2, reason lease_expired.
    assert set(leases) == set(attempt_ids)
    assert {lease[:3] for lease in leases.values()} == {("released", 2, "lease_expired")}
    assert attempt_states == {"lost": CANDIDATES}
    # No retry policy was declared: lost retry settled every lost Run as failed.
    assert run_states == {"failed": CANDIDATES}

    # The replicas' backends have exited, so their statistics are flushed.
    time.sleep(0.5)
    with pg_server.connect_admin() as admin:
        deadlocks_after = deadlocks(admin, dbname)
    assert deadlocks_after == deadlocks_before

    sys.stderr.write(
        f"\n{replicas} replicas: seed {seed_s:.1f}s, recovery wall {wall_s:.1f}s, "
        f"recovered per replica {per_replica}, "
        f"cycles per replica {[len(r['cycles']) for r in reports]}\n"
    )
