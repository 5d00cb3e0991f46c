"""``ql3 serve`` (a Cluster node) and ``ql3 worker`` (a remote worker)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import click

from ql3.adapters.cli import secure

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
positive = click.FloatRange(min=0, min_open=True)


def _postgres_url(url: str) -> str:
    if not url.startswith("postgresql"):
        raise click.UsageError("a cluster node needs a PostgreSQL database")
    return url


def _configure_logging(
    level: str,
    log_format: str = "text",
    context: dict[str, str] | None = None,
    secrets: tuple[str | None, ...] = (),
) -> None:
    from ql3.adapters import logs

    logs.configure(level, log_format, context=context, secrets=secrets)


log_format_option = click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="json: one JSON object per line, with run_id, attempt_id, worker_id and step fields "
    "where they apply.",
)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="0 picks a free port (printed when ready).",
)
@click.option(
    "--cadence",
    type=positive,
    default=1.0,
    show_default=True,
    help="Seconds between scheduler cycles.",
)
@click.option(
    "--lease-ttl",
    type=positive,
    default=30.0,
    show_default=True,
    help="Seconds a dispatch lease lives without renewal.",
)
@click.option("--max-body-bytes", type=click.IntRange(1024), default=1024 * 1024, show_default=True)
@click.option("--database-url", "database_url", default=None, help="Defaults to $QL3_DATABASE_URL.")
@click.option(
    "--ingress-database-url",
    default=None,
    help="The ingress's own role [default: $QL3_INGRESS_DATABASE_URL, else the "
    "node's database URL].",
)
@click.option("--access-log", is_flag=True, help="Log each request (method, path, status).")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@secure.serve_options
@log_format_option
def serve(
    host: str,
    port: int,
    cadence: float,
    lease_ttl: float,
    max_body_bytes: int,
    database_url: str | None,
    ingress_database_url: str | None,
    access_log: bool,
    log_level: str,
    log_format: str,
    **security: Any,
) -> None:
    """Run a cluster node: the scheduler cadence and the worker ingress in one process.

    Workers claim work over the ingress; the node wakes their waiting claims on every NOTIFY
    of the database's dispatch channel. Several nodes may share one database.

    Off a loopback address the node starts only when workers must authenticate
    (--require-credentials: `ql3 credentials issue`; or $QL3_REGISTRATION_TOKEN) or
    --allow-anonymous-workers says otherwise. Stops on SIGTERM or SIGINT."""
    from ql3.adapters.cli.main import Failure, _database_url
    from ql3.bootstrap import node

    options = secure.node_settings(host, database_url, ingress_database_url, security)
    url = _postgres_url(_database_url(options.pop("database_url")))
    ingress_url = options.pop("ingress_database_url")
    if ingress_url:
        ingress_url = _postgres_url(_database_url(ingress_url))
    from ql3.adapters.logs import url_password
    from ql3.adapters.secrets import SecretUnavailable

    ingress_password = None
    if (password_source := options.get("ingress_password_source")) is not None:
        with contextlib.suppress(SecretUnavailable):  # refused at the first connection
            ingress_password = password_source()
    _configure_logging(
        log_level,
        log_format,
        secrets=(
            options.get("registration_token"),
            url_password(url),
            url_password(ingress_url),
            ingress_password,
        ),
    )
    tls = options.pop("tls")
    container = node.build(
        database_url=url,
        ingress_database_url=ingress_url,
        cadence_s=cadence,
        lease_ttl_s=lease_ttl,
        max_body_bytes=max_body_bytes,
        **options,
    )
    secure.warn_if_anonymous(host, container.config.require_credentials(), options)
    report = container.cluster.startup_recovery().run()
    logging.getLogger("ql3.node").info(
        "startup recovery: %s", " ".join(f"{k}={v}" for k, v in report.counts().items())
    )
    sock = node.bind_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host

    def ready() -> None:
        scheme = "https" if tls else "http"
        click.echo(f"ql3 node listening on {scheme}://{shown}:{bound_port}")

    try:
        started = node.serve(
            container,
            sock,
            on_ready=ready,
            access_log=access_log,
            log_level=log_level,
            run_startup_recovery=False,
            **tls,
            own_log_config=log_format == "text",
        )
    finally:
        sock.close()
    if not started:
        raise Failure("the node could not start")


@click.command()
@click.option(
    "--ingress",
    "ingress_urls",
    multiple=True,
    help="The node's URL, http://HOST:PORT (a worker outside the database's network); give it "
    "once per node of the cluster to move to the next node when one does not answer.",
)
@click.option(
    "--database-url",
    default=None,
    help="Call the worker's functions on this database directly, as a role made with `ql3 db "
    "grant-ingress` (a direct worker) [default: $QL3_WORKER_DATABASE_URL, or the file "
    "$QL3_WORKER_DATABASE_URL_FILE names].",
)
@click.option(
    "--database-url-file",
    type=click.Path(exists=True, dir_okay=False, readable=True),
    default=None,
    help="A file holding --database-url, read again at each new connection.",
)
@click.option(
    "--lease-ttl",
    type=click.FloatRange(min=1, max=3600),
    default=30.0,
    show_default=True,
    help="A direct worker's lease TTL in seconds (the node's --lease-ttl for an --ingress worker).",
)
@click.option(
    "--app", "app_spec", required=True, help="MODULE:ATTR, a mapping of task names to callables."
)
@click.option(
    "--worker-id",
    required=True,
    help="Names one execution slot group: a restarted process reuses it, and its "
    "registration tells the runtime that the old process is gone. Never run two "
    "processes with one worker id.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1024),
    default=1,
    show_default=True,
    help="Tasks run at once, each in its own child process.",
)
@click.option(
    "--drain-timeout",
    type=positive,
    default=30.0,
    show_default=True,
    help="Seconds a drain waits for running tasks before stopping them.",
)
@click.option(
    "--poll-interval",
    type=click.FloatRange(min=0, min_open=True, max=30),
    default=None,
    help="Longest a claim waits at the node for work (a long poll: the node answers as "
    "soon as work is queued) before it is made again [default: 10, or a third of the "
    "lease TTL if shorter].",
)
@click.option(
    "--register-timeout",
    type=positive,
    default=30.0,
    show_default=True,
    help="Seconds to keep trying to reach the ingress at start.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics.",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@log_format_option
@secure.worker_options
def worker(
    ingress_urls: tuple[str, ...],
    database_url: str | None,
    database_url_file: str | None,
    lease_ttl: float,
    app_spec: str,
    worker_id: str,
    concurrency: int,
    drain_timeout: float,
    poll_interval: float | None,
    register_timeout: float,
    log_level: str,
    credential_file: str | None,
    ca_file: str | None,
    metrics_port: int | None,
    metrics_host: str,
    log_format: str,
) -> None:
    """Run tasks from a node's ingress (--ingress) or from the database itself (--database-url,
    a direct worker): claim work for the free slots, run each task in its slot's child
    process, report it. SIGTERM (or ^C) drains: no new work, running tasks
    finish, work granted that never began is handed back, the session closes; a second signal
    stops the tasks at once. While the ingress or the database does not answer, the worker
    keeps trying (each task stops when its lease ends) and goes on when it is answered. Exits 1
    when the session is refused (closed, replaced, its credential revoked) or when the first
    registration gets no answer within --register-timeout."""
    from ql3.adapters.cli.main import Failure
    from ql3.adapters.execution import AppLoadError, load_app
    from ql3.adapters.worker.runtime import Worker, WorkerFailed, WorkerSettings

    url_source = secure.worker_database_url(database_url, database_url_file)
    if (url_source is None) == (not ingress_urls):
        raise click.UsageError("give the worker --ingress URL or --database-url URL (one of them)")
    for url in ingress_urls:
        if not url.startswith(("http://", "https://")) or "," in url:
            raise click.BadParameter(
                f"{url!r}: an ingress URL starts with http:// or https:// (give --ingress once "
                "per node)",
                param_hint="--ingress",
            )
    if url_source is not None and (credential_file or ca_file):
        raise click.UsageError(
            "a direct worker signs in with its database role: --credential-file and --ca-file "
            "are for --ingress"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # --app names a module of the current directory
    try:
        tasks = load_app(app_spec)
    except AppLoadError as error:
        raise click.BadParameter(str(error), param_hint="--app") from None
    token = os.environ.get("QL3_REGISTRATION_TOKEN") or None
    _configure_logging(log_level, log_format, context={"worker_id": worker_id}, secrets=(token,))
    client_factory = None
    if url_source is not None:
        client_factory = _direct_client(url_source, lease_ttl)
    settings = WorkerSettings(
        ingress_url=",".join(ingress_urls),
        app_spec=app_spec,
        worker_id=worker_id,
        tasks=tuple(sorted(tasks)),
        concurrency=concurrency,
        drain_timeout_s=drain_timeout,
        poll_interval_s=poll_interval,
        register_timeout_s=register_timeout,
        registration_token=secure.worker_credential(credential_file),
        ca_file=ca_file,
    )
    runner = Worker(settings, client_factory=client_factory)
    if metrics_port is not None:
        from ql3.adapters.prometheus import serve_worker_metrics

        serve_worker_metrics(runner, metrics_host, metrics_port)
    signals = 0

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            runner.request_drain()
        else:
            runner.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        status = runner.run()
    except WorkerFailed as error:
        raise Failure(str(error)) from None
    if status != 0:
        raise Failure("the worker was stopped before its tasks finished")


def _direct_client(url_source: Callable[[], str], lease_ttl_s: float) -> Callable[[Any], Any]:
    """The direct worker's transport, opened when the worker starts; a database URL that does
    not name a worker's role is refused with its reason."""
    from ql3.adapters.cli.main import Failure
    from ql3.adapters.secrets import FileSecret, SecretUnavailable

    try:
        url = url_source()
    except SecretUnavailable as error:
        raise click.UsageError(str(error)) from None
    if not url.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
        raise click.BadParameter("must be a postgresql:// URL", param_hint="--database-url")

    def open_transport(_settings: Any) -> Any:
        from sqlalchemy.exc import DBAPIError

        from ql3.bootstrap.direct_worker import NotAWorkerRole, direct_transport

        try:
            return direct_transport(
                url,
                lease_ttl_s=lease_ttl_s,
                url_source=url_source if isinstance(url_source, FileSecret) else None,
            )
        except NotAWorkerRole as error:
            raise Failure(str(error)) from None
        except DBAPIError as error:
            first = str(error.orig).split("\n", 1)[0] if error.orig else type(error).__name__
            raise Failure(f"cannot connect to the database: {first}") from None

    return open_transport
