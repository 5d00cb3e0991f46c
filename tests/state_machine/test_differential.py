"""Differential test: one command sequence applied to a memory store and to a SQL store (SQLite,
then PostgreSQL).

Both sides run the same application services over deterministic identities, so they hand out
the same ids and secrets. After every command the two sides must agree on the command's outcome
(its return value, or the class of the error it raised) and on the normalised state of every
run (run, attempts, leases, events) and session. Timestamps and absolute expiries are dropped;
statuses, numbers, generations, versions, release reasons and the order of events are kept.

Time moves only by large steps (at least twice the lease TTL, past every backoff) or small steps
far below every limit, so the few milliseconds PostgreSQL's real clock moves between statements
can never change an outcome. The memory side's clock moves by itself too (:class:`MovingClock`).
Workers claim (ADR 0007): each side keeps the fences its own claims granted, since the tokens
are minted by each side's identities."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Iterator
from pathlib import Path
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

from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.application.admission import Admission
from ql3.application.dispatch import DispatchGateStep
from ql3.application.lost_retry import LostRetry
from ql3.application.ports import DispatchGate
from ql3.application.recovery import RuntimeRecovery
from ql3.application.scheduler import (
    ClusterSchedulerCoordinator,
    NoTriggerSchedule,
    NoWorkflowFrontier,
    SchedulerCoordinator,
)
from ql3.application.startup import StartupRecovery
from ql3.application.worker_commands import Abandonment, Completion, Release, WorkerCommands
from ql3.domain.fence import LeaseFence
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.application.support import CountingIdentities, store_view

EXAMPLES = 25
LEASE_TTL_MS = 30_000
LARGE_STEPS = (2 * LEASE_TTL_MS, 3 * LEASE_TTL_MS)
SMALL_STEPS = (5, 50)
TASKS = ("a", "b")
WORKERS = ("w1", "w2")
FENCED = ("renew", "complete_ok", "complete_failed", "release", "abandon")
GATE_REASON = "runtime_recovery failed: OperationalError"

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
    """A comparable picture of a value without timestamps (``*at_ms`` and ``now_ms`` fields
    and keys)."""
    if isinstance(value, enum.Enum):
        return value.value
    if attrs.has(type(value)):
        return (type(value).__name__, {
            f.name: normalise(getattr(value, f.name))
            for f in attrs.fields(type(value)) if not _is_time(f.name)
        })
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, {
            f.name: normalise(getattr(value, f.name))
            for f in dataclasses.fields(value) if not _is_time(f.name)
        })
    if isinstance(value, dict):
        return {k: normalise(v) for k, v in value.items() if not _is_time(str(k))}
    if isinstance(value, (list, tuple)):
        return [normalise(v) for v in value]
    return value


def _is_time(name: str) -> bool:
    return name.endswith("at_ms") or name == "now_ms"


class MovingClock(FakeClock):
    """A fake clock that also moves by itself, one millisecond per read, as a database clock
    does between statements: no two writes of the memory side share a timestamp, so its
    oldest-first orders match those of a real database (PostgreSQL's and SQLite's clocks never
    stand still)."""

    def now_ms(self) -> int:
        return self.advance(1) - 1


class PaddedIdentities(CountingIdentities):
    """``CountingIdentities`` whose ids sort in the order they were made (``d-000010`` after
    ``d-000009``): stores break timestamp ties by id, and the fake clock makes many ties that
    PostgreSQL's moving clock does not."""

    def new_id(self) -> str:
        prefix, number = super().new_id().rsplit("-", 1)
        return f"{prefix}-{int(number):06d}"


