"""Smoke tests of ``python -m benchmarks``: each benchmark, run as a subprocess in a tiny
configuration against the test server, prints a JSON object with the promised keys last, and
bad arguments end with one line and exit status 2."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.__main__ import main as benchmarks_main
from tests.conftest import in_ci
from tests.postgres_server import PostgresServer

ROOT = Path(__file__).resolve().parent.parent
DROP_GRACE_S = 30.0
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


def _number(result: dict[str, object], key: str) -> float:
    value = result[key]
    assert isinstance(value, int | float) and not isinstance(value, bool), (key, value)
    return float(value)


def _bench_databases(server: PostgresServer) -> set[str]:
    """The benchmarks' throwaway databases (others come and go with concurrent test runs)."""
    with server.connect_admin() as conn:
        rows = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'ql3\\_bench\\_%'"
        ).fetchall()
    return {str(row[0]) for row in rows}


def _assert_no_databases_left(server: PostgresServer, before: set[str]) -> None:
    """The benchmark dropped what it created. On a busy server a drop may still be finishing
    when the benchmark's process has gone, so the check gives it a few seconds."""
    deadline = time.monotonic() + DROP_GRACE_S
    while (left := _bench_databases(server) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the benchmark left databases behind: {sorted(left)}"


def _bench_roles(server: PostgresServer) -> set[str]:
    with server.connect_admin() as conn:
        rows = conn.execute(
            "SELECT rolname FROM pg_roles WHERE rolname LIKE 'ql3\\_bench\\_ingress\\_%'"
        ).fetchall()
    return {str(row[0]) for row in rows}


def test_recovery_benchmark_reports_throughput_against_pgbench(pg_server: PostgresServer) -> None:
    before = _bench_databases(pg_server)
    done = _run(
        [
            "recovery",
            "--attempts",
            "200",
            "--rounds",
            "3",
            "--concurrency",
            "2",
            "--pgbench-seconds",
            "3",
            "--json",
        ],
        pg_server.admin_url,
    )
    result = _last_json(done)
    _positive_numbers(
        result,
        (
            "recovered_per_s",
            "pgbench_tps",
            "ratio",
            "pgbench_tps_one_client",
            "ratio_one_client",
            "client_cpu_ms_per_attempt",
            "peak_rss_mb",
        ),
    )
    assert result["attempts"] == 200 and result["rounds"] == 3
    # pgbench runs at as many clients as recovery's transactions at once.
    assert result["pgbench_clients"] == result["concurrency"] == 2
    server_cpu = result["postgres_cpu_ms_per_attempt"]
    assert server_cpu is None or _number(result, "postgres_cpu_ms_per_attempt") >= 0, result
    assert 0 < _number(result, "page_query_share") < 1, result
    assert result["target_ratio"] == 0.8
    assert result["meets_target"] is (_number(result, "ratio") >= 0.8)
    # Each ratio is the median of the per-round ratios (each round recovery and pgbench at N
    # and at 1 client, the order rotated).
    for ratio, rates, tps in (
        ("ratio", "recovered_per_s_per_round", "pgbench_tps_per_round"),
        (
            "ratio_one_client",
            "recovered_per_s_per_round",
            "pgbench_tps_one_client_per_round",
        ),
    ):
        per_round = result[f"{ratio}_per_round"]
        assert isinstance(per_round, list) and len(per_round) == 3, result
        assert _number(result, ratio) == pytest.approx(statistics.median(per_round), rel=0.01)
        rate_list, tps_list = result[rates], result[tps]
        assert isinstance(rate_list, list) and isinstance(tps_list, list), result
        for value, rate, round_tps in zip(per_round, rate_list, tps_list, strict=True):
            assert value == pytest.approx(rate / round_tps, rel=0.02, abs=0.002), result
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("recovered_per_s") for line in table), done.stdout
    assert any(line.startswith("ratio_one_client") for line in table), done.stdout
    _assert_no_databases_left(pg_server, before)


