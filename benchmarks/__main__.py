"""``python -m benchmarks <recovery|idle|recover-time|throughput|latency|standalone|chaos> ...``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benchmarks.common import ADMIN_URL_ENV, ArgumentParser, BenchmarkError, admin_url


def parser() -> ArgumentParser:
    from benchmarks import chaos, idle, latency, recover_time, recovery, standalone, throughput

    top = ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "QL3 runtime benchmarks against a PostgreSQL server. Each creates and drops its own"
            f" databases on the server named by ${ADMIN_URL_ENV} (an admin URL)."
        ),
    )
    commands = top.add_subparsers(
        dest="command",
        metavar="{recovery,idle,recover-time,throughput,latency,standalone,chaos}",
    )
    commands.required = True
    recovery.add_arguments(
        commands.add_parser(
            "recovery", help="runtime recovery throughput vs pgbench TPC-B, 1 client"
        )
    )
    idle.add_arguments(
        commands.add_parser("idle", help="one idle Cluster cycle: empty vs large history")
    )
    recover_time.add_arguments(
        commands.add_parser(
            "recover-time", help="SIGKILL of a worker -> its run queued again and succeeded"
        )
    )
    throughput.add_arguments(
        commands.add_parser(
            "throughput", help="no-op runs through one node and one worker vs PgQueuer"
        )
    )
    latency.add_arguments(
        commands.add_parser(
            "latency", help="submit -> task started, idle and under load, vs PgQueuer"
        )
    )
    standalone.add_arguments(
        commands.add_parser(
            "standalone", help="no-op runs through ql3 standalone on SQLite vs Huey's SqliteHuey"
        )
    )
    chaos.add_arguments(
        commands.add_parser(
            "chaos",
            help="faults under load (kills, server restart, held transactions, ...) vs PgQueuer"
            " and Procrastinate, on a private server",
        )
    )
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from benchmarks import chaos, idle, latency, recover_time, recovery, standalone, throughput

    run = {
        "recovery": recovery.main,
        "idle": idle.main,
        "recover-time": recover_time.main,
        "throughput": throughput.main,
        "latency": latency.main,
        "standalone": standalone.main,
        "chaos": chaos.main,
    }[args.command]
    try:
        return run(args, admin_url())
    except BenchmarkError as error:
        print(f"python -m benchmarks {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"python -m benchmarks {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
