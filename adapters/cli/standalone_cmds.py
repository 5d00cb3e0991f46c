"""``ql3 standalone``: one process that schedules and executes the work of an embedded SQLite
database (runs admitted with ``ql3 submit --database-url sqlite:///PATH``, triggers, workflows),
until SIGTERM or SIGINT; then it drains and exits 0. Its in-process pool claims queued work
through the worker protocol (ADR 0007), up to ``--capacity`` tasks at once. ``--edge`` runs the
Edge profile: smaller page budgets and no resident wake-ups. Beside the database it keeps
``PATH.lock`` (one executing process per database) and ``PATH.wake`` (the named pipe through
which every commit that queues a Run wakes it)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import click

DEFAULT_DATABASE = "ql3.sqlite"


def _stamp(line: str) -> None:
    # Two lines per Run on a busy process: a plain write, without click.echo's look at the
    # stream on every line (the lines hold no ANSI codes to strip).
    print(time.strftime("%H:%M:%S ") + line, flush=True)


def _json_line(line: str) -> None:
    """What the runner reports, as a JSON log line (on stderr, with every other line)."""
    logging.getLogger("ql3.standalone").info(line)


@contextmanager
def _stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and SIGINT ask the runner to drain and stop (a second one as well: the drain is
    bounded by its timeout)."""

    def handler(_signum: int, _frame: FrameType | None) -> None:
        stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# What dependency_injector integrates with when the package is installed (it imports each one
# it finds when it is first imported: the web frameworks, pydantic for its settings, yaml for its
# configuration files). The process wires none of them and reads no configuration through it:
# importing them took about a third of its start-up.
UNUSED_INTEGRATIONS = (
    "fastapi",
    "starlette",
    "werkzeug",
    "pydantic_settings",
    "fast_depends",
    "pydantic",
    "yaml",
)


class _Hidden:
    """A finder of ``sys.meta_path`` (the protocol of ``importlib.abc.MetaPathFinder``, whose
    import would cost more than the finder saves) that finds the named packages and their
    modules missing: their import raises ``ModuleNotFoundError``, as when they are not
    installed."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"{fullname} is not used here", name=fullname)
        return None


@contextmanager
def _without_unused_integrations() -> Iterator[None]:
    """While the profile's containers are imported, the integrations no module has imported
    yet read as missing; they are importable again afterwards, by task code say."""
    finder = _Hidden(name for name in UNUSED_INTEGRATIONS if name not in sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


@contextmanager
def _start_up_uncollected() -> Iterator[None]:
    """No garbage collection while the process imports and builds what it keeps for its whole
    life (the imports alone would trigger dozens of collections that find nothing to free);
    then those objects are frozen out of later collections, so the full collections of a busy
    loop walk only what it allocated since."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _importable_cwd() -> None:
    """``--app`` names a module of the current directory, as ``python -m`` would find it."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


@click.command("standalone")
@click.option("--app", "app_spec", required=True, help="The task mapping, as MODULE:ATTR.")
@click.option(
    "--db",
    "database_path",
    default=DEFAULT_DATABASE,
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The SQLite database file (created when missing).",
)
@click.option("--edge", is_flag=True, help="Run the Edge profile: no resident wake-ups.")
@click.option(
    "--capacity",
    type=click.IntRange(1, 1024),
    default=None,
    help="Tasks executed at once: each claim asks for the free ones [default: 4; Edge 2].",
)
@click.option(
    "--lease-ttl",
    type=click.FloatRange(0.3, 3600),
    default=None,
    help="Seconds a lease lasts between renewals (a restart after a crash waits at most this).",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(0, 3600),
    default=None,
    help="Seconds running tasks get to finish after SIGTERM.",
)
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one JSON object per line.",
)
@click.option(
    "--console-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve the operator console on this port too (ADR 0020).",
)
@click.option("--console-host", default="127.0.0.1", show_default=True)
@click.option(
    "--console-users-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="Who signs in to the console (needed off loopback); see `ql3 console`.",
)
def standalone_command(
    app_spec: str,
    database_path: str,
    edge: bool,
    capacity: int | None,
    lease_ttl: float | None,
    drain_timeout: float | None,
    log_format: str,
    console_port: int | None,
    console_host: str,
    console_users_file: str | None,
) -> None:
    """Execute the tasks of --app on an embedded database until SIGTERM or SIGINT."""
    console_users = None
    if console_port is not None:
        from ql3.adapters.cli.console_cmds import load_console_users

        console_users = load_console_users(console_users_file, console_host)
    with _start_up_uncollected():
        from ql3.adapters import logs
        from ql3.adapters.execution import AppLoadError, load_app

        emit = _stamp
        if log_format == "json":
            logs.configure("info", log_format)
            emit = _json_line

        _importable_cwd()
        try:
            tasks = load_app(app_spec)
        except AppLoadError as error:
            raise click.UsageError(str(error)) from None
        settings: dict[str, Any] = {"database_path": os.path.abspath(database_path)}
        for name, value in (
            ("capacity", capacity),
            ("lease_ttl_s", lease_ttl),
            ("drain_timeout_s", drain_timeout),
        ):
            if value is not None:
                settings[name] = value
        with _without_unused_integrations():
            if edge:
                from ql3.bootstrap import edge as profile
            else:
                from ql3.bootstrap import standalone as profile  # type: ignore[no-redef]
        container = profile.build(**settings)
    stop_console: Callable[[], None] | None = None
    try:
        if console_port is not None:
            stop_console = _serve_console(
                settings["database_path"], console_host, console_port, console_users or {}
            )
            emit(f"ql3 console on http://{console_host}:{console_port}/")
        runner = container.runner(tasks=tasks, emit=emit)
        with _stop_on_signals(runner.request_stop):
            name = "edge" if edge else "standalone"
            emit(f"ql3 {name} on {settings['database_path']}: tasks {', '.join(sorted(tasks))}")
            runner.serve()
    finally:
        if stop_console is not None:
            stop_console()
        container.store().close()


def _serve_console(
    database_path: str, host: str, port: int, users: dict[str, Any]
) -> Callable[[], None]:
    """The console beside this process, on a thread and a store of its own (ADR 0020)."""
    from ql3.bootstrap import console
    from ql3.bootstrap.producer import open_sqlite_store

    store = open_sqlite_store(database_path)
    built = console.build(
        store, users=users or None, anonymous=None if users else console.LOCAL_OPERATOR
    )
    try:
        stop = console.serve_in_thread(built, host, port)
    except console.ConsoleUnavailable as error:
        store.close()
        from ql3.adapters.cli.main import Failure

        raise Failure(str(error)) from None

    def stop_and_close() -> None:
        stop()
        store.close()

    return stop_and_close