class Side:
    """One store with the same service graph ``ql3.bootstrap.cluster`` declares."""

    def __init__(self, name: str, store: Any, advance: Callable[[int], Any]) -> None:
        self.name = name
        self.store = store
        self.advance = advance
        ids = PaddedIdentities("d")
        uow = store.unit_of_work
        self.admission = Admission(uow, ids)
        self.workers = WorkerCommands(uow, ids, lease_ttl_ms=LEASE_TTL_MS)
        self.gate = DispatchGateStep(uow, store)
        inner = SchedulerCoordinator(trigger_schedule=NoTriggerSchedule(),
                                     workflow_frontier=NoWorkflowFrontier(),
                                     task_attempt_admission=self.gate)
        self.coordinator = ClusterSchedulerCoordinator(
            runtime_recovery=RuntimeRecovery(uow, store),
            lost_retry=LostRetry(uow, store, ids),
            inner=inner,
            gate=self.gate,
        )
        self.startup = StartupRecovery(uow, store, ids)
        # attempt id -> (session id, the fence this side's claim granted)
        self.fences: dict[str, tuple[str, LeaseFence]] = {}

    def close_gate(self) -> None:
        with self.store.unit_of_work() as uow:
            uow.gate.set(DispatchGate(open=False, reason=GATE_REASON, changed_at_ms=uow.now_ms()))
            uow.commit()

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
                "reports": normalise(view.reports), "gate": normalise(self.store.dispatch_gate())}


