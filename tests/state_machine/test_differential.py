"""Differential test: one command sequence applied to a memory store and a PostgreSQL store.

Both sides run the same application services over deterministic identities, so they hand out
the same ids and secrets. After every command the two sides must agree on the command's outcome
(its return value, or the class of the error it raised) and on the normalised state of every
run (run, attempts, leases, events) and session. Timestamps and absolute expiries are dropped;
statuses, numbers, generations, versions, release reasons and the order of events are kept.

Time moves only by large steps (at least twice the lease TTL, past every backoff and the session
silence limit) or small steps far below every limit, so the few milliseconds PostgreSQL's real
clock moves between statements can never change an outcome."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from adapters.memory import FakeClock, MemoryStore
from application.admission import Admission
from application.dispatch import TaskAttemptAdmission
from application.lost_retry import LostRetry
from application.recovery import RuntimeRecovery
from application.scheduler import (
    ClusterSchedulerCoordinator,
    NoTriggerSchedule,
    NoWorkflowFrontier,
    SchedulerCoordinator,
)
from application.startup import StartupRecovery
from application.worker_commands import WorkerCommands
from domain.fence import LeaseFence
from domain.policy import Backoff, RetryPolicy, Safety
from tests.application.support import CountingIdentities, store_view

EXAMPLES = 25
LEASE_TTL_MS = 30_000
SILENCE_MS = 45_000
LARGE_STEPS = (2 * LEASE_TTL_MS, 3 * LEASE_TTL_MS)
SMALL_STEPS = (5, 50)
TASKS = ("a", "b")
WORKERS = ("w1", "w2")
FENCED = ("activate", "mark_running", "renew", "complete_ok", "complete_failed", "abandon")

STATS: dict[str, int] = {}


def _count(key: str) -> None:
    STATS[key] = STATS.get(key, 0) + 1


def policies() -> st.SearchStrategy[RetryPolicy | None]:
    # Every delay is either 0 or far above the small steps and below one large step.
    backoffs = st.builds(
        lambda initial, multiplier, jitter: Backoff(
            initial_ms=initial, multiplier=multiplier, cap_ms=max(initial, 40_000),
            jitter=jitter),
        st.sampled_from([0, 20_000]),
        st.sampled_from([1.0, 2.0]),
        st.sampled_from([0.0, 0.25]),
    )
    return st.none() | st.builds(
        RetryPolicy,
        retry_on_lost=st.booleans(),
        max_attempts=st.integers(1, 3),
        safety=st.sampled_from([None, Safety.IDEMPOTENT, Safety.DEDUPLICATED, Safety.UNSAFE]),
        backoff=backoffs,
    )


def normalise(value: Any) -> Any:
    """A comparable picture of a value without timestamps (``*at_ms`` fields and keys)."""
    if isinstance(value, enum.Enum):
        return value.value
    if attrs.has(type(value)):
        return (type(value).__name__, {
            f.name: normalise(getattr(value, f.name))
            for f in attrs.fields(type(value)) if not f.name.endswith("at_ms")
        })
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, {
            f.name: normalise(getattr(value, f.name))
            for f in dataclasses.fields(value) if not f.name.endswith("at_ms")
        })
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items() if not str(k).endswith("at_ms")}
    if isinstance(value, (list, tuple)):
        return [normalise(v) for v in value]
    return value


class PaddedIdentities(CountingIdentities):
    """``CountingIdentities`` whose ids sort in the order they were made (``d-000010`` after
    ``d-000009``): stores break timestamp ties by id, and the fake clock makes many ties that
    PostgreSQL's moving clock does not."""

    def new_id(self) -> str:
        prefix, number = super().new_id().rsplit("-", 1)
        return f"{prefix}-{int(number):06d}"


class Side:
    """One store with the same service graph ``bootstrap.cluster`` declares."""

    def __init__(self, name: str, store: Any, advance: Callable[[int], Any]) -> None:
        self.name = name
        self.store = store
        self.advance = advance
        ids = PaddedIdentities("d")
        uow = store.unit_of_work
        self.admission = Admission(uow, ids)
        self.workers = WorkerCommands(uow, ids, lease_ttl_ms=LEASE_TTL_MS)
        self.dispatch = TaskAttemptAdmission(uow, store, lease_ttl_ms=LEASE_TTL_MS,
                                             max_silence_ms=SILENCE_MS)
        inner = SchedulerCoordinator(trigger_schedule=NoTriggerSchedule(),
                                     workflow_frontier=NoWorkflowFrontier(),
                                     task_attempt_admission=self.dispatch)
        self.coordinator = ClusterSchedulerCoordinator(
            runtime_recovery=RuntimeRecovery(uow, store),
            lost_retry=LostRetry(uow, store, ids),
            inner=inner,
        )
        self.startup = StartupRecovery(uow, store, ids)

    def state(self, session_ids: list[str]) -> Any:
        view = store_view(self.store, session_ids)
        runs = {
            run_id: {
                "run": normalise(rv.run),
                "attempts": normalise(rv.attempts),
                "leases": normalise(rv.leases),
                # the sequence numbers are the store's own; keep only the order
                "events": [normalise(e[1:]) for e in rv.events],
            }
            for run_id, rv in view.runs.items()
        }
        return {"runs": runs, "sessions": normalise(view.sessions),
                "reports": normalise(view.reports)}


