"""PostgreSQL servers and throw-away databases for the test suite.

A test session needs one server it may create and drop databases on. It is found in this order:

1. ``QL3_TEST_DATABASE_URL`` (a SQLAlchemy URL, used as the maintenance connection);
2. a server at ``127.0.0.1:5432``, user ``postgres``, database ``postgres``, trust auth;
3. a private server started from the installed PostgreSQL binaries in a temporary directory,
   stopped and deleted at the end of the session (:mod:`benchmarks.private_server`, which the
   chaos benchmark uses too).

Databases are created and dropped with psycopg directly in autocommit mode, because
``CREATE DATABASE`` cannot run inside a transaction.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import URL, make_url

from benchmarks.private_server import (
    DRIVER,
    LOCAL_HOST,
    LOCAL_USER,
    PrivateServer,
    ServerUnavailable,
    start_private_server,
)
from ql3.adapters.postgres.migrate import upgrade

DATABASE_URL_ENV = "QL3_TEST_DATABASE_URL"
LOCAL_PORT = 5432
CONNECT_TIMEOUT_S = 3


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


# ------------------------------------------------------------------------------ databases


def random_name(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(6)}"


def create_database(server: PostgresServer, name: str, *, template: str | None = None) -> str:
    """Create database ``name`` (optionally cloned from ``template``) and return its URL.

    Its sessions commit without waiting for the WAL to reach the disk (``synchronous_commit``
    off, as on the private server): a crash of the server could lose the last commits, which no
    test on these databases brings about, and what a commit makes visible, and when, is
    unchanged. The suite commits thousands of times; each flush would cost milliseconds."""
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        statement = sql.SQL("{} TEMPLATE {}").format(statement, sql.Identifier(template))
    with server.connect_admin() as conn:
        conn.execute(statement)
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(sql.Identifier(name))
        )
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


@contextmanager
def private_database(name: str) -> Iterator[tuple[PrivateServer, str]]:
    """A private server of the tests' own (which they may stop and start) holding the migrated
    database ``name``: the server and the database's URL. The tests are skipped when no private
    server can be started (no PostgreSQL binaries)."""
    try:
        private = start_private_server()
    except ServerUnavailable as error:
        pytest.skip(f"no private PostgreSQL server: {error}")
    try:
        url = URL.create(
            DRIVER, username=LOCAL_USER, host=LOCAL_HOST, port=private.port, database=name
        ).render_as_string(hide_password=False)
        with connect(private.admin_url) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        upgrade(url)
        yield private, url
    finally:
        private.stop()
