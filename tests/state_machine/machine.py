"""A reusable Hypothesis state machine for any store that implements the application ports.

``make_machine(store_factory)`` returns a ``RuleBasedStateMachine`` class. ``store_factory()``
must return ``(store, advance_clock)``: a fresh, empty store implementing
:class:`ql3.application.ports.RuntimeStore` and a callable that moves the store's clock forward by
a number of milliseconds. The machine drives the real application services (admission, the
worker protocol of ADR 0007, the dispatch gate, the cluster coordinator, startup recovery) and
keeps a small model beside the store: the sessions and their secrets, every fence a claim ever
granted, the Attempts that were ever claimed, the dispatch gate, and the highest lease version
seen per (run, generation).

Every worker command is checked against an independent statement of what it must do, worked
out from the store's state before the command: each item's outcome (or the reason it was
refused), and then the exact rows and the one event each accepted item changed; everything
else must be unchanged. After every step the invariants check the store as a whole."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from attrs import evolve
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from ql3.application.admission import Admission, AdmissionRequest, UnknownRun
from ql3.application.dispatch import DispatchGateStep
from ql3.application.history import HistoryPruning
from ql3.application.lost_retry import LostRetry
from ql3.application.ports import DispatchGate, PrunedRows, RuntimeStore
from ql3.application.recovery import RuntimeRecovery
from ql3.application.scheduler import (
    ClusterSchedulerCoordinator,
    NoTriggerSchedule,
    NoWorkflowFrontier,
    SchedulerCoordinator,
)
from ql3.application.startup import StartupRecovery
from ql3.application.task_limits import TaskLimits
from ql3.application.worker_commands import (
    Abandonment,
    BatchAnswer,
    BatchOutcome,
    ClaimAnswer,
    Completion,
    ItemResult,
    NoGrant,
    Rejection,
    Release,
    WorkerCommands,
)
from ql3.domain.errors import FenceReason, InvalidTransition, SessionRejected
from ql3.domain.events import EventType
from ql3.domain.fence import LeaseFence, hash_token
from ql3.domain.model import (
    TERMINAL_ATTEMPT_STATUSES,
    Attempt,
    AttemptStatus,
    DispatchLease,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunStatus,
    SessionStatus,
)
from ql3.domain.policy import RETRYABLE_SAFETY, Backoff, RetryPolicy, Safety
from ql3.domain.states import (
    OPEN_SESSION_STATUSES,
    RECOVERABLE_RUN_STATUSES,
)
from tests.application.support import CountingIdentities, RunView, StoreView, store_view

StoreFactory = Callable[[], tuple[RuntimeStore, Callable[[int], Any]]]

LEASE_TTL_MS = 5_000
# How far a real database clock may move by itself between two reads of one step.
CLOCK_SLACK_MS = 1_000
TASKS = ("a", "b")
WORKERS = ("w1", "w2", "w3")
OPEN = OPEN_SESSION_STATUSES
# A fence as the worker holds it, or stale in one way: another version, another generation,
# another token. Expired and released fences come from the clock and from earlier commands;
# another session's fence from presenting it through another session.
MUTATIONS = (None, None, None, "version", "generation", "token")
# One fence to pick: (index into the pool, an older generation's, mutation).
PICKS = st.tuples(
    st.integers(0, 63), st.sampled_from([False, False, False, True]), st.sampled_from(MUTATIONS)
)
BATCH = st.lists(PICKS, min_size=1, max_size=3)
POOLS = st.sampled_from(["live", "live", "own", "any"])
# The session a batch goes through: a live lease's holder (None) or any session.
CALLERS = st.sampled_from([None, None, None, 0, 1, 2, 3])
GATE_REASONS = ("runtime_recovery failed: OperationalError", "lost_retry failed: timeout")
# Events only the offer protocol of ADR 0005 wrote.
LEGACY_EVENTS = frozenset(
    {
        EventType.ATTEMPT_OFFERED,
        EventType.ATTEMPT_ACCEPTED,
        EventType.ATTEMPT_ACTIVATED,
        EventType.ATTEMPT_RUNNING,
    }
)

# How many machines (examples) and steps ran in this process, for the report.
STATS: dict[str, int] = defaultdict(int)

Picks = list[tuple[int, bool, str | None]]
Item = tuple["Held", LeaseFence]
# An item's outcome, comparable with an ItemResult: ("ok", outcome) or ("rejected", kind, reason).
Expect = tuple[str, str, str | None]


def backoffs() -> st.SearchStrategy[Backoff]:
    return st.builds(
        lambda initial, extra, mult: Backoff(
            initial_ms=initial, multiplier=mult, cap_ms=initial + extra
        ),
        st.sampled_from([0, 10, 1_000]),
        st.sampled_from([0, 500, 5_000]),
        st.sampled_from([1.0, 2.0]),
    )


def policies() -> st.SearchStrategy[RetryPolicy | None]:
    safe = st.builds(
        RetryPolicy,
        retry_on_lost=st.just(True),
        max_attempts=st.integers(2, 4),
        safety=st.sampled_from([Safety.IDEMPOTENT, Safety.DEDUPLICATED]),
        backoff=backoffs(),
    )
    return safe | st.none() | error_policies() | st.builds(
        RetryPolicy,
        retry_on_lost=st.booleans(),
        max_attempts=st.integers(1, 4),
        safety=st.sampled_from([None, Safety.IDEMPOTENT, Safety.DEDUPLICATED, Safety.UNSAFE]),
        backoff=backoffs(),
    )


def retry_safe(policy: RetryPolicy | None) -> bool:
    """The policy may retry at all: on lost Attempts or on errors, declared safe to repeat."""
    return (
        policy is not None
        and (policy.retry_on_lost or policy.retry_on_error)
        and policy.max_attempts >= 2
        and policy.safety in RETRYABLE_SAFETY
    )


# --- retry on error and execution timeouts (ADR 0013) ------------------------------------------

TIMEOUTS = st.sampled_from([None, 100, 2_500])
TIMED_OUT_ERRORS = {100: "timed out after 0.1 s", 2_500: "timed out after 2.5 s"}


def error_policies() -> st.SearchStrategy[RetryPolicy]:
    """Policies that retry on error (only idempotent or deduplicated work may)."""
    return st.builds(
        RetryPolicy,
        retry_on_lost=st.booleans(),
        retry_on_error=st.just(True),
        max_attempts=st.integers(1, 4),
        safety=st.sampled_from([Safety.IDEMPOTENT, Safety.DEDUPLICATED]),
        backoff=backoffs(),
    )


def retried_on_error(policy: RetryPolicy | None, attempt_number: int) -> bool:
    """An independent statement of the retry decision for a failed or timed-out Attempt."""
    return (
        policy is not None
        and policy.retry_on_error
        and policy.safety in RETRYABLE_SAFETY
        and attempt_number < policy.max_attempts
    )


def check_failure_effect(rb: RunView, ra: RunView, attempt_b: Attempt, attempt_a: Attempt,
                         lease_b: DispatchLease, released_at: int | None,
                         timed_out: bool) -> None:
    """A failing completion: the Attempt failed with its error (the timeout's for a timeout),
    the Run ``retry_wait`` due after the backoff when the policy retries on error, else
    ``failed``; one ``attempt_failed`` event that says which."""
    assert released_at is not None
    run = rb.run
    error = "task error"
    if timed_out and run.timeout_ms is not None:
        error = TIMED_OUT_ERRORS[run.timeout_ms]
    retry = retried_on_error(run.policy, attempt_b.number)
    if retry:
        assert run.policy is not None
        due = released_at + run.policy.backoff.delay_ms(run.id, attempt_b.number)
        assert ra.run == evolve(run, status=RunStatus.RETRY_WAIT, output=None, error=None,
                                next_attempt_at_ms=due, updated_at_ms=released_at)
    else:
        assert ra.run == evolve(run, status=RunStatus.FAILED, output=None, error=error,
                                updated_at_ms=released_at)
    assert attempt_a == evolve(
        attempt_b,
        status=AttemptStatus.FAILED,
        lease_version=lease_b.version + 1,
        finished_at_ms=released_at,
        error=error,
        updated_at_ms=released_at,
    )
    data = _one_event(rb, ra, EventType.ATTEMPT_FAILED, attempt_b.id)
    assert data["error"] == error and data["retry"] is retry
    assert data["cause"] == ("timeout" if timed_out else "error")
    if retry:
        assert (data["next_attempt"], data["next_attempt_at_ms"]) == (
            attempt_b.number + 1, ra.run.next_attempt_at_ms
        )
    _count(f"failure:{data['cause']}:{'retry' if retry else data['reason']}")


def check_retry_causes(rv: RunView) -> None:
    """Every Attempt but the latest ended so that the policy retried it: failed (or timed out)
    only under retry on error, lost only under retry on lost; work that is not declared safe to
    repeat has one Attempt."""
    policy = rv.run.policy
    for attempt in rv.attempts[:-1]:
        assert policy is not None and policy.safety in RETRYABLE_SAFETY, rv.run
        if attempt.status is AttemptStatus.FAILED:
            assert policy.retry_on_error, (rv.run, attempt)
        else:
            assert attempt.status is AttemptStatus.LOST and policy.retry_on_lost, attempt
    if len(rv.attempts) > 1 and any(a.status is AttemptStatus.FAILED for a in rv.attempts):
        _count("retried_on_error")


@dataclass(frozen=True)
class Held:
    """A fence a claim granted, with the Run and the session it was granted to."""

    run_id: str
    session_id: str
    fence: LeaseFence


# --- reading a store view ----------------------------------------------------------------------


def _attempt(rv: RunView, attempt_id: str) -> Attempt:
    return next(a for a in rv.attempts if a.id == attempt_id)


def _lease(rv: RunView, generation: int) -> DispatchLease | None:
    return next((x for x in rv.leases if x.generation == generation), None)


def _locked_lease(rv: RunView, attempt: Attempt) -> DispatchLease | None:
    """The lease :meth:`RunRepository.lock_attempt` gives with ``attempt``: its own generation's,
    or, for an Attempt without one, the Run's latest."""
    if attempt.lease_generation is not None:
        return _lease(rv, attempt.lease_generation)
    return max(rv.leases, key=lambda x: x.generation) if rv.leases else None


def claim_order(view: StoreView, attempt: Attempt) -> tuple[int, int]:
    """Where a queued Attempt stands in its task's claim order: the Run's highest priority
    first, then the oldest (ADR 0014)."""
    return (-view.runs[attempt.run_id].run.priority, attempt.created_at_ms)


def leased_by_task(view: StoreView) -> dict[str, int]:
    """Per task, the Runs holding a ``leased`` lease."""
    counts: dict[str, int] = defaultdict(int)
    for rv in view.runs.values():
        if any(x.status is LeaseStatus.LEASED for x in rv.leases):
            counts[rv.run.task] += 1
    return counts


def _held_by(view: StoreView, session_id: str) -> list[str]:
    """What :meth:`WorkerSessionRegistry.held_by` must answer."""
    return sorted(
        x.attempt_id
        for rv in view.runs.values()
        for x in rv.leases
        if x.status is LeaseStatus.LEASED and x.holder_session_id == session_id
    )


def _new_events(before: RunView, after: RunView) -> list[tuple[Any, ...]]:
    assert list(after.events[: len(before.events)]) == list(before.events), "events rewritten"
    return list(after.events[len(before.events) :])


def _one_event(
    before: RunView, after: RunView, kind: EventType, attempt_id: str
) -> dict[str, Any]:
    added = _new_events(before, after)
    assert len(added) == 1, added
    _, event_type, event_attempt, data = added[0]
    assert (event_type, event_attempt) == (kind.value, attempt_id), added[0]
    return data


def _only_evidence_added(before: StoreView, after: StoreView, run_id: str) -> None:
    """A stop report changes no state; it appends exactly one ``evidence_recorded`` event."""
    old, new = before.runs[run_id], after.runs[run_id]
    assert (new.run, new.attempts, new.leases) == (old.run, old.attempts, old.leases)
    added = _new_events(old, new)
    assert len(added) == 1 and added[0][1] == EventType.EVIDENCE_RECORDED.value, added


def _one_report_added(
    before: StoreView, after: StoreView, attempt_id: str, kind: EvidenceKind
) -> None:
    """Exactly one stop report of ``kind`` was added for the Attempt (reports of one instant
    may come back in any order)."""
    old = Counter(r.kind for r in before.reports[attempt_id])
    new = Counter(r.kind for r in after.reports[attempt_id])
    assert new - old == Counter({kind: 1}) and not old - new, (old, new)


def _fence_error(
    lease: DispatchLease | None, fence: LeaseFence, now: int, *, holder_only: bool = False
) -> str | None:
    """Why the fence does not name this lease (``holder_only``), or is not live at ``now``."""
    if lease is None:
        return "no_lease"
    if lease.attempt_id != fence.attempt_id:
        return "attempt_mismatch"
    if lease.generation != fence.generation:
        return "generation_mismatch"
    if lease.token_hash is None or lease.token_hash != hash_token(fence.token):
        return "token_mismatch"
    if holder_only:
        return None
    if _cancelled(lease):
        return "cancelled"  # the holder is told why, whatever version it names (ADR 0017)
    if lease.version != fence.version:
        return "version_mismatch"
    if lease.status is not LeaseStatus.LEASED:
        return "released"
    if lease.expires_at_ms <= now:
        return "expired"
    return None


def _cancelled(lease: DispatchLease) -> bool:
    return lease.status is LeaseStatus.RELEASED and lease.release_reason is ReleaseReason.CANCELLED


def _fence_rejected(reason: str) -> Expect:
    return ("rejected", "fence_rejected", reason)


STATE: Expect = ("rejected", "invalid_state", None)


def expect_item(
    command: str, caller: str, fence: LeaseFence, run_view: RunView, now: int
) -> Expect:
    """An independent statement of what one fenced item of ``caller`` must do at ``now``
    (``command`` is ``renew``, ``complete_ok``, ``complete_failed``, ``release`` or
    ``abandon``)."""
    attempt = _attempt(run_view, fence.attempt_id)
    run = run_view.run
    lease = _locked_lease(run_view, attempt)
    if lease is not None and lease.holder_session_id != caller:
        return _fence_rejected("token_mismatch")  # another session's lease
    if command == "renew":
        error = _fence_error(lease, fence, now)
        if error is not None:
            return _fence_rejected(error)
        return STATE if attempt.status.is_terminal else ("ok", "renewed", None)
    if command.startswith("complete"):
        ok = command == "complete_ok"
        error = _fence_error(lease, fence, now)
        if error is not None:
            assert lease is not None or error == "no_lease"
            if (
                lease is not None
                and _fence_error(lease, fence, now, holder_only=True) is None
                and lease.status is LeaseStatus.RELEASED
                and lease.release_reason is ReleaseReason.COMPLETED
                and lease.version == fence.version + 1
                and attempt.lease_generation == fence.generation
                and attempt.status is (AttemptStatus.SUCCEEDED if ok else AttemptStatus.FAILED)
            ):
                return ("ok", "already_completed", None)
            return _fence_rejected(error)
        if not attempt.status.is_started or run.status is not RunStatus.RUNNING:
            return STATE
        return ("ok", "succeeded" if ok else "failed", None)
    if command == "release":
        error = _fence_error(lease, fence, now, holder_only=True)
        if error is not None:
            return _fence_rejected(error)
        assert lease is not None
        if _cancelled(lease):
            return ("ok", "cancelled", None)  # the stop is taken; nothing changes
        if lease.version != fence.version:
            return _fence_rejected("version_mismatch")
        if run.status not in (RunStatus.RUNNING, RunStatus.DISPATCHING):
            return STATE
        if attempt.status.is_terminal:
            return STATE
        if lease.generation != attempt.lease_generation:
            return _fence_rejected("no_lease")
        if lease.status is not LeaseStatus.LEASED:
            return _fence_rejected("released")
        return ("ok", "released", None)
    assert command == "abandon", command
    error = _fence_error(lease, fence, now)
    if error == "cancelled":
        return ("ok", "cancelled", None)  # the stop is taken; nothing changes
    if error == "expired":
        return STATE if attempt.status.is_terminal else ("ok", "recorded", None)
    if error is not None:
        return _fence_rejected(error)
    if run.status not in RECOVERABLE_RUN_STATUSES:
        return STATE
    return ("ok", "lost", None)


def observed(result: ItemResult) -> Expect:
    if result.rejection is None:
        assert result.outcome is not None
        return ("ok", result.outcome.value, None)
    reason = result.reason if result.rejection.value == "fence_rejected" else None
    return ("rejected", result.rejection.value, reason)


# --- the event stream --------------------------------------------------------------------------


def _replay(events: Sequence[tuple[Any, ...]]) -> tuple[RunStatus | None, dict[str, Any]]:
    """The Run and Attempt statuses (and whether each claimed Attempt is pristine) that the
    event stream implies; every event must be a change."""
    status: RunStatus | None = None
    attempts: dict[str, tuple[AttemptStatus, bool]] = {}
    for _, kind, attempt_id, data in events:
        before = (status, dict(attempts))
        event = EventType(kind)
        assert event not in LEGACY_EVENTS, f"{kind} is written only by the offer protocol"
        current = attempts.get(attempt_id) if attempt_id else None
        if event is EventType.RUN_ADMITTED:
            assert status is None, "admitted twice"
            status = RunStatus.QUEUED if attempt_id else RunStatus.CREATED
            if not attempt_id and "run_after_ms" in data:
                status = RunStatus.RETRY_WAIT  # delayed (ADR 0015)
            if attempt_id:
                attempts[attempt_id] = (AttemptStatus.CLAIMED, True)
        elif event is EventType.ATTEMPT_CREATED:
            assert status in (RunStatus.CREATED, RunStatus.RETRY_WAIT), status
            assert attempt_id and attempt_id not in attempts
            status = RunStatus.QUEUED
            attempts[attempt_id] = (AttemptStatus.CLAIMED, True)
        elif event is EventType.ATTEMPT_STARTED:
            assert status is RunStatus.QUEUED, status
            assert current == (AttemptStatus.CLAIMED, True), current
            status = RunStatus.RUNNING
            attempts[attempt_id] = (AttemptStatus.RUNNING, False)  # type: ignore[index]
        elif event is EventType.ATTEMPT_RELEASED:
            assert status is RunStatus.RUNNING, status
            assert current == (AttemptStatus.RUNNING, False), current
            status = RunStatus.QUEUED
            attempts[attempt_id] = (AttemptStatus.CLAIMED, True)  # type: ignore[index]
        elif event is EventType.EVIDENCE_RECORDED:
            assert current is not None and not current[0].is_terminal, "evidence of a finished"
            continue
        elif event in (EventType.ATTEMPT_SUCCEEDED, EventType.ATTEMPT_FAILED):
            assert status is RunStatus.RUNNING and current == (AttemptStatus.RUNNING, False)
            ok = event is EventType.ATTEMPT_SUCCEEDED
            attempts[attempt_id] = (  # type: ignore[index]
                AttemptStatus.SUCCEEDED if ok else AttemptStatus.FAILED,
                False,
            )
            status = RunStatus.SUCCEEDED if ok else RunStatus.FAILED
            if not ok and data.get("retry"):  # retried on error (ADR 0013)
                status = RunStatus.RETRY_WAIT
        elif event is EventType.ATTEMPT_LOST:
            assert current is not None and not current[0].is_terminal
            attempts[attempt_id] = (AttemptStatus.LOST, False)  # type: ignore[index]
            status = RunStatus.LOST
        elif event is EventType.RETRY_SCHEDULED:
            assert status is RunStatus.LOST
            status = RunStatus.RETRY_WAIT
        elif event is EventType.RUN_FAILED:
            assert status is RunStatus.LOST
            status = RunStatus.FAILED
        elif event is EventType.RUN_CANCELLED:
            assert status is not None and not status.is_terminal
            status = RunStatus.CANCELLED
            if current is not None and not current[0].is_terminal:
                attempts[attempt_id] = (AttemptStatus.CANCELLED, False)  # type: ignore[index]
        else:
            raise AssertionError(f"unexpected event {kind}")
        assert (status, attempts) != before, f"event {kind} changed nothing"
    return status, attempts


def _without_expiry(view: RunView) -> tuple[Any, ...]:
    """A run's rows with the lease expiry blanked: renewals move only that and write no event."""
    return (
        view.run,
        view.attempts,
        tuple(evolve(lease, expires_at_ms=0) for lease in view.leases),
    )


def _admitted_delayed(view: RunView) -> bool:
    """The run was admitted delayed: ``retry_wait`` without an Attempt (ADR 0015)."""
    first = view.events[0] if view.events else None
    return first is not None and first[1] == EventType.RUN_ADMITTED.value and (
        "run_after_ms" in first[3]
    )


def _count(key: str) -> None:
    STATS[key] += 1


def make_machine(
    store_factory: StoreFactory,
    *,
    lease_ttl_ms: int = LEASE_TTL_MS,
    page_size: int | None = None,
) -> type[RuleBasedStateMachine]:
    class RuntimeMachine(RuleBasedStateMachine):
        runs = Bundle("runs")
        sessions = Bundle("sessions")
        delayed = Bundle("delayed")  # delayed runs (ADR 0015)

        def __init__(self) -> None:
            super().__init__()
            STATS["examples"] += 1
            self.store, self._advance = store_factory()
            ids = CountingIdentities("m")
            uow = self.store.unit_of_work
            self.gate_step = DispatchGateStep(uow, self.store)
            self.admission = Admission(uow, ids)
            self.workers = WorkerCommands(uow, ids, lease_ttl_ms=lease_ttl_ms)
            inner = SchedulerCoordinator(
                trigger_schedule=NoTriggerSchedule(),
                workflow_frontier=NoWorkflowFrontier(),
                task_attempt_admission=self.gate_step,
            )
            self.coordinator = ClusterSchedulerCoordinator(
                runtime_recovery=RuntimeRecovery(uow, self.store, page_size=page_size),
                lost_retry=LostRetry(uow, self.store, ids, page_size=page_size),
                inner=inner,
                gate=self.gate_step,
            )
            self.startup = StartupRecovery(uow, self.store, ids, page_size=page_size)
            # the model
            self.secrets: dict[str, str] = {}
            self.worker_of: dict[str, str] = {}
            self.fences: dict[str, list[Held]] = {}  # attempt id -> every grant, oldest first
            self.ever_claimed: dict[str, set[str]] = defaultdict(set)
            self.max_version: dict[tuple[str, int], int] = {}
            self.gate = DispatchGate(open=True)
            self.tokens = 0
            self.previous: StoreView | None = None
            self.pruned: set[str] = set()  # Runs a prune deleted (ADR 0016)
            self.cancelled_at: dict[str, frozenset[str]] = {}
            # task limits (ADR 0014): the limit of each limited task, and how many of its
            # Attempts were leased beyond it when it was set (lowered as they finish)
            self.limits: dict[str, int] = {}
            self.over_limit: dict[str, int] = {}

        # --- helpers ------------------------------------------------------------------------

        def now(self) -> int:
            with self.store.unit_of_work() as uow:
                return uow.now_ms()

        def view(self) -> StoreView:
            return store_view(self.store, self.secrets)  # type: ignore[arg-type]

        def current(self) -> StoreView:
            """The store as it is: what the invariants read after the previous step (nothing
            changed it since), or a fresh read."""
            if self.previous is not None and self.previous.sessions.keys() == self.secrets.keys():
                return self.previous
            return self.view()

        def expect_unchanged(self, before: StoreView) -> None:
            assert self.view() == before, "a refused command changed the store"

        def forged_token(self) -> str:
            self.tokens += 1
            return f"forged-{self.tokens:06d}-".ljust(32, "f")

        def mutate(self, fence: LeaseFence, mutation: str | None) -> LeaseFence:
            if mutation == "version":
                return evolve(fence, version=fence.version + 1)
            if mutation == "generation":
                return evolve(fence, generation=fence.generation + 1)
            if mutation == "token":
                return evolve(fence, token=self.forged_token())
            return fence

        def pick_fences(self, picks: Picks, caller: str, pool_of: str) -> list[Item]:
            """Fences of distinct Attempts, chosen by ``picks`` from a pool: the caller's live
            ones, all its own, or any. Each is current or an older generation's, and as the
            worker holds it or stale in one way (``MUTATIONS``)."""
            own = sorted(a for a, h in self.fences.items() if h[-1].session_id == caller)
            live_now = self.live_attempts()
            pools = {"live": [a for a in own if a in live_now], "own": own, "any": []}
            pool = pools[pool_of] or sorted(self.fences)
            drawn: dict[str, Item] = {}
            for index, older, mutation in picks:
                if not pool:
                    break
                attempt_id = pool[index % len(pool)]
                grants = self.fences[attempt_id]
                held = grants[0 if older else -1]
                drawn.setdefault(attempt_id, (held, self.mutate(held.fence, mutation)))
            return list(drawn.values())

        def allowed(self, command: str, caller: str, fence: LeaseFence, before: StoreView,
                    now: int, later: int) -> set[Expect]:
            """The outcomes the store may give. A fake clock stands still, so this is exactly
            the expectation at ``now``. A real database clock moves during the command: when
            the lease's expiry fell between ``now`` and the clock read after the command, the
            store may have judged either side of it (a renewal may also meet the expiry in its
            compare-and-set); nowhere else is a different result tolerated."""
            run_view = before.runs[self.run_of(fence.attempt_id)]
            first = expect_item(command, caller, fence, run_view, now)
            if later == now:
                return {first}
            last = expect_item(command, caller, fence, run_view, later)
            if last == first:
                return {first}
            _count("expiry_raced_clock")
            extra: set[Expect] = {("rejected", "conflict", None)} if command == "renew" else set()
            return {first, last, *extra}

        def mostly_open(self, session: str, pick: int) -> str:
            """``session``, or most of the time an open session instead of a gone one."""
            if self.previous is None or self.previous.sessions[session].status in OPEN:
                return session
            open_ = sorted(s for s, v in self.previous.sessions.items() if v.status in OPEN)
            if not open_ or pick % 4 == 0:
                return session
            return open_[pick % len(open_)]

        def live_attempts(self) -> set[str]:
            """The Attempts whose lease was ``leased`` after the previous step."""
            if self.previous is None:
                return set()
            return {
                x.attempt_id
                for rv in self.previous.runs.values()
                for x in rv.leases
                if x.status is LeaseStatus.LEASED
            }

        def run_of(self, attempt_id: str) -> str:
            return self.fences[attempt_id][0].run_id

        def check_times(self, value: int | None, now: int, later: int) -> None:
            assert value is not None and now <= value <= later, (value, now, later)

        # --- effects of accepted items ------------------------------------------------------

        def check_effect(self, outcome: str, command: str, fence: LeaseFence, caller: str,
                         before: StoreView, after: StoreView, now: int, later: int,
                         expires_at: int | None = None) -> None:
            """The exact rows and the one event an accepted item changed."""
            rb = before.runs[self.run_of(fence.attempt_id)]
            ra = after.runs[rb.run.id]
            attempt_b, attempt_a = _attempt(rb, fence.attempt_id), _attempt(ra, fence.attempt_id)
            others_b = [a for a in rb.attempts if a.id != fence.attempt_id]
            assert [a for a in ra.attempts if a.id != fence.attempt_id] == others_b
            lease_b = _lease(rb, fence.generation)
            lease_a = _lease(ra, fence.generation)
            other_leases = [x for x in rb.leases if x.generation != fence.generation]
            assert [x for x in ra.leases if x.generation != fence.generation] == other_leases
            _count(f"effect:{command}:{outcome}")
            if outcome in ("already_completed", "cancelled"):
                assert ra == rb
                return
            if outcome == "recorded":
                _only_evidence_added(before, after, rb.run.id)
                _one_report_added(before, after, fence.attempt_id, EvidenceKind.WORKER_ABANDONED)
                return
            assert lease_b is not None and lease_a is not None
            if outcome == "renewed":
                assert ra.run == rb.run and ra.attempts == rb.attempts
                assert ra.events == rb.events, "a renewal writes no event"
                assert lease_a == evolve(lease_b, expires_at_ms=lease_a.expires_at_ms)
                assert lease_a.expires_at_ms == expires_at
                low = max(lease_b.expires_at_ms, now + lease_ttl_ms)
                high = max(lease_b.expires_at_ms, later + lease_ttl_ms)
                assert low <= lease_a.expires_at_ms <= high, (lease_b, lease_a, now, later)
                return
            released_at = lease_a.released_at_ms
            self.check_times(released_at, now, later)
            if outcome == "failed":
                check_failure_effect(rb, ra, attempt_b, attempt_a, lease_b, released_at,
                                     command == "complete_timeout")
                reason = ReleaseReason.COMPLETED
            elif outcome == "succeeded":
                assert ra.run == evolve(
                    rb.run,
                    status=RunStatus.SUCCEEDED,
                    output={"ok": True},
                    error=None,
                    updated_at_ms=released_at,
                )
                assert attempt_a == evolve(
                    attempt_b,
                    status=AttemptStatus.SUCCEEDED,
                    lease_version=lease_b.version + 1,
                    finished_at_ms=released_at,
                    error=None,
                    updated_at_ms=released_at,
                )
                reason = ReleaseReason.COMPLETED
                _one_event(rb, ra, EventType.ATTEMPT_SUCCEEDED, fence.attempt_id)
            elif outcome == "released":
                assert ra.run == evolve(rb.run, status=RunStatus.QUEUED, updated_at_ms=released_at)
                assert attempt_a == evolve(
                    attempt_b,
                    status=AttemptStatus.CLAIMED,
                    session_id=None,
                    worker_id=None,
                    lease_generation=None,
                    lease_version=None,
                    offered_at_ms=None,
                    accepted_at_ms=None,
                    started_at_ms=None,
                    updated_at_ms=released_at,
                )
                assert attempt_a.is_pristine
                reason = ReleaseReason.HANDED_BACK
                data = _one_event(rb, ra, EventType.ATTEMPT_RELEASED, fence.attempt_id)
                assert data["cause"] == ("not_held" if command == "claim" else "not_started")
                assert data["session_id"] == caller
                assert (data["lease_generation"], data["lease_version"]) == (
                    lease_b.generation,
                    lease_b.version + 1,
                )
            else:
                assert outcome == "lost", outcome
                assert ra.run == evolve(rb.run, status=RunStatus.LOST, updated_at_ms=released_at)
                assert attempt_a == evolve(
                    attempt_b,
                    status=AttemptStatus.LOST,
                    lease_version=lease_b.version + 1,
                    lost_evidence=EvidenceKind.WORKER_ABANDONED,
                    finished_at_ms=released_at,
                    updated_at_ms=released_at,
                )
                reason = ReleaseReason.ABANDONED
                data = _one_event(rb, ra, EventType.ATTEMPT_LOST, fence.attempt_id)
                assert data["evidence"] == EvidenceKind.WORKER_ABANDONED.value, data
            assert lease_b.status is LeaseStatus.LEASED
            assert lease_a == evolve(
                lease_b,
                status=LeaseStatus.RELEASED,
                version=lease_b.version + 1,
                release_reason=reason,
                released_at_ms=released_at,
            )

        def check_batch(self, command: str, caller: str,
                        items: list[tuple[Held, LeaseFence]], results: Sequence[ItemResult],
                        before: StoreView, after: StoreView, now: int, later: int) -> set[str]:
            """Every item's result is one the store may give, and each accepted item changed
            exactly its rows; returns the ids of the Runs the items changed."""
            assert [r.attempt_id for r in results] == [f.attempt_id for _, f in items]
            touched: set[str] = set()
            for (_, fence), result in zip(items, results, strict=True):
                got = observed(result)
                allowed = self.allowed(command, caller, fence, before, now, later)
                _count(f"{command}:{got[0]}:{got[1]}:{got[2] or ''}")
                assert got in allowed, (command, fence, got, allowed)
                if got[0] == "ok":
                    run_id = self.run_of(fence.attempt_id)
                    if got[1] not in ("already_completed", "cancelled"):
                        assert run_id not in touched, "two items changed one run"
                        touched.add(run_id)
                    self.check_effect(got[1], command, fence, caller, before, after, now, later,
                                      result.expires_at_ms)
            return touched

        def check_untouched(self, before: StoreView, after: StoreView, touched: set[str],
                            added: Sequence[str] = ()) -> None:
            """Nothing but the ``touched`` Runs changed, and no Run but ``added`` appeared."""
            assert after.runs.keys() == before.runs.keys() | set(added)
            for run_id, rv in before.runs.items():
                if run_id not in touched:
                    assert after.runs[run_id] == rv, f"run {run_id} changed"
            run_of = {a.id: rv.run.id for rv in before.runs.values() for a in rv.attempts}
            for attempt_id, reports in before.reports.items():
                if run_of[attempt_id] not in touched:
                    assert after.reports[attempt_id] == reports

        # --- admission and sessions ---------------------------------------------------------

        @initialize(target=sessions)
        def first_session(self) -> str:
            return self.register("w1", 3, set(TASKS))

        @initialize(target=runs, policy=policies())
        def first_run(self, policy: RetryPolicy | None) -> str:
            return self.admit("a", policy)

        def admit(self, task: str, policy: RetryPolicy | None) -> str:
            (run_id,) = self.admit_many([task], policy)
            return run_id

        @rule(target=runs, tasks=st.lists(st.sampled_from(TASKS), min_size=1, max_size=2),
              policy=policies())
        def admit_runs(self, tasks: list[str], policy: RetryPolicy | None) -> Any:
            return multiple(*self.admit_many(tasks, policy))

        def admit_many(self, tasks: list[str], policy: RetryPolicy | None,
                       timeout_ms: int | None = None,
                       priorities: Sequence[int] | None = None) -> list[str]:
            before = self.current()
            chosen = list(priorities) if priorities is not None else [0] * len(tasks)
            run_ids = self.admission.submit_many(
                [AdmissionRequest(task=task, input={"task": task}, policy=policy,
                                  timeout_ms=timeout_ms, priority=priority)
                 for task, priority in zip(tasks, chosen, strict=True)]
            )
            after = self.view()
            for run_id, task, priority in zip(run_ids, tasks, chosen, strict=True):
                run = after.runs[run_id]
                assert (
                    run.run.status, run.run.task, run.run.policy, run.run.timeout_ms,
                    run.run.priority,
                ) == (
                    RunStatus.QUEUED, task, policy, timeout_ms, priority
                )
                assert len(run.attempts) == 1 and run.attempts[0].is_pristine
                assert [e[1] for e in run.events] == [EventType.RUN_ADMITTED.value]
            self.check_untouched(before, after, set(), added=run_ids)
            return run_ids

        @rule(
            target=sessions,
            worker=st.sampled_from(WORKERS),
            capacity=st.integers(1, 3),
            tasks=st.sets(st.sampled_from(TASKS), min_size=1),
        )
        def register(self, worker: str, capacity: int, tasks: set[str]) -> str:
            before = self.current()
            grant = self.workers.register(worker, capacity, sorted(tasks))
            expected = {
                s
                for s, w in self.worker_of.items()
                if w == worker and before.sessions[s].status in OPEN
            }
            assert set(grant.replaced_session_ids) == expected
            self.secrets[grant.session_id] = grant.secret
            self.worker_of[grant.session_id] = worker
            after = self.view()
            session = after.sessions[grant.session_id]
            assert session.status is SessionStatus.ACTIVE
            assert (session.capacity, tuple(session.tasks)) == (capacity, tuple(sorted(tasks)))
            for old in expected:
                assert after.sessions[old].status is SessionStatus.REPLACED
            assert after.runs == before.runs
            return grant.session_id

        @rule(session=sessions, action=st.sampled_from(["poll", "poll", "drain", "close"]))
        def session_command(self, session: str, action: str) -> None:
            """A heartbeat, a drain or a close; a gone session's command is refused."""
            before = self.current()
            status = before.sessions[session].status
            command = {"poll": self.workers.poll, "drain": self.workers.drain,
                       "close": self.workers.close}[action]
            if status not in OPEN:
                try:
                    command(session, self.secrets[session])
                except SessionRejected:
                    self.expect_unchanged(before)
                    return
                raise AssertionError(f"{action} of a {status.value} session was taken")
            answer = command(session, self.secrets[session])
            after = self.view()
            state = after.sessions[session]
            if action == "poll":
                assert answer.status is status is state.status
                assert state.last_heartbeat_at_ms == answer.now_ms
            else:
                expected = SessionStatus.DRAINING if action == "drain" else SessionStatus.CLOSED
                assert state.status is expected
            # a closed session's leases stay until recovery takes them
            assert after.runs == before.runs and after.reports == before.reports

        # --- the claim ----------------------------------------------------------------------

        @rule(
            session=sessions,
            pick=st.integers(0, 63),
            limit=st.sampled_from([0, 1, 1, 2, 3, 4]),
            completions=st.lists(st.tuples(PICKS, st.booleans()), max_size=2),
            pool_of=POOLS,
            statement=st.sampled_from(["none", "none", "all", "omit"]),
            omit=st.integers(1, 7),
            other=st.none() | st.integers(0, 63),
        )
        def claim(self, session: str, pick: int, limit: int,
                  completions: list[tuple[tuple[int, bool, str | None], bool]], pool_of: str,
                  statement: str, omit: int, other: int | None) -> None:
            """A claim with a limit, with completions riding along (some stale), and with a
            ``held`` statement: none, all the session holds, or leaving some out (``omit`` as
            a bit mask), sometimes naming an Attempt it does not hold."""
            session = self.mostly_open(session, pick)
            items = self.pick_fences([p for p, _ in completions], session, pool_of)
            done = [(h, f, ok) for (h, f), (_, ok) in zip(items, completions, strict=False)]
            before = self.current()
            held: list[str] | None = None
            if statement != "none":
                leased = _held_by(before, session)
                if statement == "omit":
                    leased = [a for i, a in enumerate(leased) if not omit >> (i % 3) & 1]
                held = leased
                if self.fences and other is not None:
                    held.append(sorted(self.fences)[other % len(self.fences)])
            self.do_claim(session, limit, done, held, before)

        @rule(session=sessions, pick=st.integers(0, 63), succeed=st.booleans(),
              forget=st.sampled_from([0, 0, 0, 1, 2, 5]))
        def worker_loop(self, session: str, pick: int, succeed: bool, forget: int) -> None:
            """The common path: the worker completes everything it holds with its current
            fences, states that it holds nothing else, and asks to fill its slots. Claim
            answers it never received (``forget``, a bit mask over what the session holds) it
            neither completes nor states."""
            session = self.mostly_open(session, pick)
            before = self.current()
            leased = _held_by(before, session)
            completions = []
            for index, attempt_id in enumerate(leased):
                if forget >> (index % 3) & 1:
                    continue
                held = self.fences[attempt_id][-1]
                completions.append((held, held.fence, succeed))
            capacity = before.sessions[session].capacity
            self.do_claim(session, capacity, completions, [], before)

        def do_claim(self, session: str, limit: int,
                     completions: list[tuple[Held, LeaseFence, bool]],
                     held: list[str] | None, before: StoreView) -> None:
            secret = self.secrets[session]
            requests = [
                Completion(
                    fence=fence,
                    succeeded=ok,
                    output={"ok": ok} if ok else None,
                    error=None if ok else "task error",
                )
                for _, fence, ok in completions
            ]
            status = before.sessions[session].status
            now = self.now()
            if status not in OPEN:
                try:
                    self.workers.claim(session, secret, limit=limit, completions=requests,
                                       held=held)
                except SessionRejected:
                    _count("claim:session_gone")
                    self.expect_unchanged(before)
                    return
                raise AssertionError(f"a {status.value} session claimed")
            answer = self.workers.claim(session, secret, limit=limit, completions=requests,
                                        held=held)
            later = self.now()
            after = self.view()
            self.check_claim(session, limit, completions, held, before, after, answer, now,
                             later)

        def check_claim(self, session: str, limit: int,
                        completions: list[tuple[Held, LeaseFence, bool]],
                        held: list[str] | None, before: StoreView, after: StoreView,
                        answer: ClaimAnswer, now: int, later: int) -> None:
            state = before.sessions[session]
            assert answer.status is state.status
            self.check_times(answer.now_ms, now, later)
            assert after.sessions == before.sessions, "a claim changes no session"
            # 1. the completions, decided as complete_many decides them
            items = [(h, f) for h, f, _ in completions]
            touched: set[str] = set()
            for (h, fence, ok), result in zip(completions, answer.completed, strict=True):
                touched |= self.check_batch("complete_ok" if ok else "complete_failed",
                                            session, [(h, fence)], [result], before, after,
                                            now, later)
            assert len(answer.completed) == len(items)
            # 2. what the worker no longer holds: while its lease is live the claim answer
            # never reached the worker, so it is handed back (in id order); once the lease
            # expired the statement is recorded as not-running evidence
            leased = _held_by(before, session)
            not_held: list[str] = []
            if held is not None:
                stated = set(held) | {f.attempt_id for _, f in items}
                not_held = [a for a in leased if a not in stated]
            assert list(answer.released) == [a for a in not_held if a in answer.released], (
                answer.released, leased, held
            )
            for attempt_id in not_held:
                run_id = self.run_of(attempt_id)
                assert run_id not in touched
                touched.add(run_id)
                lease = _locked_lease(before.runs[run_id], _attempt(before.runs[run_id],
                                                                    attempt_id))
                assert lease is not None and lease.status is LeaseStatus.LEASED
                handed_back = attempt_id in answer.released
                live_now, live_later = lease.expires_at_ms > now, lease.expires_at_ms > later
                if live_now == live_later:
                    assert handed_back is live_now, (attempt_id, lease, now)
                else:
                    _count("expiry_raced_clock")
                fence = LeaseFence(attempt_id=attempt_id, generation=lease.generation,
                                   version=lease.version, token="")
                outcome = "released" if handed_back else "recorded"
                self.check_effect(outcome, "claim", fence, session, before, after, now, later)
                _count(f"claim:not_held:{outcome}")
            # 3. the grants
            freed = sum(1 for r in answer.completed if r.ok and r.outcome is not None
                        and r.outcome.value in ("succeeded", "failed"))
            freed += len(answer.released)
            room = min(limit, state.capacity - len(leased) + freed)
            candidates = {
                task: sorted(
                    (rv.attempts[-1] for rv in before.runs.values()
                     if rv.run.task == task and rv.run.status is RunStatus.QUEUED
                     and rv.attempts and rv.attempts[-1].is_pristine),
                    key=lambda a: claim_order(before, a),
                )
                for task in state.tasks
            }
            grants = answer.grants
            # in flight per task once this call's completions and hand-backs are written,
            # before its grants: what the claim balances and limits
            in_flight = Counter(leased_by_task(after))
            in_flight.subtract(Counter(g.task for g in grants))
            takes = {
                task: min(limit, len(queued), self.free_places(task, in_flight[task]))
                for task, queued in candidates.items()
            }
            if limit == 0:
                expected_no_grant = None
            elif state.status is not SessionStatus.ACTIVE:
                expected_no_grant = NoGrant.SESSION_NOT_ACTIVE
            elif not self.gate.open:
                expected_no_grant = NoGrant.GATE_CLOSED
                assert answer.detail == self.gate.reason
            elif room <= 0:
                expected_no_grant = NoGrant.NO_CAPACITY
            else:
                window = sum(takes.values())
                expected_count = min(room, window)
                assert len(grants) == expected_count, (len(grants), room, window)
                expected_no_grant = None if expected_count else NoGrant.NOTHING_QUEUED
            if expected_no_grant is not None or limit == 0:
                assert grants == ()
            assert answer.no_grant is expected_no_grant, (answer.no_grant, expected_no_grant)
            _count(f"claim:no_grant:{expected_no_grant.value if expected_no_grant else ''}")
            if grants:
                self.check_fair(grants, candidates, takes, in_flight, before)
            for grant in grants:
                assert grant.run_id not in touched
                touched.add(grant.run_id)
                self.check_granted(grant, session, before, after, now, later)
                self.fences.setdefault(grant.attempt_id, []).append(
                    Held(run_id=grant.run_id, session_id=session, fence=grant.fence)
                )
                self.ever_claimed[grant.run_id].add(grant.attempt_id)
                _count("claim:granted")
            self.check_untouched(before, after, touched)

        def check_fair(self, grants: Sequence[Any], candidates: dict[str, list[Attempt]],
                       takes: dict[str, int], in_flight: Counter[str],
                       before: StoreView) -> None:
            """Within a task the highest priority, then the oldest queued Attempts are taken
            (ADR 0014); across tasks each grant goes to the task with the fewest Attempts in
            flight (ADR 0003), never past a task's limit."""
            granted = {g.attempt_id for g in grants}
            picks: dict[str, int] = defaultdict(int)
            for task, queued in candidates.items():
                mine = [a for a in queued if a.id in granted]
                rest = [a for a in queued if a.id not in granted]
                picks[task] = len(mine)
                assert picks[task] <= takes[task], ("past the limit", task, picks[task])
                if mine and rest:
                    assert max(claim_order(before, a) for a in mine) <= min(
                        claim_order(before, a) for a in rest
                    ), "a later attempt (priority, age) was claimed before an earlier one"
            assert sum(picks.values()) == len(grants)
            for served, count in picks.items():
                if not count:
                    continue
                for starved in candidates:
                    if picks[starved] < takes[starved]:
                        assert in_flight[served] + count - 1 <= (
                            in_flight[starved] + picks[starved]
                        ), ("unfair", dict(picks), dict(in_flight))

        def check_granted(self, grant: Any, session: str, before: StoreView,
                          after: StoreView, now: int, later: int) -> None:
            """A claim's grant: Run queued -> running, the pristine Attempt running under a new
            lease bound to the token the answer carries, one ``attempt_started`` event."""
            rb, ra = before.runs[grant.run_id], after.runs[grant.run_id]
            attempt_b = rb.attempts[-1]
            assert attempt_b.id == grant.attempt_id and attempt_b.is_pristine
            assert rb.run.status is RunStatus.QUEUED
            previous = max((x.generation for x in rb.leases), default=0)
            assert (grant.generation, grant.version) == (previous + 1, 1)
            assert grant.attempt_number == attempt_b.number
            assert (grant.task, grant.input, grant.idempotency_key) == (
                rb.run.task, rb.run.input, rb.run.id
            )
            assert grant.fence == LeaseFence(attempt_id=grant.attempt_id,
                                             generation=grant.generation, version=1,
                                             token=grant.token)
            lease = _lease(ra, grant.generation)
            assert lease is not None and list(ra.leases) == [*rb.leases, lease]
            at = lease.granted_at_ms
            self.check_times(at, now, later)
            state = before.sessions[session]
            assert lease == DispatchLease(
                run_id=grant.run_id,
                attempt_id=grant.attempt_id,
                generation=grant.generation,
                version=1,
                status=LeaseStatus.LEASED,
                holder_session_id=session,
                token_hash=hash_token(grant.token),
                expires_at_ms=at + lease_ttl_ms,
                granted_at_ms=at,
            )
            assert grant.expires_at_ms == lease.expires_at_ms
            assert ra.run == evolve(rb.run, status=RunStatus.RUNNING, updated_at_ms=at)
            assert list(ra.attempts[:-1]) == list(rb.attempts[:-1])
            assert ra.attempts[-1] == evolve(
                attempt_b,
                status=AttemptStatus.RUNNING,
                session_id=session,
                worker_id=state.worker_id,
                lease_generation=grant.generation,
                lease_version=1,
                offered_at_ms=at,
                accepted_at_ms=at,
                started_at_ms=at,
                updated_at_ms=at,
            )
            data = _one_event(rb, ra, EventType.ATTEMPT_STARTED, grant.attempt_id)
            assert data == {"session_id": session, "worker_id": state.worker_id,
                            "generation": grant.generation}

        # --- the fenced batches -------------------------------------------------------------

        @precondition(lambda self: bool(self.fences))
        @rule(first=st.integers(0, 63), caller=CALLERS, picks=BATCH, pool_of=POOLS)
        def renew_batch(self, first: int, caller: int | None, picks: Picks, pool_of: str) -> None:
            self.fenced_batch("renew", first, caller, picks, pool_of)

        @precondition(lambda self: bool(self.fences))
        @rule(first=st.integers(0, 63), caller=CALLERS, picks=BATCH, pool_of=POOLS,
              succeed=st.booleans())
        def complete_batch(self, first: int, caller: int | None, picks: Picks, pool_of: str,
                           succeed: bool) -> None:
            command = "complete_ok" if succeed else "complete_failed"
            self.fenced_batch(command, first, caller, picks, pool_of)

        @precondition(lambda self: bool(self.fences))
        @rule(first=st.integers(0, 63), caller=CALLERS, picks=BATCH, pool_of=POOLS)
        def release_batch(self, first: int, caller: int | None, picks: Picks,
                          pool_of: str) -> None:
            self.fenced_batch("release", first, caller, picks, pool_of)

        @precondition(lambda self: bool(self.fences))
        @rule(first=st.integers(0, 63), caller=CALLERS, picks=BATCH, pool_of=POOLS)
        def abandon_batch(self, first: int, caller: int | None, picks: Picks,
                          pool_of: str) -> None:
            self.fenced_batch("abandon", first, caller, picks, pool_of)

        # --- retry on error and execution timeouts (ADR 0013) -------------------------------

        @rule(target=runs, tasks=st.lists(st.sampled_from(TASKS), min_size=1, max_size=2),
              policy=error_policies() | policies(), timeout=TIMEOUTS)
        def admit_retried_runs(self, tasks: list[str], policy: RetryPolicy | None,
                               timeout: int | None) -> Any:
            """Runs that retry on error, some with an execution timeout."""
            return multiple(*self.admit_many(tasks, policy, timeout_ms=timeout))

        @precondition(lambda self: bool(self.fences))
        @rule(first=st.integers(0, 63), caller=CALLERS, picks=BATCH, pool_of=POOLS,
              timed_out=st.booleans())
        def task_failures(self, first: int, caller: int | None, picks: Picks, pool_of: str,
                          timed_out: bool) -> None:
            """Workers report their tasks raised, or ran past their timeout and were stopped."""
            command = "complete_timeout" if timed_out else "complete_failed"
            self.fenced_batch(command, first, caller, picks, pool_of)

        def fenced_batch(self, command: str, first: int, caller: int | None, picks: Picks,
                         pool_of: str) -> None:
            """A batch of up to three items through one session: the holder of a live lease
            (``caller`` None), or any session, whose items are then mostly another's."""
            live = sorted(self.live_attempts()) or sorted(self.fences)
            session = self.fences[live[first % len(live)]][-1].session_id
            if caller is not None:
                sessions = sorted(self.secrets)
                session = sessions[caller % len(sessions)]
            self.do_batch(command, session, self.pick_fences(picks, session, pool_of))

        def do_batch(self, command: str, caller: str,
                     items: list[tuple[Held, LeaseFence]]) -> None:
            secret = self.secrets[caller]
            fences = [fence for _, fence in items]
            before = self.current()
            now = self.now()

            def call() -> BatchAnswer:
                w = self.workers
                if command == "renew":
                    return w.renew_many(caller, secret, fences)
                if command.startswith("complete"):
                    ok = command == "complete_ok"
                    return w.complete_many(caller, secret, [
                        Completion(fence=f, succeeded=ok, output={"ok": ok} if ok else None,
                                   error=None if ok else "task error",
                                   timed_out=command == "complete_timeout") for f in fences])
                if command == "release":
                    return w.release_many(caller, secret, [Release(fence=f) for f in fences])
                return w.abandon_many(caller, secret,
                                      [Abandonment(fence=f, detail="stopping") for f in fences])

            gone = before.sessions[caller].status not in OPEN
            if gone and command != "abandon":
                try:
                    call()
                except SessionRejected:
                    _count(f"{command}:session_gone")
                    self.expect_unchanged(before)
                    return
                raise AssertionError(f"{command} of a gone session was taken")
            answer = call()
            later = self.now()
            after = self.view()
            self.check_times(answer.now_ms, now, later)
            assert after.sessions == before.sessions
            touched = self.check_batch(command, caller, items, answer.results, before, after,
                                       now, later)
            self.check_untouched(before, after, touched)

        # --- the dispatch gate --------------------------------------------------------------

        @rule(reason=st.sampled_from([None, None, *GATE_REASONS]))
        def gate(self, reason: str | None) -> None:
            """Close the dispatch gate as the cluster coordinator does when recovery or lost
            retry fails (``reason``), or open it as step 5 of the cadence alone does."""
            before = self.current()
            if reason is None:
                was_open = self.gate.open
                report = self.gate_step.run_once()
                assert report.opened == (0 if was_open else 1)
                gate = self.store.dispatch_gate()
                assert gate.open and gate.reason is None
            else:
                with self.store.unit_of_work() as uow:
                    at = uow.now_ms()
                    uow.gate.set(DispatchGate(open=False, reason=reason, changed_at_ms=at))
                    uow.commit()
                gate = self.store.dispatch_gate()
                assert gate == DispatchGate(open=False, reason=reason, changed_at_ms=at)
            self.gate = gate
            self.expect_unchanged(before)

        # --- operators and the cadence ------------------------------------------------------

        @rule(run=runs, action=st.sampled_from(["attest", "attest", "cancel"]))
        def operator(self, run: str, action: str) -> None:
            """An operator attests the Run's Attempt stopped, or cancels the Run."""
            before = self.current()
            if run in self.pruned:
                self.operator_on_pruned(run, before)
                return
            attempt = before.runs[run].attempts[-1]
            terminal = (attempt.status if action == "attest" else before.runs[run].run.status)
            if terminal.is_terminal:
                try:
                    if action == "attest":
                        self.workers.attest_stopped(attempt.id, "operator checked the host")
                    else:
                        self.admission.cancel(run)
                except InvalidTransition:
                    self.expect_unchanged(before)
                    return
                raise AssertionError(f"{action} of a terminal {run} was taken")
            if action == "attest":
                self.workers.attest_stopped(attempt.id, "operator checked the host")
                after = self.view()
                _one_report_added(before, after, attempt.id, EvidenceKind.OPERATOR_ATTESTED)
                _only_evidence_added(before, after, run)
            else:
                self.admission.cancel(run)
                after = self.view()
                view = after.runs[run]
                assert view.run.status is RunStatus.CANCELLED
                assert not any(x.status is LeaseStatus.LEASED for x in view.leases)
                _one_event(before.runs[run], view, EventType.RUN_CANCELLED, view.attempts[-1].id)
            self.check_untouched(before, after, {run})

        @rule(ms=st.sampled_from([1, 200, 1_000, 3_000, lease_ttl_ms + 1, 4 * lease_ttl_ms]))
        def advance_clock(self, ms: int) -> None:
            before = self.now()
            self._advance(ms)
            # A fake clock moves by exactly ``ms``; a real database clock also moves on its own
            # between the two reads, by far less than CLOCK_SLACK_MS.
            assert before + ms <= self.now() < before + ms + CLOCK_SLACK_MS

        @rule(ms=st.sampled_from([0, 0, lease_ttl_ms + 1, 2 * lease_ttl_ms]))
        def cluster_cycle(self, ms: int) -> None:
            """The cadence runs, at once or after the workers went quiet past their lease."""
            if ms:
                self.advance_clock(ms)
            was, now = self.gate, self.now()
            summary = self.coordinator.run_cycle()
            later = self.now()
            assert summary.ok, summary.as_dict()
            assert [s.name for s in summary.steps] == list(ClusterSchedulerCoordinator.STEP_NAMES)
            step = summary.step("task_attempt_admission")
            assert step is not None
            opened = step.counts.get("gate_opened")
            # Step 5 opens a closed gate only if it closed before the cycle began, which was
            # between ``now`` and ``later`` (the same instant on a fake clock), ADR 0007.
            if was.open:
                assert opened == 0
            elif was.changed_at_ms is None or was.changed_at_ms < now:
                assert opened == 1
            elif was.changed_at_ms >= later:
                assert opened == 0
            self.gate = self.store.dispatch_gate()
            if opened:
                assert self.gate.open and self.gate.reason is None, self.gate
            else:
                assert self.gate == was, "a close since the cycle began is kept"

        @rule(coin=st.integers(0, 3))
        def restart(self, coin: int) -> None:
            if coin:  # a node restarts now and then
                return
            report = self.startup.run()
            assert report.orphans_queued == 0  # admission never leaves created orphans

        # --- pruning finished history (ADR 0016) ---------------------------------------------

        @rule(
            age=st.sampled_from([0, 0, 1_000, lease_ttl_ms, 10 * lease_ttl_ms]),
            batch=st.integers(1, 3),
            dry_run=st.booleans(),
        )
        def prune(self, age: int, batch: int, dry_run: bool) -> None:
            """An operator prunes (or, dry, counts) finished history: exactly the finished Runs
            last changed before the cutoff go, with every row of theirs, in batches of at most
            ``batch`` Runs; nothing else changes. A late worker's fence of a pruned Attempt is
            then refused as unknown, and changes nothing."""
            before = self.current()
            now = self.now()
            report = HistoryPruning(self.store.unit_of_work).prune(  # type: ignore[arg-type]
                age, dry_run=dry_run, batch_size=batch
            )
            later = self.now()
            after = self.view()
            cutoff = report.finished_before_ms
            assert now - age <= cutoff <= later - age, (now, cutoff, later)
            expected = sorted(
                run_id
                for run_id, rv in before.runs.items()
                if rv.run.status.is_terminal and rv.run.updated_at_ms < cutoff
            )
            gone = [before.runs[run_id] for run_id in expected]
            assert report.removed == PrunedRows(
                runs=len(gone),
                attempts=sum(len(rv.attempts) for rv in gone),
                leases=sum(len(rv.leases) for rv in gone),
                events=sum(len(rv.events) for rv in gone),
                stop_reports=sum(len(before.reports[a.id]) for rv in gone for a in rv.attempts),
            )
            assert sum(report.batch_runs) == len(gone)
            assert all(1 <= n <= batch for n in report.batch_runs)
            _count(f"prune:{'dry' if dry_run else 'deleted'}:{min(len(gone), 3)}")
            removed = set() if dry_run else set(expected)
            assert after.runs.keys() == before.runs.keys() - removed
            for run_id, rv in after.runs.items():
                assert rv == before.runs[run_id], f"prune changed run {run_id}"
            pruned_attempts = sorted(a.id for r in removed for a in before.runs[r].attempts)
            with self.store.unit_of_work() as uow:
                for attempt_id in pruned_attempts:
                    assert uow.evidence.reports_for(attempt_id) == ()
            self.pruned |= removed
            self.late_fences_of_pruned(pruned_attempts, after)
            for attempt_id in pruned_attempts:
                self.fences.pop(attempt_id, None)
            self.previous = None  # the invariants read the store afresh

        def late_fences_of_pruned(self, attempt_ids: list[str], before: StoreView) -> None:
            held = [self.fences[a][-1] for a in attempt_ids[:2] if a in self.fences]
            callers = [s for s, v in before.sessions.items() if v.status is SessionStatus.ACTIVE]
            if not held or not callers:
                return
            caller = callers[0]
            done = [
                Completion(fence=h.fence, succeeded=True, output={"ok": True}) for h in held
            ]
            answer = self.workers.complete_many(caller, self.secrets[caller], done)
            assert [observed(r)[:2] for r in answer.results] == [
                ("rejected", "unknown_attempt")
            ] * len(held)
            _count("prune:late_fence_refused")
            self.expect_unchanged(before)

        def operator_on_pruned(self, run: str, before: StoreView) -> None:
            """An operator's command on a pruned Run finds no Run and changes nothing."""
            try:
                self.admission.cancel(run)
            except UnknownRun:
                _count("prune:operator_unknown_run")
                self.expect_unchanged(before)
                return
            raise AssertionError(f"cancel of the pruned run {run} was taken")

        # === delayed and unique submissions (ADR 0015) =============================
        #
        # A delayed run waits in retry_wait without an Attempt until the store's clock reaches
        # its due time; the cadence's lost-retry step then makes its Attempt 1. A unique key
        # held by an unfinished run answers with that run and writes nothing.

        def unfinished_holder(self, view: StoreView, key: str) -> str | None:
            holders = [
                run_id for run_id, rv in view.runs.items()
                if rv.run.unique_key == key and not rv.run.status.is_terminal
            ]
            assert len(holders) <= 1, (key, holders)
            return holders[0] if holders else None

        def submit_keyed_or_delayed(
            self, task: str, policy: RetryPolicy | None, key: str | None, delay_ms: int | None
        ) -> tuple[str, bool]:
            before = self.current()
            holder = self.unfinished_holder(before, key) if key is not None else None
            now = self.now()
            [answer] = self.admission.admit_many(
                [AdmissionRequest(task=task, input={"task": task}, policy=policy,
                                  unique_key=key, delay_ms=delay_ms)]
            )
            if holder is not None:
                STATS["unique_key_held"] += 1
                assert (answer.run_id, answer.existing) == (holder, True)
                self.expect_unchanged(before)  # no run, no attempt, no event
                return answer.run_id, False
            assert not answer.existing
            after = self.view()
            rv = after.runs[answer.run_id]
            assert (rv.run.task, rv.run.policy, rv.run.unique_key) == (task, policy, key)
            if delay_ms:
                assert rv.run.status is RunStatus.RETRY_WAIT and rv.attempts == ()
                assert rv.run.next_attempt_at_ms == rv.run.created_at_ms + delay_ms
                self.check_times(rv.run.created_at_ms, now, self.now())
                assert [(e[1], e[2], e[3]) for e in rv.events] == [
                    (EventType.RUN_ADMITTED.value, None,
                     {"task": task, "run_after_ms": rv.run.next_attempt_at_ms}),
                ]
            else:
                assert rv.run.status is RunStatus.QUEUED and len(rv.attempts) == 1
                assert [e[1] for e in rv.events] == [EventType.RUN_ADMITTED.value]
            self.check_untouched(before, after, set(), added=[answer.run_id])
            return answer.run_id, True

        @rule(target=delayed, task=st.sampled_from(TASKS), policy=policies(),
              delay_ms=st.sampled_from([1, 1_000, 3_000, 2 * lease_ttl_ms]),
              key=st.sampled_from([None, None, "k1", "k2"]))
        def admit_delayed(self, task: str, policy: RetryPolicy | None, delay_ms: int,
                          key: str | None) -> Any:
            run_id, new = self.submit_keyed_or_delayed(task, policy, key, delay_ms)
            return run_id if new else multiple()

        @rule(target=runs, task=st.sampled_from(TASKS), policy=policies(),
              key=st.sampled_from(["k1", "k1", "k2"]))
        def admit_unique(self, task: str, policy: RetryPolicy | None, key: str) -> Any:
            run_id, new = self.submit_keyed_or_delayed(task, policy, key, None)
            return run_id if new else multiple()

        @rule(run=delayed)
        def cancel_delayed(self, run: str) -> None:
            """Cancel a delayed run: at once, whatever it is doing, unless it finished (refused,
            nothing changes) or was pruned (unknown, nothing changes)."""
            before = self.current()
            if run in self.pruned:
                self.operator_on_pruned(run, before)
                return
            status = before.runs[run].run.status
            try:
                was = self.admission.cancel(run, "not needed")
            except InvalidTransition:
                assert status.is_terminal, status
                self.expect_unchanged(before)
                return
            assert was is status and not status.is_terminal, (was, status)
            STATS[f"cancel_delayed:{status.value}"] += 1
            after = self.view()
            rv = after.runs[run]
            assert rv.run.status is RunStatus.CANCELLED
            attempt_id = rv.attempts[-1].id if rv.attempts else None
            _one_event(before.runs[run], rv, EventType.RUN_CANCELLED, attempt_id)
            self.check_untouched(before, after, {run})

        def delayed_and_unique_invariants(self, view: StoreView) -> None:
            keys = Counter(
                rv.run.unique_key for rv in view.runs.values()
                if rv.run.unique_key is not None and not rv.run.status.is_terminal
            )
            # at most one unfinished run per unique key
            assert all(count == 1 for count in keys.values()), keys
            for rv in view.runs.values():
                if not _admitted_delayed(rv):
                    continue
                STATS[f"delayed_seen:{rv.run.status.value}"] += 1
                due = rv.events[0][3]["run_after_ms"]
                assert isinstance(due, int)
                if not rv.attempts:
                    # never queued: still waiting for its time, or cancelled while it waited
                    assert rv.run.status in (RunStatus.RETRY_WAIT, RunStatus.CANCELLED)
                    assert not self.ever_claimed[rv.run.id]
                else:
                    # its Attempt 1 was made no earlier than its due time
                    assert rv.attempts[0].created_at_ms >= due, (rv.attempts[0], due)
        # --- cancellation (ADR 0017) --------------------------------------------------------
        #
        # A cancel at any point of a Run's life: ``operator`` above cancels any Run of the
        # bundle; ``cancel_running`` cancels a running one, and ``told_cancelled`` plays its
        # worker's next calls. ``cancelled_at`` keeps, per cancelled Run, the Attempts ever
        # claimed when it was cancelled: the invariants check that none is claimed after.

        @precondition(lambda self: self.running_runs())
        @rule(pick=st.integers(0, 63))
        def cancel_running(self, pick: int) -> None:
            """An operator cancels a running Run: the Run and its Attempt are cancelled at
            once, the lease released for ``cancelled`` one version up, one event."""
            running = self.running_runs()
            run_id = running[pick % len(running)]
            before = self.current()
            rb = before.runs[run_id]
            attempt_b = rb.attempts[-1]
            lease_b = _locked_lease(rb, attempt_b)
            was = self.admission.cancel(run_id, "operator cancelled")
            after = self.view()
            ra = after.runs[run_id]
            assert was is rb.run.status is RunStatus.RUNNING
            assert ra.run.status is RunStatus.CANCELLED and ra.run.error == "operator cancelled"
            attempt_a = _attempt(ra, attempt_b.id)
            assert attempt_a.status is AttemptStatus.CANCELLED
            if lease_b is not None and lease_b.status is LeaseStatus.LEASED:
                lease_a = _lease(ra, lease_b.generation)
                assert lease_a is not None
                assert (lease_a.status, lease_a.release_reason, lease_a.version) == (
                    LeaseStatus.RELEASED,
                    ReleaseReason.CANCELLED,
                    lease_b.version + 1,
                )
                assert attempt_a.lease_version == lease_a.version
            data = _one_event(rb, ra, EventType.RUN_CANCELLED, attempt_b.id)
            assert data == {"reason": "operator cancelled", "previous_status": "running"}
            self.check_untouched(before, after, {run_id})
            _count("cancel:running")

        @precondition(lambda self: self.told_candidates())
        @rule(pick=st.integers(0, 63), report=st.sampled_from(["abandon", "release"]))
        def told_cancelled(self, pick: int, report: str) -> None:
            """The worker of a cancelled Attempt renews and completes as it would: both are
            refused as ``cancelled``; its stop report (an abandon, or a hand-back when the task
            never began) is taken as ``cancelled``. Nothing changes."""
            candidates = self.told_candidates()
            held = candidates[pick % len(candidates)]
            before = self.current()
            secret = self.secrets[held.session_id]
            fence = held.fence
            renewed = self.workers.renew_many(held.session_id, secret, [fence]).results
            completion = Completion(fence=fence, succeeded=True, output={"ok": True})
            completed = self.workers.complete_many(held.session_id, secret, [completion]).results
            for (result,) in (renewed, completed):
                assert (result.rejection, result.reason) == (
                    Rejection.FENCE,
                    FenceReason.CANCELLED.value,
                ), result
            if report == "abandon":
                stop = [Abandonment(fence=fence, detail="its run was cancelled")]
                (result,) = self.workers.abandon_many(held.session_id, secret, stop).results
            else:
                gone = [Release(fence=fence, cause="cancelled")]
                (result,) = self.workers.release_many(held.session_id, secret, gone).results
            assert result.outcome is BatchOutcome.CANCELLED, result
            self.expect_unchanged(before)
            _count(f"cancel:told:{report}")

        def running_runs(self) -> list[str]:
            if self.previous is None:
                return []
            return sorted(
                run_id
                for run_id, rv in self.previous.runs.items()
                if rv.run.status is RunStatus.RUNNING
            )

        def told_candidates(self) -> list[Held]:
            """The current grants of Attempts cancelled under a lease, whose session is open."""
            if self.previous is None:
                return []
            found = []
            for attempt_id, grants in sorted(self.fences.items()):
                held = grants[-1]
                rv = self.previous.runs[self.run_of(attempt_id)]
                lease = _lease(rv, held.fence.generation)
                session = self.previous.sessions.get(held.session_id)
                if (
                    lease is not None
                    and _cancelled(lease)
                    and session is not None
                    and session.status in OPEN
                ):
                    found.append(held)
            return found

        # --- invariants ---------------------------------------------------------------------

        @invariant()
        def design_invariants(self) -> None:
            STATS["steps"] += 1
            view = self.view()
            for rv in view.runs.values():
                STATS[f"run_seen:{rv.run.status.value}"] += 1
            STATS["max_attempts_seen"] = max(
                [STATS["max_attempts_seen"], *(len(rv.attempts) for rv in view.runs.values())]
            )
            assert self.store.dispatch_gate() == self.gate
            previous = self.previous
            leased_by_session: dict[str, int] = defaultdict(int)
            for run_id, rv in view.runs.items():
                run, attempts, leases = rv.run, rv.attempts, rv.leases
                # attempt numbers contiguous 1..N
                assert [a.number for a in attempts] == list(range(1, len(attempts) + 1))
                assert run.attempt_count == len(attempts)
                # at most one non-terminal attempt, the latest
                live = [a for a in attempts if not a.status.is_terminal]
                assert len(live) <= 1
                if live:
                    assert live[0] is attempts[-1]
                # at most one leased lease, belonging to the current non-terminal attempt
                leased = [x for x in leases if x.status is LeaseStatus.LEASED]
                assert len(leased) <= 1
                for lease in leased:
                    assert live and lease.attempt_id == live[0].id
                    assert live[0].lease_generation == lease.generation
                    assert live[0].status is AttemptStatus.RUNNING
                    assert live[0].session_id == lease.holder_session_id
                    leased_by_session[lease.holder_session_id] += 1
                # generations are 1..N, one lease row each
                assert [x.generation for x in leases] == list(range(1, len(leases) + 1))
                # a queued run's attempt is pristine, and only a queued run has a pristine one
                pristine = bool(attempts) and attempts[-1].is_pristine
                assert pristine == (run.status is RunStatus.QUEUED), (run, attempts)
                for attempt in attempts:
                    # a finished attempt holds no leased lease
                    if attempt.status in TERMINAL_ATTEMPT_STATUSES:
                        assert not any(x.attempt_id == attempt.id for x in leased)
                    # an Attempt without a lease generation holds no leased lease
                    if attempt.lease_generation is None:
                        assert not any(x.attempt_id == attempt.id for x in leased)
                # a handed-back lease's Attempt no longer holds it: after the release the
                # Attempt is pristine, or a later claim gave it a newer generation
                for lease in leases:
                    if lease.release_reason is ReleaseReason.HANDED_BACK:
                        holder = _attempt(rv, lease.attempt_id)
                        assert (holder.lease_generation or 0) != lease.generation
                        assert holder.lease_generation is None or (
                            holder.lease_generation > lease.generation
                        )
                # a released attempt is pristine and its run queued
                if rv.events and rv.events[-1][1] == EventType.ATTEMPT_RELEASED.value:
                    assert run.status is RunStatus.QUEUED
                    assert attempts[-1].id == rv.events[-1][2] and attempts[-1].is_pristine
                # a started attempt that became lost has evidence in its event
                for attempt in attempts:
                    if attempt.status is AttemptStatus.LOST and attempt.started_at_ms is not None:
                        lost = [
                            e for e in rv.events if e[1] == "attempt_lost" and e[2] == attempt.id
                        ]
                        assert len(lost) == 1 and "evidence" in lost[0][3], lost
                        assert attempt.lost_evidence is not None
                # retry_wait only for declared-safe policies with attempts left (or delayed,
                # before its first Attempt)
                if run.status is RunStatus.RETRY_WAIT and run.attempt_count:
                    policy = run.policy
                    assert retry_safe(policy)
                    assert policy is not None and run.attempt_count < policy.max_attempts
                if run.status is RunStatus.RETRY_WAIT:
                    assert run.next_attempt_at_ms is not None
                # lease versions never go down
                for lease in leases:
                    key = (run_id, lease.generation)
                    assert lease.version >= self.max_version.get(key, 0)
                    self.max_version[key] = lease.version
                # every change writes exactly one event: the stream replays to the state, each
                # event a change, and a step that changed a run appended to its stream
                status, replayed = _replay(rv.events)
                assert status is run.status
                assert replayed == {a.id: (a.status, a.is_pristine) for a in attempts}
                old = previous.runs.get(run_id) if previous else None
                if old is not None:
                    new_events = len(rv.events) - len(old.events)
                    assert rv.events[: len(old.events)] == old.events  # append-only
                    reported = any(
                        len(view.reports.get(a.id, ())) != len(previous.reports.get(a.id, ()))
                        for a in attempts
                    )
                    changed = _without_expiry(rv) != _without_expiry(old) or reported
                    assert changed == (new_events > 0), (run_id, new_events)
                    # terminal runs stay terminal, and nothing of them changes
                    if old.run.status.is_terminal:
                        assert _without_expiry(rv) == _without_expiry(old)
                        assert rv.events == old.events
                elif previous is not None:
                    assert rv.events[0][1] == "run_admitted"
                # an unsafe run is never executed by two attempts; every claim started one
                for attempt in attempts:
                    if attempt.started_at_ms is not None:
                        assert attempt.id in self.ever_claimed[run_id], "started unclaimed"
                claimed = self.ever_claimed[run_id]
                assert claimed <= {a.id for a in attempts}
                # a cancelled run never runs again: no Attempt claimed, none open, none leased
                if run.status is RunStatus.CANCELLED:
                    frozen_claims = self.cancelled_at.setdefault(run_id, frozenset(claimed))
                    assert claimed == frozen_claims, "a cancelled run was claimed again"
                    assert not live and not leased
                    assert rv.events[-1][1] == EventType.RUN_CANCELLED.value
                if not retry_safe(run.policy):
                    assert len(claimed) <= 1
                    assert len(attempts) == 1 or (not attempts and _admitted_delayed(rv))
                check_retry_causes(rv)
            # a session never holds more leased leases than its capacity
            for session_id, count in leased_by_session.items():
                assert count <= view.sessions[session_id].capacity, (session_id, count)
            for session_id in view.sessions:
                assert _held_by(view, session_id) == sorted(self.held_by(session_id))
            self.delayed_and_unique_invariants(view)
            self.check_limits(view)
            self.previous = view

        def held_by(self, session_id: str) -> list[str]:
            with self.store.unit_of_work() as uow:
                return list(uow.sessions.held_by(session_id))

        # --- priorities and task limits (ADR 0014) ---------------------------------------

        def free_places(self, task: str, in_flight: int) -> int:
            """How many more of the task a claim may grant: unbounded without a limit."""
            if task not in self.limits:
                return 1 << 30
            return max(0, self.limits[task] - in_flight)

        @rule(target=runs, tasks=st.lists(st.sampled_from(TASKS), min_size=1, max_size=3),
              priorities=st.lists(st.sampled_from([-1, 0, 0, 1, 7]), min_size=3, max_size=3),
              policy=policies())
        def admit_prioritized(self, tasks: list[str], priorities: list[int],
                              policy: RetryPolicy | None) -> Any:
            return multiple(*self.admit_many(tasks, policy, priorities=priorities[: len(tasks)]))

        @rule(task=st.sampled_from(TASKS), limit=st.sampled_from([0, 1, 1, 2, None]))
        def task_limit(self, task: str, limit: int | None) -> None:
            """An operator sets a task's limit (or clears it, None); no Run changes."""
            before = self.current()
            limits = TaskLimits(self.store.unit_of_work)
            if limit is None:
                assert limits.clear(task) is (task in self.limits)
                self.limits.pop(task, None)
                self.over_limit.pop(task, None)
                _count("task_limit:cleared")
            else:
                limits.set(task, limit)
                self.limits[task] = limit
                self.over_limit[task] = leased_by_task(before)[task]
                _count(f"task_limit:{limit}")
            assert {x.task: x.max_running for x in limits.all()} == self.limits
            assert self.view().runs == before.runs

        def check_limits(self, view: StoreView) -> None:
            """Invariant: the leased Attempts of a limited task never exceed its limit, but for
            those already leased when it was lowered, which only finish."""
            leased = leased_by_task(view)
            for task, limit in self.limits.items():
                allowed = max(limit, self.over_limit.get(task, 0))
                assert leased[task] <= allowed, (task, leased[task], limit)
                self.over_limit[task] = min(self.over_limit.get(task, 0), leased[task])
                if leased[task] and leased[task] == limit:
                    _count("task_limit:full")

    return RuntimeMachine
