"""PostgreSQL servers and throw-away databases for the test suite.

A test session needs one server it may create and drop databases on. It is found in this order:

1. ``QL3_TEST_DATABASE_URL`` (a SQLAlchemy URL, used as the maintenance connection);
2. a server at ``127.0.0.1:5432``, user ``postgres``, database ``postgres``, trust auth;
3. a private server started from the installed PostgreSQL binaries in a temporary directory,
   stopped and deleted at the end of the session.

Databases are created and dropped with psycopg directly in autocommit mode, because
``CREATE DATABASE`` cannot run inside a transaction.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql
from sqlalchemy.engine import URL, make_url

DATABASE_URL_ENV = "QL3_TEST_DATABASE_URL"
DRIVER = "postgresql+psycopg"
LOCAL_HOST = "127.0.0.1"
LOCAL_PORT = 5432
LOCAL_USER = "postgres"
CONNECT_TIMEOUT_S = 3
SERVER_START_TIMEOUT_S = 30

PRIVATE_SERVER_SETTINGS = {
    "listen_addresses": f"'{LOCAL_HOST}'",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
}


class ServerUnavailable(RuntimeError):
    """No PostgreSQL server could be reached or started; the message says why."""


@dataclass
class PostgresServer:
    """A PostgreSQL server the tests may create and drop databases on.

    ``admin_url`` is a SQLAlchemy URL (driver ``postgresql+psycopg``) for the maintenance
    database. ``origin`` says how the server was found: ``env``, ``local`` or ``private``.
    """

    admin_url: str
    origin: str
    private: PrivateServer | None = field(default=None, repr=False)

    def url_for(self, dbname: str) -> str:
        """The SQLAlchemy URL of database ``dbname`` on this server."""
        return _render(make_url(self.admin_url).set(database=dbname))

    def connect_admin(self) -> psycopg.Connection[tuple[object, ...]]:
        """An autocommit psycopg connection to the maintenance database."""
        return connect(self.admin_url)

    def stop(self) -> None:
        """Stop the server if this session started it; a shared server is left alone."""
        if self.private is not None:
            self.private.stop()
            self.private = None


def connect(url: str) -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit psycopg connection for a SQLAlchemy-style PostgreSQL URL."""
    parsed = make_url(url)
    params: dict[str, str | int] = {"connect_timeout": CONNECT_TIMEOUT_S}
    if parsed.host:
        params["host"] = parsed.host
    if parsed.port:
        params["port"] = parsed.port
    if parsed.username:
        params["user"] = parsed.username
    if parsed.password:
        params["password"] = parsed.password
    if parsed.database:
        params["dbname"] = parsed.database
    for key, value in parsed.query.items():
        params[key] = value if isinstance(value, str) else value[-1]
    return psycopg.connect(autocommit=True, **params)  # type: ignore[arg-type]


def normalise_url(url: str) -> str:
    """Force the psycopg 3 driver onto a PostgreSQL URL (``postgres://`` is accepted too)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url.removeprefix("postgres://")
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"not a PostgreSQL URL: {parsed.render_as_string(hide_password=True)}")
    return _render(parsed.set(drivername=DRIVER))


def _render(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def _answers(url: str) -> str | None:
    """None if ``select 1`` works at ``url``, else the reason it did not."""
    try:
        with connect(url) as conn:
            conn.execute("select 1")
    except psycopg.Error as error:
        return str(error).strip() or type(error).__name__
    return None


# ------------------------------------------------------------------------------ resolution


def find_server() -> PostgresServer:
    """Find or start a server in the documented order, or raise ``ServerUnavailable``."""
    configured = os.environ.get(DATABASE_URL_ENV)
    if configured:
        admin_url = normalise_url(configured)
        problem = _answers(admin_url)
        if problem is not None:
            shown = make_url(admin_url).render_as_string(hide_password=True)
            raise ServerUnavailable(f"{DATABASE_URL_ENV}={shown} does not answer: {problem}")
        return PostgresServer(admin_url=admin_url, origin="env")

    local_url = _render(
        URL.create(
            DRIVER, username=LOCAL_USER, host=LOCAL_HOST, port=LOCAL_PORT, database="postgres"
        )
    )
    local_problem = _answers(local_url)
    if local_problem is None:
        return PostgresServer(admin_url=local_url, origin="local")

    try:
        private = start_private_server()
    except ServerUnavailable as error:
        raise ServerUnavailable(
            f"no PostgreSQL for tests: {DATABASE_URL_ENV} is not set; "
            f"{LOCAL_HOST}:{LOCAL_PORT} does not answer ({local_problem}); "
            f"a private server could not be started ({error})"
        ) from error
    return PostgresServer(admin_url=private.admin_url, origin="private", private=private)


# ------------------------------------------------------------------------------ private server


def find_binaries() -> Path:
    """The directory holding both ``initdb`` and ``pg_ctl``; newest major version first."""
    candidates: list[Path] = []
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).parent)
        candidates.append(Path(on_path).resolve().parent)

    def major(directory: str) -> int:
        version = Path(directory).parent.name
        return int(version) if version.isdigit() else -1

    versioned = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=major, reverse=True)
    candidates.extend(Path(directory) for directory in versioned)
    for directory in candidates:
        if (directory / "initdb").is_file() and (directory / "pg_ctl").is_file():
            return directory
    raise ServerUnavailable("initdb and pg_ctl not found on PATH or in /usr/lib/postgresql/*/bin")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((LOCAL_HOST, 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class PrivateServer:
    """A server this process started in ``base_dir``; ``stop`` shuts it down and deletes it."""

    bin_dir: Path
    base_dir: Path
    port: int
    run_as: str | None
    running: bool = True

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "server.log"

    @property
    def admin_url(self) -> str:
        return _render(
            URL.create(
                DRIVER, username=LOCAL_USER, host=LOCAL_HOST, port=self.port, database="postgres"
            )
        )

    def stop(self) -> None:
        try:
            if self.running:
                _run(
                    [
                        str(self.bin_dir / "pg_ctl"),
                        "-D",
                        str(self.data_dir),
                        "-m",
                        "immediate",
                        "-w",
                        "-t",
                        str(SERVER_START_TIMEOUT_S),
                        "stop",
                    ],
                    run_as=self.run_as,
                    cwd=self.base_dir,
                )
        finally:
            self.running = False
            shutil.rmtree(self.base_dir, ignore_errors=True)


def _run(
    command: Sequence[str], *, run_as: str | None, cwd: Path
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool, as ``run_as`` when given (the server refuses to run as root)."""
    if run_as is not None:
        if shutil.which("runuser"):
            command = ["runuser", "-u", run_as, "--", *command]
        else:
            command = ["su", run_as, "-s", "/bin/sh", "-c", shlex.join(command)]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env["LC_ALL"] = "C"
    result = subprocess.run(
        list(command),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SERVER_START_TIMEOUT_S * 2,
        check=False,
    )
    if result.returncode != 0:
        raise ServerUnavailable(
            f"{shlex.join(command)} exited {result.returncode}: "
            f"{(result.stderr or result.stdout).strip()[-2000:]}"
        )
    return result


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for directory, subdirs, files in os.walk(root):
        for name in [*subdirs, *files]:
            os.chown(os.path.join(directory, name), uid, gid)


