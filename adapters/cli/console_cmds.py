"""``ql3 console``: the operator console on its own port (ADR 0020), never on the worker
ingress's. Off a loopback address it starts only with users who sign in (a users file or
``$QL3_CONSOLE_USERS``); ``ql3 console hash-password`` makes the hash a user's line holds.
Errors follow the command line's rules: one line on stderr, exit 2 for bad input."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ql3.adapters.cli.secure import is_loopback

DEFAULT_PORT = 8090


F = TypeVar("F", bound=Callable[..., Any])


def users_option(command: F) -> F:
    return click.option(
        "--users-file",
        type=click.Path(dir_okay=False),
        default=None,
        help="Users who sign in, NAME:ROLE:HASH a line (also $QL3_CONSOLE_USERS_FILE,"
        " or the lines in $QL3_CONSOLE_USERS).",
    )(command)


def load_console_users(users_file: str | None, host: str) -> dict[str, object]:
    """The users, or a usage error: none off loopback, or a file that cannot be read."""
    from ql3.adapters.console.auth import InvalidUsers, load_users

    try:
        users = load_users(users_file)
    except InvalidUsers as error:
        raise click.UsageError(str(error)) from None
    if not users and not is_loopback(host):
        raise click.UsageError(
            f"the console on {host} needs users who sign in: pass --users-file or set"
            " $QL3_CONSOLE_USERS (make a hash with `ql3 console hash-password`)"
        )
    return dict(users)


@click.group("console", invoke_without_command=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--root-path", default="", help="The path prefix a proxy serves it under.")
@users_option
@click.option("--database-url", "database_url", default=None, help="Defaults to $QL3_DATABASE_URL.")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="The log on stderr, where every action is written with the operator's name.",
)
@click.pass_context
def console(
    ctx: click.Context,
    host: str,
    port: int,
    root_path: str,
    users_file: str | None,
    database_url: str | None,
    log_format: str,
) -> None:
    """Serve the operator console: runs, attempts, workers, tasks, triggers and workflows,
    live, with the operator's actions."""
    if ctx.invoked_subcommand is not None:
        return
    from ql3.adapters import logs
    from ql3.adapters.cli.main import SQLITE_URL_PREFIX, _database_url, _sqlite_path
    from ql3.bootstrap import console as root
    from ql3.bootstrap import producer

    users = load_console_users(users_file, host)
    url = _database_url(database_url)
    logs.configure("info", log_format, secrets=[logs.url_password(url)])
    if url.startswith(SQLITE_URL_PREFIX):
        store = producer.open_sqlite_store(_sqlite_path(url))
    else:
        store = producer.open_postgres_store(url, pool_size=4)
    try:
        built = root.build(
            store,
            users=users,  # type: ignore[arg-type]
            anonymous=None if users else root.LOCAL_OPERATOR,
            database_url=url,
        )
        signed = "users sign in" if users else "no sign-in (loopback)"
        click.echo(f"ql3 console on http://{host}:{port}{root_path}/ ({signed})", err=True)
        root.serve(built, host, port, root_path)
    finally:
        store.close()


@console.command("hash-password")
def hash_password_command() -> None:
    """Read a password (from stdin, or asked for) and print its hash for a users line."""
    from ql3.adapters.console.auth import hash_password

    if sys.stdin.isatty():
        password = click.prompt("password", hide_input=True, confirmation_prompt=True)
    else:
        password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise click.UsageError("the password is empty")
    click.echo(hash_password(password))
