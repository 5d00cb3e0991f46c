"""Smoke tests of ``python -m benchmarks``: each benchmark, run as a subprocess in a tiny
configuration against the test server, prints a JSON object with the promised keys last, and
bad arguments end with one line and exit status 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.postgres_server import PostgresServer

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120


def _run(args: list[str], admin_url: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if admin_url is not None:
        env["QL3_BENCH_DATABASE_URL"] = admin_url
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _last_json(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr[-2000:]
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    return result


def _positive_numbers(result: dict[str, object], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = result[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)


def _bench_databases(server: PostgresServer) -> set[str]:
    """The benchmarks' throwaway databases (others come and go with concurrent test runs)."""
    with server.connect_admin() as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'ql3\\_bench\\_%'"
        ).fetchall()
    return {str(row[0]) for row in rows}


def test_recovery_benchmark_reports_throughput_against_pgbench(pg_server: PostgresServer) -> None:
    before = _bench_databases(pg_server)
    done = _run(
        ["recovery", "--attempts", "200", "--pgbench-seconds", "1", "--json"], pg_server.admin_url
    )
    result = _last_json(done)
    _positive_numbers(result, ("recovered_per_s", "pgbench_tps", "ratio", "peak_rss_mb"))
    assert result["attempts"] == 200
    ratio = float(result["ratio"])  # type: ignore[arg-type]
    per_s = float(result["recovered_per_s"])  # type: ignore[arg-type]
    tps = float(result["pgbench_tps"])  # type: ignore[arg-type]
    assert ratio == pytest.approx(per_s / tps, rel=0.01)
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("recovered_per_s") for line in table), done.stdout
    assert _bench_databases(pg_server) == before, "the benchmark left databases behind"


def test_idle_benchmark_reports_queries_and_median_cycle_times(pg_server: PostgresServer) -> None:
    before = _bench_databases(pg_server)
    done = _run(["idle", "--finished", "2000", "--cycles", "10", "--json"], pg_server.admin_url)
    result = _last_json(done)
    _positive_numbers(result, ("queries_per_cycle", "median_ms_empty", "median_ms_large", "ratio"))
    assert isinstance(result["queries_per_cycle"], int)
    assert result["finished"] == 2000
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("queries_per_cycle") for line in table), done.stdout
    assert _bench_databases(pg_server) == before, "the benchmark left databases behind"


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["nonsense"],
        ["recovery", "--attempts", "0"],
        ["recovery", "--page-size", "65"],
        ["idle", "--cycles", "many"],
        ["idle", "--unknown"],
    ],
)
def test_bad_arguments_end_with_one_line_and_status_2(args: list[str]) -> None:
    done = _run(args, admin_url=None)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "error:" in lines[0]
    assert "Traceback" not in done.stderr
