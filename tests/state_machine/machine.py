"""A reusable Hypothesis state machine for any store that implements the application ports.

``make_machine(store_factory)`` returns a ``RuleBasedStateMachine`` class. ``store_factory()``
must return ``(store, advance_clock)``: a fresh, empty store implementing
:class:`application.ports.RuntimeStore` and a callable that moves the store's clock forward by
a number of milliseconds. The machine drives the real application services (admission, the
worker protocol, dispatch, the cluster coordinator, startup recovery) and keeps a tiny model
beside the store: the sessions and their secrets, the fences each worker holds, the attempts
that ever crossed the start barrier, and the highest lease version seen per (run, generation).
After every step its invariant checks every invariant of DESIGN.md against the store."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attrs import evolve
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from application.admission import Admission
from application.dispatch import TaskAttemptAdmission
from application.lost_retry import LostRetry
from application.ports import RuntimeStore
from application.recovery import RuntimeRecovery
from application.scheduler import (
    ClusterSchedulerCoordinator,
    NoTriggerSchedule,
    NoWorkflowFrontier,
    SchedulerCoordinator,
)
from application.startup import StartupRecovery
from application.worker_commands import WorkerCommands
from domain.errors import (
    DomainError,
    FenceReason,
    FenceRejected,
    InvalidTransition,
    SessionRejected,
)
from domain.events import EventType
from domain.fence import LeaseFence, hash_token
from domain.model import (
    AttemptStatus,
    LeaseStatus,
    ReleaseReason,
    RunStatus,
    SessionStatus,
)
from domain.policy import RETRYABLE_SAFETY, Backoff, RetryPolicy, Safety
from tests.application.support import CountingIdentities, StoreView, store_view

StoreFactory = Callable[[], tuple[RuntimeStore, Callable[[int], Any]]]

LEASE_TTL_MS = 5_000
SILENCE_MS = 60_000
# How far a real database clock may move by itself between two reads of one step.
CLOCK_SLACK_MS = 1_000
TASKS = ("a", "b")
WORKERS = ("w1", "w2", "w3")
OPEN = frozenset({SessionStatus.ACTIVE, SessionStatus.DRAINING})
LOSSY = frozenset({AttemptStatus.LOST, AttemptStatus.SUCCEEDED, AttemptStatus.FAILED})

# How many machines (examples) and steps ran in this process, for the report.
STATS: dict[str, int] = defaultdict(int)


def policies() -> st.SearchStrategy[RetryPolicy | None]:
    backoffs = st.builds(
        lambda initial, extra, mult: Backoff(initial_ms=initial, multiplier=mult,
                                             cap_ms=initial + extra),
        st.sampled_from([0, 10, 1_000]),
        st.sampled_from([0, 500, 5_000]),
        st.sampled_from([1.0, 2.0]),
    )
    safe = st.builds(
        RetryPolicy,
        retry_on_lost=st.just(True),
        max_attempts=st.integers(2, 4),
        safety=st.sampled_from([Safety.IDEMPOTENT, Safety.DEDUPLICATED]),
        backoff=backoffs,
    )
    return safe | st.none() | st.builds(
        RetryPolicy,
        retry_on_lost=st.booleans(),
        max_attempts=st.integers(1, 4),
        safety=st.sampled_from([None, Safety.IDEMPOTENT, Safety.DEDUPLICATED, Safety.UNSAFE]),
        backoff=backoffs,
    )


def retry_safe(policy: RetryPolicy | None) -> bool:
    return (
        policy is not None
        and policy.retry_on_lost
        and policy.max_attempts >= 2
        and policy.safety in RETRYABLE_SAFETY
    )


def _only_evidence_added(before: StoreView, after: StoreView, run_id: str) -> None:
    """A stop report changes no state; it appends exactly one ``evidence_recorded`` event."""
    assert {k: v for k, v in after.runs.items() if k != run_id} == {
        k: v for k, v in before.runs.items() if k != run_id
    }
    old, new = before.runs[run_id], after.runs[run_id]
    assert (new.run, new.attempts, new.leases) == (old.run, old.attempts, old.leases)
    assert list(new.events[: len(old.events)]) == list(old.events)
    added = list(new.events[len(old.events) :])
    assert len(added) == 1 and added[0][1] == EventType.EVIDENCE_RECORDED.value, added


@dataclass(frozen=True)
class Held:
    """A fence a worker holds, with the session that accepted it."""

    run_id: str
    session_id: str
    fence: LeaseFence


def _replay_statuses(events: list[tuple[int, str, str | None, dict[str, object]]]):  # type: ignore[no-untyped-def]
    """The Run and Attempt statuses the event stream implies; every event must be a change."""
    status: RunStatus | None = None
    attempts: dict[str, AttemptStatus] = {}
    accepted: set[str] = set()
    for _, kind, attempt_id, _data in events:
        before = (status, dict(attempts))
        event = EventType(kind)
        if event is EventType.RUN_ADMITTED:
            assert status is None, "admitted twice"
            status = RunStatus.QUEUED if attempt_id else RunStatus.CREATED
            if attempt_id:
                attempts[attempt_id] = AttemptStatus.CLAIMED
        elif event is EventType.ATTEMPT_CREATED:
            assert status in (RunStatus.CREATED, RunStatus.RETRY_WAIT), status
            assert attempt_id and attempt_id not in attempts
            status = RunStatus.QUEUED
            attempts[attempt_id] = AttemptStatus.CLAIMED
        elif event is EventType.ATTEMPT_OFFERED:
            assert status is RunStatus.QUEUED and attempts[attempt_id] is AttemptStatus.CLAIMED  # type: ignore[index]
            status = RunStatus.DISPATCHING
            accepted.discard(attempt_id)  # type: ignore[arg-type]
        elif event is EventType.ATTEMPT_ACCEPTED:
            assert attempts[attempt_id] is AttemptStatus.CLAIMED  # type: ignore[index]
            assert attempt_id not in accepted, "accepted twice"
            accepted.add(attempt_id)  # type: ignore[arg-type]
            continue
        elif event is EventType.EVIDENCE_RECORDED:
            assert not attempts[attempt_id].is_terminal, "evidence for a finished attempt"  # type: ignore[index]
            continue
        elif event is EventType.ATTEMPT_ACTIVATED:
            assert status is RunStatus.DISPATCHING
            assert attempts[attempt_id] is AttemptStatus.CLAIMED  # type: ignore[index]
            status = RunStatus.RUNNING
            attempts[attempt_id] = AttemptStatus.STARTING  # type: ignore[index]
        elif event is EventType.ATTEMPT_RUNNING:
            assert attempts[attempt_id] is AttemptStatus.STARTING  # type: ignore[index]
            attempts[attempt_id] = AttemptStatus.RUNNING  # type: ignore[index]
        elif event in (EventType.ATTEMPT_SUCCEEDED, EventType.ATTEMPT_FAILED):
            assert attempts[attempt_id] in (AttemptStatus.STARTING, AttemptStatus.RUNNING)  # type: ignore[index]
            ok = event is EventType.ATTEMPT_SUCCEEDED
            attempts[attempt_id] = AttemptStatus.SUCCEEDED if ok else AttemptStatus.FAILED  # type: ignore[index]
            status = RunStatus.SUCCEEDED if ok else RunStatus.FAILED
        elif event is EventType.ATTEMPT_LOST:
            assert not attempts[attempt_id].is_terminal  # type: ignore[index]
            attempts[attempt_id] = AttemptStatus.LOST  # type: ignore[index]
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
            if attempt_id and not attempts[attempt_id].is_terminal:
                attempts[attempt_id] = AttemptStatus.CANCELLED
        assert (status, attempts) != before, f"event {kind} changed nothing"
    return status, attempts


def _without_expiry(view):  # type: ignore[no-untyped-def]
    """A run's rows with the lease expiry blanked: renewals move only that and write no event."""
    return (view.run, view.attempts,
            tuple(evolve(lease, expires_at_ms=0) for lease in view.leases))


