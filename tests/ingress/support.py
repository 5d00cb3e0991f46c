"""Helpers of the ingress tests: throw-away roles, the services wired over the runtime's store
(admission, dispatch, recovery) and over the ingress role (the worker commands), a worker as
the tests drive it, and a dump of every row to show that a refused call changed nothing."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from adapters.postgres.ingress import PostgresIngressStore
from adapters.postgres.store import PostgresStore
from adapters.sql.schema import ALL_TABLES
from application.admission import Admission
from application.dispatch import TaskAttemptAdmission
from application.recovery import RuntimeRecovery
from application.worker_commands import Offer, SessionGrant, WorkerCommands
from domain.fence import LeaseFence
from tests.application.support import CountingIdentities
from tests.postgres_server import connect

LEASE_TTL_MS = 30_000
SILENCE_MS = 60_000


def unique_role() -> str:
    return f"ql3_ingress_test_{secrets.token_hex(5)}"


def role_url(database_url: str, role: str, password: str | None = None) -> str:
    return (
        make_url(database_url)
        .set(username=role, password=password)
        .render_as_string(hide_password=False)
    )


def drop_role(database_url: str, role: str) -> None:
    """Drop ``role`` and its privileges in this database (its only one), if it exists."""
    with connect(database_url) as conn:
        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def dump(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the runtime, in primary key order."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    with engine.connect() as connection:
        for table in ALL_TABLES:
            keys = ", ".join(column.name for column in table.primary_key.columns)
            result = connection.execute(text(f"SELECT * FROM {table.name} ORDER BY {keys}"))
            found[table.name] = [tuple(row) for row in result]
    return found


def expire_lease(admin: PostgresStore, run_id: str) -> None:
    """Move the Run's leased lease one second into the past of the database's clock."""
    with admin.engine.begin() as connection:
        connection.execute(
            text(
                "UPDATE run_dispatch_leases"
                " SET expires_at = statement_timestamp() - interval '1 second'"
                " WHERE run_id = :run_id AND status = 'leased'"
            ),
            {"run_id": run_id},
        )


@dataclass
class Env:
    """The runtime's side on its own store, the worker commands on the ingress's."""

    admin: PostgresStore
    ingress: PostgresIngressStore
    identities: CountingIdentities
    admission: Admission
    dispatch: TaskAttemptAdmission
    recovery: RuntimeRecovery
    workers: WorkerCommands

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        return dump(self.admin.engine)


def build_env(admin: PostgresStore, ingress: PostgresIngressStore) -> Env:
    identities = CountingIdentities()
    return Env(
        admin=admin,
        ingress=ingress,
        identities=identities,
        admission=Admission(admin.unit_of_work, identities),
        dispatch=TaskAttemptAdmission(
            admin.unit_of_work, admin, lease_ttl_ms=LEASE_TTL_MS, max_silence_ms=SILENCE_MS
        ),
        recovery=RuntimeRecovery(admin.unit_of_work, admin),
        workers=WorkerCommands(ingress.unit_of_work, identities, lease_ttl_ms=LEASE_TTL_MS),
    )


@dataclass
class Worker:
    """One worker session, driven through the ingress store, and the fences it holds."""

    env: Env
    grant: SessionGrant
    fences: dict[str, LeaseFence] = field(default_factory=dict)

    @property
    def session_id(self) -> str:
        return self.grant.session_id

    @property
    def secret(self) -> str:
        return self.grant.secret

    def offers(self) -> list[Offer]:
        return self.env.workers.heartbeat(self.session_id, self.secret)

    def accept(self, offer: Offer, token: str | None = None) -> LeaseFence:
        token = token or f"token-{offer.attempt_id}-{offer.generation}".ljust(24, "t")
        self.env.workers.accept(
            self.session_id, self.secret, offer.attempt_id, offer.generation, offer.version, token
        )
        fence = LeaseFence(
            attempt_id=offer.attempt_id,
            generation=offer.generation,
            version=offer.version,
            token=token,
        )
        self.fences[offer.attempt_id] = fence
        return fence

    def take_all(self) -> list[LeaseFence]:
        return [self.accept(offer) for offer in self.offers()]

    def start(self, fence: LeaseFence, *, running: bool = True) -> None:
        self.env.workers.activate(self.session_id, self.secret, fence)
        if running:
            self.env.workers.mark_running(self.session_id, self.secret, fence)


def register(env: Env, worker_id: str = "w1", tasks: Iterable[str] = ("t",)) -> Worker:
    return Worker(env=env, grant=env.workers.register(worker_id, 4, list(tasks)))
