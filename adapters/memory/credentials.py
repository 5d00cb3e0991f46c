"""Worker credentials in memory (ADR 0008): the reference for the PostgreSQL store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ql3.domain.credentials import CredentialEvent, CredentialEventType, WorkerCredential
from ql3.domain.errors import ConcurrencyConflict
from ql3.domain.model import WorkerSession
from ql3.domain.states import OPEN_SESSION_STATUSES

if TYPE_CHECKING:
    from ql3.adapters.memory.state import StateAccess


class MemoryCredentialRepository:
    def __init__(self, uow: StateAccess) -> None:
        self._uow = uow

    def add(self, credential: WorkerCredential) -> None:
        state = self._uow.read()
        if credential.id in state.credentials or any(
            c.secret_hash == credential.secret_hash for c in state.credentials.values()
        ):
            raise ConcurrencyConflict(f"credential {credential.id} already exists")
        self._uow.write().credentials[credential.id] = credential

    def get(self, credential_id: str, *, lock: bool = False) -> WorkerCredential | None:
        return self._uow.read().credentials.get(credential_id)

    def find_by_secret_hash(self, secret_hash: str) -> WorkerCredential | None:
        found = [c for c in self._uow.read().credentials.values() if c.secret_hash == secret_hash]
        return found[0] if found else None

    def update(self, before: WorkerCredential, after: WorkerCredential) -> None:
        if after.id != before.id:
            raise ValueError("a credential update must name the same credential")
        stored = self._uow.read().credentials.get(before.id)
        if stored is None or stored.status is not before.status:
            raise ConcurrencyConflict(f"credential {before.id} changed since it was read")
        self._uow.write().credentials[after.id] = after

    def list_credentials(self) -> Sequence[WorkerCredential]:
        found = self._uow.read().credentials.values()
        return tuple(sorted(found, key=lambda c: (c.issued_at_ms, c.id)))

    def record(self, event: CredentialEvent) -> None:
        state = self._uow.write()
        state.credential_events = (*state.credential_events, event)

    def events_of(self, credential_id: str) -> Sequence[CredentialEvent]:
        return tuple(
            e for e in self._uow.read().credential_events if e.credential_id == credential_id
        )

    def open_sessions_of(self, credential_id: str) -> Sequence[WorkerSession]:
        state = self._uow.read()
        ids = {
            e.session_id
            for e in state.credential_events
            if e.credential_id == credential_id and e.type is CredentialEventType.USED
        }
        found = [
            s for s in state.sessions.values() if s.id in ids and s.status in OPEN_SESSION_STATUSES
        ]
        return tuple(sorted(found, key=lambda s: s.id))