def test_recovery_benchmark_defaults_to_the_cluster_profiles_concurrency() -> None:
    from benchmarks.recovery import configured_concurrency, round_order
    from ql3.bootstrap.cluster import CLUSTER_DEFAULTS

    assert configured_concurrency(None) == CLUSTER_DEFAULTS["recovery_concurrency"]
    assert configured_concurrency(5) == 5
    orders = [round_order(index) for index in range(3)]
    assert orders[0] == ("recovery", "pgbench", "pgbench_one_client")
    assert {order[0] for order in orders} == set(orders[0])  # each goes first once in 3 rounds


def test_idle_benchmark_reports_queries_and_median_cycle_times(pg_server: PostgresServer) -> None:
    before = _bench_databases(pg_server)
    done = _run(
        ["idle", "--finished", "2000", "--cycles", "10", "--idle-seconds", "2", "--json"],
        pg_server.admin_url,
    )
    result = _last_json(done)
    _positive_numbers(result, ("queries_per_cycle", "median_ms_empty", "median_ms_large", "ratio"))
    assert isinstance(result["queries_per_cycle"], int)
    assert result["finished"] == 2000
    # An idle Standalone process writes nothing; the cluster's figures are read off the server.
    assert result["standalone_writes_per_min"] == 0
    assert result["standalone_write_bytes_per_min"] == 0
    assert result["cluster_commits_per_min"] >= 0 and result["cluster_wal_bytes_per_min"] >= 0
    assert (result["idle_seconds"], result["cluster_workers"]) == (2, 4)
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("queries_per_cycle") for line in table), done.stdout
    _assert_no_databases_left(pg_server, before)


def test_console_benchmark_reports_each_pages_p95_empty_and_large(
    pg_server: PostgresServer,
) -> None:
    before = _bench_databases(pg_server)
    done = _run(["console", "--finished", "500", "--requests", "3", "--json"], pg_server.admin_url)
    result = _last_json(done)
    _positive_numbers(result, ("ratio", "slowest_page_p95_ms_large"))
    empty, large = result["page_p95_ms_empty"], result["page_p95_ms_large"]
    assert isinstance(empty, dict) and isinstance(large, dict)
    assert set(empty) == set(large) >= {"overview", "runs", "run", "tasks", "workers", "workflow"}
    assert all(isinstance(v, float) and v > 0 for v in (*empty.values(), *large.values()))
    assert result["finished"] == 500 and isinstance(result["meets_targets"], bool)
    assert any(line.startswith("overview") for line in done.stdout.splitlines()), done.stdout
    _assert_no_databases_left(pg_server, before)


def test_recover_time_benchmark_times_requeue_and_success_after_a_kill(
    pg_server: PostgresServer,
) -> None:
    before = _bench_databases(pg_server)
    done = _run(
        ["recover-time", "--rounds", "1", "--lease-ttl", "1", "--cadence", "0.25", "--json"],
        pg_server.admin_url,
    )
    result = _last_json(done)
    _positive_numbers(result, ("to_queued_s_median", "to_succeeded_s_median", "target_s"))
    assert (result["lease_ttl_s"], result["cadence_s"], result["rounds"]) == (1.0, 0.25, 1)
    queued = float(result["to_queued_s_median"])  # type: ignore[arg-type]
    assert queued <= float(result["to_succeeded_s_median"])  # type: ignore[arg-type]
    # Nothing is recovered before its lease expired by the database's clock.
    lease_left = result["lease_left_s"]
    assert isinstance(lease_left, list) and len(lease_left) == 1, result
    assert 0 < float(lease_left[0]) <= queued, result
    assert result["meets_target"] is (queued <= 1.0 + 2 * 0.25)
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("to_queued_s_median") for line in table), done.stdout
    _assert_no_databases_left(pg_server, before)


