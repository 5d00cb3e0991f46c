"""Worker credentials (ADR 0008): the operator's commands (issue, rotate, list, revoke) and
the registration of a worker session with a credential.

A credential's secret is returned once, by :meth:`CredentialCommands.issue` and
:meth:`CredentialCommands.rotate`; the store keeps its SHA-256 hash only (the secret is 256
random bits: a fast hash cannot be searched back). A presented secret is found by its hash and
compared in constant time. Every issue, use and revocation writes an audit line in the same
transaction; a refused registration writes nothing."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from ql3.application.ports import CredentialUnitOfWorkFactory, Identities
from ql3.application.worker_commands import SessionGrant, open_session
from ql3.domain.credentials import (
    CredentialEvent,
    CredentialRefusal,
    CredentialRejected,
    UnknownCredential,
    WorkerCredential,
    authorize_registration,
    credential_used,
    issue_credential,
    revoke_credential,
)
from ql3.domain.fence import hash_token

SECRET_PREFIX = "ql3w_"
MAX_SECRET_LENGTH = 256


@dataclass(frozen=True, slots=True)
class IssuedCredential:
    """A new credential and its secret, which is shown this once."""

    credential: WorkerCredential
    secret: str


@dataclass(frozen=True, slots=True)
class Revocation:
    credential: WorkerCredential
    revoked_session_ids: tuple[str, ...]


class CredentialCommands:
    def __init__(self, uow_factory: CredentialUnitOfWorkFactory, identities: Identities) -> None:
        self._uow_factory = uow_factory
        self._identities = identities

    def issue(
        self,
        worker_pattern: str,
        *,
        tasks: Sequence[str] | None = None,
        expires_in_ms: int | None = None,
    ) -> IssuedCredential:
        """A credential for worker ids matching ``worker_pattern`` (and only ``tasks``, when
        given)."""
        return self._issue(worker_pattern, tasks, expires_in_ms, rotates_id=None)

    def rotate(self, credential_id: str, *, expires_in_ms: int | None = None) -> IssuedCredential:
        """A second credential with the same pattern and tasks. Both are valid until the old
        one is revoked, so workers move to the new one one at a time."""
        return self._issue("*", None, expires_in_ms, rotates_id=credential_id)

    def _issue(
        self,
        worker_pattern: str,
        tasks: Sequence[str] | None,
        expires_in_ms: int | None,
        rotates_id: str | None,
    ) -> IssuedCredential:
        secret = SECRET_PREFIX + self._identities.new_secret()
        with self._uow_factory() as uow:
            rotates = None
            if rotates_id is not None:
                rotates = uow.credentials.get(rotates_id, lock=True)
                if rotates is None:
                    raise UnknownCredential(f"unknown credential {rotates_id}")
            credential, event = issue_credential(
                credential_id=self._identities.new_id(),
                worker_pattern=worker_pattern,
                tasks=tasks,
                secret_hash=hash_token(secret),
                now_ms=uow.now_ms(),
                expires_in_ms=expires_in_ms,
                rotates=rotates,
            )
            uow.credentials.add(credential)
            uow.credentials.record(event)
            uow.commit()
        return IssuedCredential(credential=credential, secret=secret)

    def revoke(self, credential_id: str, reason: str = "") -> Revocation:
        """Revoke the credential and its open sessions at once: they claim nothing more and
        every call of theirs is refused. What they hold is not declared stopped: recovery
        waits for not-running evidence (an operator's attestation, say)."""
        with self._uow_factory() as uow:
            before = uow.credentials.get(credential_id, lock=True)
            if before is None:
                raise UnknownCredential(f"unknown credential {credential_id}")
            sessions = uow.credentials.open_sessions_of(credential_id)
            after, revoked, event = revoke_credential(
                before, sessions, now_ms=uow.now_ms(), reason=reason
            )
            uow.credentials.update(before, after)
            by_id = {s.id: s for s in sessions}
            for session in revoked:
                uow.sessions.update(by_id[session.id], session)
            uow.credentials.record(event)
            uow.commit()
        return Revocation(credential=after, revoked_session_ids=tuple(s.id for s in revoked))

    def list_credentials(self) -> Sequence[WorkerCredential]:
        with self._uow_factory() as uow:
            return uow.credentials.list_credentials()

    def audit(self, credential_id: str) -> Sequence[CredentialEvent]:
        with self._uow_factory() as uow:
            if uow.credentials.get(credential_id) is None:
                raise UnknownCredential(f"unknown credential {credential_id}")
            return uow.credentials.events_of(credential_id)

    def register(
        self, presented: str | None, worker_id: str, capacity: int, tasks: list[str]
    ) -> tuple[SessionGrant, str]:
        """Open a session with a credential, in one transaction: the credential is found by
        the hash of ``presented`` (locked for share), must admit ``worker_id`` and ``tasks``
        now, and its ``used`` audit line names the new session. Returns the grant and the
        credential's id; a refusal raises :class:`CredentialRejected` and writes nothing."""
        if not presented:
            raise CredentialRejected(CredentialRefusal.MISSING, "a worker credential is required")
        if len(presented) > MAX_SECRET_LENGTH or not presented.startswith(SECRET_PREFIX):
            raise CredentialRejected(CredentialRefusal.UNKNOWN, "unknown credential")
        presented_hash = hash_token(presented)
        with self._uow_factory() as uow:
            found = uow.credentials.find_by_secret_hash(presented_hash)
            if found is not None and not hmac.compare_digest(found.secret_hash, presented_hash):
                found = None
            credential = authorize_registration(
                found, worker_id=worker_id, tasks=tasks, now_ms=uow.now_ms()
            )
            grant, session = open_session(uow, self._identities, worker_id, capacity, tasks)
            uow.credentials.record(credential_used(credential, session))
            uow.commit()
        return grant, credential.id
