"""``ql3 credentials``: worker credentials (ADR 0008), on the Cluster profile's database.

``issue`` and ``rotate`` print the secret once; the database keeps only its hash. ``revoke``
revokes a credential and its open sessions at once (they claim nothing more); what those
sessions were running is not declared stopped: ``ql3 attempts attest-stopped`` does that."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from ql3.application.credentials import CredentialCommands, IssuedCredential
from ql3.domain.credentials import CredentialEvent, UnknownCredential, WorkerCredential

UNITS_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
DURATION = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")


class Duration(click.ParamType):
    """``90s``, ``15m``, ``12h``, ``30d``: milliseconds."""

    name = "DURATION"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        found = DURATION.match(str(value))
        if not found or int(found.group(1)) == 0:
            self.fail("a positive duration such as 90s, 15m, 12h or 30d", param, ctx)
        return int(found.group(1)) * UNITS_MS[found.group(2)]


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).isoformat(timespec="seconds")


def credential_document(credential: WorkerCredential) -> dict[str, Any]:
    """What may be shown of a credential: never its secret, nor its hash."""
    return {
        "id": credential.id,
        "worker_pattern": credential.worker_pattern,
        "tasks": list(credential.tasks) if credential.tasks is not None else None,
        "status": credential.status.value,
        "issued_at": _iso(credential.issued_at_ms),
        "expires_at": _iso(credential.expires_at_ms),
        "revoked_at": _iso(credential.revoked_at_ms),
        "rotates_id": credential.rotates_id,
    }


def _event_document(event: CredentialEvent) -> dict[str, Any]:
    return {
        "type": event.type.value,
        "at": _iso(event.at_ms),
        "worker_id": event.worker_id,
        "session_id": event.session_id,
        "detail": event.detail,
    }


@contextmanager
def _commands(database_url: str | None) -> Iterator[CredentialCommands]:
    from ql3.adapters.cli.main import SQLITE_URL_PREFIX, Failure, _cluster, _database_url
    from ql3.application.identities import RandomIdentities

    if _database_url(database_url).startswith(SQLITE_URL_PREFIX):
        raise click.UsageError("worker credentials are for a Cluster (PostgreSQL) database")
    with _cluster(database_url) as container:
        try:
            yield CredentialCommands(container.store().unit_of_work, RandomIdentities())
        except UnknownCredential as error:
            raise Failure(f"not found: {error}") from None


def _print_issued(issued: IssuedCredential, as_json: bool) -> None:
    from ql3.adapters.cli.main import _emit

    document = {**credential_document(issued.credential), "secret": issued.secret}

    def text() -> None:
        c = issued.credential
        click.echo(f"credential {c.id} for worker ids {c.worker_pattern!r}")
        click.echo(f"  tasks:   {', '.join(c.tasks) if c.tasks else 'any'}")
        click.echo(f"  expires: {_iso(c.expires_at_ms) or 'never'}")
        click.echo(f"  secret:  {issued.secret}")
        click.echo("The secret is shown once: give it to the workers (--credential-file).")

    _emit(as_json, document, text)


database_option = click.option(
    "--database-url", "database_url", default=None, help="Defaults to $QL3_DATABASE_URL."
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


@click.group("credentials")
def credentials() -> None:
    """Worker credentials: who may register a worker session."""


@credentials.command("issue")
@click.argument("worker_pattern")
@click.option(
    "--task", "tasks", multiple=True, help="A task the workers may serve (repeat); default any."
)
@click.option("--expires-in", type=Duration(), default=None, help="e.g. 30d; default never.")
@database_option
@json_option
def issue(
    worker_pattern: str,
    tasks: tuple[str, ...],
    expires_in: int | None,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Issue a credential for worker ids matching WORKER_PATTERN (``host-a-*``); its secret
    is printed once."""
    with _commands(database_url) as commands:
        issued = commands.issue(worker_pattern, tasks=list(tasks) or None, expires_in_ms=expires_in)
    _print_issued(issued, as_json)


@credentials.command("rotate")
@click.argument("credential_id")
@click.option("--expires-in", type=Duration(), default=None, help="e.g. 30d; default never.")
@database_option
@json_option
def rotate(
    credential_id: str, expires_in: int | None, database_url: str | None, as_json: bool
) -> None:
    """Issue a second credential with the same worker ids and tasks. Both stay valid: restart
    the workers with the new one, one at a time, then revoke the old one."""
    with _commands(database_url) as commands:
        issued = commands.rotate(credential_id, expires_in_ms=expires_in)
    _print_issued(issued, as_json)


@credentials.command("list")
@database_option
@json_option
def list_(database_url: str | None, as_json: bool) -> None:
    """Every credential (never a secret)."""
    from ql3.adapters.cli.main import _emit

    with _commands(database_url) as commands:
        found = commands.list_credentials()

    def text() -> None:
        for c in found:
            tasks = ",".join(c.tasks) if c.tasks else "any"
            expires = _iso(c.expires_at_ms) or "never"
            click.echo(
                f"{c.id}  {c.status.value:<8} {c.worker_pattern:<20} tasks={tasks} "
                f"expires={expires}"
            )

    _emit(as_json, [credential_document(c) for c in found], text)


@credentials.command("revoke")
@click.argument("credential_id")
@click.option("--reason", default="", help="Recorded in the audit.")
@database_option
@json_option
def revoke(credential_id: str, reason: str, database_url: str | None, as_json: bool) -> None:
    """Revoke a credential and its open sessions at once: they claim nothing more. Their
    running attempts are not declared stopped; recovery waits for evidence."""
    from ql3.adapters.cli.main import _emit

    with _commands(database_url) as commands:
        revocation = commands.revoke(credential_id, reason)
    document = {
        **credential_document(revocation.credential),
        "revoked_session_ids": list(revocation.revoked_session_ids),
    }

    def text() -> None:
        sessions = ", ".join(revocation.revoked_session_ids) or "none"
        click.echo(f"revoked: credential {credential_id}; sessions revoked: {sessions}")

    _emit(as_json, document, text)


@credentials.command("audit")
@click.argument("credential_id")
@database_option
@json_option
def audit(credential_id: str, database_url: str | None, as_json: bool) -> None:
    """The credential's audit: its issue, every session registered with it, its revocation."""
    from ql3.adapters.cli.main import _emit

    with _commands(database_url) as commands:
        events = commands.audit(credential_id)

    def text() -> None:
        for e in events:
            who = f" worker={e.worker_id} session={e.session_id}" if e.session_id else ""
            detail = f" {e.detail}" if e.detail else ""
            click.echo(f"{_iso(e.at_ms)}  {e.type.value:<8}{who}{detail}")

    _emit(as_json, [_event_document(e) for e in events], text)
