"""Helpers of the ingress tests: throw-away roles, the services wired over the runtime's store
(admission, recovery) and over the ingress role (the worker commands), a worker as the tests
drive it, the dispatch gate set by hand, and a dump of every row to show that a refused call
changed nothing."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from ql3.adapters.postgres.ingress import PostgresIngressStore
from ql3.adapters.postgres.store import PostgresStore
from ql3.adapters.sql.schema import ALL_TABLES
from ql3.application.admission import Admission
from ql3.application.recovery import RuntimeRecovery
from ql3.application.worker_commands import (
    ClaimAnswer,
    Completion,
    SessionGrant,
    WorkerCommands,
)
from ql3.domain.fence import LeaseFence
from tests.application.support import BatchesOfOne, CountingIdentities
from tests.postgres_server import connect

LEASE_TTL_MS = 30_000


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


def set_gate(admin: PostgresStore, *, open: bool, reason: str | None = None) -> None:
    """The dispatch gate's one row, written by hand (as the cluster coordinator would)."""
    with admin.engine.begin() as connection:
        connection.execute(
            text(
                "INSERT INTO dispatch_gate (id, open, reason, changed_at)"
                " VALUES (1, :open, :reason, statement_timestamp())"
                " ON CONFLICT (id) DO UPDATE SET open = excluded.open,"
                " reason = excluded.reason, changed_at = excluded.changed_at"
            ),
            {"open": open, "reason": reason},
        )


@dataclass
class Env:
    """The runtime's side on its own store, the worker commands on the ingress's."""

    admin: PostgresStore
    ingress: PostgresIngressStore
    identities: CountingIdentities
    admission: Admission
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
        recovery=RuntimeRecovery(admin.unit_of_work, admin),
        workers=WorkerCommands(ingress.unit_of_work, identities, lease_ttl_ms=LEASE_TTL_MS),
    )


@dataclass
class Worker(BatchesOfOne):
    """One worker session, driven through the ingress store, and the fences it holds."""

    env: Env
    grant: SessionGrant
    fences: dict[str, LeaseFence] = field(default_factory=dict)

    @property
    def workers(self) -> WorkerCommands:  # type: ignore[override]
        return self.env.workers

    @property
    def session_id(self) -> str:
        return self.grant.session_id

    @property
    def secret(self) -> str:
        return self.grant.secret

    def claim(
        self,
        limit: int = 1,
        *,
        completions: Sequence[Completion] = (),
        held: Sequence[str] | None = None,
    ) -> ClaimAnswer:
        """One claim call; the fences of its grants are kept."""
        answer = self.env.workers.claim(
            self.session_id, self.secret, limit=limit, completions=completions, held=held
        )
        for grant in answer.grants:
            self.fences[grant.attempt_id] = grant.fence
        return answer

    def take_all(self, limit: int = 16) -> list[LeaseFence]:
        """Claim (and so start) as much as the session may take."""
        return [grant.fence for grant in self.claim(limit).grants]


def register(
    env: Env, worker_id: str = "w1", tasks: Iterable[str] = ("t",), capacity: int = 4
) -> Worker:
    return Worker(env=env, grant=env.workers.register(worker_id, capacity, list(tasks)))
