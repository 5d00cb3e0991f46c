"""A Cluster node: the scheduler lifecycle and the worker ingress in one process.

Several nodes may share one database: every cycle of every node takes the same locks, so each
candidate is resolved by exactly one of them. The node runs startup recovery once, starts its
one scheduler lifecycle (the only timer), and serves the ingress with uvicorn until SIGTERM or
SIGINT; then it releases its parked claims, stops taking requests, waits for the running cycle
and closes its stores.

The ingress reaches the store only through its own :class:`WorkerCommands`, built on its own
least-privilege store (``ingress_store``, ADR 0024): through the fenced functions, as the login
role of ``ingress_database_url`` when given, else as the default ingress role, which a second
small pool on the node's database takes on every connection (``SET ROLE``).

Parked claims (ADR 0007) wait on the node's :class:`~ql3.adapters.http.wake.ClaimSignal`. On
PostgreSQL the node keeps one LISTEN connection on the runtime database
(:class:`~ql3.adapters.postgres.listen.DispatchListener`) that wakes them on every ``NOTIFY
ql3_dispatch``; while that connection is down, and always on a store without one (the memory
store of the tests), the end of every scheduler cycle wakes them instead."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from dependency_injector import containers, providers
from fastapi import FastAPI

from ql3.adapters.http import (
    DEFAULT_MAX_BODY_BYTES,
    ClaimSignal,
    create_app,
    default_heartbeat_interval_ms,
)
from ql3.adapters.http.auth import RegistrationAuth
from ql3.adapters.http.metrics import metrics_routes
from ql3.adapters.prometheus import node_registry
from ql3.application.credentials import CredentialCommands
from ql3.application.identities import RandomIdentities
from ql3.application.scheduler import (
    ClusterSchedulerLifecycle,
    CycleListener,
    CycleSummary,
    NodeHeartbeat,
)
from ql3.application.worker_commands import WorkerCommands
from ql3.bootstrap.cluster import CLUSTER_DEFAULTS, ClusterContainer, open_postgres_store
from ql3.bootstrap.core import seconds_to_ms

if TYPE_CHECKING:
    from ql3.adapters.postgres.listen import DispatchListener

log = logging.getLogger("ql3.node")

NODE_DEFAULTS: dict[str, object] = {
    **CLUSTER_DEFAULTS,
    "ingress_database_url": None,
    # the role the ingress pool takes on the node's own URL when no ingress URL is given
    "ingress_role": "ql3_ingress_default",
    "ingress_pool_size": 8,
    "max_body_bytes": DEFAULT_MAX_BODY_BYTES,
    "registration_token": None,
    "require_credentials": False,
    "anonymous_workers": False,  # off loopback with --allow-anonymous-workers (ADR 0008)
    # Secret providers (ADR 0008): callables read at each new connection, for secrets in files.
    "database_url_source": None,
    "ingress_url_source": None,
    "ingress_password_source": None,
    "node_id": None,
}
STOP_TIMEOUT_S = 30
# The counts that make a cycle worth a log line: what recovery and lost retry changed.
NOTEWORTHY = {
    "runtime_recovery": ("recovered",),
    "lost_retry": ("failed", "retries_scheduled", "attempts_created"),
}


def open_ingress_store(
    database_url: str,
    ingress_database_url: str | None,
    pool_size: int,
    url_source: Callable[[], str] | None = None,
    password_source: Callable[[], str] | None = None,
    ingress_role: str = "ql3_ingress_default",
) -> Any:
    """The ingress's store, with its own engine and pool, always least-privilege (ADR 0024):
    on ``ingress_database_url`` (a login role of ``ql3 db grant-ingress``) when given, else on
    the node's own database URL, every connection taking ``ingress_role`` (the NOLOGIN role
    ``ql3 db upgrade`` makes). Each new connection reads the URL and password of the sources
    given (secrets in files, read again when they change)."""
    from ql3.adapters.postgres.engine import refresh_on_connect
    from ql3.adapters.postgres.ingress import PostgresIngressStore

    if ingress_database_url:
        store = PostgresIngressStore.from_url(ingress_database_url, pool_size=pool_size)
    else:
        store = PostgresIngressStore.from_url(database_url, pool_size=pool_size, role=ingress_role)
    refresh_on_connect(store.engine, url_source=url_source, password_source=password_source)
    return store


def open_node_store(
    database_url: str, pool_size: int, url_source: Callable[[], str] | None = None
) -> Any:
    """The node's runtime store; each new connection reads ``url_source`` when given."""
    from ql3.adapters.postgres.engine import refresh_on_connect

    store: Any = open_postgres_store(database_url, pool_size)
    refresh_on_connect(store.engine, url_source=url_source)
    return store


