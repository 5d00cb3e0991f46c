"""What an idle runtime writes: a Standalone process and a small cluster with nothing to do.

Standalone: one ``ql3 standalone`` process (default settings, the resident cadence) on a fresh
SQLite file. Once it has booted, the benchmark waits ``SETTLE_S`` and then reads the process's
``/proc/PID/io`` twice, ``seconds`` apart: ``syscw`` (write system calls of every kind, files,
pipes and sockets alike) and ``wchar`` (the bytes they wrote) -> ``standalone_writes_per_min``
and ``standalone_write_bytes_per_min``. Target: 0.

Cluster: one ``ql3 serve`` node and ``WORKERS`` idle ``ql3 worker --concurrency 2`` processes on
a migrated throwaway database. After they registered and settled, ``pg_stat_database`` of that
database (``xact_commit``; read from the maintenance database, so the reading is not counted)
and ``pg_current_wal_lsn()`` are read twice, ``seconds`` apart -> ``cluster_commits_per_min``
and ``cluster_wal_bytes_per_min``. Target: ``cluster_commits_per_min`` <= 30. PostgreSQL
publishes a backend's counters at most once a second (an idle backend's within 10 s), so the
first reading waits ``CLUSTER_SETTLE_S`` after the registrations and a reading may lag by about
a second; the WAL position is the server's, so anything else the server does
meanwhile is counted too (``pg_stat_statements`` is not needed).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from benchmarks.common import BenchmarkError, connect
from benchmarks.processes import Processes, wait_until
from benchmarks.tasks import APP_SPEC

WORKERS = 4
WORKER_CONCURRENCY = 2
SETTLE_S = 3.0
# A backend publishes its counters at most once a second, and an idle one 10 s after its last
# transaction at the latest: the registrations' commits are published before the first reading.
CLUSTER_SETTLE_S = 11.0
STATS_TIMEOUT_S = 30.0
BOOT_TIMEOUT_S = 60.0
TARGET_STANDALONE_WRITES = 0
TARGET_CLUSTER_COMMITS = 30
STANDALONE_READY = "startup recovery: "


def _io(pid: int) -> dict[str, int]:
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError as error:
        raise BenchmarkError(f"cannot read /proc/{pid}/io: {error}") from None
    fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return {name: int(value) for name, value in fields.items()}


def _per_min(value: float, seconds: float) -> float:
    return round(value * 60 / seconds, 1)


def standalone_writes(seconds: float) -> dict[str, Any]:
    """An idle ``ql3 standalone`` process's writes over ``seconds``, per minute."""
    with tempfile.TemporaryDirectory(prefix="ql3-bench-idle-") as workdir, Processes(
        None
    ) as processes:
        path = str(Path(workdir) / "idle.sqlite")
        process = processes.start("standalone", ["standalone", "--app", APP_SPEC, "--db", path])
        wait_until(
            lambda: STANDALONE_READY in process.output(),
            BOOT_TIMEOUT_S,
            "the standalone process to boot",
            0.05,
            watch=[process],
        )
        time.sleep(SETTLE_S)
        before = _io(process.pid)
        time.sleep(seconds)
        after = _io(process.pid)
        process.check_alive()
    return {
        "standalone_writes_per_min": _per_min(after["syscw"] - before["syscw"], seconds),
        "standalone_write_bytes_per_min": _per_min(after["wchar"] - before["wchar"], seconds),
    }


def _commits_and_wal(admin: str, database: str) -> tuple[int, int]:
    """The database's committed transactions and the server's WAL position. The database's row
    appears once one of its backends has published its counters: wait for it."""
    deadline = time.monotonic() + STATS_TIMEOUT_S
    with connect(admin, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT (SELECT xact_commit FROM pg_stat_database WHERE datname = %s),"
                " pg_current_wal_lsn() - '0/0'::pg_lsn",
                (database,),
            ).fetchone()
            if row is not None and row[0] is not None:
                return int(row[0]), int(row[1])
            if time.monotonic() > deadline:
                raise BenchmarkError(f"pg_stat_database has no row for {database}")
            time.sleep(0.2)


def cluster_commits(admin: str, url: str, seconds: float) -> dict[str, Any]:
    """One node and ``WORKERS`` idle workers on ``url``: commits and WAL over ``seconds``."""
    database = make_url(url).database or ""
    with Processes(url) as processes:
        node, node_url = processes.start_node([])
        workers = [
            processes.start_worker(
                node_url, f"idle-worker-{n}", ["--concurrency", str(WORKER_CONCURRENCY)]
            )
            for n in range(WORKERS)
        ]

        def registered() -> bool:
            return all("registered session" in w.output() for w in workers)

        wait_until(registered, BOOT_TIMEOUT_S, "the workers to register", 0.05, watch=workers)
        time.sleep(CLUSTER_SETTLE_S)
        commits_before, wal_before = _commits_and_wal(admin, database)
        time.sleep(seconds)
        commits_after, wal_after = _commits_and_wal(admin, database)
        for process in (node, *workers):
            process.check_alive()
    return {
        "cluster_commits_per_min": _per_min(commits_after - commits_before, seconds),
        "cluster_wal_bytes_per_min": _per_min(wal_after - wal_before, seconds),
        "cluster_workers": WORKERS,
    }
