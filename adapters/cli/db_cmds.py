"""``ql3 db grant-ingress``: the worker ingress's least-privilege database role."""

from __future__ import annotations

import os

import click


@click.command("grant-ingress")
@click.argument("role")
@click.option(
    "--password-env",
    "password_env",
    default=None,
    metavar="VAR",
    help="Set the role's password from this environment variable (never on the command line).",
)
@click.option("--database-url", "database_url", default=None, help="Defaults to $QL3_DATABASE_URL.")
def grant_ingress_command(role: str, password_env: str | None, database_url: str | None) -> None:
    """Create or update ROLE with exactly the worker ingress's privileges.

    ROLE can log in, inherits nothing, reads runs, attempts, leases and worker sessions, and
    writes only through the ingress's fenced functions. Run it as the owner of the schema, after
    `ql3 db upgrade`; run it again after every upgrade."""
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from ql3.adapters.cli.main import Failure, _database_url
    from ql3.adapters.postgres.grants import IngressSchemaMissing, grant_ingress

    password: str | None = None
    if password_env is not None:
        password = os.environ.get(password_env)
        if not password:
            raise click.UsageError(f"--password-env: ${password_env} is not set or empty")
    url = _database_url(database_url)
    if not url.startswith("postgresql"):
        raise click.UsageError("db grant-ingress is for PostgreSQL (the Cluster store)")
    engine = create_engine(url, poolclass=NullPool)
    try:
        grant = grant_ingress(engine, role, password)
    except IngressSchemaMissing as missing:
        raise Failure(str(missing)) from missing
    finally:
        engine.dispose()
    click.echo(
        f"ingress role {grant.role} {'created' if grant.created else 'updated'}"
        f"{' with a new password' if grant.password_set else ''}: CONNECT on {grant.database},"
        f" USAGE on schema {grant.schema}, SELECT on {', '.join(grant.tables)},"
        f" EXECUTE on {', '.join(grant.functions)}"
    )
