"""The wall time of one ``ql3 submit`` from the command line, the whole process: start-up,
imports, connecting, the admission and exit (ADR 0009; target: at most 0.3 s).

Each round runs, one after the other, the two references and the two submits, as separate
processes with the ``.pyc`` caches a user's machine has (``PYTHONDONTWRITEBYTECODE`` is
removed from their environment):

- ``python -c pass``: the interpreter's start-up, the floor of any Python command line;
- ``psql -c 'select 1'`` on the benchmark's database: a client that connects and runs one
  statement, the floor of any PostgreSQL command line (left out when ``psql`` is missing);
- ``ql3 submit noop --json`` on a migrated throwaway PostgreSQL database (Cluster);
- ``ql3 submit noop --json`` into a SQLite file (Standalone/Edge), created before the rounds.

Reported per command: the median wall time and the median CPU time of the process (user +
sys, from ``wait4``), and each submit's median beside ``python -c pass``'s (ratio). Rounds
interleave the commands, so that a change in the machine's load reaches all of them alike.
Every submit must exit 0 and print a run id, else the benchmark fails.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BenchmarkError,
    median,
    migrated_database,
    positive_int,
    print_json,
    print_table,
    say,
    server_address,
)

TARGET_S = 0.3
TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds", type=positive_int, default=11, metavar="N", help="runs of each command"
    )


def _ql3() -> list[str]:
    """The ``ql3`` console script beside this interpreter, else the module it runs."""
    script = Path(sys.executable).with_name("ql3")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "ql3.adapters.cli.main"]


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env.update(extra or {})
    return env


def _run(argv: Sequence[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Run ``argv`` to its end: (wall seconds, CPU seconds user + sys of the process, stdout)."""
    # One child at a time: the growth of the waited-for children's usage is this process's.
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    process = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    try:
        out, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise BenchmarkError(f"{' '.join(argv)} took over {TIMEOUT_S:.0f} s") from None
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise BenchmarkError(f"{' '.join(argv)} exited {process.returncode}: {err.strip()[-500:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, out


def _run_id(out: str, what: str) -> str:
    try:
        document = json.loads(out.strip().splitlines()[-1])
        run_id = document["run_id"]
    except (ValueError, IndexError, KeyError, TypeError):
        raise BenchmarkError(f"{what} printed no run id: {out[-300:]!r}") from None
    if not isinstance(run_id, str) or not run_id or document.get("existing") is not False:
        raise BenchmarkError(f"{what} did not admit a new run: {out[-300:]!r}")
    return run_id


def _psql(url: str) -> tuple[list[str], dict[str, str]] | None:
    psql = shutil.which("psql")
    if psql is None:
        return None
    address = server_address(url)
    database = url.rsplit("/", 1)[-1].split("?", 1)[0]
    argv = [psql, "-X", "-q", "-A", "-t", "-h", address.host, "-p", str(address.port)]
    argv += ["-U", address.user, "-d", database, "-c", "select 1"]
    extra = {"PGPASSWORD": address.password} if address.password else {}
    return argv, _environment(extra)


def main(args: argparse.Namespace, admin: str) -> int:
    rounds = int(args.rounds)
    env = _environment()
    ql3 = _ql3()
    with (
        migrated_database(admin, "ql3_bench_submit") as url,
        tempfile.TemporaryDirectory(prefix="ql3-bench-submit-") as folder,
    ):
        sqlite_url = f"sqlite:///{Path(folder) / 'submit.db'}"
        commands: dict[str, tuple[list[str], dict[str, str]]] = {
            "python_start": ([sys.executable, "-c", "pass"], env),
            "postgres_submit": ([*ql3, "submit", "noop", "--json", "--database-url", url], env),
            "sqlite_submit": (
                [*ql3, "submit", "noop", "--json", "--database-url", sqlite_url],
                env,
            ),
        }
        psql = _psql(url)
        if psql is not None:
            commands["psql_select_1"] = psql
        # Warm-up: creates the SQLite file and its schema, and the .pyc caches a user has.
        for name, (argv, command_env) in commands.items():
            _run(argv, command_env)
            say(f"submit: warmed up {name}")
        walls: dict[str, list[float]] = {name: [] for name in commands}
        cpus: dict[str, list[float]] = {name: [] for name in commands}
        for index in range(1, rounds + 1):
            for name, (argv, command_env) in commands.items():
                wall, cpu, out = _run(argv, command_env)
                if name.endswith("_submit"):
                    _run_id(out, name)
                walls[name].append(wall)
                cpus[name].append(cpu)
            say(
                f"submit: round {index}/{rounds}: "
                + ", ".join(f"{name} {walls[name][-1]:.3f}s" for name in commands)
            )

    result: dict[str, Any] = {"rounds": rounds, "target_s": TARGET_S}
    for name in commands:
        result[f"{name}_median_s"] = round(median(walls[name]), 4)
        result[f"{name}_cpu_median_s"] = round(median(cpus[name]), 4)
    start = result["python_start_median_s"]
    for name in ("postgres_submit", "sqlite_submit"):
        result[f"{name}_vs_python_start"] = round(result[f"{name}_median_s"] / start, 2)
        result[f"{name}_meets_target"] = result[f"{name}_median_s"] <= TARGET_S
    if psql is not None:
        result["postgres_submit_vs_psql"] = round(
            result["postgres_submit_median_s"] / result["psql_select_1_median_s"], 2
        )
    result["command"] = " ".join(ql3) + " submit noop --json --database-url URL"

    rows: list[tuple[str, object, str]] = [
        ("python_start_median_s", result["python_start_median_s"], "python -c pass"),
    ]
    if psql is not None:
        rows.append(
            ("psql_select_1_median_s", result["psql_select_1_median_s"], "psql -c 'select 1'")
        )
    for name, label in (("postgres_submit", "PostgreSQL"), ("sqlite_submit", "SQLite")):
        rows.append(
            (
                f"{name}_median_s",
                result[f"{name}_median_s"],
                f"ql3 submit on {label}; target <= {TARGET_S} s"
                f" ({'met' if result[f'{name}_meets_target'] else 'NOT met'})",
            )
        )
        rows.append((f"{name}_cpu_median_s", result[f"{name}_cpu_median_s"], "user + sys"))
        rows.append(
            (f"{name}_vs_python_start", result[f"{name}_vs_python_start"], "wall / python -c pass")
        )
    if psql is not None:
        rows.append(
            ("postgres_submit_vs_psql", result["postgres_submit_vs_psql"], "wall / psql select 1")
        )
    print_table(f"ql3 submit from the command line, median of {rounds} rounds", rows)
    if args.json:
        print_json(result)
    return 0