def test_throughput_benchmark_reports_admission_work_and_pgqueuer(
    pg_server: PostgresServer,
) -> None:
    before = _bench_databases(pg_server)
    roles_before = _bench_roles(pg_server)
    done = _run(
        [
            "throughput",
            "--runs",
            "40",
            "--rounds",
            "1",
            "--admit-batch",
            "16",
            "--ingress-login-role",
            "--json",
        ],
        pg_server.admin_url,
    )
    result = _last_json(done)
    _positive_numbers(
        result,
        (
            "admitted_per_s",
            "direct_worked_per_s",
            "http_worked_per_s",
            "pgqueuer_worked_per_s",
            "pgqueuer_enqueue_per_s",
            "procrastinate_worked_per_s",
            "ratio",
            "http_ratio",
            "procrastinate_ratio",
            *(
                f"rss_mb_{who}_{when}_{form}"
                for who in ("node", "worker")
                for when in ("10pct", "end")
                for form in ("direct", "http")
            ),
            "cpu_ms_per_attempt_node_http",
            "cpu_ms_per_attempt_worker_http",
            "cpu_ms_per_attempt_worker_direct",
        ),
    )
    for form in ("direct", "http"):
        # Null only when the server is not a process of this machine.
        postgres_cpu = result[f"cpu_ms_per_attempt_postgres_{form}"]
        assert postgres_cpu is None or float(postgres_cpu) > 0, result  # type: ignore[arg-type]
    assert (result["runs"], result["rounds"], result["slots"]) == (40, 1, 8)
    theirs = float(result["pgqueuer_worked_per_s"])  # type: ignore[arg-type]
    ratio = float(result["ratio"])  # type: ignore[arg-type]
    http_ratio = float(result["http_ratio"])  # type: ignore[arg-type]
    direct = float(result["direct_worked_per_s"])  # type: ignore[arg-type]
    http = float(result["http_worked_per_s"])  # type: ignore[arg-type]
    assert ratio == pytest.approx(direct / theirs, rel=0.01)
    assert http_ratio == pytest.approx(http / theirs, rel=0.01)
    second = float(result["procrastinate_worked_per_s"])  # type: ignore[arg-type]
    assert float(result["procrastinate_ratio"]) == pytest.approx(  # type: ignore[arg-type]
        direct / second, rel=0.01
    )
    assert result["meets_rss_target"] is all(
        float(result[f"rss_mb_{who}_end_{form}"])  # type: ignore[arg-type]
        <= 1.1 * float(result[f"rss_mb_{who}_10pct_{form}"])  # type: ignore[arg-type]
        for who in ("node", "worker")
        for form in ("direct", "http")
    )
    assert result["meets_ratio_target"] is (ratio >= 1.0 and http_ratio >= 0.5)
    admitted = float(result["admitted_per_s"])  # type: ignore[arg-type]
    enqueued = float(result["pgqueuer_enqueue_per_s"])  # type: ignore[arg-type]
    assert result["meets_admission_target"] is (admitted >= enqueued / 3)
    assert result["meets_target"] is (
        result["meets_ratio_target"]
        and result["meets_admission_target"]
        and result["meets_rss_target"]
    )
    # The node and the worker run at their defaults, but for the worker's slots.
    assert str(result["node_flags"]).startswith("ql3 serve --port 0 --ingress-database-url ")
    assert "***" in str(result["node_flags"]), "the ingress role's password is printed"
    worker_flags = str(result["http_worker_flags"])
    assert worker_flags.startswith("ql3 worker --ingress http://127.0.0.1:")
    assert worker_flags.endswith(" --concurrency 8")
    direct_flags = str(result["direct_worker_flags"])
    assert direct_flags.startswith("ql3 worker --database-url postgresql"), direct_flags
    assert "***" in direct_flags, "the direct worker's password is printed"
    assert direct_flags.endswith(" --concurrency 8")
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("pgqueuer_worked_per_s") for line in table), done.stdout
    assert result["ingress"] == "own login role"
    _assert_no_databases_left(pg_server, before)
    assert _bench_roles(pg_server) == roles_before, "the benchmark left its ingress role behind"


