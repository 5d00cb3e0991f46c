"""The worker protocol (ADR 0007): sessions, the claim that starts work, and the fenced commands
on a claimed Attempt.

Every command authenticates the session by its secret (constant-time comparison of hashes) and,
for fenced commands, the lease by (attempt, generation, version, token). Every command is a
batch (a single command is a batch of one): one transaction, each item decided on its own by
the domain's transitions, a refused item changing nothing. A rejected command changes
nothing."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ql3.application.lookups import UnknownAttempt
from ql3.application.ports import (
    NO_METRICS,
    ClaimLock,
    Identities,
    Metrics,
    Snapshot,
    UnitOfWork,
    UnitOfWorkFactory,
)
from ql3.domain.dispatch import fair_pick
from ql3.domain.errors import (
    ConcurrencyConflict,
    DomainError,
    FenceReason,
    FenceRejected,
    InvalidAdmission,
    InvalidTransition,
    SessionRejected,
)
from ql3.domain.fence import (
    LeaseFence,
    check_holder,
    hash_token,
    released_for_cancel,
    secrets_match,
)
from ql3.domain.model import (
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
from ql3.domain.recovery import report_stopped
from ql3.domain.sessions import close, drain, heartbeat, register_session
from ql3.domain.states import OPEN_SESSION_STATUSES
from ql3.domain.transitions import Change, abandon, claim, complete, release, renew

MIN_TOKEN_LENGTH = 22  # 22 URL-safe base64 characters carry 132 bits
MAX_TOKEN_LENGTH = 256
MAX_BATCH_ITEMS = 256
MAX_DETAIL_LENGTH = 500
MAX_CLAIM = 256


class UnknownSession(SessionRejected):
    """No session with that id."""


class SessionUnauthorized(SessionRejected):
    """The session secret does not match."""


@dataclass(frozen=True, slots=True)
class SessionGrant:
    session_id: str
    secret: str
    replaced_session_ids: tuple[str, ...]
    registered_at_ms: int = 0


@dataclass(frozen=True, slots=True)
class Grant:
    """An Attempt a claim started for the session, with the fence the worker must present: the
    token was minted for this lease and is sent once, in this answer."""

    run_id: str
    attempt_id: str
    attempt_number: int
    task: str
    input: JsonValue
    generation: int
    version: int
    token: str
    expires_at_ms: int
    idempotency_key: str
    timeout_ms: int | None = None  # the Run's execution timeout: the worker stops it past this

    @property
    def fence(self) -> LeaseFence:
        return LeaseFence(
            attempt_id=self.attempt_id,
            generation=self.generation,
            version=self.version,
            token=self.token,
        )


def _released_by_task(writes: Sequence[tuple[Snapshot, Change]]) -> dict[str, int]:
    """Per task, the ``leased`` leases that ``writes`` release."""
    released: dict[str, int] = {}
    for before, change in writes:
        was, now = before.lease, change.lease
        if (
            was is not None
            and was.status is LeaseStatus.LEASED
            and now is not None
            and (now.run_id, now.generation) == (was.run_id, was.generation)
            and now.status is not LeaseStatus.LEASED
        ):
            released[before.run.task] = released.get(before.run.task, 0) + 1
    return released


class NoGrant(enum.Enum):
    """Why a claim that asked for work was granted none."""

    GATE_CLOSED = "dispatch_gate_closed"  # recovery or lost retry failed; see ``detail``
    SESSION_NOT_ACTIVE = "session_not_active"  # draining: it may finish, not take more
    NO_CAPACITY = "no_capacity"  # the session holds as many leases as its capacity
    NOTHING_QUEUED = "nothing_queued"


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    """A claim's answer: the results of the completions it carried (in their order), the
    Attempts it handed back because the worker no longer held them, what it started, and, when
    it was asked for work and started none, why."""

    now_ms: int
    status: SessionStatus
    completed: tuple[ItemResult, ...]
    released: tuple[str, ...]
    grants: tuple[Grant, ...]
    no_grant: NoGrant | None = None
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class PollAnswer:
    """A heartbeat's answer: the session's status and the store's clock."""

    now_ms: int
    status: SessionStatus