def start_private_server(bin_dir: Path | None = None) -> PrivateServer:
    """Initialise and start a throw-away server on a free local port.

    Durability is switched off (``fsync``, ``synchronous_commit``, ``full_page_writes``) because
    the data dies with the session. Its unix socket lives in the temporary directory, so it never
    collides with a system server. Raises ``ServerUnavailable`` when it cannot be started.
    """
    bin_dir = bin_dir or find_binaries()
    run_as: str | None = None
    owner: pwd.struct_passwd | None = None
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError as error:
            raise ServerUnavailable("running as root and no 'postgres' OS user exists") from error
        run_as = owner.pw_name

    base_dir = Path(tempfile.mkdtemp(prefix="ql3-pg-"))
    try:
        if owner is not None:
            _chown_tree(base_dir, owner.pw_uid, owner.pw_gid)
        server = PrivateServer(
            bin_dir=bin_dir, base_dir=base_dir, port=free_port(), run_as=run_as, running=False
        )
        _run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(server.data_dir),
                "-U",
                LOCAL_USER,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            run_as=run_as,
            cwd=base_dir,
        )
        settings = {
            **PRIVATE_SERVER_SETTINGS,
            "port": str(server.port),
            "unix_socket_directories": f"'{base_dir}'",
        }
        with (server.data_dir / "postgresql.conf").open("a", encoding="utf-8") as conf:
            conf.write("\n# throw-away test server\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
        try:
            _run(
                [
                    str(bin_dir / "pg_ctl"),
                    "-D",
                    str(server.data_dir),
                    "-l",
                    str(server.log_file),
                    "-w",
                    "-t",
                    str(SERVER_START_TIMEOUT_S),
                    "start",
                ],
                run_as=run_as,
                cwd=base_dir,
            )
        except ServerUnavailable as error:
            log = ""
            if server.log_file.exists():
                log = server.log_file.read_text(errors="replace")[-2000:]
            raise ServerUnavailable(f"{error}\n{log}") from error
        server.running = True
    except BaseException:
        shutil.rmtree(base_dir, ignore_errors=True)
        raise
    return server


# ------------------------------------------------------------------------------ databases


def random_name(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(6)}"


def create_database(server: PostgresServer, name: str, *, template: str | None = None) -> str:
    """Create database ``name`` (optionally cloned from ``template``) and return its URL."""
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        statement = sql.SQL("{} TEMPLATE {}").format(statement, sql.Identifier(template))
    with server.connect_admin() as conn:
        conn.execute(statement)
    return server.url_for(name)


def drop_database(server: PostgresServer, name: str) -> None:
    """Drop database ``name`` if it exists, disconnecting anyone still using it."""
    with server.connect_admin() as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def close_connections(server: PostgresServer, name: str) -> None:
    """Terminate other sessions on ``name``; a database is only cloned while nobody uses it."""
    with server.connect_admin() as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )


def user_tables(url: str) -> frozenset[str]:
    """``schema.table`` names of the ordinary tables outside the system schemas."""
    with connect(url) as conn:
        rows = conn.execute(
            "SELECT table_schema || '.' || table_name FROM information_schema.tables"
            " WHERE table_type = 'BASE TABLE'"
            " AND table_schema NOT IN ('pg_catalog', 'information_schema')"
        ).fetchall()
    return frozenset(str(row[0]) for row in rows)