def make_differential(factory: Callable[[], Side]) -> type[RuleBasedStateMachine]:
    class Differential(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            _count("examples")
            self.memory_clock = FakeClock()
            memory = MemoryStore(self.memory_clock)
            self.sides = (Side("memory", memory, self.memory_clock.advance), factory())
            self.run_ids: list[str] = []
            self.sessions: list[tuple[str, str]] = []  # (session id, secret)
            self.held: dict[str, tuple[str, LeaseFence]] = {}  # attempt -> (session, fence)
            self.tokens = 0

        def both(self, label: str, command: Callable[[Side], Any]) -> Any:
            """Run ``command`` on each side; both must return the same or raise the same."""
            outcomes = []
            for side in self.sides:
                side.advance(1)  # time moves between commands, on the fake clock too
                try:
                    outcomes.append(("ok", normalise(command(side))))
                except Exception as error:  # the class of the error is the outcome
                    outcomes.append(("raised", type(error).__name__))
            _count(f"{label}:{outcomes[0][0]}")
            assert outcomes[0] == outcomes[1], (label, outcomes)
            return outcomes[0]

        # --- commands -------------------------------------------------------------------

        @initialize(task=st.sampled_from(TASKS), policy=policies())
        def first_run(self, task: str, policy: RetryPolicy | None) -> None:
            self.admit(task, policy)

        @initialize(tasks=st.sets(st.sampled_from(TASKS), min_size=1))
        def first_session(self, tasks: set[str]) -> None:
            self.register("w1", 3, tasks)

        @rule(task=st.sampled_from(TASKS), policy=policies())
        def admit(self, task: str, policy: RetryPolicy | None) -> None:
            kind, run_id = self.both("admit", lambda s: s.admission.submit(task, {"t": task},
                                                                           policy))
            assert kind == "ok"
            self.run_ids.append(run_id)

        @rule(worker=st.sampled_from(WORKERS), capacity=st.integers(1, 3),
              tasks=st.sets(st.sampled_from(TASKS), min_size=1))
        def register(self, worker: str, capacity: int, tasks: set[str]) -> None:
            kind, grant = self.both(
                "register", lambda s: s.workers.register(worker, capacity, sorted(tasks)))
            assert kind == "ok"
            fields = grant[1]
            self.sessions.append((fields["session_id"], fields["secret"]))

        @rule()
        def dispatch(self) -> None:
            self.both("dispatch", lambda s: s.dispatch.run_once())

        @precondition(lambda self: bool(self.sessions))
        @rule(data=st.data(), accept=st.sampled_from([True, True, False]),
              dispatch_first=st.booleans())
        def heartbeat(self, data: st.DataObject, accept: bool, dispatch_first: bool) -> None:
            session, secret = data.draw(st.sampled_from(self.sessions), label="session")
            if dispatch_first:
                self.dispatch()
            self.take(session, secret, accept)

        def take(self, session: str, secret: str, accept: bool) -> None:
            # Offers come by grant time; offers granted in one command tie on the fake clock
            # (then the attempt id decides) but not on PostgreSQL's, so compare them as a set.
            kind, offers = self.both("heartbeat", lambda s: sorted(
                s.workers.heartbeat(session, secret), key=lambda o: o.attempt_id))
            if kind != "ok" or not accept:
                return
            for _, offer in offers:
                self.tokens += 1
                token = f"token-{self.tokens:05d}-".ljust(32, "k")
                kind, _ = self.both("accept", lambda s, o=offer, t=token: s.workers.accept(
                    session, secret, o["attempt_id"], o["generation"], o["version"], t))
                if kind == "ok":
                    self.held[offer["attempt_id"]] = (session, LeaseFence(
                        attempt_id=offer["attempt_id"], generation=offer["generation"],
                        version=offer["version"], token=token))

        @precondition(lambda self: bool(self.sessions))
        @rule(data=st.data())
        def dispatch_and_take(self, data: st.DataObject) -> None:
            """The common path: a session's heartbeat, a dispatch, a heartbeat taking the
            offers."""
            index = data.draw(st.integers(0, len(self.sessions) - 1), label="session")
            session, secret = self.sessions[-1 - index]
            self.take(session, secret, False)
            self.dispatch()
            self.take(session, secret, True)

        @precondition(lambda self: bool(self.held))
        @rule(data=st.data(), command=st.sampled_from(FENCED),
              mutation=st.sampled_from([None, None, None, "version", "generation", "token"]))
        def fenced(self, data: st.DataObject, command: str, mutation: str | None) -> None:
            attempt_id = data.draw(st.sampled_from(sorted(self.held)), label="attempt")
            self.fenced_command(attempt_id, command, mutation)

        def fenced_command(self, attempt_id: str, command: str, mutation: str | None) -> None:
            session, fence = self.held[attempt_id]
            secret = dict(self.sessions)[session]
            if mutation == "version":
                fence = attrs.evolve(fence, version=fence.version + 1)
            elif mutation == "generation":
                fence = attrs.evolve(fence, generation=fence.generation + 1)
            elif mutation == "token":
                fence = attrs.evolve(fence, token="forged-token".ljust(32, "f"))

            def run(side: Side) -> Any:
                w = side.workers
                if command == "activate":
                    return w.activate(session, secret, fence)
                if command == "mark_running":
                    return w.mark_running(session, secret, fence)
                if command == "renew":
                    w.renew(session, secret, fence)  # the new expiry is a timestamp
                    return "renewed"
                if command.startswith("complete"):
                    ok = command == "complete_ok"
                    return w.complete(session, secret, fence, succeeded=ok, output={"ok": ok},
                                      error=None if ok else "task error")
                return w.abandon(session, secret, fence, "stopping")

            self.both(command, run)

        @precondition(lambda self: bool(self.held))
        @rule(data=st.data(), succeed=st.booleans())
        def progress(self, data: st.DataObject, succeed: bool) -> None:
            """The natural next command of a held attempt, as the memory side sees it."""
            attempt_id = data.draw(st.sampled_from(sorted(self.held)), label="attempt")
            with self.sides[0].store.unit_of_work() as uow:
                attempt = uow.runs.get_attempt(attempt_id)
            assert attempt is not None
            command = {"claimed": "activate", "starting": "mark_running"}.get(
                attempt.status.value, "complete_ok" if succeed else "complete_failed")
            self.fenced_command(attempt_id, command, None)

        @precondition(lambda self: bool(self.sessions))
        @rule(data=st.data(), coin=st.integers(0, 2))
        def close_session(self, data: st.DataObject, coin: int) -> None:
            session, secret = data.draw(st.sampled_from(self.sessions), label="session")
            if coin == 0:
                self.both("close", lambda s: s.workers.close(session, secret))

        @precondition(lambda self: bool(self.run_ids))
        @rule(data=st.data())
        def attest_stopped(self, data: st.DataObject) -> None:
            run_id = data.draw(st.sampled_from(self.run_ids), label="run")
            with self.sides[0].store.unit_of_work() as uow:
                attempts = uow.runs.attempts_of(run_id)
            if attempts:
                attempt_id = attempts[-1].id
                self.both("attest", lambda s: s.workers.attest_stopped(attempt_id, "checked"))

        @precondition(lambda self: bool(self.run_ids))
        @rule(data=st.data(), coin=st.integers(0, 2))
        def cancel(self, data: st.DataObject, coin: int) -> None:
            run_id = data.draw(st.sampled_from(self.run_ids), label="run")
            if coin == 0:
                self.both("cancel", lambda s: s.admission.cancel(run_id))

        @rule(ms=st.sampled_from(SMALL_STEPS + SMALL_STEPS + LARGE_STEPS))
        def advance_clock(self, ms: int) -> None:
            _count(f"advance:{ms}")
            for side in self.sides:
                side.advance(ms)

        @rule()
        def cluster_cycle(self) -> None:
            kind, summary = self.both("cycle", lambda s: s.coordinator.run_cycle().as_dict())
            assert kind == "ok" and summary["ok"], summary

        @rule(ms=st.sampled_from(LARGE_STEPS))
        def expire_and_cycle(self, ms: int) -> None:
            self.advance_clock(ms)
            self.cluster_cycle()

        @rule()
        def restart(self) -> None:
            self.both("restart", lambda s: s.startup.run())

        # --- the comparison -------------------------------------------------------------

        @invariant()
        def same_state(self) -> None:
            _count("steps")
            session_ids = [s for s, _ in self.sessions]
            memory, postgres = (side.state(session_ids) for side in self.sides)
            assert memory["sessions"] == postgres["sessions"]
            assert memory["reports"] == postgres["reports"]
            assert memory["runs"].keys() == postgres["runs"].keys()
            for run_id, mine in memory["runs"].items():
                assert mine == postgres["runs"][run_id], run_id

    return Differential


@pytest.fixture(scope="module")
def pg_store(pg_database_url: str) -> Iterator[Any]:
    from adapters.postgres.store import PostgresStore

    store = PostgresStore.from_url(pg_database_url, create_schema=True)
    try:
        yield store
    finally:
        store.close()


def test_memory_and_postgres_agree_on_every_command(pg_store: Any) -> None:
    def postgres_side() -> Side:
        pg_store.testing_reset()
        return Side("postgres", pg_store, pg_store.testing_advance_clock)

    STATS.clear()
    started = time.monotonic()
    run_state_machine_as_test(
        make_differential(postgres_side),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
    elapsed = time.monotonic() - started
    print(f"\ndifferential: {STATS.get('examples', 0)} examples, {STATS.get('steps', 0)} "
          f"compared states, {elapsed:.1f}s")
    for key in sorted(STATS):
        print(f"  {key}: {STATS[key]}")
    assert STATS["examples"] >= EXAMPLES
    assert STATS["steps"] > STATS["examples"]