def make_differential(factory: Callable[[], Side]) -> type[RuleBasedStateMachine]:
    class Differential(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            _count("examples")
            self.memory_clock = MovingClock()
            memory = MemoryStore(self.memory_clock)
            self.sides = (Side("memory", memory, self.memory_clock.advance), factory())
            self.run_ids: list[str] = []
            self.sessions: list[tuple[str, str]] = []  # (session id, secret)
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

        def pick_session(self, index: int) -> tuple[str, str]:
            """Mostly an open session (as the memory side sees it), sometimes any."""
            with self.sides[0].store.unit_of_work() as uow:
                open_ = [
                    (s, secret) for s, secret in self.sessions
                    if (found := uow.sessions.get(s)) is not None and found.accepts_work
                ]
            pool = open_ if open_ and index % 4 else self.sessions
            return pool[index % len(pool)]

        def held(self) -> list[str]:
            """The Attempts some claim granted, as the memory side knows them."""
            return sorted(self.sides[0].fences)

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
              tasks=st.sets(st.sampled_from(TASKS), min_size=1), coin=st.integers(0, 2))
        def register_again(self, worker: str, capacity: int, tasks: set[str],
                           coin: int) -> None:
            """A worker (re)starts; not too often, so that sessions live long enough to work."""
            if coin == 0:
                self.register(worker, capacity, tasks)

        def register(self, worker: str, capacity: int, tasks: set[str]) -> None:
            kind, grant = self.both(
                "register", lambda s: s.workers.register(worker, capacity, sorted(tasks)))
            assert kind == "ok"
            fields = grant[1]
            self.sessions.append((fields["session_id"], fields["secret"]))

        @precondition(lambda self: bool(self.sessions))
        @rule(index=st.integers(0, 7), limit=st.sampled_from([0, 1, 2, 3]),
              complete=st.sampled_from([None, True, False]),
              statement=st.sampled_from(["none", "all", "omit_first"]))
        def claim(self, index: int, limit: int, complete: bool | None, statement: str) -> None:
            """A claim, with completions of every Attempt the session was granted riding along
            (``complete`` says how they ended), and a ``held`` statement: none, every Attempt
            granted to the session, or all but the first."""
            session, secret = self.pick_session(index)
            mine = [a for a, (s, _) in sorted(self.sides[0].fences.items()) if s == session]
            done = mine if complete is not None else []
            held = None if statement == "none" else mine[1:] if statement == "omit_first" \
                else mine

            def run(side: Side) -> Any:
                completions = [
                    Completion(fence=side.fences[a][1], succeeded=bool(complete),
                               output={"ok": True} if complete else None,
                               error=None if complete else "task error")
                    for a in done
                ]
                answer = side.workers.claim(session, secret, limit=limit,
                                            completions=completions, held=held)
                for grant in answer.grants:
                    side.fences[grant.attempt_id] = (session, grant.fence)
                    _count(f"granted:{side.name}")
                # Grants of one claim tie on nothing but their order, which a fair pick
                # between tasks with equal standing may break differently; compare them by
                # attempt, without the tokens each side minted.
                grants = sorted(
                    (dataclasses.replace(g, token="") for g in answer.grants),
                    key=lambda g: g.attempt_id,
                )
                return dataclasses.replace(answer, grants=tuple(grants))

            self.both("claim", run)

        @precondition(lambda self: bool(self.sessions))
        @rule(index=st.integers(0, 7), succeed=st.booleans())
        def work(self, index: int, succeed: bool) -> None:
            """The common path: a worker completes all it was granted and claims again."""
            self.claim(index, 3, succeed, "all")

        @precondition(lambda self: bool(self.sides[0].fences))
        @rule(data=st.data(), command=st.sampled_from(FENCED),
              mutation=st.sampled_from([None, None, None, "version", "generation", "token"]))
        def fenced(self, data: st.DataObject, command: str, mutation: str | None) -> None:
            attempt_id = data.draw(st.sampled_from(self.held()), label="attempt")
            self.fenced_command(attempt_id, command, mutation)

        @precondition(lambda self: bool(self.sides[0].fences))
        @rule(data=st.data(), command=st.sampled_from(FENCED))
        def fenced_live(self, data: st.DataObject, command: str) -> None:
            """A fenced command with the fence of a lease still held, as the memory side
            sees it."""
            with self.sides[0].store.unit_of_work() as uow:
                live = [
                    a for a in self.held()
                    if (s := uow.runs.lock_attempt(a)) is not None and s.lease is not None
                    and s.lease.status.value == "leased" and s.lease.attempt_id == a
                ]
            if live:
                attempt_id = data.draw(st.sampled_from(live), label="live attempt")
                self.fenced_command(attempt_id, command, None)

        def fenced_command(self, attempt_id: str, command: str, mutation: str | None) -> None:
            session = self.sides[0].fences[attempt_id][0]
            secret = dict(self.sessions)[session]

            def run(side: Side) -> Any:
                fence = side.fences[attempt_id][1]
                if mutation == "version":
                    fence = attrs.evolve(fence, version=fence.version + 1)
                elif mutation == "generation":
                    fence = attrs.evolve(fence, generation=fence.generation + 1)
                elif mutation == "token":
                    fence = attrs.evolve(fence, token="forged-token".ljust(32, "f"))
                w = side.workers
                if command == "renew":
                    return w.renew_many(session, secret, [fence])  # expiries are timestamps
                if command.startswith("complete"):
                    ok = command == "complete_ok"
                    return w.complete_many(session, secret, [Completion(
                        fence=fence, succeeded=ok, output={"ok": ok},
                        error=None if ok else "task error")])
                if command == "release":
                    return w.release_many(session, secret, [Release(fence=fence)])
                return w.abandon_many(session, secret, [Abandonment(fence, "stopping")])

            self.both(command, run)

        @precondition(lambda self: bool(self.sessions))
        @rule(data=st.data(), action=st.sampled_from(["poll", "drain", "close", "none", "none"]))
        def session_command(self, data: st.DataObject, action: str) -> None:
            session, secret = data.draw(st.sampled_from(self.sessions), label="session")
            if action != "none":
                self.both(action, lambda s: getattr(s.workers, action)(session, secret))

        @precondition(lambda self: bool(self.run_ids))
        @rule(data=st.data(), action=st.sampled_from(["attest", "attest", "cancel", "none"]))
        def operator(self, data: st.DataObject, action: str) -> None:
            """An operator attests a Run's latest Attempt stopped, or cancels the Run."""
            run_id = data.draw(st.sampled_from(self.run_ids), label="run")
            if action == "cancel":
                self.both("cancel", lambda s: s.admission.cancel(run_id))
                return
            with self.sides[0].store.unit_of_work() as uow:
                attempts = uow.runs.attempts_of(run_id)
            if attempts and action == "attest":
                attempt_id = attempts[-1].id
                self.both("attest", lambda s: s.workers.attest_stopped(attempt_id, "checked"))

        @rule(close=st.sampled_from([False, False, True]))
        def gate(self, close: bool) -> None:
            """Close the dispatch gate, or open it with step 5 alone."""
            if close:
                self.both("close_gate", lambda s: s.close_gate())
            else:
                self.both("open_gate", lambda s: s.gate.run_once())

        @rule(ms=st.sampled_from((0, *SMALL_STEPS, *SMALL_STEPS, *LARGE_STEPS)),
              cycle=st.booleans())
        def time_passes(self, ms: int, cycle: bool) -> None:
            """Time moves (a small or a large step), and the cadence may run."""
            if ms:
                self.advance_clock(ms)
            if cycle or not ms:
                kind, summary = self.both("cycle", lambda s: s.coordinator.run_cycle().as_dict())
                assert kind == "ok" and summary["ok"], summary

        def advance_clock(self, ms: int) -> None:
            _count(f"advance:{ms}")
            for side in self.sides:
                side.advance(ms)

        @rule(coin=st.integers(0, 3))
        def restart(self, coin: int) -> None:
            if coin == 0:  # a node restarts now and then
                self.both("restart", lambda s: s.startup.run())

        # --- the comparison -------------------------------------------------------------

        @invariant()
        def same_state(self) -> None:
            _count("steps")
            session_ids = [s for s, _ in self.sessions]
            memory, other = (side.state(session_ids) for side in self.sides)
            assert memory["sessions"] == other["sessions"]
            assert memory["reports"] == other["reports"]
            assert memory["gate"] == other["gate"]
            assert memory["runs"].keys() == other["runs"].keys()
            for run_id, mine in memory["runs"].items():
                assert mine == other["runs"][run_id], run_id
            # both sides granted the same Attempts to the same sessions
            assert {a: s for a, (s, _) in self.sides[0].fences.items()} == {
                a: s for a, (s, _) in self.sides[1].fences.items()
            }

    return Differential


