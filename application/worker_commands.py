"""The worker protocol: sessions and the fenced commands on a dispatched Attempt.

Every command authenticates the session by its secret (constant-time comparison of hashes) and,
for fenced commands, the lease by (attempt, generation, version, token). A rejected command
changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from application.ports import Identities, Snapshot, UnitOfWork, UnitOfWorkFactory
from domain.errors import FenceReason, FenceRejected, InvalidAdmission, SessionRejected
from domain.fence import LeaseFence, check_holder, hash_token, secrets_match
from domain.model import (
    DispatchLease,
    EvidenceKind,
    JsonValue,
    SessionStatus,
    WorkerSession,
)
from domain.recovery import report_stopped
from domain.sessions import close, drain, heartbeat, register_session
from domain.transitions import Change, abandon, accept, activate, complete, mark_running, renew

MIN_TOKEN_LENGTH = 22  # 22 URL-safe base64 characters carry 132 bits
MAX_TOKEN_LENGTH = 256

_OPEN = frozenset({SessionStatus.ACTIVE, SessionStatus.DRAINING})


class UnknownSession(SessionRejected):
    """No session with that id."""


class SessionUnauthorized(SessionRejected):
    """The session secret does not match."""


class UnknownAttempt(LookupError):
    """No Attempt with that id."""


@dataclass(frozen=True, slots=True)
class SessionGrant:
    session_id: str
    secret: str
    replaced_session_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Offer:
    """An Attempt offered to a session, with the fence the worker must present."""

    run_id: str
    attempt_id: str
    attempt_number: int
    task: str
    input: JsonValue
    generation: int
    version: int
    expires_at_ms: int
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class AbandonOutcome:
    """``lost`` when the live lease was released at once; ``recorded`` when the lease had
    already expired and the report was kept as not-running evidence for recovery."""

    outcome: str


class WorkerCommands:
    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        identities: Identities,
        lease_ttl_ms: int,
    ) -> None:
        if lease_ttl_ms <= 0:
            raise ValueError("lease ttl must be positive")
        self._uow_factory = uow_factory
        self._identities = identities
        self._lease_ttl_ms = lease_ttl_ms

    @property
    def lease_ttl_ms(self) -> int:
        return self._lease_ttl_ms

    # --- sessions ---------------------------------------------------------------------------

    def register(self, worker_id: str, capacity: int, tasks: list[str]) -> SessionGrant:
        """A new session. Open sessions of the same worker id are marked ``replaced``: a worker
        id names one execution slot, so its older process is gone."""
        secret = self._identities.new_secret()
        with self._uow_factory() as uow:
            existing = uow.sessions.open_sessions_of(worker_id)
            session, replaced = register_session(
                session_id=self._identities.new_id(),
                worker_id=worker_id,
                capacity=capacity,
                tasks=tasks,
                secret_hash=hash_token(secret),
                existing=existing,
                now_ms=uow.now_ms(),
            )
            before = {s.id: s for s in existing}
            for old in replaced:
                uow.sessions.update(before[old.id], old)
            uow.sessions.add(session)
            uow.commit()
        return SessionGrant(
            session_id=session.id, secret=secret, replaced_session_ids=tuple(s.id for s in replaced)
        )

    def heartbeat(self, session_id: str, secret: str) -> list[Offer]:
        """Record liveness; answer with the session's open offers and their fences."""
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            uow.sessions.update(session, heartbeat(session, uow.now_ms()))
            offers = []
            for attempt, lease in uow.sessions.offers_of(session_id):
                run = uow.runs.get_run(attempt.run_id)
                if run is None:
                    continue
                offers.append(
                    Offer(
                        run_id=run.id,
                        attempt_id=attempt.id,
                        attempt_number=attempt.number,
                        task=run.task,
                        input=run.input,
                        generation=lease.generation,
                        version=lease.version,
                        expires_at_ms=lease.expires_at_ms,
                        idempotency_key=run.id,
                    )
                )
            uow.commit()
        return offers

    def drain(self, session_id: str, secret: str) -> None:
        """No new offers for this session; its running Attempts may finish."""
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            uow.sessions.update(session, drain(session, uow.now_ms()))
            uow.commit()

    def close(self, session_id: str, secret: str) -> None:
        """The worker executes nothing any more: its unfinished Attempts become recoverable."""
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            uow.sessions.update(session, close(session, uow.now_ms()))
            uow.commit()

    # --- fenced commands --------------------------------------------------------------------

    def accept(
        self,
        session_id: str,
        secret: str,
        attempt_id: str,
        generation: int,
        version: int,
        token: str,
    ) -> None:
        """Take an offer and bind the worker's own secret token to the lease."""
        if not MIN_TOKEN_LENGTH <= len(token) <= MAX_TOKEN_LENGTH:
            raise InvalidAdmission(
                f"lease token must be {MIN_TOKEN_LENGTH}..{MAX_TOKEN_LENGTH} characters"
            )

        def decide(uow: UnitOfWork, snapshot: Snapshot, session: WorkerSession) -> Change:
            assert snapshot.attempt is not None
            return accept(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=snapshot.lease,
                session_id=session.id,
                generation=generation,
                version=version,
                token_hash=hash_token(token),
                ttl_ms=self._lease_ttl_ms,
                now_ms=uow.now_ms(),
            )

        self._fenced_change(session_id, secret, attempt_id, decide)

    def activate(self, session_id: str, secret: str, fence: LeaseFence) -> None:
        """Cross the start barrier."""

        def decide(uow: UnitOfWork, snapshot: Snapshot, session: WorkerSession) -> Change:
            assert snapshot.attempt is not None
            return activate(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=self._held(snapshot, session, fence),
                fence=fence,
                ttl_ms=self._lease_ttl_ms,
                now_ms=uow.now_ms(),
            )

        self._fenced_change(session_id, secret, fence.attempt_id, decide)

    def mark_running(self, session_id: str, secret: str, fence: LeaseFence) -> None:
        def decide(uow: UnitOfWork, snapshot: Snapshot, session: WorkerSession) -> Change:
            assert snapshot.attempt is not None
            return mark_running(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=self._held(snapshot, session, fence),
                fence=fence,
                now_ms=uow.now_ms(),
            )

        self._fenced_change(session_id, secret, fence.attempt_id, decide)

    def complete(
        self,
        session_id: str,
        secret: str,
        fence: LeaseFence,
        *,
        succeeded: bool,
        output: JsonValue = None,
        error: str | None = None,
    ) -> None:
        def decide(uow: UnitOfWork, snapshot: Snapshot, session: WorkerSession) -> Change:
            assert snapshot.attempt is not None
            return complete(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=self._held(snapshot, session, fence),
                fence=fence,
                succeeded=succeeded,
                output=output,
                error=error,
                now_ms=uow.now_ms(),
            )

        self._fenced_change(session_id, secret, fence.attempt_id, decide)

    def renew(self, session_id: str, secret: str, fence: LeaseFence) -> int:
        """Extend the lease; returns the new ``expires_at_ms``. No version change, no event."""
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            snapshot = self._lock(uow, fence.attempt_id)
            assert snapshot.attempt is not None
            lease = self._held(snapshot, session, fence)
            renewed = renew(
                attempt=snapshot.attempt,
                lease=lease,
                fence=fence,
                ttl_ms=self._lease_ttl_ms,
                now_ms=uow.now_ms(),
            )
            uow.runs.renew_lease(check_holder(lease, fence), renewed)
            uow.commit()
            return renewed.expires_at_ms

    def abandon(
        self, session_id: str, secret: str, fence: LeaseFence, detail: str
    ) -> AbandonOutcome:
        """The worker stopped executing the Attempt. With a live lease the Attempt is lost at
        once; once the lease expired the report is kept as not-running evidence."""
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret, allow_closed=True)
            snapshot = self._lock(uow, fence.attempt_id)
            assert snapshot.attempt is not None
            lease = self._held(snapshot, session, fence)
            now_ms = uow.now_ms()
            try:
                change = abandon(
                    run=snapshot.run,
                    attempt=snapshot.attempt,
                    lease=lease,
                    fence=fence,
                    detail=detail[:500],
                    now_ms=now_ms,
                )
            except FenceRejected as rejected:
                if rejected.reason is not FenceReason.EXPIRED:
                    raise
                check_holder(lease, fence)
                report, audit = report_stopped(
                    run=snapshot.run,
                    attempt=snapshot.attempt,
                    kind=EvidenceKind.WORKER_ABANDONED,
                    detail=detail[:500],
                    now_ms=now_ms,
                )
                uow.evidence.record(report)
                uow.runs.apply(snapshot, audit)
                uow.commit()
                return AbandonOutcome(outcome="recorded")
            uow.runs.apply(snapshot, change)
            uow.commit()
            return AbandonOutcome(outcome="lost")

    def attest_stopped(self, attempt_id: str, reason: str) -> None:
        """An operator states that the Attempt no longer executes anywhere."""
        if not reason.strip():
            raise InvalidAdmission("an attestation needs a reason")
        with self._uow_factory() as uow:
            snapshot = self._lock(uow, attempt_id)
            assert snapshot.attempt is not None
            report, audit = report_stopped(
                run=snapshot.run,
                attempt=snapshot.attempt,
                kind=EvidenceKind.OPERATOR_ATTESTED,
                detail=reason.strip()[:500],
                now_ms=uow.now_ms(),
            )
            uow.evidence.record(report)
            uow.runs.apply(snapshot, audit)
            uow.commit()

    # --- helpers ------------------------------------------------------------------------------

    def _authenticate(
        self,
        uow: UnitOfWork,
        session_id: str,
        secret: str,
        *,
        allow_closed: bool = False,
    ) -> WorkerSession:
        session = uow.sessions.get(session_id)
        if session is None:
            raise UnknownSession(f"unknown session {session_id}")
        if not secrets_match(secret, session.secret_hash):
            raise SessionUnauthorized(f"bad secret for session {session_id}")
        if not allow_closed and session.status not in _OPEN:
            raise SessionRejected(f"session {session_id} is {session.status.value}")
        return session

    @staticmethod
    def _lock(uow: UnitOfWork, attempt_id: str) -> Snapshot:
        snapshot = uow.runs.lock_attempt(attempt_id)
        if snapshot is None or snapshot.attempt is None:
            raise UnknownAttempt(attempt_id)
        return snapshot

    @staticmethod
    def _held(
        snapshot: Snapshot, session: WorkerSession, fence: LeaseFence
    ) -> DispatchLease | None:
        """The snapshot's lease, refused when another session holds it."""
        lease = snapshot.lease
        if lease is not None and lease.holder_session_id != session.id:
            raise FenceRejected(FenceReason.TOKEN_MISMATCH, fence.attempt_id)
        return lease

    def _fenced_change(
        self,
        session_id: str,
        secret: str,
        attempt_id: str,
        decide: Callable[[UnitOfWork, Snapshot, WorkerSession], Change],
    ) -> None:
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            snapshot = self._lock(uow, attempt_id)
            change = decide(uow, snapshot, session)
            uow.runs.apply(snapshot, change)
            uow.commit()
