"""The worker protocol: sessions and the fenced commands on a dispatched Attempt.

Every command authenticates the session by its secret (constant-time comparison of hashes) and,
for fenced commands, the lease by (attempt, generation, version, token). A rejected command
changes nothing."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from application.ports import Identities, Snapshot, UnitOfWork, UnitOfWorkFactory
from domain.errors import (
    ConcurrencyConflict,
    DomainError,
    FenceReason,
    FenceRejected,
    InvalidAdmission,
    InvalidTransition,
    SessionRejected,
)
from domain.fence import LeaseFence, check_fence, check_holder, hash_token, secrets_match
from domain.model import (
    Attempt,
    AttemptStatus,
    DispatchLease,
    EvidenceKind,
    JsonValue,
    LeaseStatus,
    ReleaseReason,
    SessionStatus,
    WorkerSession,
)
from domain.recovery import report_stopped
from domain.sessions import close, drain, heartbeat, register_session
from domain.transitions import Change, abandon, accept, activate, complete, mark_running, renew

MIN_TOKEN_LENGTH = 22  # 22 URL-safe base64 characters carry 132 bits
MAX_TOKEN_LENGTH = 256
MAX_BATCH_ITEMS = 256
MAX_DETAIL_LENGTH = 500

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
    registered_at_ms: int = 0


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


@dataclass(frozen=True, slots=True)
class PollAnswer:
    """A heartbeat's answer: the session's status, its open offers and the store's clock."""

    now_ms: int
    status: SessionStatus
    offers: tuple[Offer, ...]


class BatchOutcome(enum.Enum):
    """What one item of a batch achieved."""

    ACCEPTED = "accepted"
    RUNNING = "running"
    STARTING = "starting"  # activated; the report that it runs did not persist
    RENEWED = "renewed"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ALREADY_COMPLETED = "already_completed"  # a repeated completion: nothing changed
    LOST = "lost"
    RECORDED = "recorded"


class Rejection(enum.Enum):
    """Why one item of a batch changed nothing."""

    FENCE = "fence_rejected"
    STATE = "invalid_state"
    SESSION = "session_rejected"
    CONFLICT = "conflict"
    UNKNOWN_ATTEMPT = "unknown_attempt"
    INVALID = "invalid"


@dataclass(frozen=True, slots=True)
class ItemResult:
    """The answer for one item of a batch: an outcome, or a rejection that changed nothing.

    ``expires_at_ms`` is the lease's expiry (store clock) after the item, while it is held."""

    attempt_id: str
    outcome: BatchOutcome | None = None
    expires_at_ms: int | None = None
    rejection: Rejection | None = None
    reason: str | None = None
    message: str | None = None

    @property
    def ok(self) -> bool:
        return self.rejection is None


@dataclass(frozen=True, slots=True)
class BatchAnswer:
    """Per-item results in the order of the request, and the store's clock when they were
    decided (a worker sets its local deadlines from ``expires_at_ms - now_ms``)."""

    now_ms: int
    results: tuple[ItemResult, ...]


@dataclass(frozen=True, slots=True)
class Completion:
    fence: LeaseFence
    succeeded: bool
    output: JsonValue = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Abandonment:
    fence: LeaseFence
    detail: str = ""


class StartStage(enum.Enum):
    """How far a start batch takes each offer."""

    ACCEPTED = "accepted"  # bind the token only (prefetch)
    ACTIVATED = "activated"  # cross the start barrier of an accepted offer, mark it running
    STARTED = "started"  # accept, activate and mark running in one go


@dataclass(frozen=True, slots=True)
class _BatchItem:
    """One item of a batch, locked and held by the calling session: what its decision needs.
    Changes go to ``writes``; the batch writes them all together."""

    uow: UnitOfWork
    session: WorkerSession
    snapshot: Snapshot
    attempt: Attempt
    lease: DispatchLease | None
    fence: LeaseFence
    index: int
    now_ms: int
    writes: list[tuple[Snapshot, Change]]