def heartbeat_interval_ms(lease_ttl_s: float) -> int:
    """How often a worker heartbeats: once per lease TTL (ADR 0012)."""
    return default_heartbeat_interval_ms(seconds_to_ms(lease_ttl_s))


def open_dispatch_listener(
    database_url: str | None, claims: ClaimSignal
) -> DispatchListener | None:
    """The node's LISTEN connection on the runtime database, waking ``claims``; None without
    a PostgreSQL database URL (a node built on a given store)."""
    if not database_url or not database_url.startswith("postgresql"):
        return None
    from ql3.adapters.postgres.listen import DispatchListener

    return DispatchListener(database_url, claims.wake)


def end_of_cycle(
    claims: ClaimSignal,
    listener: DispatchListener | None,
    heartbeat: CycleListener | None = None,
) -> CycleListener:
    """What the node does after each scheduler cycle: log it, and wake the parked claims
    unless the LISTEN connection is up (then NOTIFY wakes them as soon as work is queued);
    record it now and then for ``ql3 status`` (``heartbeat``)."""

    def on_cycle(summary: CycleSummary) -> None:
        log_cycle(summary)
        if listener is None or not listener.connected:
            claims.wake()
        if heartbeat is not None:
            with contextlib.suppress(Exception):  # the next cycle tries again
                heartbeat(summary)

    return on_cycle


def log_cycle(summary: CycleSummary) -> None:
    """One line per cycle that failed or changed recovery state; quiet otherwise."""
    if not summary.ok:
        step = summary.step(summary.aborted_at or "")
        candidate = step.candidate if step else None
        log.error(
            "cycle aborted at %s: %s",
            summary.aborted_at,
            step.error if step else "",
            extra={
                "step": summary.aborted_at,
                "run_id": candidate.run_id if candidate else None,
                "attempt_id": candidate.attempt_id if candidate else None,
            },
        )
        return
    notes = []
    for name, keys in NOTEWORTHY.items():
        step = summary.step(name)
        counts = {k: step.counts.get(k, 0) for k in keys} if step else {}
        if any(counts.values()):
            notes.append(f"{name} " + " ".join(f"{k}={v}" for k, v in counts.items() if v))
    if notes:
        log.info("cycle: %s", "; ".join(notes))


class NodeContainer(containers.DeclarativeContainer):
    config = providers.Configuration()
    cluster = providers.Container(ClusterContainer, config=config)

    claim_signal = providers.Singleton(ClaimSignal)
    dispatch_listener = providers.Singleton(
        open_dispatch_listener, config.database_url, claim_signal
    )
    lifecycle = providers.Singleton(
        ClusterSchedulerLifecycle,
        coordinator=cluster.coordinator,
        cadence_s=config.cadence_s,
        on_cycle=providers.Callable(
            end_of_cycle,
            claim_signal,
            dispatch_listener,
            providers.Singleton(
                NodeHeartbeat,
                cluster.store,
                config.node_id,
                anonymous_workers=config.anonymous_workers,
            ),
        ),
    )
    ingress_store = providers.Singleton(
        open_ingress_store,
        config.database_url,
        config.ingress_database_url,
        config.ingress_pool_size,
        config.ingress_url_source,
        config.ingress_password_source,
        config.ingress_role,
    )
    # The node's Prometheus registry and its counters (ADR 0010), shared by the scheduler
    # steps and the ingress.
    metrics_registry = providers.Singleton(node_registry, cluster.store)
    metrics = providers.Callable(operator.itemgetter(1), metrics_registry)
    ingress_commands = providers.Singleton(
        WorkerCommands,
        uow_factory=ingress_store.provided.unit_of_work,
        identities=providers.Singleton(RandomIdentities),
        lease_ttl_ms=providers.Callable(seconds_to_ms, config.lease_ttl_s),
        metrics=metrics,
    )
    heartbeat_interval_ms = providers.Callable(heartbeat_interval_ms, config.lease_ttl_s)
    # Worker credentials live on the node's own role (ADR 0008), never the ingress role's.
    credential_commands = providers.Singleton(
        CredentialCommands,
        uow_factory=cluster.store.provided.unit_of_work,
        identities=providers.Singleton(RandomIdentities),
    )
    registration = providers.Singleton(
        RegistrationAuth,
        credentials=credential_commands,
        token=config.registration_token,
        required=config.require_credentials,
    )


