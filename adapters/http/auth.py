"""Who may register a worker session (ADR 0008).

A registration presents a bearer token: a worker credential (``ql3w_...``, issued by ``ql3
credentials issue``) or the node's shared registration token. A credential is checked, and its
use audited, in the transaction that opens the session (:meth:`CredentialCommands.register`);
it may admit only some worker ids and tasks. When the node requires authentication, a
registration without either is refused; otherwise (a node on a loopback address, or one told
``--allow-anonymous-workers``) it is admitted anonymously, but a credential presented is still
checked.

Refusals answer 401 (no, unknown, revoked or expired credential; wrong token) or 403 (a valid
credential that does not admit this worker id or these tasks), change nothing, and are logged
with the worker id and the reason, never with what was presented."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

from ql3.adapters.http.errors import ApiError, translated
from ql3.application.credentials import SECRET_PREFIX, CredentialCommands
from ql3.application.worker_commands import SessionGrant, WorkerCommands
from ql3.domain.credentials import CredentialRejected

log = logging.getLogger("ql3.ingress")


@dataclass(frozen=True, slots=True)
class RegistrationAuth:
    """How the ingress admits registrations. ``credentials`` checks worker credentials (none:
    credentials are not accepted); ``token`` is a shared registration token; ``required``
    refuses anonymous registrations. A shared token given makes authentication required."""

    credentials: CredentialCommands | None = None
    token: str | None = None
    required: bool = False

    @property
    def anonymous_allowed(self) -> bool:
        return not self.required and self.token is None


def register_session(
    auth: RegistrationAuth,
    commands: WorkerCommands,
    presented: str | None,
    worker_id: str,
    capacity: int,
    tasks: list[str],
) -> SessionGrant:
    """Open a session for a registration as ``auth`` admits it, or raise :class:`ApiError`."""
    if presented and presented.startswith(SECRET_PREFIX) and auth.credentials is not None:
        return _with_credential(auth.credentials, presented, worker_id, capacity, tasks)
    token = auth.token
    if token is not None and presented and hmac.compare_digest(presented.encode(), token.encode()):
        return translated(lambda: commands.register(worker_id, capacity, tasks))
    if not auth.anonymous_allowed or presented:
        _refuse(worker_id, "missing or unknown credential")
        raise ApiError(401, "unauthorized", "wrong or missing worker credential")
    return translated(lambda: commands.register(worker_id, capacity, tasks))


def _with_credential(
    credentials: CredentialCommands, presented: str, worker_id: str, capacity: int, tasks: list[str]
) -> SessionGrant:
    def register() -> SessionGrant | CredentialRejected:
        try:
            grant, credential_id = credentials.register(presented, worker_id, capacity, tasks)
        except CredentialRejected as refused:  # answered here, not as a store conflict
            return refused
        log.info(
            "worker %s registered session %s with credential %s",
            worker_id,
            grant.session_id,
            credential_id,
        )
        return grant

    outcome = translated(register)
    if isinstance(outcome, CredentialRejected):
        _refuse(worker_id, str(outcome))
        status, error = (401, "unauthorized") if outcome.unauthenticated else (403, "forbidden")
        raise ApiError(status, error, str(outcome), outcome.reason.value)
    return outcome


def _refuse(worker_id: str, why: str) -> None:
    log.warning("registration of worker %s refused: %s", worker_id[:200], why)