class BatchOutcome(enum.Enum):
    """What one item of a batch achieved."""

    RENEWED = "renewed"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ALREADY_COMPLETED = "already_completed"  # a repeated completion: nothing changed
    LOST = "lost"
    RECORDED = "recorded"
    RELEASED = "released"
    # an abandon or hand-back of an Attempt whose Run was cancelled: the stop is taken, and
    # nothing changes (the cancellation already settled the Attempt and released its lease)
    CANCELLED = "cancelled"


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
    """A task's outcome; ``timed_out``: a failure because the worker stopped the task at its
    Run's timeout."""

    fence: LeaseFence
    succeeded: bool
    output: JsonValue = None
    error: str | None = None
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class Abandonment:
    fence: LeaseFence
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Release:
    fence: LeaseFence
    cause: str = "not_started"


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


def open_session(
    uow: UnitOfWork, identities: Identities, worker_id: str, capacity: int, tasks: list[str]
) -> tuple[SessionGrant, WorkerSession]:
    """Register a new session in ``uow`` (not committed): open sessions of the same worker id
    are marked ``replaced``. The grant holds the session's secret, sent once."""
    secret = identities.new_secret()
    existing = uow.sessions.open_sessions_of(worker_id)
    session, replaced = register_session(
        session_id=identities.new_id(),
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
    grant = SessionGrant(
        session_id=session.id,
        secret=secret,
        replaced_session_ids=tuple(s.id for s in replaced),
        registered_at_ms=session.registered_at_ms,
    )
    return grant, session


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


def _check_batch(attempt_ids: Sequence[str], *, allow_empty: bool = False) -> None:
    if not (0 if allow_empty else 1) <= len(attempt_ids) <= MAX_BATCH_ITEMS:
        raise InvalidAdmission(f"a batch holds 1..{MAX_BATCH_ITEMS} items")
    if len(set(attempt_ids)) != len(attempt_ids):
        raise InvalidAdmission("a batch names each attempt at most once")


def _report(
    metrics: Metrics, writes: Sequence[tuple[Snapshot, Change]], results: Sequence[ItemResult]
) -> None:
    """Tell the metrics what a committed batch or claim did (ADR 0010)."""
    metrics.committed([change.event for _, change in writes])
    renewed = sum(1 for r in results if r.outcome is BatchOutcome.RENEWED)
    if renewed:
        metrics.leases_renewed(renewed)
    for r in results:
        if r.rejection is Rejection.FENCE:
            metrics.fence_rejected(r.reason or "unknown")


class WorkerCommands:
    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        identities: Identities,
        lease_ttl_ms: int,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        if lease_ttl_ms <= 0:
            raise ValueError("lease ttl must be positive")
        self._uow_factory = uow_factory
        self._identities = identities
        self._lease_ttl_ms = lease_ttl_ms
        self._metrics = metrics

    @property
    def lease_ttl_ms(self) -> int:
        return self._lease_ttl_ms

    # --- sessions ---------------------------------------------------------------------------

    def register(self, worker_id: str, capacity: int, tasks: list[str]) -> SessionGrant:
        """A new session. Open sessions of the same worker id are marked ``replaced``: a worker
        id names one execution slot, so its older process is gone."""
        with self._uow_factory() as uow:
            grant, _session = open_session(uow, self._identities, worker_id, capacity, tasks)
            uow.commit()
        return grant

    def poll(self, session_id: str, secret: str) -> PollAnswer:
        """A heartbeat: records liveness, tells the session's status and the store's clock."""
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            now_ms = uow.now_ms()
            updated = heartbeat(session, now_ms)
            uow.sessions.update(session, updated)
            uow.commit()
        return PollAnswer(now_ms=now_ms, status=updated.status)

    def drain(self, session_id: str, secret: str) -> None:
        """No new work for this session; what it runs may finish."""
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

    # --- the claim ----------------------------------------------------------------------------

    def claim(
        self,
        session_id: str,
        secret: str,
        *,
        limit: int,
        completions: Sequence[Completion] = (),
        held: Sequence[str] | None = None,
    ) -> ClaimAnswer:
        """One call, one transaction: record ``completions``, hand back what the worker no
        longer holds, then claim and start up to ``limit`` queued Attempts of the session's
        tasks (ADR 0007).

        ``held`` is the worker's statement of every Attempt it holds (running, or finished with
        its completion not yet answered). Any Attempt the session's leases name that is
        neither held nor completed here never began on the worker (a claim answer it did not
        receive): it is released back to ``queued`` with no ``lost`` verdict. ``None`` states
        nothing.

        The claim takes the session's row lock, so two claims of one session count its
        capacity one after the other; it grants nothing while the dispatch gate is closed or
        the session drains, and says why. Each grant is one :func:`ql3.domain.transitions.claim`
        change, fair across tasks."""
        if not 0 <= limit <= MAX_CLAIM:
            raise InvalidAdmission(f"a claim asks for 0..{MAX_CLAIM} attempts")
        completion_ids = [c.fence.attempt_id for c in completions]
        _check_batch(completion_ids, allow_empty=True)
        if held is not None and len(held) > MAX_CLAIM * 4:
            raise InvalidAdmission(f"a worker holds at most {MAX_CLAIM * 4} attempts")
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret)
            not_held: list[str] = []
            if held is not None:
                stated = set(held) | set(completion_ids)
                not_held = [a for a in uow.sessions.held_by(session_id) if a not in stated]
            snapshots = self._lock(uow, [*completion_ids, *not_held])
            # The store's clock: read with the locks when there are any; otherwise the claim's
            # lock statement reads it, so an idle claim costs no extra round trip.
            now_ms = uow.now_ms() if (snapshots or limit == 0 or not session.accepts_work) else 0
            writes: list[tuple[Snapshot, Change]] = []
            completed = self._decide(
                uow,
                session,
                completion_ids,
                [c.fence for c in completions],
                snapshots,
                now_ms,
                writes,
                lambda it: self._complete_item(it, completions[it.index]),
            )
            released: list[str] = []
            for attempt_id in not_held:
                snapshot = snapshots.get(attempt_id)
                if snapshot is None or snapshot.attempt is None:
                    continue
                try:
                    change, handed_back = self._not_held(uow, snapshot, session, now_ms)
                except DomainError:
                    continue  # settled meanwhile (completed, lost, cancelled)
                writes.append((snapshot, change))
                if handed_back:
                    released.append(attempt_id)
            grant = _NO_GRANT
            if limit > 0:
                freed = sum(1 for r in completed if r.ok and r.outcome in _FREES_A_SLOT)
                freed += len(released)
                grant = self._grant(uow, session, limit, freed, writes)
                now_ms = grant.now_ms or now_ms
            if writes:
                uow.runs.apply_many(writes)
                uow.commit()
        _report(self._metrics, writes, completed)
        self._metrics.claim_answered(len(grant.grants), grant.no_grant and grant.no_grant.value)
        return ClaimAnswer(
            now_ms=now_ms,
            status=session.status,
            completed=tuple(completed),
            released=tuple(released),
            grants=grant.grants,
            no_grant=grant.no_grant,
            detail=grant.detail,
        )

    @staticmethod
    def _not_held(
        uow: UnitOfWork, snapshot: Snapshot, session: WorkerSession, now_ms: int
    ) -> tuple[Change, bool]:
        """What the worker's statement that it does not hold an Attempt changes. While the
        lease is live the Attempt's claim answer never reached the worker (it keeps everything
        it began until the node answered its completion or abandon): it is handed back. Once
        the lease expired the worker may have begun it and given it up (an abandon recorded as
        evidence after the expiry): the statement is recorded as not-running evidence and
        recovery settles the Attempt by its retry policy. Returns the change and whether it
        was a hand-back."""
        assert snapshot.attempt is not None
        lease = snapshot.lease
        if lease is not None and lease.is_live(now_ms):
            change = release(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=lease,
                session_id=session.id,
                cause="not_held",
                now_ms=now_ms,
            )
            return change, True
        if lease is None or lease.holder_session_id != session.id:
            raise SessionRejected(f"attempt {snapshot.attempt.id} is not held by {session.id}")
        report, audit = report_stopped(
            run=snapshot.run,
            attempt=snapshot.attempt,
            kind=EvidenceKind.WORKER_ABANDONED,
            detail="not held by its worker after its lease expired",
            now_ms=now_ms,
        )
        uow.evidence.record(report)
        return audit, False

    def _grant(
        self,
        uow: UnitOfWork,
        session: WorkerSession,
        limit: int,
        freed: int,
        writes: list[tuple[Snapshot, Change]],
    ) -> _Granted:
        if not session.accepts_work:
            return _Granted(
                no_grant=NoGrant.SESSION_NOT_ACTIVE,
                detail=f"session {session.id} is {session.status.value}",
            )
        lock: ClaimLock = uow.runs.lock_for_claim(session.id, session.tasks, limit)
        now_ms = lock.observed_at_ms
        if not lock.gate.open:
            return _Granted(now_ms=now_ms, no_grant=NoGrant.GATE_CLOSED, detail=lock.gate.reason)
        capacity = lock.capacity
        if capacity is None or not capacity.session.accepts_work:
            return _Granted(
                now_ms=now_ms,
                no_grant=NoGrant.SESSION_NOT_ACTIVE,
                detail=f"session {session.id} is not active",
            )
        room = min(limit, capacity.session.capacity - capacity.in_flight + freed)
        if room <= 0:
            return _Granted(now_ms=now_ms, no_grant=NoGrant.NO_CAPACITY)
        # The leases this call's completions and hand-backs release are still counted in
        # flight by the lock: they are written with the grants.
        in_flight = dict(lock.in_flight_by_task)
        for task, count in _released_by_task(writes).items():
            in_flight[task] = max(0, in_flight.get(task, 0) - count)
        chosen = fair_pick(
            [s for s in lock.candidates if s.attempt is not None],
            task_of=lambda s: s.run.task,
            queued_at_of=lambda s: s.attempt.created_at_ms if s.attempt else 0,
            priority_of=lambda s: s.run.priority,
            in_flight=in_flight,
            limits=lock.limits,
            count=room,
            observed_at_ms=now_ms,
        )
        grants: list[Grant] = []
        for snapshot in chosen:
            assert snapshot.attempt is not None
            token = self._identities.new_secret()
            try:
                change = claim(
                    run=snapshot.run,
                    attempt=snapshot.attempt,
                    previous_lease=snapshot.lease,
                    session=capacity.session,
                    token_hash=hash_token(token),
                    ttl_ms=self._lease_ttl_ms,
                    now_ms=now_ms,
                )
            except DomainError:
                continue  # no longer claimable: left alone
            writes.append((snapshot, change))
            lease = change.lease
            assert lease is not None
            grants.append(
                Grant(
                    run_id=snapshot.run.id,
                    attempt_id=snapshot.attempt.id,
                    attempt_number=snapshot.attempt.number,
                    task=snapshot.run.task,
                    input=snapshot.run.input,
                    generation=lease.generation,
                    version=lease.version,
                    token=token,
                    expires_at_ms=lease.expires_at_ms,
                    idempotency_key=snapshot.run.id,
                    timeout_ms=snapshot.run.timeout_ms,
                )
            )
        if not grants:
            return _Granted(now_ms=now_ms, no_grant=NoGrant.NOTHING_QUEUED)
        return _Granted(now_ms=now_ms, grants=tuple(grants))

    # --- fenced batches -----------------------------------------------------------------------
    #
    # One transaction per batch. The session is authenticated once; a session that fails
    # authentication fails the whole batch. Then every Attempt is locked (advisory lock, then
    # rows) in attempt id order, so concurrent batches cannot deadlock, and the store's clock is
    # read once with all locks held. Each item goes through the domain's transitions; an item
    # that is refused changes nothing and does not affect the others.

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
        ``already_completed`` and changes nothing; a completion of an Attempt whose Run was
        cancelled is refused with reason ``cancelled``."""
        return self._batch(
            session_id,
            secret,
            [c.fence for c in completions],
            lambda it: self._complete_item(it, completions[it.index]),
        )

    def release_many(
        self, session_id: str, secret: str, releases: Sequence[Release]
    ) -> BatchAnswer:
        """Hand back Attempts whose task never began (a drain, a self-fence before the start, a
        slot that failed to start): each goes back to ``queued`` with no ``lost`` verdict. The
        fence must name the lease and its token; an expired lease may still be handed back."""

        def item(it: _BatchItem) -> ItemResult:
            lease = check_holder(it.lease, it.fence)
            if released_for_cancel(lease):
                return ItemResult(attempt_id=it.fence.attempt_id, outcome=BatchOutcome.CANCELLED)
            if lease.version != it.fence.version:
                raise FenceRejected(FenceReason.VERSION_MISMATCH, it.fence.attempt_id)
            change = release(
                run=it.snapshot.run,
                attempt=it.attempt,
                lease=lease,
                session_id=it.session.id,
                cause=releases[it.index].cause[:MAX_DETAIL_LENGTH] or "not_started",
                now_ms=it.now_ms,
            )
            it.writes.append((it.snapshot, change))
            return ItemResult(attempt_id=it.fence.attempt_id, outcome=BatchOutcome.RELEASED)

        return self._batch(session_id, secret, [r.fence for r in releases], item)

    def abandon_many(
        self, session_id: str, secret: str, abandonments: Sequence[Abandonment]
    ) -> BatchAnswer:
        """The worker stopped executing these Attempts (also allowed once its session is no
        longer open). A live lease is released at once (``lost``); an expired one keeps the
        report as not-running evidence for recovery (``recorded``); one released because its
        Run was cancelled answers ``cancelled`` and changes nothing (ADR 0017)."""

        def item(it: _BatchItem) -> ItemResult:
            if released_for_cancel(check_holder(it.lease, it.fence)):
                return ItemResult(attempt_id=it.fence.attempt_id, outcome=BatchOutcome.CANCELLED)
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

    def attest_stopped(self, attempt_id: str, reason: str) -> None:
        """An operator states that the Attempt no longer executes anywhere."""
        if not reason.strip():
            raise InvalidAdmission("an attestation needs a reason")
        with self._uow_factory() as uow:
            snapshot = uow.runs.lock_attempt(attempt_id)
            if snapshot is None or snapshot.attempt is None:
                raise UnknownAttempt(attempt_id)
            report, audit = report_stopped(
                run=snapshot.run,
                attempt=snapshot.attempt,
                kind=EvidenceKind.OPERATOR_ATTESTED,
                detail=reason.strip()[:MAX_DETAIL_LENGTH],
                now_ms=uow.now_ms(),
            )
            uow.evidence.record(report)
            uow.runs.apply(snapshot, audit)
            uow.commit()

    # --- decisions ----------------------------------------------------------------------------

    def _complete_item(self, it: _BatchItem, done: Completion) -> ItemResult:
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
                timed_out=done.timed_out,
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
        _check_batch(attempt_ids)
        with self._uow_factory() as uow:
            session = self._authenticate(uow, session_id, secret, allow_closed=allow_closed)
            snapshots = self._lock(uow, attempt_ids)
            now_ms = uow.now_ms()
            writes: list[tuple[Snapshot, Change]] = []
            results = self._decide(
                uow, session, attempt_ids, fences, snapshots, now_ms, writes, item
            )
            uow.runs.apply_many(writes)
            uow.commit()
        _report(self._metrics, writes, results)
        return BatchAnswer(now_ms=now_ms, results=tuple(results))

    @staticmethod
    def _lock(uow: UnitOfWork, attempt_ids: Sequence[str]) -> dict[str, Snapshot]:
        """Lock every named Attempt in id order (concurrent batches cannot deadlock)."""
        ordered = sorted(set(attempt_ids))
        if not ordered:
            return {}
        locked = uow.runs.lock_attempts(ordered)
        return {
            attempt_id: snapshot
            for attempt_id, snapshot in zip(ordered, locked, strict=True)
            if snapshot is not None and snapshot.attempt is not None
        }

    def _decide(
        self,
        uow: UnitOfWork,
        session: WorkerSession,
        attempt_ids: Sequence[str],
        fences: Sequence[LeaseFence],
        snapshots: dict[str, Snapshot],
        now_ms: int,
        writes: list[tuple[Snapshot, Change]],
        item: Callable[[_BatchItem], ItemResult],
    ) -> list[ItemResult]:
        """Decide each item on its own (a refusal changes nothing); the accepted changes go to
        ``writes``, which the caller persists together, all or nothing."""
        results: list[ItemResult] = []
        for index, attempt_id in enumerate(attempt_ids):
            snapshot = snapshots.get(attempt_id)
            if snapshot is None or snapshot.attempt is None:
                results.append(_rejected(attempt_id, UnknownAttempt()))
                continue
            mark = len(writes)
            fence = fences[index]
            try:
                lease = self._held(snapshot, session, fence)
                results.append(
                    item(
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
                )
            except (DomainError, UnknownAttempt) as error:
                del writes[mark:]
                results.append(_rejected(attempt_id, error))
        return results

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
        if session.status is SessionStatus.REVOKED or (
            not allow_closed and session.status not in OPEN_SESSION_STATUSES
        ):
            raise SessionRejected(f"session {session_id} is {session.status.value}")
        return session

    @staticmethod
    def _held(
        snapshot: Snapshot, session: WorkerSession, fence: LeaseFence
    ) -> DispatchLease | None:
        """The snapshot's lease, refused when another session holds it."""
        lease = snapshot.lease
        if lease is not None and lease.holder_session_id != session.id:
            raise FenceRejected(FenceReason.TOKEN_MISMATCH, fence.attempt_id)
        return lease


_FREES_A_SLOT = frozenset({BatchOutcome.SUCCEEDED, BatchOutcome.FAILED})


@dataclass(frozen=True, slots=True)
class _Granted:
    """What the claim step of a claim decided; ``now_ms`` is the clock its lock read."""

    now_ms: int = 0
    grants: tuple[Grant, ...] = ()
    no_grant: NoGrant | None = None
    detail: str | None = None


_NO_GRANT = _Granted()
