"""The composition root of a direct worker (ADR 0026): ``ql3 worker --database-url URL``.

The worker commands run in the worker's own process on the worker ingress's store, signed in as
the login role ``URL`` names (``ql3 db grant-ingress ROLE``: the fenced functions and reads,
nothing else), with the dispatch wake-ups heard on a LISTEN connection of its own. Nothing here
needs the runtime's own role: a worker that connected with the owner's URL is refused, so that
a misconfigured worker cannot quietly hold more than a worker may."""

from __future__ import annotations

from collections.abc import Callable

from ql3.adapters.postgres.engine import refresh_on_connect
from ql3.adapters.postgres.ingress import PostgresIngressStore
from ql3.adapters.postgres.listen import DispatchListener
from ql3.adapters.worker.direct import DirectTransport
from ql3.application.identities import RandomIdentities
from ql3.application.worker_commands import WorkerCommands
from ql3.bootstrap.core import seconds_to_ms

# A claimer, a reporter and the lifecycle's calls at once.
POOL_SIZE = 3


class NotAWorkerRole(Exception):
    """The database URL of a direct worker names a role that may do more than a worker."""


def direct_transport(
    database_url: str,
    *,
    lease_ttl_s: float,
    url_source: Callable[[], str] | None = None,
) -> DirectTransport:
    """A direct worker's transport on ``database_url``; each new connection reads
    ``url_source`` when given (a URL in a file, read again when it changes)."""
    store = PostgresIngressStore.from_url(database_url, pool_size=POOL_SIZE)
    refresh_on_connect(store.engine, url_source=url_source)
    try:
        check_worker_role(store)
    except BaseException:
        store.close()
        raise
    commands = WorkerCommands(store.unit_of_work, RandomIdentities(), seconds_to_ms(lease_ttl_s))

    def open_wake(on_wake: Callable[[], None]) -> DispatchListener:
        return DispatchListener(database_url, on_wake)

    return DirectTransport(commands, open_wake=open_wake, close_store=store.close)


def check_worker_role(store: PostgresIngressStore) -> None:
    """Refuse a role that may write the tables (the schema's owner, a superuser) or that may
    not call the worker's functions (not granted with ``ql3 db grant-ingress``, or the schema is
    not migrated); the first connection is opened here, so a wrong URL fails at start."""
    with store.engine.connect() as connection:
        row = connection.exec_driver_sql(
            "SELECT current_user, to_regclass('runs') IS NOT NULL,"
            " to_regprocedure('ql3_ingress_apply(jsonb)') IS NOT NULL"
        ).one()
        role, migrated, has_functions = str(row[0]), bool(row[1]), bool(row[2])
        if not (migrated and has_functions):
            raise NotAWorkerRole(
                f"role {role} sees no migrated QL3 schema (run `ql3 db upgrade` as the schema's "
                "owner, and give the worker's URL the schema in its search_path if it is not "
                "public)"
            )
        writes, calls = connection.exec_driver_sql(
            "SELECT has_table_privilege('runs', 'UPDATE') OR has_table_privilege('runs', 'DELETE')"
            " OR has_table_privilege('runs', 'INSERT'),"
            " has_function_privilege('ql3_ingress_apply(jsonb)', 'EXECUTE')"
        ).one()
    if writes:
        raise NotAWorkerRole(
            f"role {role} may write the runtime's tables: a direct worker connects as a role "
            "made with `ql3 db grant-ingress ROLE`"
        )
    if not calls:
        raise NotAWorkerRole(
            f"role {role} may not call the worker's functions: grant them with "
            f"`ql3 db grant-ingress {role}`"
        )


__all__ = ["NotAWorkerRole", "check_worker_role", "direct_transport"]