def test_throughput_without_pgqueuer_fails_in_one_line(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    (tmp_path / "pgqueuer.py").write_text(
        "raise ImportError(\"No module named 'pgqueuer'\", name='pgqueuer')\n"
    )
    before = _bench_databases(pg_server)
    env = {**os.environ, "QL3_BENCH_DATABASE_URL": pg_server.admin_url}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "throughput", "--runs", "10", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pip install -e '.[bench]'" in lines[0]
    _assert_no_databases_left(pg_server, before)


def test_latency_benchmark_reports_idle_and_load_percentiles_against_pgqueuer(
    pg_server: PostgresServer,
) -> None:
    before = _bench_databases(pg_server)
    done = _run(
        ["latency", "--runs", "3", "--rate", "20", "--seconds", "0.5", "--json"],
        pg_server.admin_url,
    )
    result = _last_json(done)
    sides = ("direct", "http", "pgqueuer")
    keys = tuple(
        f"{side}_{phase}_{figure}_ms"
        for side in sides
        for phase in ("idle", "load")
        for figure in ("p50", "p99")
    )
    _positive_numbers(result, (*keys, *(f"{side}_load_achieved_per_s" for side in sides)))
    ms = {key: _number(result, key) for key in result if key.endswith("_ms")}
    for side in sides:
        for phase in ("idle", "load"):
            prefix = f"{side}_{phase}"
            assert ms[f"{prefix}_p50_ms"] <= ms[f"{prefix}_p99_ms"] <= ms[f"{prefix}_max_ms"]
    assert (result["idle_runs"], result["load_runs"]) == (3, 10)
    assert (result["rate_per_s"], result["seconds"]) == (20.0, 0.5)
    bounds = {
        "direct_idle_p50": 5.0,
        "direct_idle_p99": 20.0,
        "direct_load_p99": 2 * ms["pgqueuer_load_p99_ms"],
        "http_idle_p50": 10.0,
        "http_load_p99": 3 * ms["pgqueuer_load_p99_ms"],
    }
    for name, bound in bounds.items():
        assert ms[f"target_{name}_ms"] == pytest.approx(bound, abs=0.01), name
        assert result[f"meets_{name}_target"] is (ms[f"{name}_ms"] <= ms[f"target_{name}_ms"])
    assert result["meets_target"] is all(result[f"meets_{name}_target"] for name in bounds)
    assert result["node_flags"] == "ql3 serve --port 0"
    assert str(result["http_worker_flags"]).startswith("ql3 worker --ingress http://")
    direct_flags = str(result["direct_worker_flags"])
    assert direct_flags.startswith("ql3 worker --database-url postgresql"), direct_flags
    assert "***" in direct_flags, "the direct worker's password is printed"
    for form in ("direct", "http"):
        assert str(result[f"{form}_worker_flags"]).endswith(" --concurrency 8")
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("pgqueuer_load_p99_ms") for line in table), done.stdout
    assert any(line.startswith("direct_idle_p50_ms") for line in table), done.stdout
    _assert_no_databases_left(pg_server, before)


def test_submit_benchmark_times_cli_submits_beside_python_and_psql(
    pg_server: PostgresServer,
) -> None:
    before = _bench_databases(pg_server)
    done = _run(["submit", "--rounds", "2", "--json"], pg_server.admin_url)
    result = _last_json(done)
    _positive_numbers(
        result,
        (
            "python_start_median_s",
            "postgres_submit_median_s",
            "postgres_submit_cpu_median_s",
            "sqlite_submit_median_s",
            "sqlite_submit_cpu_median_s",
            "postgres_submit_vs_python_start",
            "sqlite_submit_vs_python_start",
        ),
    )
    assert (result["rounds"], result["target_s"]) == (2, 0.3)
    for name in ("postgres_submit", "sqlite_submit"):
        wall = _number(result, f"{name}_median_s")
        start = _number(result, "python_start_median_s")
        assert _number(result, f"{name}_vs_python_start") == pytest.approx(wall / start, rel=0.02)
        assert result[f"{name}_meets_target"] is (wall <= 0.3)
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("postgres_submit_median_s") for line in table), done.stdout
    _assert_no_databases_left(pg_server, before)


def test_standalone_benchmark_reports_sqlite_throughput_against_huey() -> None:
    done = _run(["standalone", "--runs", "20", "--rounds", "1", "--json"], admin_url=None)
    result = _last_json(done)
    _positive_numbers(
        result,
        (
            "worked_per_s",
            "huey_worked_per_s",
            "ratio",
            "admitted_per_s",
            "huey_enqueued_per_s",
            "cpu_ms_per_run",
            "huey_cpu_ms_per_run",
        ),
    )
    assert (result["runs"], result["rounds"], result["capacity"]) == (20, 1, 4)
    ratio = float(result["ratio"])  # type: ignore[arg-type]
    ours = float(result["worked_per_s"])  # type: ignore[arg-type]
    theirs = float(result["huey_worked_per_s"])  # type: ignore[arg-type]
    assert ratio == pytest.approx(ours / theirs, rel=0.01)
    assert result["meets_target"] is (ratio >= 1.0)
    for key in ("durability", "huey_durability"):
        assert str(result[key]).startswith("synchronous="), result
        assert " journal_mode=" in str(result[key]), result
    assert str(result["ql3_flags"]).endswith(" --capacity 4")
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.startswith("huey_worked_per_s") for line in table), done.stdout