@pytest.fixture(scope="module")
def pg_store(pg_database_url: str) -> Iterator[Any]:
    from ql3.adapters.postgres.store import PostgresStore

    store = PostgresStore.from_url(pg_database_url, create_schema=True)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[Any]:
    from ql3.adapters.sql.sqlite import SqliteStore

    store = SqliteStore(tmp_path / "differential.sqlite", synchronous="NORMAL")
    try:
        yield store
    finally:
        store.close()


def _agree(name: str, store: Any) -> None:
    """Run the differential machine: the memory store against ``store``."""

    def other_side() -> Side:
        store.testing_reset()
        return Side(name, store, store.testing_advance_clock)

    STATS.clear()
    started = time.monotonic()
    run_state_machine_as_test(
        make_differential(other_side),
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )
    elapsed = time.monotonic() - started
    print(f"\ndifferential (memory and {name}): {STATS.get('examples', 0)} examples, "
          f"{STATS.get('steps', 0)} compared states, {elapsed:.1f}s")
    for key in sorted(STATS):
        print(f"  {key}: {STATS[key]}")
    assert STATS["examples"] >= EXAMPLES
    assert STATS["steps"] > STATS["examples"]


# Shrinking a failing sequence takes far longer than a passing run.
@pytest.mark.timeout(1_800)
def test_memory_and_postgres_agree_on_every_command(pg_store: Any) -> None:
    _agree("postgres", pg_store)


@pytest.mark.timeout(1_800)
def test_memory_and_sqlite_agree_on_every_command(sqlite_store: Any) -> None:
    _agree("sqlite", sqlite_store)
