"""Worker credentials on a SQL store (ADR 0008): :class:`ql3.application.ports.CredentialRepository`
on any :class:`~ql3.adapters.sql.transaction.SqlTransaction`, with its statements and row mapping.
The Cluster store (PostgreSQL) uses it; the row locks it asks for are PostgreSQL's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import insert, select, update

from ql3.adapters.sql import rows
from ql3.adapters.sql.schema import worker_credential_events, worker_credentials, worker_sessions
from ql3.adapters.sql.transaction import SqlTransaction
from ql3.domain.credentials import CredentialEvent, CredentialEventType, WorkerCredential
from ql3.domain.model import CredentialStatus, WorkerSession
from ql3.domain.states import OPEN_SESSION_STATUSES

_c = worker_credentials.c
_e = worker_credential_events.c
_s = worker_sessions.c


def credential_values(credential: WorkerCredential) -> dict[str, Any]:
    return {
        "id": credential.id,
        "worker_pattern": credential.worker_pattern,
        "tasks": list(credential.tasks) if credential.tasks is not None else None,
        "secret_hash": credential.secret_hash,
        "status": credential.status.value,
        "issued_at": credential.issued_at_ms,
        "expires_at": credential.expires_at_ms,
        "revoked_at": credential.revoked_at_ms,
        "rotates_id": credential.rotates_id,
    }


def credential_from_row(row: Mapping[str, Any]) -> WorkerCredential:
    tasks = row["tasks"]
    return WorkerCredential(
        id=row["id"],
        worker_pattern=row["worker_pattern"],
        tasks=tuple(tasks) if tasks is not None else None,
        secret_hash=row["secret_hash"],
        status=CredentialStatus(row["status"]),
        issued_at_ms=int(row["issued_at"]),
        expires_at_ms=None if row["expires_at"] is None else int(row["expires_at"]),
        revoked_at_ms=None if row["revoked_at"] is None else int(row["revoked_at"]),
        rotates_id=row["rotates_id"],
    )


def event_from_row(row: Mapping[str, Any]) -> CredentialEvent:
    return CredentialEvent(
        credential_id=row["credential_id"],
        type=CredentialEventType(row["type"]),
        at_ms=int(row["at"]),
        worker_id=row["worker_id"],
        session_id=row["session_id"],
        detail=row["detail"],
    )


class SqlCredentialRepository:
    def __init__(self, uow: SqlTransaction) -> None:
        self._uow = uow

    def add(self, credential: WorkerCredential) -> None:
        statement = insert(worker_credentials).values(credential_values(credential))
        self._uow.atomically(lambda: self._uow.write(statement, f"credential {credential.id}"))

    def get(self, credential_id: str, *, lock: bool = False) -> WorkerCredential | None:
        query = select(worker_credentials).where(_c.id == credential_id)
        if lock:
            query = query.with_for_update()
        row = self._uow.execute(query).mappings().first()
        return credential_from_row(row) if row is not None else None

    def find_by_secret_hash(self, secret_hash: str) -> WorkerCredential | None:
        query = (
            select(worker_credentials)
            .where(_c.secret_hash == secret_hash)
            .with_for_update(read=True)
        )
        row = self._uow.execute(query).mappings().first()
        return credential_from_row(row) if row is not None else None

    def update(self, before: WorkerCredential, after: WorkerCredential) -> None:
        if after.id != before.id:
            raise ValueError("a credential update must name the same credential")
        values = {k: v for k, v in credential_values(after).items() if k != "id"}
        statement = (
            update(worker_credentials)
            .where(_c.id == before.id, _c.status == before.status.value)
            .values(values)
        )
        self._uow.compare_and_set(statement, f"credential {before.id}")

    def list_credentials(self) -> Sequence[WorkerCredential]:
        query = select(worker_credentials).order_by(_c.issued_at, _c.id)
        return tuple(credential_from_row(r) for r in self._uow.execute(query).mappings())

    def record(self, event: CredentialEvent) -> None:
        statement = insert(worker_credential_events).values(
            credential_id=event.credential_id,
            type=event.type.value,
            at=event.at_ms,
            worker_id=event.worker_id,
            session_id=event.session_id,
            detail=event.detail,
        )
        self._uow.write(statement, f"audit of credential {event.credential_id}")

    def events_of(self, credential_id: str) -> Sequence[CredentialEvent]:
        query = (
            select(worker_credential_events)
            .where(_e.credential_id == credential_id)
            .order_by(_e.id)
        )
        return tuple(event_from_row(r) for r in self._uow.execute(query).mappings())

    def open_sessions_of(self, credential_id: str) -> Sequence[WorkerSession]:
        used = select(_e.session_id).where(
            _e.credential_id == credential_id, _e.type == CredentialEventType.USED.value
        )
        query = (
            select(worker_sessions)
            .where(
                _s.id.in_(used),
                _s.status.in_(sorted(s.value for s in OPEN_SESSION_STATUSES)),
            )
            .order_by(_s.id)
            .with_for_update(of=worker_sessions)
        )
        return tuple(rows.session_from_row(r) for r in self._uow.execute(query).mappings())