def build(store: Any | None = None, **settings: Any) -> NodeContainer:
    """A node container. ``database_url`` is required unless a ``store`` is given (tests): then
    the scheduler and the ingress share it, and the node listens for dispatch wake-ups only
    when a PostgreSQL ``database_url`` is given too."""
    container = NodeContainer()
    container.config.from_dict(
        {**NODE_DEFAULTS, "node_id": f"{socket.gethostname()}-{os.getpid()}", **settings}
    )
    container.cluster.metrics.override(container.metrics)
    if store is not None:
        container.cluster.store.override(providers.Object(store))
        container.ingress_store.override(providers.Object(store))
    elif settings.get("database_url_source") is not None:
        config = container.config
        container.cluster.store.override(
            providers.Singleton(
                open_node_store, config.database_url, config.pool_size, config.database_url_source
            )
        )
    return container


def create_node_app(
    container: NodeContainer,
    *,
    on_ready: Callable[[], None] | None = None,
    run_startup_recovery: bool = True,
) -> FastAPI:
    """The ingress app whose lifespan is the node's: startup recovery, then the dispatch
    listener and the scheduler lifecycle; on shutdown the parked claims answer, the listener
    and the lifecycle stop (waiting for its cycle) and the stores close."""
    lifecycle = container.lifecycle()
    claims = container.claim_signal()
    listener = container.dispatch_listener()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if run_startup_recovery:
            report = await asyncio.to_thread(container.cluster.startup_recovery().run)
            log.info(
                "startup recovery: %s",
                " ".join(f"{k}={v}" for k, v in report.counts().items()),
            )
        if listener is not None:
            listener.start()
        lifecycle.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            claims.close()
            if listener is not None:
                await asyncio.to_thread(listener.stop, STOP_TIMEOUT_S)
            await asyncio.to_thread(lifecycle.stop, STOP_TIMEOUT_S)
            close_stores(container)

    return ingress_app(container, lifespan=lifespan)


def ingress_app(container: NodeContainer, *, lifespan: Any = None) -> FastAPI:
    """The worker ingress of the node's container, as an ASGI app. Without ``lifespan`` it
    starts nothing: an application that mounts it starts and stops the runtime itself."""
    app = create_app(
        container.ingress_commands(),
        signal=container.claim_signal(),
        max_body_bytes=container.config.max_body_bytes(),
        registration_token=container.config.registration_token(),
        registration=container.registration(),
        heartbeat_interval_ms=container.heartbeat_interval_ms(),
        on_attempts_ended=container.lifecycle().wake,
        lifespan=lifespan,
    )
    app.include_router(metrics_routes(container.metrics_registry()[0]))
    return app


class NodeServer(uvicorn.Server):
    """uvicorn that releases the parked claims as soon as its shutdown begins: it waits for
    open requests before it ends the app's lifespan, and a parked claim may wait 30 s."""

    def __init__(self, config: uvicorn.Config, claims: ClaimSignal) -> None:
        super().__init__(config)
        self._claims = claims

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._claims.close()
        await super().shutdown(sockets=sockets)


def close_stores(container: NodeContainer) -> None:
    ingress = container.ingress_store()
    main = container.cluster.store()
    ingress.close()
    if main is not ingress:
        main.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free port); connections wait in its backlog until
    the node is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(
    container: NodeContainer,
    sock: socket.socket,
    *,
    on_ready: Callable[[], None] | None = None,
    access_log: bool = False,
    log_level: str = "info",
    run_startup_recovery: bool = True,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    own_log_config: bool = True,
) -> bool:
    """Serve until SIGTERM/SIGINT (over TLS with ``tls_cert`` and ``tls_key``, PEM files).
    Returns False when the node could not start."""
    app = create_node_app(container, on_ready=on_ready, run_startup_recovery=run_startup_recovery)
    config = uvicorn.Config(
        app,
        lifespan="on",
        access_log=access_log,  # method, path and status only: no secret is in a URL
        log_level=log_level,
        # Without its own config uvicorn logs through the root logger (its format, its
        # redaction: ``--log-format json``).
        log_config=uvicorn.config.LOGGING_CONFIG if own_log_config else None,
        server_header=False,
        timeout_graceful_shutdown=STOP_TIMEOUT_S,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )
    server = NodeServer(config, container.claim_signal())

    def stop(_signum: int, _frame: FrameType | None) -> None:
        server.should_exit = True

    # uvicorn re-raises the signal that stopped it once it has shut down; with this handler
    # in place a graceful stop ends the process with status 0.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return bool(server.started)