def test_standalone_without_huey_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "huey.py").write_text(
        "raise ImportError(\"No module named 'huey'\", name='huey')\n"
    )
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "standalone", "--runs", "10", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pip install -e '.[bench]'" in lines[0]


CHAOS_FIGURES = {
    "system",
    "phase",
    "lost",
    "duplicates",
    "recovery_s",
    "pickup_p99_ms",
    "dead_tuples",
}


@pytest.mark.parametrize("workers", ["direct", "http"])
def test_chaos_benchmark_kills_a_ql3_worker_and_loses_nothing(workers: str) -> None:
    done = _run(
        [
            "chaos",
            "--systems",
            "ql3",
            "--ql3-workers",
            workers,
            "--phases",
            "kill-worker",
            "--phase-seconds",
            "3",
            "--json",
        ],
        admin_url=None,
    )
    if done.returncode == 1 and "needs its own PostgreSQL server" in done.stderr and not in_ci():
        pytest.skip(done.stderr.strip())
    result = _last_json(done)
    phases = result["phases"]
    assert isinstance(phases, list)
    assert [(row["system"], row["phase"]) for row in phases] == [
        ("ql3", "clean"),
        ("ql3", "kill-worker"),
    ], phases
    for row in phases:
        assert set(row) == CHAOS_FIGURES, row
        assert row["lost"] == 0 and row["duplicates"] == 0, row
        assert isinstance(row["dead_tuples"], int) and row["dead_tuples"] >= 0, row
        assert isinstance(row["pickup_p99_ms"], float) and row["pickup_p99_ms"] > 0, row
    clean, killed = phases
    assert clean["recovery_s"] is None  # no fault to recover from
    # Seconds, or null if the rate was not back within the phase (a busy machine).
    assert killed["recovery_s"] is None or killed["recovery_s"] >= 0, killed
    details = {row["phase"]: row for row in result["details"]}  # type: ignore[union-attr]
    assert details["kill-worker"]["kills"] == 1
    for row in details.values():
        assert row["admitted"] > 0 and row["finished"] == row["admitted"], row
    assert result["targets"]["zero_lost"] is True  # type: ignore[index]
    assert result["settings"]["ql3_workers"] == workers  # type: ignore[index]
    expected = "--database-url" if workers == "direct" else "--ingress"
    assert expected in result["systems"][0]["processes"], result["systems"]  # type: ignore[index]
    table = done.stdout.strip().splitlines()[:-1]
    assert any(line.split()[:2] == ["ql3", "kill-worker"] for line in table), done.stdout


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["nonsense"],
        ["recovery", "--attempts", "0"],
        ["recovery", "--page-size", "65"],
        ["idle", "--cycles", "many"],
        ["idle", "--unknown"],
        ["recover-time", "--rounds", "0"],
        ["recover-time", "--lease-ttl", "-1"],
        ["throughput", "--runs", "many"],
        ["throughput", "--admit-batch", "10001"],
        ["latency", "--runs", "0"],
        ["latency", "--rate", "0"],
        ["latency", "--seconds", "soon"],
        ["standalone", "--runs", "many"],
        ["standalone", "--rounds", "21"],
        ["submit", "--rounds", "0"],
        ["chaos", "--phases", "earthquake"],
        ["chaos", "--systems", "ql3,celery"],
        ["chaos", "--phase-seconds", "0"],
        ["chaos", "--ql3-workers", "carrier-pigeon"],
    ],
)
def test_bad_arguments_end_with_one_line_and_status_2(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process: ``python -m benchmarks`` exits with what ``main`` raises or returns (the
    # runs above and the missing-library ones go through a real process).
    with pytest.raises(SystemExit) as exited:
        benchmarks_main(args)
    out, err = capsys.readouterr()
    assert exited.value.code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0]
    assert "Traceback" not in err
