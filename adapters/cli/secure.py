"""The security options of ``ql3 serve`` and ``ql3 worker`` (ADR 0008): who may register a
worker, secrets from the environment or from files, TLS."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import click

from ql3.adapters.secrets import FileSecret, SecretUnavailable, from_environment, secret_source

F = TypeVar("F", bound=Callable[..., Any])
READABLE_FILE = click.Path(exists=True, dir_okay=False, readable=True)

log = logging.getLogger("ql3.node")

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listening address) is reachable from this machine only."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def serve_options(command: F) -> F:
    options = [
        click.option(
            "--require-credentials",
            is_flag=True,
            help="Workers register only with a worker credential (`ql3 credentials issue`).",
        ),
        click.option(
            "--allow-anonymous-workers",
            is_flag=True,
            help="Let anyone who reaches a non-loopback address register a worker (warned).",
        ),
        click.option(
            "--tls-cert",
            type=READABLE_FILE,
            default=None,
            help="Serve HTTPS with this PEM certificate (chain).",
        ),
        click.option(
            "--tls-key", type=READABLE_FILE, default=None, help="The PEM private key of --tls-cert."
        ),
        click.option(
            "--database-url-file",
            type=READABLE_FILE,
            default=None,
            help="A file holding the database URL, read again when it changes "
            "[default: $QL3_DATABASE_URL_FILE].",
        ),
        click.option(
            "--ingress-database-url-file",
            type=READABLE_FILE,
            default=None,
            help="A file holding the ingress role's URL [default: $QL3_INGRESS_DATABASE_URL_FILE].",
        ),
        click.option(
            "--ingress-password-file",
            type=READABLE_FILE,
            default=None,
            help="A file holding the ingress role's password, read again when it changes "
            "[default: $QL3_INGRESS_PASSWORD_FILE, or $QL3_INGRESS_PASSWORD].",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _source(value: str | None, path: str | None, variable: str) -> Callable[[], str] | None:
    """An option's value or file, else ``$VARIABLE`` or ``$VARIABLE_FILE``."""
    try:
        if value or path:
            return secret_source(value, path, what=variable.lower())
        return from_environment(variable)
    except (SecretUnavailable, ValueError) as error:
        raise click.UsageError(str(error)) from None


def node_settings(
    host: str, database_url: str | None, ingress_database_url: str | None, options: dict[str, Any]
) -> dict[str, Any]:
    """The node's settings from the security options; refuses, as a usage error, a node off a
    loopback address that would let anyone register a worker."""
    require = bool(options["require_credentials"])
    anonymous = bool(options["allow_anonymous_workers"])
    if require and anonymous:
        raise click.UsageError("--require-credentials and --allow-anonymous-workers contradict")
    token = os.environ.get("QL3_REGISTRATION_TOKEN") or None
    if not is_loopback(host) and not (require or token or anonymous):
        raise click.UsageError(
            f"--host {host} is reachable from other machines and workers would register "
            "unauthenticated: pass --require-credentials (see `ql3 credentials issue`) "
            "or --allow-anonymous-workers"
        )
    cert, key = options["tls_cert"], options["tls_key"]
    if (cert is None) != (key is None):
        raise click.UsageError("--tls-cert and --tls-key go together")
    url_source = _source(database_url, options["database_url_file"], "QL3_DATABASE_URL")
    ingress_source = _source(
        ingress_database_url, options["ingress_database_url_file"], "QL3_INGRESS_DATABASE_URL"
    )
    password_source = _source(None, options["ingress_password_file"], "QL3_INGRESS_PASSWORD")
    if password_source is not None and ingress_source is None:
        raise click.UsageError("an ingress password needs --ingress-database-url (its role)")
    try:
        url = url_source() if url_source else None
        ingress_url = ingress_source() if ingress_source else None
    except SecretUnavailable as error:
        raise click.UsageError(str(error)) from None
    return {
        "database_url": url,
        "ingress_database_url": ingress_url,
        "registration_token": token,
        "require_credentials": require,
        "anonymous_workers": not (require or token or is_loopback(host)),
        # Secrets given in files are read again at each new connection.
        "database_url_source": _if_file(url_source),
        "ingress_url_source": _if_file(ingress_source if ingress_url else url_source),
        "ingress_password_source": password_source,
        "tls": {"tls_cert": cert, "tls_key": key} if cert else {},
    }


def _if_file(source: Callable[[], str] | None) -> Callable[[], str] | None:
    return source if isinstance(source, FileSecret) else None


def warn_if_anonymous(host: str, require_credentials: bool, settings: dict[str, Any]) -> None:
    if require_credentials or settings.get("registration_token"):
        return
    if is_loopback(host):
        log.info("workers may register without a credential (loopback address %s)", host)
        return
    log.warning(
        "anonymous workers allowed on %s: anyone who reaches it can register a worker, "
        "receive task inputs and complete runs",
        host,
    )


def worker_options(command: F) -> F:
    command = click.option(
        "--ca-file",
        type=READABLE_FILE,
        default=None,
        help="PEM certificate authorities to verify an https:// ingress by.",
    )(command)
    return click.option(
        "--credential-file",
        type=READABLE_FILE,
        default=None,
        help="A file holding the worker credential [default: $QL3_WORKER_CREDENTIAL_FILE, "
        "$QL3_WORKER_CREDENTIAL, else $QL3_REGISTRATION_TOKEN].",
    )(command)


def worker_database_url(value: str | None, path: str | None) -> Callable[[], str] | None:
    """A direct worker's database URL: the option's value or file, else
    ``$QL3_WORKER_DATABASE_URL`` or the file ``$QL3_WORKER_DATABASE_URL_FILE`` names."""
    return _source(value, path, "QL3_WORKER_DATABASE_URL")


def worker_credential(credential_file: str | None) -> str | None:
    """The bearer a worker registers with, read now (at each start)."""
    source = _source(None, credential_file, "QL3_WORKER_CREDENTIAL")
    try:
        if source is not None:
            return source()
    except SecretUnavailable as error:
        raise click.UsageError(str(error)) from None
    return os.environ.get("QL3_REGISTRATION_TOKEN") or None