def _rejected(attempt_id: str, error: Exception) -> ItemResult:
    if isinstance(error, FenceRejected):
        return ItemResult(
            attempt_id=attempt_id,
            rejection=Rejection.FENCE,
            reason=error.reason.value,
            message=str(error),
        )
    if isinstance(error, UnknownAttempt):
        return ItemResult(
            attempt_id=attempt_id,
            rejection=Rejection.UNKNOWN_ATTEMPT,
            message=f"unknown attempt {attempt_id}",
        )
    kinds: tuple[tuple[type[Exception], Rejection], ...] = (
        (SessionRejected, Rejection.SESSION),
        (InvalidTransition, Rejection.STATE),
        (ConcurrencyConflict, Rejection.CONFLICT),
        (InvalidAdmission, Rejection.INVALID),
    )
    kind = next((k for cls, k in kinds if isinstance(error, cls)), Rejection.STATE)
    return ItemResult(attempt_id=attempt_id, rejection=kind, message=str(error))


def _after(snapshot: Snapshot, change: Change) -> Snapshot:
    """The snapshot as it is once ``change`` is applied (the locks are still held)."""
    return Snapshot(
        run=change.run,
        attempt=change.attempts[0] if change.attempts else snapshot.attempt,
        lease=change.lease if change.lease is not None else snapshot.lease,
    )


