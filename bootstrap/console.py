"""The operator console's composition root (ADR 0020): the console's services on a profile's
store, its sign-in, and the ASGI app. Used by ``ql3 console``, ``ql3 standalone
--console-port`` and ``Runtime.console_app()``; imported only by them, so that a submit loads no
web framework (ADR 0009)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ql3.adapters.console.app import ConsoleServices, create_app
from ql3.adapters.console.auth import BasicAuth, Operator, Role, User
from ql3.adapters.console.feed import ChangeFeed
from ql3.adapters.cron import CroniterCalendar
from ql3.application.console_actions import ConsoleActions
from ql3.application.identities import RandomIdentities
from ql3.application.queries import RunQueries
from ql3.application.task_limits import TaskLimits
from ql3.application.triggers import Triggers

log = logging.getLogger("ql3.console")

LOCAL_OPERATOR = Operator(name="local", role=Role.OPERATOR)
STARTUP_TIMEOUT_S = 10.0


class ConsoleUnavailable(RuntimeError):
    """The console could not start listening (its port is taken, say)."""


def _keeps_credentials(store: Any) -> bool:
    with store.unit_of_work() as uow:
        return hasattr(uow, "credentials")


def services(store: Any) -> ConsoleServices:
    identities = RandomIdentities()
    credentials_factory = store.unit_of_work if _keeps_credentials(store) else None
    credentials = None
    if credentials_factory is not None:
        from ql3.application.credentials import CredentialCommands

        credentials = CredentialCommands(credentials_factory, identities)
    calendar = CroniterCalendar()
    return ConsoleServices(
        browser=store,
        operations=store,
        runs=RunQueries(store.unit_of_work),
        limits=TaskLimits(store.unit_of_work),
        actions=ConsoleActions(store.unit_of_work, identities, credentials_factory),
        feed=ChangeFeed(store.last_event_sequence),
        credentials=credentials,
        triggers=(Triggers(store.unit_of_work, identities, calendar), calendar),
    )


@dataclass
class Console:
    """The console app and what it keeps running (PostgreSQL notification listeners)."""

    app: Any
    feed: ChangeFeed
    _listeners: list[Any] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def listen(self, database_url: str) -> None:
        """Wake the live updates on the store's notifications (queued, finished)."""
        from ql3.adapters.postgres.listen import DispatchListener
        from ql3.adapters.postgres.queries import DISPATCH_CHANNEL, FINISHED_CHANNEL

        with self._lock:
            for channel in (DISPATCH_CHANNEL, FINISHED_CHANNEL):
                listener = DispatchListener(database_url, self.feed.wake, channel=channel)
                listener.start()
                self._listeners.append(listener)
            self.feed.notified = True

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener.stop(timeout)


def identify_by(
    users: Mapping[str, User] | None,
    identify: Callable[[Any], Operator | None] | None,
    anonymous: Operator | None,
) -> Callable[[Any], Operator | None]:
    """Who sent a request: the application's own dependency, else HTTP Basic against
    ``users``, else ``anonymous`` (loopback only; the callers check)."""
    if identify is not None:
        return identify
    if users:
        basic = BasicAuth(users)
        return lambda request: basic(request.headers.get("authorization"))
    if anonymous is None:
        raise ValueError(
            "the console needs users (a users file or $QL3_CONSOLE_USERS) or the"
            " application's own identify dependency"
        )
    return lambda _request: anonymous


def build(
    store: Any,
    *,
    users: Mapping[str, User] | None = None,
    identify: Callable[[Any], Operator | None] | None = None,
    anonymous: Operator | None = None,
    database_url: str | None = None,
) -> Console:
    built = services(store)
    app = create_app(built, identify_by(users, identify, anonymous))
    console = Console(app=app, feed=built.feed)
    if database_url is not None and database_url.startswith("postgresql"):
        console.listen(database_url)
    return console


def _server(console: Console, host: str, port: int, root_path: str = "") -> Any:
    import uvicorn

    config = uvicorn.Config(
        console.app,
        host=host,
        port=port,
        root_path=root_path,
        log_level="warning",
        access_log=False,
        lifespan="off",
        # An open event stream must not hold a shutdown for long.
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)


def serve(console: Console, host: str, port: int, root_path: str = "") -> None:
    """Serve the console until SIGTERM or SIGINT."""
    try:
        _server(console, host, port, root_path).run()
    finally:
        console.close()


def serve_in_thread(console: Console, host: str, port: int) -> Callable[[], None]:
    """Serve the console on a daemon thread (beside a Standalone process); returns what stops
    it."""
    server = _server(console, host, port)
    thread = threading.Thread(target=server.run, name="ql3-console", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        server.should_exit = True
        console.close()
        raise ConsoleUnavailable(f"the console could not listen on {host}:{port}")

    def stop() -> None:
        server.should_exit = True
        thread.join(5.0)
        console.close()

    return stop
