"""The runtimes of the Cluster and Standalone/Edge profiles, built from settings.

Each opens its store when built (through :mod:`ql3.bootstrap.producer`, which loads no
dependency-injector and no web framework) and builds the profile's composition root on that same
store only when started."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ql3.application.tasks import TaskRegistry
from ql3.bootstrap.producer import Producer, open_postgres_store, open_sqlite_store
from ql3.runtime import FinishSignal, Notified, Runtime, UnsupportedTransaction

log = logging.getLogger("ql3")

POSTGRES_PREFIXES = ("postgresql+psycopg://", "postgresql://")


class WithConsole(Runtime):
    """A runtime that serves the operator console (ADR 0020)."""

    def console_app(
        self,
        *,
        users: Mapping[str, Any] | None = None,
        identify: Callable[[Any], Any] | None = None,
    ) -> Any:
        """The operator console as an ASGI app on this runtime's store, to mount in the
        application (``app.mount("/ops", runtime.console_app(identify=...))``), never beside
        the worker ingress. Who may use it: ``identify``, the application's own dependency (a
        callable from the request to a ``ql3.ConsoleOperator``, or None for nobody signed
        in), or ``users`` (``ql3.console_users(path)``) who sign in with HTTP Basic; one of
        them is required. On the Cluster profile the store's notifications drive its live
        updates. The console is closed with the runtime."""
        if users is None and identify is None:
            raise ValueError("console_app() needs users= or identify= (who may use it)")
        from ql3.bootstrap import console

        built = console.build(
            self.store, users=users, identify=identify, database_url=self._notifications_url()
        )
        self._consoles.append(built)
        return built.app

    def _notifications_url(self) -> str | None:
        return None


class ClusterRuntime(WithConsole):
    """The Cluster profile on PostgreSQL. :meth:`start` runs startup recovery, then this
    process's scheduler replica (the one cadence) and the dispatch listener that wakes the
    parked claims of :meth:`ingress_app`."""

    profile = "cluster"

    def __init__(
        self, database_url: str, tasks: TaskRegistry | None, settings: dict[str, Any]
    ) -> None:
        if not database_url.startswith(POSTGRES_PREFIXES):
            raise ValueError("the Cluster database URL must start with postgresql+psycopg://")
        self._url = database_url.replace("postgresql://", "postgresql+psycopg://", 1)
        self._settings = dict(settings)
        store = open_postgres_store(self._url, int(self._settings.get("pool_size", 5)))
        super().__init__(Producer(store), tasks)
        self._node: Any = None
        self._node_lock = threading.Lock()
        self._finished: Notified | None = None
        self._finished_listener: Any = None

    def _notifications_url(self) -> str | None:
        return self._url

    def _unit_of_work_in(self, transaction: object, *, workflow: bool) -> Callable[[], Any]:
        from ql3.adapters.postgres import caller_transaction

        try:
            unit_of_work = caller_transaction.caller_unit_of_work(self.store, transaction)
        except caller_transaction.UnsupportedTransaction as error:
            raise UnsupportedTransaction(str(error)) from None
        if workflow and isinstance(unit_of_work, caller_transaction.CallerPsycopgUnitOfWork):
            # A workflow's steps are written by the SQL store's statements, which need a
            # SQLAlchemy connection; one around the caller's would roll it back on release.
            raise UnsupportedTransaction(
                "a workflow is written in a SQLAlchemy Connection or Session, "
                "not in a bare psycopg connection"
            )
        return lambda: unit_of_work

    def _finish_signal(self) -> FinishSignal:
        """Woken by ``NOTIFY ql3_run_finished`` on one LISTEN connection of this runtime,
        opened by the first wait and closed with the runtime."""
        with self._node_lock:
            if self._finished is None:
                from ql3.adapters.postgres.listen import DispatchListener
                from ql3.adapters.postgres.queries import FINISHED_CHANNEL

                listener: Any = None
                signal = Notified(lambda: listener is not None and listener.connected)
                listener = DispatchListener(self._url, signal.notify, channel=FINISHED_CHANNEL)
                listener.start()
                self._finished, self._finished_listener = signal, listener
            return self._finished

    def node(self) -> Any:
        """The node's container (``ql3.bootstrap.node``) on this runtime's store, built once."""
        with self._node_lock:
            if self._node is None:
                from ql3.bootstrap import node

                container = node.build(store=self.store, database_url=self._url, **self._settings)
                # The ingress is least-privilege here too (ADR 0024): its own pool, as the
                # ingress URL's role or the default ingress role, never the runtime's store.
                container.ingress_store.reset_override()
                self._node = container
            return self._node

    def ingress_app(self) -> Any:
        """The worker ingress as an ASGI app, to mount in the application's own server (or to
        serve). It starts nothing itself: :meth:`start` and :meth:`stop` do."""
        from ql3.bootstrap import node

        return node.ingress_app(self.node())

    def _start(self) -> None:
        container = self.node()
        report = container.cluster.startup_recovery().run()
        log.info("startup recovery: %s", report.counts())
        listener = container.dispatch_listener()
        if listener is not None:
            listener.start()
        container.lifecycle().start()

    def _stop(self, timeout: float) -> None:
        container = self._node
        container.claim_signal().close()
        listener = container.dispatch_listener()
        if listener is not None:
            listener.stop(timeout)
        container.lifecycle().stop(timeout)

    def close(self) -> None:
        super().close()
        if self._finished_listener is not None:
            self._finished_listener.stop(5.0)
        if self._node is not None:
            ingress = self._node.ingress_store()
            if ingress is not self.store:
                ingress.close()


class StandaloneRuntime(WithConsole):
    """The Standalone (or Edge) profile on a SQLite file. :meth:`start` takes the database's
    exclusive lock and runs the in-process runner (startup recovery, the pool, the cadence) on
    a thread of its own; it needs the task registry."""

    def __init__(
        self,
        database_path: str,
        tasks: TaskRegistry | None,
        settings: dict[str, Any],
        *,
        edge: bool = False,
    ) -> None:
        self.profile = "edge" if edge else "standalone"
        self._path = database_path
        self._settings = dict(settings)
        store = open_sqlite_store(
            database_path,
            busy_timeout_s=float(self._settings.get("busy_timeout_s", 30.0)),
            synchronous=str(self._settings.get("synchronous", "FULL")),
        )
        super().__init__(Producer(store), tasks)
        self._runner: Any = None
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if not self._tasks:
            raise RuntimeError("starting the runtime needs its task registry (tasks=...)")
        if self.profile == "edge":
            from ql3.bootstrap import edge as root
        else:
            from ql3.bootstrap import standalone as root  # type: ignore[no-redef]
        container = root.build(store=self.store, database_path=self._path, **self._settings)
        runner = container.runner(tasks=self._tasks, emit=log.info)
        runner.boot()
        thread = threading.Thread(target=runner.serve, name="ql3-standalone", daemon=True)
        thread.start()
        self._runner, self._thread = runner, thread

    def _stop(self, timeout: float) -> None:
        runner, thread = self._runner, self._thread
        self._runner, self._thread = None, None
        if runner is None or thread is None:
            return
        runner.request_stop()
        thread.join(timeout)
        if thread.is_alive():  # asked twice: running tasks are abandoned at once
            runner.request_stop()
            thread.join(timeout)
