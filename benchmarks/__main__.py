"""``python -m benchmarks <recovery|idle|recover-time|throughput|latency|standalone|submit|
console|chaos> ...``."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks.common import ADMIN_URL_ENV, ArgumentParser, BenchmarkError, admin_url

# Each command: its module (with ``add_arguments`` and ``main``) and its one-line help.
COMMANDS: dict[str, tuple[str, str]] = {
    "recovery": (
        "recovery",
        "runtime recovery throughput vs pgbench TPC-B at equal clients and at 1",
    ),
    "idle": ("idle", "one idle Cluster cycle: empty vs large history"),
    "recover-time": (
        "recover_time",
        "SIGKILL of a worker -> its run queued again and succeeded",
    ),
    "throughput": ("throughput", "no-op runs through one node and one worker vs PgQueuer"),
    "latency": ("latency", "submit -> task started, idle and under load, vs PgQueuer"),
    "standalone": (
        "standalone",
        "no-op runs through ql3 standalone on SQLite vs Huey's SqliteHuey",
    ),
    "submit": (
        "submit",
        "wall time of one ql3 submit process on PostgreSQL and SQLite vs python and psql start-up",
    ),
    "console": ("console", "the operator console's pages: p95, empty vs large history"),
    "chaos": (
        "chaos",
        "faults under load (kills, server restart, held transactions, ...) vs PgQueuer"
        " and Procrastinate, on a private server",
    ),
}


def _module(command: str) -> Any:
    return importlib.import_module(f"benchmarks.{COMMANDS[command][0]}")


def parser() -> ArgumentParser:
    top = ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "QL3 runtime benchmarks against a PostgreSQL server. Each creates and drops its own"
            f" databases on the server named by ${ADMIN_URL_ENV} (an admin URL)."
        ),
    )
    commands = top.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    commands.required = True
    for command, (_, help_text) in COMMANDS.items():
        sub = commands.add_parser(command, help=help_text)
        sub.add_argument("--json", action="store_true", help="print one JSON object last")
        _module(command).add_arguments(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run = _module(args.command).main
    try:
        return int(run(args, admin_url()))
    except BenchmarkError as error:
        print(f"python -m benchmarks {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"python -m benchmarks {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