def _check_token(token: str) -> None:
    if not MIN_TOKEN_LENGTH <= len(token) <= MAX_TOKEN_LENGTH:
        raise InvalidAdmission(
            f"lease token must be {MIN_TOKEN_LENGTH}..{MAX_TOKEN_LENGTH} characters"
        )


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
            session_id=session.id,
            secret=secret,
            replaced_session_ids=tuple(s.id for s in replaced),
            registered_at_ms=session.registered_at_ms,
        )

    def heartbeat(self, session_id: str, secret: str) -> list[Offer]:
        """Record liveness; answer with the session's open offers and their fences."""
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            uow.sessions.update(session, heartbeat(session, uow.now_ms()))
            offers = self._offers_of(uow, session_id)
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
            change, recorded = self._abandonment(uow, snapshot, lease, fence, detail[:500], now_ms)
            uow.runs.apply(snapshot, change)
            uow.commit()
            return AbandonOutcome(outcome="recorded" if recorded else "lost")

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

    # --- batches ------------------------------------------------------------------------------
    #
    # One transaction per batch. The session is authenticated once; a session that fails
    # authentication fails the whole batch. Then every Attempt is locked (advisory lock, then
    # rows) in attempt id order, so concurrent batches cannot deadlock, the store's clock is
    # observed once with all locks held, and each item is decided by the same domain
    # transitions as the single commands. An item that is refused changes nothing and does not
    # affect the others.

    def poll(self, session_id: str, secret: str) -> PollAnswer:
        """A heartbeat that also tells the session's status and the store's clock."""
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            now_ms = uow.now_ms()
            updated = heartbeat(session, now_ms)
            uow.sessions.update(session, updated)
            offers = tuple(self._offers_of(uow, session_id))
            uow.commit()
        return PollAnswer(now_ms=now_ms, status=updated.status, offers=offers)

    def start_many(
        self,
        session_id: str,
        secret: str,
        fences: Sequence[LeaseFence],
        stage: StartStage = StartStage.STARTED,
    ) -> BatchAnswer:
        """Take offers as far as ``stage``: accept binds each fence's token to its lease;
        activation crosses the start barrier and marks the Attempt running. Repeating an item
        that already got that far (same token) answers as before and changes nothing."""
        for fence in fences:
            _check_token(fence.token)

        def item(it: _BatchItem) -> ItemResult:
            return self._start_one(it.session, it.snapshot, it.fence, stage, it.now_ms, it.writes)

        return self._batch(session_id, secret, fences, item)

    def renew_many(self, session_id: str, secret: str, fences: Sequence[LeaseFence]) -> BatchAnswer:
        """Extend each lease; no version change, no event."""

        def item(it: _BatchItem) -> ItemResult:
            renewed = renew(
                attempt=it.attempt,
                lease=it.lease,
                fence=it.fence,
                ttl_ms=self._lease_ttl_ms,
                now_ms=it.now_ms,
            )
            it.uow.runs.renew_lease(check_holder(it.lease, it.fence), renewed)
            return ItemResult(
                attempt_id=it.fence.attempt_id,
                outcome=BatchOutcome.RENEWED,
                expires_at_ms=renewed.expires_at_ms,
            )

        return self._batch(session_id, secret, fences, item)

    def complete_many(
        self, session_id: str, secret: str, completions: Sequence[Completion]
    ) -> BatchAnswer:
        """Report outcomes; each lease is released with reason ``completed``. Repeating a
        completion that was already recorded with the same fence answers
        ``already_completed`` and changes nothing."""

        def item(it: _BatchItem) -> ItemResult:
            done = completions[it.index]
            try:
                change = complete(
                    run=it.snapshot.run,
                    attempt=it.attempt,
                    lease=it.lease,
                    fence=it.fence,
                    succeeded=done.succeeded,
                    output=done.output,
                    error=done.error,
                    now_ms=it.now_ms,
                )
            except FenceRejected:
                if self._already_completed(it.snapshot, it.fence, done.succeeded):
                    return ItemResult(
                        attempt_id=it.fence.attempt_id, outcome=BatchOutcome.ALREADY_COMPLETED
                    )
                raise
            it.writes.append((it.snapshot, change))
            outcome = BatchOutcome.SUCCEEDED if done.succeeded else BatchOutcome.FAILED
            return ItemResult(attempt_id=it.fence.attempt_id, outcome=outcome)

        return self._batch(session_id, secret, [c.fence for c in completions], item)

    def abandon_many(
        self, session_id: str, secret: str, abandonments: Sequence[Abandonment]
    ) -> BatchAnswer:
        """The worker stopped executing these Attempts (also allowed once its session is no
        longer open). A live lease is released at once (``lost``); an expired one keeps the
        report as not-running evidence for recovery (``recorded``)."""

        def item(it: _BatchItem) -> ItemResult:
            detail = abandonments[it.index].detail[:MAX_DETAIL_LENGTH]
            change, recorded = self._abandonment(
                it.uow, it.snapshot, it.lease, it.fence, detail, it.now_ms
            )
            it.writes.append((it.snapshot, change))
            outcome = BatchOutcome.RECORDED if recorded else BatchOutcome.LOST
            return ItemResult(attempt_id=it.fence.attempt_id, outcome=outcome)

        return self._batch(
            session_id, secret, [a.fence for a in abandonments], item, allow_closed=True
        )

    def _start_one(
        self,
        session: WorkerSession,
        snapshot: Snapshot,
        fence: LeaseFence,
        stage: StartStage,
        now_ms: int,
        writes: list[tuple[Snapshot, Change]],
    ) -> ItemResult:
        """Decide every step first (pure); the batch persists them in order. The batch has
        checked that ``session`` holds the lease."""
        changes: list[tuple[Snapshot, Change]] = []
        current = snapshot
        lease = current.lease
        if stage is not StartStage.ACTIVATED and lease is not None and lease.token_hash is None:
            assert current.attempt is not None
            change = accept(
                run=current.run,
                attempt=current.attempt,
                lease=lease,
                session_id=session.id,
                generation=fence.generation,
                version=fence.version,
                token_hash=hash_token(fence.token),
                ttl_ms=self._lease_ttl_ms,
                now_ms=now_ms,
            )
            changes.append((current, change))
            current = _after(current, change)
        # From here on the token is bound: every step checks the whole fence.
        live = check_fence(current.lease, fence, now_ms)
        assert current.attempt is not None
        if stage is StartStage.ACCEPTED:
            if current.attempt.status is not AttemptStatus.CLAIMED:
                raise InvalidTransition(
                    "attempt", fence.attempt_id, current.attempt.status.value, "be accepted"
                )
        else:
            if current.attempt.status is AttemptStatus.CLAIMED:
                change = activate(
                    run=current.run,
                    attempt=current.attempt,
                    lease=current.lease,
                    fence=fence,
                    ttl_ms=self._lease_ttl_ms,
                    now_ms=now_ms,
                )
                changes.append((current, change))
                current = _after(current, change)
            assert current.attempt is not None
            if current.attempt.status is AttemptStatus.STARTING:
                change = mark_running(
                    run=current.run,
                    attempt=current.attempt,
                    lease=current.lease,
                    fence=fence,
                    now_ms=now_ms,
                )
                changes.append((current, change))
                current = _after(current, change)
            assert current.attempt is not None
            if current.attempt.status is not AttemptStatus.RUNNING:
                raise InvalidTransition(
                    "attempt", fence.attempt_id, current.attempt.status.value, "be started"
                )
        # Persisted with the rest of the batch, all together.
        writes.extend(changes)
        lease = current.lease if current.lease is not None else live
        outcome = BatchOutcome.ACCEPTED if stage is StartStage.ACCEPTED else BatchOutcome.RUNNING
        return ItemResult(
            attempt_id=fence.attempt_id, outcome=outcome, expires_at_ms=lease.expires_at_ms
        )

    @staticmethod
    def _abandonment(
        uow: UnitOfWork,
        snapshot: Snapshot,
        lease: DispatchLease | None,
        fence: LeaseFence,
        detail: str,
        now_ms: int,
    ) -> tuple[Change, bool]:
        """What a worker's abandon report changes, and whether the report was only recorded:
        with a live lease the Attempt is lost at once; once the lease expired the report is
        recorded as not-running evidence and the change is its audit event."""
        assert snapshot.attempt is not None
        try:
            change = abandon(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=lease,
                fence=fence,
                detail=detail,
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
                detail=detail,
                now_ms=now_ms,
            )
            uow.evidence.record(report)
            return audit, True
        return change, False

    @staticmethod
    def _already_completed(snapshot: Snapshot, fence: LeaseFence, succeeded: bool) -> bool:
        """The fence's own completion was recorded: its exact lease was released for
        ``completed`` by that one version step and the Attempt ended as reported."""
        lease, attempt = snapshot.lease, snapshot.attempt
        if lease is None or attempt is None:
            return False
        try:
            check_holder(lease, fence)
        except FenceRejected:
            return False
        expected = AttemptStatus.SUCCEEDED if succeeded else AttemptStatus.FAILED
        return (
            lease.status is LeaseStatus.RELEASED
            and lease.release_reason is ReleaseReason.COMPLETED
            and lease.version == fence.version + 1
            and attempt.lease_generation == fence.generation
            and attempt.status is expected
        )

    def _batch(
        self,
        session_id: str,
        secret: str,
        fences: Sequence[LeaseFence],
        item: Callable[[_BatchItem], ItemResult],
        *,
        allow_closed: bool = False,
    ) -> BatchAnswer:
        attempt_ids = [fence.attempt_id for fence in fences]
        if not 1 <= len(attempt_ids) <= MAX_BATCH_ITEMS:
            raise InvalidAdmission(f"a batch holds 1..{MAX_BATCH_ITEMS} items")
        if len(set(attempt_ids)) != len(attempt_ids):
            raise InvalidAdmission("a batch names each attempt at most once")
        results: list[ItemResult | None] = [None] * len(attempt_ids)
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret, allow_closed=allow_closed)
            snapshots: dict[int, Snapshot] = {}
            order = sorted(range(len(attempt_ids)), key=lambda i: attempt_ids[i])
            locked = uow.runs.lock_attempts([attempt_ids[index] for index in order])
            for index, snapshot in zip(order, locked, strict=True):
                if snapshot is None or snapshot.attempt is None:
                    results[index] = _rejected(attempt_ids[index], UnknownAttempt())
                else:
                    snapshots[index] = snapshot
            now_ms = uow.now_ms()
            # Each item is decided on its own (a refusal changes nothing); the changes of the
            # accepted ones are written together, all or nothing, at the end.
            writes: list[tuple[Snapshot, Change]] = []
            for index, snapshot in sorted(snapshots.items()):
                mark = len(writes)
                fence = fences[index]
                try:
                    assert snapshot.attempt is not None
                    lease = self._held(snapshot, session, fence)
                    results[index] = item(
                        _BatchItem(
                            uow=uow,
                            session=session,
                            snapshot=snapshot,
                            attempt=snapshot.attempt,
                            lease=lease,
                            fence=fence,
                            index=index,
                            now_ms=now_ms,
                            writes=writes,
                        )
                    )
                except (DomainError, UnknownAttempt) as error:
                    del writes[mark:]
                    results[index] = _rejected(attempt_ids[index], error)
            uow.runs.apply_many(writes)
            uow.commit()
        return BatchAnswer(now_ms=now_ms, results=tuple(r for r in results if r is not None))

    def _offers_of(self, uow: UnitOfWork, session_id: str) -> list[Offer]:
        return [
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
            for run, attempt, lease in uow.sessions.offers_of(session_id)
        ]

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
