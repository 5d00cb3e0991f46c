"""The connection pool of a Cluster store, and how it tells a dead connection at checkout.

A pool that pings every connection it hands out spends one round trip per unit of work. Instead,
a connection checked out of the pool is tested without one: an idle PostgreSQL connection
receives nothing unless the server ends it (``pg_terminate_backend``, a restart or a shutdown send
an error and close the socket), so a socket that is readable while the connection is idle means
the connection is gone. The pool then discards it and hands out a fresh one, as a failed ping
would. (The rare message a server sends unasked to a live idle connection, such as a changed
reported setting, costs no more than one reconnect.) A connection that dies unseen (no word from
the server) fails its first statement; the unit of work or cycle that used it fails cleanly and
the pool replaces it.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.pool import QueuePool


def pooled_engine(url: str, *, pool_size: int, **options: Any) -> Engine:
    """A psycopg engine on ``url`` with a fixed pool of ``pool_size`` connections (no overflow),
    READ COMMITTED, parameters hidden from error messages, and the checkout test above."""
    engine = create_engine(
        url,
        poolclass=QueuePool,
        pool_size=pool_size,
        max_overflow=0,
        hide_parameters=True,
        isolation_level="READ COMMITTED",
        **options,
    )
    event.listen(engine.pool, "checkout", _refuse_ended_connection)
    return engine


def connection_ended(driver_connection: Any) -> bool:
    """True when the server has spoken on, or closed, an idle connection: it has ended it."""
    if driver_connection.closed:
        return True
    try:
        readable, _, _ = select.select([driver_connection.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _refuse_ended_connection(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    if connection_ended(dbapi_connection):
        # The pool invalidates this connection and checks out a new one.
        raise DisconnectionError("the server has ended this pooled connection")


def refresh_on_connect(
    engine: Engine,
    *,
    url_source: Callable[[], str] | None = None,
    password_source: Callable[[], str] | None = None,
) -> None:
    """Every new connection of ``engine`` is opened with the current URL of ``url_source``
    (its host, port, user, password and database) and the current password of
    ``password_source``: a secret rotated in its file is used from the next connection on,
    without a restart. Connections already open are kept (a changed password does not end
    them on the server)."""
    if url_source is None and password_source is None:
        return

    def on_connect(dialect: Any, _record: Any, _args: Any, params: dict[str, Any]) -> None:
        if url_source is not None:
            url = make_url(url_source())
            if url.drivername in ("postgresql", "postgres"):
                url = url.set(drivername="postgresql+psycopg")
            _, fresh = dialect.create_connect_args(url)
            for key in _ADDRESS_KEYS:
                if key in fresh:
                    params[key] = fresh[key]
                else:
                    params.pop(key, None)
        if password_source is not None:
            params["password"] = password_source()

    event.listen(engine, "do_connect", on_connect)


_ADDRESS_KEYS = ("host", "port", "user", "password", "dbname")


def set_role_on_connect(engine: Engine, role: str) -> None:
    """Every new connection of ``engine`` takes ``role`` (``SET ROLE``, committed, so a rolled
    back transaction keeps it) before the pool hands it out: the session then holds that role's
    privileges only. A role the connecting user may not take fails the connection."""
    statement = "SET ROLE " + '"' + role.replace('"', '""') + '"'

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(statement)
        dbapi_connection.commit()

    event.listen(engine, "connect", on_connect)
