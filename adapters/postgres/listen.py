"""The node's one LISTEN connection for dispatch wake-ups (ADR 0007).

Every commit that puts a Run into ``queued`` sends ``NOTIFY ql3_dispatch``. A node keeps one
dedicated connection (autocommit, outside every pool) listening on that channel, in a thread of
its own that waits on the socket and calls ``on_wake`` for each notification: the node's parked
claims then claim again.

When the connection is lost (the server ended it, a restart, the network) the thread reconnects
with an exponential backoff. While it is down, :attr:`DispatchListener.connected` is false, so
the node falls back to waking its parked claims at the end of every scheduler cycle; once it is
back, ``on_wake`` is called once at once, for the notifications it may have missed. Nothing else
depends on this connection: recovery and lost retry stay on the cadence."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from ql3.adapters.postgres.queries import DISPATCH_CHANNEL

log = logging.getLogger("ql3.listen")

APPLICATION_NAME = "ql3-dispatch-listener"
POLL_S = 0.25  # how long one wait on the socket lasts: the latency of stop()
MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0
CONNECT_TIMEOUT_S = 5
# TCP keepalives tell a connection that died silently (no word from the server) in ~25 s.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}


def libpq_conninfo(url: str) -> str:
    """A libpq connection string for ``url``: a SQLAlchemy URL (``postgresql+psycopg://``)
    loses its driver name; anything else is taken as it is."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    if not parsed.drivername.startswith("postgresql"):
        return url
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


class DispatchListener:
    """``LISTEN ql3_dispatch`` on one dedicated connection, in a daemon thread.

    ``on_wake`` is called from that thread (it must be thread-safe and quick) for every
    notification, and once after every (re)connection. :meth:`start` returns at once; the
    thread connects, and reconnects after a loss, until :meth:`stop`."""

    def __init__(
        self,
        url: str,
        on_wake: Callable[[], None],
        *,
        channel: str = DISPATCH_CHANNEL,
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        poll_s: float = POLL_S,
    ) -> None:
        if not channel or "\x00" in channel:
            raise ValueError(f"not a channel name: {channel!r}")
        if not 0 < min_backoff_s <= max_backoff_s or poll_s <= 0:
            raise ValueError("backoff and poll intervals must be positive, min <= max")
        self._conninfo = libpq_conninfo(url)
        self._on_wake = on_wake
        self._channel = channel
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._poll_s = poll_s
        self._stopping = threading.Event()
        self._state = threading.Condition()
        self._connected = False
        self._backend_pid: int | None = None
        self._connections = 0
        self._thread: threading.Thread | None = None

    @property
    def channel(self) -> str:
        return self._channel

    @property
    def connected(self) -> bool:
        """The connection listens now (a notification would be seen)."""
        return self._connected

    @property
    def backend_pid(self) -> int | None:
        """The server process of the current connection (None while down)."""
        return self._backend_pid

    @property
    def connections(self) -> int:
        """How many times the listener connected (1 + the reconnections)."""
        return self._connections

    def start(self) -> None:
        with self._state:
            if self._stopping.is_set():
                raise RuntimeError("a stopped listener cannot start again")
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, name="ql3-dispatch-listener", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop listening and close the connection (waits for the thread, at most
        ``timeout``)."""
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait_connected(self, timeout: float, *, connections: int = 1) -> bool:
        """Wait until the listener listens and has connected at least ``connections`` times."""
        with self._state:
            return self._state.wait_for(
                lambda: self._connected and self._connections >= connections, timeout
            )

    def wait_disconnected(self, timeout: float) -> bool:
        with self._state:
            return self._state.wait_for(lambda: not self._connected, timeout)

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = self._min_backoff_s
        while not self._stopping.is_set():
            try:
                with psycopg.connect(
                    self._conninfo,
                    autocommit=True,
                    connect_timeout=CONNECT_TIMEOUT_S,
                    application_name=APPLICATION_NAME,
                    **KEEPALIVES,
                ) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    # What was notified while no connection listened: woken before the
                    # listener counts as connected, so that whoever waits for it sees both.
                    self._wake()
                    self._set_connected(conn.info.backend_pid)
                    backoff = self._min_backoff_s
                    self._listen(conn)
            except Exception as error:  # the thread never dies: the node would lose its wake-ups
                if self._stopping.is_set():
                    break
                self._lost(error, backoff)
                self._stopping.wait(backoff)
                backoff = min(self._max_backoff_s, backoff * 2)
        self._set_disconnected()

    def _lost(self, error: Exception, backoff: float) -> None:
        was_connected = self._connected
        self._set_disconnected()
        if not isinstance(error, psycopg.Error):
            log.error("dispatch listener failed", exc_info=error)
            return
        first = (str(error).splitlines() or [type(error).__name__])[0]
        if was_connected:
            log.warning("dispatch listener lost its connection: %s", first)
        else:
            log.info("dispatch listener cannot connect, next try in %.2fs: %s", backoff, first)

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        while not self._stopping.is_set():
            for _notify in conn.notifies(timeout=self._poll_s):
                self._wake()
                if self._stopping.is_set():
                    return

    def _wake(self) -> None:
        try:
            self._on_wake()
        except Exception:
            log.exception("a dispatch wake-up failed")

    def _set_connected(self, pid: int) -> None:
        with self._state:
            self._connected = True
            self._backend_pid = pid
            self._connections += 1
            self._state.notify_all()
        if self._connections > 1:
            log.info("dispatch listener connected again")

    def _set_disconnected(self) -> None:
        with self._state:
            self._connected = False
            self._backend_pid = None
            self._state.notify_all()