def make_machine(
    store_factory: StoreFactory,
    *,
    lease_ttl_ms: int = LEASE_TTL_MS,
    silence_ms: int = SILENCE_MS,
    page_size: int | None = None,
) -> type[RuleBasedStateMachine]:
    class RuntimeMachine(RuleBasedStateMachine):
        runs = Bundle("runs")
        sessions = Bundle("sessions")

        def __init__(self) -> None:
            super().__init__()
            STATS["examples"] += 1
            self.store, self._advance = store_factory()
            ids = CountingIdentities("m")
            uow = self.store.unit_of_work
            dispatch = TaskAttemptAdmission(uow, self.store, lease_ttl_ms=lease_ttl_ms,
                                            max_silence_ms=silence_ms, page_size=page_size)
            self.admission = Admission(uow, ids)
            self.workers = WorkerCommands(uow, ids, lease_ttl_ms=lease_ttl_ms)
            self.dispatch = dispatch
            inner = SchedulerCoordinator(trigger_schedule=NoTriggerSchedule(),
                                         workflow_frontier=NoWorkflowFrontier(),
                                         task_attempt_admission=dispatch)
            self.coordinator = ClusterSchedulerCoordinator(
                runtime_recovery=RuntimeRecovery(uow, self.store, page_size=page_size),
                lost_retry=LostRetry(uow, self.store, ids, page_size=page_size),
                inner=inner,
            )
            self.startup = StartupRecovery(uow, self.store, ids, page_size=page_size)
            # the model
            self.secrets: dict[str, str] = {}
            self.worker_of: dict[str, str] = {}
            self.held: dict[str, Held] = {}
            self.ever_started: dict[str, set[str]] = defaultdict(set)
            self.max_version: dict[tuple[str, int], int] = {}
            self.tokens = 0
            self.previous: StoreView | None = None

        # --- helpers ------------------------------------------------------------------------

        def now(self) -> int:
            with self.store.unit_of_work() as uow:
                return uow.now_ms()

        def view(self) -> StoreView:
            return store_view(self.store, self.secrets)  # type: ignore[arg-type]

        def expect_unchanged(self, before: StoreView) -> None:
            after = self.view()
            assert after == before, "a refused command changed the store"

        def new_token(self) -> str:
            self.tokens += 1
            return f"token-{self.tokens:06d}-".ljust(32, "k")

        # --- rules --------------------------------------------------------------------------

        @initialize(target=sessions)
        def first_session(self) -> str:
            return self.register("w1", 3, set(TASKS))

        @initialize(target=runs, policy=policies())
        def first_run(self, policy: RetryPolicy | None) -> str:
            return self.admit("a", policy)

        @rule(target=runs, task=st.sampled_from(TASKS), policy=policies())
        def admit(self, task: str, policy: RetryPolicy | None) -> str:
            run_id = self.admission.submit(task, {"task": task}, policy)
            run = self.view().runs[run_id]
            assert run.run.status is RunStatus.QUEUED
            assert run.run.policy == policy
            return run_id

        @rule(
            target=sessions,
            worker=st.sampled_from(WORKERS),
            capacity=st.integers(1, 3),
            tasks=st.sets(st.sampled_from(TASKS), min_size=1),
        )
        def register(self, worker: str, capacity: int, tasks: set[str]) -> str:
            before = self.view()
            grant = self.workers.register(worker, capacity, sorted(tasks))
            expected = {s for s, w in self.worker_of.items()
                        if w == worker and before.sessions[s].status in OPEN}
            assert set(grant.replaced_session_ids) == expected
            self.secrets[grant.session_id] = grant.secret
            self.worker_of[grant.session_id] = worker
            after = self.view()
            assert after.sessions[grant.session_id].status is SessionStatus.ACTIVE
            for old in expected:
                assert after.sessions[old].status is SessionStatus.REPLACED
            return grant.session_id

        @rule()
        def dispatch_step(self) -> None:
            report = self.dispatch.run_once()
            assert report.offered + report.skipped <= report.queued_seen

        @rule(session=sessions, again=st.sampled_from(["same", "other", "none"]),
              dispatch_first=st.booleans())
        def heartbeat_and_accept(self, session: str, again: str, dispatch_first: bool) -> None:
            if dispatch_first:
                self.dispatch_step()
            before = self.view()
            status = before.sessions[session].status
            if status not in OPEN:
                try:
                    self.workers.heartbeat(session, self.secrets[session])
                except SessionRejected:
                    self.expect_unchanged(before)
                    return
                raise AssertionError(f"heartbeat of a {status.value} session succeeded")
            offers = self.workers.heartbeat(session, self.secrets[session])
            for offer in offers:
                self._accept(session, offer, again)

        def _accept(self, session: str, offer: Any, again: str) -> None:
            token = self.new_token()
            now = self.now()
            before = self.view()
            if offer.expires_at_ms <= now:
                try:
                    self.workers.accept(session, self.secrets[session], offer.attempt_id,
                                        offer.generation, offer.version, token)
                except FenceRejected as refused:
                    assert refused.reason is FenceReason.EXPIRED
                    self.expect_unchanged(before)
                    return
                raise AssertionError("an expired offer was accepted")
            try:
                self.workers.accept(session, self.secrets[session], offer.attempt_id,
                                    offer.generation, offer.version, token)
            except FenceRejected as refused:
                # only a real database clock can pass the expiry during the command
                assert refused.reason is FenceReason.EXPIRED, refused
                assert offer.expires_at_ms <= self.now(), "a live offer was refused"
                STATS["expiry_raced_clock"] += 1
                self.expect_unchanged(before)
                return
            fence = LeaseFence(attempt_id=offer.attempt_id, generation=offer.generation,
                               version=offer.version, token=token)
            self.held[offer.attempt_id] = Held(run_id=offer.run_id, session_id=session,
                                               fence=fence)
            after = self.view()
            lease = after.runs[offer.run_id].leases[-1]
            assert lease.token_hash == hash_token(token)
            assert lease.version == offer.version
            if again == "none":
                return
            repeat = token if again == "same" else self.new_token()
            try:
                self.workers.accept(session, self.secrets[session], offer.attempt_id,
                                    offer.generation, offer.version, repeat)
            except InvalidTransition as refused:
                assert again == "same" and "already accepted" in str(refused)
            except FenceRejected as refused:
                assert again == "other" and refused.reason is FenceReason.TOKEN_MISMATCH
            else:
                raise AssertionError("an offer was accepted twice")
            self.expect_unchanged(after)

        def _expected(self, command: str, held: Held, fence: LeaseFence,
                      before: StoreView, now: int) -> tuple[str, type[DomainError] | None,
                                                            FenceReason | None]:
            """An independent statement of what the command must do at time ``now``."""
            session = before.sessions[held.session_id]
            if session.status not in OPEN and command != "abandon":
                return "error", SessionRejected, None
            run_view = before.runs[held.run_id]
            attempt = next(a for a in run_view.attempts if a.id == fence.attempt_id)
            lease = next((x for x in run_view.leases
                          if x.generation == attempt.lease_generation), None)
            if lease is None:
                return "error", FenceRejected, FenceReason.NO_LEASE
            if fence.generation != lease.generation:
                return "error", FenceRejected, FenceReason.GENERATION_MISMATCH
            if lease.token_hash != hash_token(fence.token):
                return "error", FenceRejected, FenceReason.TOKEN_MISMATCH
            if fence.version != lease.version:
                return "error", FenceRejected, FenceReason.VERSION_MISMATCH
            if lease.status is not LeaseStatus.LEASED:
                return "error", FenceRejected, FenceReason.RELEASED
            if lease.expires_at_ms <= now:
                if command == "abandon" and not attempt.status.is_terminal:
                    return "recorded", None, None
                return "error", FenceRejected, FenceReason.EXPIRED
            run = run_view.run
            allowed = {
                "activate": attempt.status is AttemptStatus.CLAIMED
                and run.status is RunStatus.DISPATCHING,
                "mark_running": attempt.status is AttemptStatus.STARTING,
                "renew": not attempt.status.is_terminal,
                "complete_ok": attempt.status.is_started and run.status is RunStatus.RUNNING,
                "complete_failed": attempt.status.is_started
                and run.status is RunStatus.RUNNING,
                "abandon": not attempt.status.is_terminal,
            }[command]
            return ("ok", None, None) if allowed else ("error", InvalidTransition, None)

        def _settle(self, command: str, held: Held, fence: LeaseFence, before: StoreView,
                    now: int, expected: tuple[str, type[DomainError] | None,
                                              FenceReason | None],
                    got: str) -> tuple[str, type[DomainError] | None, FenceReason | None]:
            """The expectation to check the command against. A fake clock stands still, so
            this is always ``expected``. A real database clock moves during the command: when
            the lease's expiry fell between ``now`` and the clock read after the command, the
            store may have judged either side of it, so the expectation at the later time is
            accepted too; nowhere else is a different result tolerated."""
            if (expected[0] == "error") == (got == "error"):
                return expected
            later = self.now()
            if later == now:
                return expected
            run_view = before.runs[held.run_id]
            attempt = next(a for a in run_view.attempts if a.id == fence.attempt_id)
            lease = next((x for x in run_view.leases
                          if x.generation == attempt.lease_generation), None)
            if lease is None or not now < lease.expires_at_ms <= later:
                return expected
            STATS["expiry_raced_clock"] += 1
            return self._expected(command, held, fence, before, later)

        @precondition(lambda self: bool(self.held))
        @rule(
            data=st.data(),
            command=st.sampled_from(["activate", "mark_running", "renew", "complete_ok",
                                     "complete_failed", "abandon"]),
            mutation=st.sampled_from([None, None, None, "version", "generation", "token"]),
        )
        def fenced_command(self, data: st.DataObject, command: str,
                           mutation: str | None) -> None:
            attempt_id = data.draw(st.sampled_from(sorted(self.held)), label="attempt")
            self._fenced(attempt_id, command, mutation)

        @precondition(lambda self: bool(self.held))
        @rule(data=st.data(), succeed=st.booleans())
        def progress(self, data: st.DataObject, succeed: bool) -> None:
            """The natural next command of a held attempt, with its valid fence."""
            attempt_id = data.draw(st.sampled_from(sorted(self.held)), label="attempt")
            held = self.held[attempt_id]
            view = self.view().runs[held.run_id]
            attempt = next(a for a in view.attempts if a.id == attempt_id)
            command = {
                AttemptStatus.CLAIMED: "activate",
                AttemptStatus.STARTING: "mark_running",
            }.get(attempt.status, "complete_ok" if succeed else "complete_failed")
            self._fenced(attempt_id, command, None)

        @precondition(lambda self: bool(self.held))
        @rule(succeed=st.booleans(), fail_some=st.booleans())
        def progress_all(self, succeed: bool, fail_some: bool) -> None:
            """Every held, unfinished attempt takes its natural next step with a valid fence."""
            view = self.view()
            for attempt_id in sorted(self.held):
                held = self.held[attempt_id]
                attempt = next(a for a in view.runs[held.run_id].attempts if a.id == attempt_id)
                if attempt.status.is_terminal:
                    continue
                command = {
                    AttemptStatus.CLAIMED: "activate",
                    AttemptStatus.STARTING: "mark_running" if fail_some else "complete_ok",
                }.get(attempt.status, "complete_ok" if succeed else "abandon")
                self._fenced(attempt_id, command, None)

        def _fenced(self, attempt_id: str, command: str, mutation: str | None) -> None:
            held = self.held[attempt_id]
            fence = held.fence
            if mutation == "version":
                fence = evolve(fence, version=fence.version + 1)
            elif mutation == "generation":
                fence = evolve(fence, generation=fence.generation + 1)
            elif mutation == "token":
                fence = evolve(fence, token=self.new_token())
            before = self.view()
            now = self.now()
            outcome, error, reason = self._expected(command, held, fence, before, now)
            secret = self.secrets[held.session_id]
            try:
                if command == "activate":
                    self.workers.activate(held.session_id, secret, fence)
                elif command == "mark_running":
                    self.workers.mark_running(held.session_id, secret, fence)
                elif command == "renew":
                    expires = self.workers.renew(held.session_id, secret, fence)
                elif command.startswith("complete"):
                    ok = command == "complete_ok"
                    self.workers.complete(held.session_id, secret, fence, succeeded=ok,
                                          output={"ok": ok}, error=None if ok else "task error")
                else:
                    result = self.workers.abandon(held.session_id, secret, fence, "stopping")
            except DomainError as refused:
                outcome, error, reason = self._settle(command, held, fence, before, now,
                                                      (outcome, error, reason), "error")
                STATS[f"{command}:{outcome}:{reason.value if reason else ''}"] += 1
                assert outcome == "error", f"{command} refused unexpectedly: {refused!r}"
                assert isinstance(refused, error), (refused, error)  # type: ignore[arg-type]
                if reason is not None:
                    assert refused.reason is reason, (refused, reason)  # type: ignore[attr-defined]
                self.expect_unchanged(before)
                return
            outcome, error, reason = self._settle(command, held, fence, before, now,
                                                  (outcome, error, reason), "ok")
            STATS[f"{command}:{outcome}:{reason.value if reason else ''}"] += 1
            assert outcome != "error", f"{command} should have raised {error} {reason}"
            after = self.view()
            run_before, run_after = before.runs[held.run_id], after.runs[held.run_id]
            attempt = next(a for a in run_after.attempts if a.id == attempt_id)
            lease = next(x for x in run_after.leases if x.generation == fence.generation)
            old_lease = next(x for x in run_before.leases if x.generation == fence.generation)
            if command == "activate":
                assert attempt.status is AttemptStatus.STARTING
                assert run_after.run.status is RunStatus.RUNNING
            elif command == "mark_running":
                assert attempt.status is AttemptStatus.RUNNING
            elif command == "renew":
                assert lease.expires_at_ms == expires >= old_lease.expires_at_ms
                assert lease == evolve(old_lease, expires_at_ms=expires)
                assert run_after.events == run_before.events
            elif command.startswith("complete"):
                ok = command == "complete_ok"
                assert run_after.run.status is (RunStatus.SUCCEEDED if ok else RunStatus.FAILED)
                assert lease.status is LeaseStatus.RELEASED
                assert lease.release_reason is ReleaseReason.COMPLETED
                assert lease.version == old_lease.version + 1
            elif outcome == "recorded":
                assert result.outcome == "recorded"
                assert len(after.reports[attempt_id]) == len(before.reports[attempt_id]) + 1
                _only_evidence_added(before, after, held.run_id)
            else:
                assert result.outcome == "lost"
                assert attempt.status is AttemptStatus.LOST
                assert run_after.run.status is RunStatus.LOST
                assert lease.release_reason is ReleaseReason.ABANDONED
                assert lease.version == old_lease.version + 1

        @rule(session=sessions, coin=st.integers(0, 1))
        def close_session(self, session: str, coin: int) -> None:
            if coin:
                return
            before = self.view()
            if before.sessions[session].status not in OPEN:
                try:
                    self.workers.close(session, self.secrets[session])
                except SessionRejected:
                    self.expect_unchanged(before)
                    return
                raise AssertionError("a closed session was closed again")
            self.workers.close(session, self.secrets[session])
            assert self.view().sessions[session].status is SessionStatus.CLOSED

        @rule(run=runs)
        def attest_stopped(self, run: str) -> None:
            before = self.view()
            attempt = before.runs[run].attempts[-1]
            if attempt.status.is_terminal:
                try:
                    self.workers.attest_stopped(attempt.id, "operator checked the host")
                except InvalidTransition:
                    self.expect_unchanged(before)
                    return
                raise AssertionError("a terminal attempt was attested")
            self.workers.attest_stopped(attempt.id, "operator checked the host")
            after = self.view()
            assert len(after.reports[attempt.id]) == len(before.reports[attempt.id]) + 1
            _only_evidence_added(before, after, run)

        @rule(run=runs, coin=st.integers(0, 3))
        def cancel(self, run: str, coin: int) -> None:
            if coin:  # an operator's cancel is rare; most steps should let work progress
                return
            before = self.view()
            if before.runs[run].run.status.is_terminal:
                try:
                    self.admission.cancel(run)
                except InvalidTransition:
                    self.expect_unchanged(before)
                    return
                raise AssertionError("a terminal run was cancelled")
            self.admission.cancel(run)
            view = self.view().runs[run]
            assert view.run.status is RunStatus.CANCELLED
            assert not any(x.status is LeaseStatus.LEASED for x in view.leases)

        @rule(ms=st.sampled_from([1, 200, 1_000, 3_000, lease_ttl_ms + 1, 4 * lease_ttl_ms]))
        def advance_clock(self, ms: int) -> None:
            before = self.now()
            self._advance(ms)
            # A fake clock moves by exactly ``ms``; a real database clock also moves on its own
            # between the two reads, by far less than CLOCK_SLACK_MS.
            assert before + ms <= self.now() < before + ms + CLOCK_SLACK_MS

        @rule()
        def cluster_cycle(self) -> None:
            summary = self.coordinator.run_cycle()
            assert summary.ok, summary.as_dict()
            assert [s.name for s in summary.steps] == list(ClusterSchedulerCoordinator.STEP_NAMES)

        @rule(ms=st.sampled_from([lease_ttl_ms + 1, 2 * lease_ttl_ms]))
        def expire_and_cycle(self, ms: int) -> None:
            """Workers go quiet past their lease; the cadence runs."""
            self.advance_clock(ms)
            self.cluster_cycle()

        @rule()
        def restart(self) -> None:
            report = self.startup.run()
            assert report.orphans_queued == 0  # admission never leaves created orphans

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
            previous = self.previous
            for run_id, rv in view.runs.items():
                run, attempts, leases = rv.run, rv.attempts, rv.leases
                # attempt numbers contiguous 1..N
                assert [a.number for a in attempts] == list(range(1, len(attempts) + 1))
                assert run.attempt_count == len(attempts)
                # at most one non-terminal attempt
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
                # lost/succeeded/failed attempts hold no leased lease
                for attempt in attempts:
                    if attempt.status in LOSSY:
                        assert not any(x.attempt_id == attempt.id for x in leased)
                # a started attempt that became lost has evidence in its event
                for attempt in attempts:
                    if attempt.status is AttemptStatus.LOST and attempt.started_at_ms is not None:
                        lost = [e for e in rv.events
                                if e[1] == "attempt_lost" and e[2] == attempt.id]
                        assert len(lost) == 1 and "evidence" in lost[0][3], lost
                        assert attempt.lost_evidence is not None
                # retry_wait only for declared-safe policies with attempts left
                if run.status is RunStatus.RETRY_WAIT:
                    policy = run.policy
                    assert retry_safe(policy)
                    assert policy is not None and run.attempt_count < policy.max_attempts
                    assert run.next_attempt_at_ms is not None
                # lease versions never go down
                for lease in leases:
                    key = (run_id, lease.generation)
                    assert lease.version >= self.max_version.get(key, 0)
                    self.max_version[key] = lease.version
                # every change writes exactly one event: the stream replays to the state
                status, attempt_statuses = _replay_statuses(list(rv.events))
                assert status is run.status
                assert attempt_statuses == {a.id: a.status for a in attempts}
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
                # an unsafe run is never executed by two attempts
                for attempt in attempts:
                    if attempt.started_at_ms is not None:
                        self.ever_started[run_id].add(attempt.id)
                if not retry_safe(run.policy):
                    assert len(self.ever_started[run_id]) <= 1
                    assert len(attempts) == 1
            self.previous = view

    return RuntimeMachine
