"""The one scheduler cadence: coordinators and the lifecycle that drives them.

Production order (ADR 0002): runtime recovery -> lost retry -> trigger schedule -> workflow
frontier -> task attempt admission. If recovery or lost retry fails, the rest of that cycle does
not run and the dispatch gate closes: no new work is dispatched while the authority state is
unknown. Step 5 of the next good cycle opens it again, unless the gate closed after that cycle's
recovery step began (ADR 0007).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ql3.application.diagnosis import CandidateFailed, FailingCandidate, describe
from ql3.application.ports import NO_METRICS, Metrics, NodeCycle, NodeRegistry


class StepReport(Protocol):
    def counts(self) -> Mapping[str, int]: ...


class SchedulerStep(Protocol):
    """One step of the cadence: does a bounded amount of work and reports counts."""

    def run_once(self) -> StepReport: ...


class AdmissionStep(Protocol):
    """Step 5, task attempt admission: told when the cycle's recovery step began (the store's
    clock its page observed; None without one), so that it never opens a gate that closed
    since (ADR 0007)."""

    def run_once(self, cycle_started_at_ms: int | None = None) -> StepReport: ...


class ObservedReport(StepReport, Protocol):
    @property
    def observed_at_ms(self) -> int | None: ...


class RecoveryStep(Protocol):
    """Step 1, runtime recovery: its first statement, the candidate page, observes the store's
    clock, which is when the cycle began."""

    def run_once(self) -> ObservedReport: ...


@dataclass(frozen=True, slots=True)
class EmptyReport:
    def counts(self) -> Mapping[str, int]:
        return {}


class NoTriggerSchedule:
    """Trigger schedule step for a deployment without triggers."""

    def run_once(self) -> EmptyReport:
        return EmptyReport()


class NoWorkflowFrontier:
    """Workflow frontier step for a deployment without workflows."""

    def run_once(self) -> EmptyReport:
        return EmptyReport()


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """One step of a cycle: its counts, or the error that ended the cycle and, when the step
    failed on one candidate, that candidate (ADR 0010); and how long it took."""

    name: str
    counts: Mapping[str, int]
    error: str | None = None
    candidate: FailingCandidate | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class CycleSummary:
    """What one cycle did, step by step. ``aborted_at`` names the step whose failure ended it."""

    steps: tuple[StepOutcome, ...]
    aborted_at: str | None = None

    @property
    def ok(self) -> bool:
        return self.aborted_at is None

    def step(self, name: str) -> StepOutcome | None:
        return next((s for s in self.steps if s.name == name), None)

    def followed_by(self, later: CycleSummary) -> CycleSummary:
        """This cycle's steps, then ``later``'s (which ran because these succeeded)."""
        return CycleSummary(steps=(*self.steps, *later.steps), aborted_at=later.aborted_at)

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "aborted_at": self.aborted_at,
            "steps": [
                {
                    "name": s.name,
                    "counts": dict(s.counts),
                    "error": s.error,
                    **(
                        {"run_id": s.candidate.run_id, "attempt_id": s.candidate.attempt_id}
                        if s.candidate is not None
                        else {}
                    ),
                }
                for s in self.steps
            ],
        }


def run_steps(steps: tuple[tuple[str, SchedulerStep], ...]) -> CycleSummary:
    """Run the steps in order; the first failure ends the cycle and is reported."""
    outcomes: list[StepOutcome] = []
    for name, step in steps:
        started = time.perf_counter()
        try:
            report = step.run_once()
        except CandidateFailed as failed:  # fail closed, naming the candidate
            outcomes.append(
                StepOutcome(
                    name=name,
                    counts={},
                    error=failed.candidate.error,
                    candidate=failed.candidate,
                    seconds=time.perf_counter() - started,
                )
            )
            return CycleSummary(steps=tuple(outcomes), aborted_at=name)
        except Exception as error:  # fail closed: reported, the next cadence tries again
            outcomes.append(
                StepOutcome(
                    name=name,
                    counts={},
                    error=describe(error),
                    seconds=time.perf_counter() - started,
                )
            )
            return CycleSummary(steps=tuple(outcomes), aborted_at=name)
        outcomes.append(
            StepOutcome(
                name=name, counts=dict(report.counts()), seconds=time.perf_counter() - started
            )
        )
    return CycleSummary(steps=tuple(outcomes))


@dataclass(frozen=True, slots=True)
class _AdmissionInCycle:
    step: AdmissionStep
    cycle_started_at_ms: int | None

    def run_once(self) -> StepReport:
        return self.step.run_once(self.cycle_started_at_ms)


class SchedulerCoordinator:
    """The inner scheduler: trigger schedule -> workflow frontier -> task attempt admission."""

    STEP_NAMES = ("trigger_schedule", "workflow_frontier", "task_attempt_admission")

    def __init__(
        self,
        trigger_schedule: SchedulerStep,
        workflow_frontier: SchedulerStep,
        task_attempt_admission: AdmissionStep,
    ) -> None:
        self._trigger_schedule = trigger_schedule
        self._workflow_frontier = workflow_frontier
        self._admission = task_attempt_admission

    def run_cycle(self, cycle_started_at_ms: int | None = None) -> CycleSummary:
        """The three steps; ``cycle_started_at_ms`` is when the cluster coordinator's recovery
        step began this cycle (None without one)."""
        return run_steps(
            (
                ("trigger_schedule", self._trigger_schedule),
                ("workflow_frontier", self._workflow_frontier),
                ("task_attempt_admission", _AdmissionInCycle(self._admission, cycle_started_at_ms)),
            )
        )


class GateCloser(Protocol):
    def close(self, reason: str, candidate: FailingCandidate | None = None) -> None: ...


GUARD_STEPS = ("runtime_recovery", "lost_retry")
"""The steps whose failure leaves lease authority unknown and closes the dispatch gate."""


class ClusterSchedulerCoordinator:
    """Puts runtime recovery and lost retry in front of the inner scheduler coordinator, and
    closes the dispatch gate when either fails.

    It owns no timer, pool, connection, cursor or per-run state: only its collaborators."""

    __slots__ = ("_gate", "_inner", "_lost_retry", "_metrics", "_recovery")

    STEP_NAMES = (*GUARD_STEPS, *SchedulerCoordinator.STEP_NAMES)

    def __init__(
        self,
        runtime_recovery: RecoveryStep,
        lost_retry: SchedulerStep,
        inner: SchedulerCoordinator,
        gate: GateCloser,
        metrics: Metrics = NO_METRICS,
    ) -> None:
        self._recovery = runtime_recovery
        self._lost_retry = lost_retry
        self._inner = inner
        self._gate = gate
        self._metrics = metrics

    def run_cycle(self) -> CycleSummary:
        recovery = _CycleStart(self._recovery)
        summary = run_steps((("runtime_recovery", recovery), ("lost_retry", self._lost_retry)))
        if summary.ok:
            summary = summary.followed_by(self._inner.run_cycle(recovery.observed_at_ms))
        if summary.aborted_at in GUARD_STEPS:
            step = summary.step(summary.aborted_at or "")
            # A store that cannot take this write cannot grant a claim either.
            with contextlib.suppress(Exception):
                self._gate.close(
                    f"{summary.aborted_at} failed: {step.error if step else ''}",
                    step.candidate if step else None,
                )
        report_cycle(self._metrics, summary, self.STEP_NAMES)
        return summary


class _CycleStart:
    """The recovery step, keeping when its page observed the store's clock: the cycle's start."""

    __slots__ = ("_step", "observed_at_ms")

    def __init__(self, step: RecoveryStep) -> None:
        self._step = step
        self.observed_at_ms: int | None = None

    def run_once(self) -> StepReport:
        report = self._step.run_once()
        self.observed_at_ms = report.observed_at_ms
        return report


def report_cycle(metrics: Metrics, summary: CycleSummary, step_names: tuple[str, ...]) -> None:
    """Each step's outcome and duration; the steps an abort left out are ``skipped``."""
    for name in step_names:
        step = summary.step(name)
        if step is None:
            metrics.step_finished(name, "skipped", 0.0)
        else:
            metrics.step_finished(name, "ok" if step.ok else "failed", step.seconds)
    metrics.cycle_finished(summary.ok)


class NodeHeartbeat:
    """A cycle listener that records this node's last cycle in the store (``ql3 status``):
    after the first cycle, whenever the outcome changes, and otherwise at most every
    ``every_s`` seconds, so that an idle cycle costs no statement for it and an idle node
    commits twice a minute for it (ADRs 0010, 0012). A failed
    write is tried again after the next cycle."""

    def __init__(
        self,
        registry: NodeRegistry,
        node_id: str,
        every_s: float = 30.0,
        *,
        anonymous_workers: bool = False,
    ) -> None:
        self._registry = registry
        self._node_id = node_id
        self._anonymous_workers = anonymous_workers
        self._every_s = every_s
        self._cycles = 0
        self._last: tuple[bool, str | None] | None = None
        self._written_at: float | None = None

    def __call__(self, summary: CycleSummary) -> None:
        self._cycles += 1
        outcome = (summary.ok, summary.aborted_at)
        now = time.monotonic()
        if (
            outcome == self._last
            and self._written_at is not None
            and now - self._written_at < self._every_s
        ):
            return
        self._registry.record_node_cycle(
            NodeCycle(
                node_id=self._node_id,
                ok=summary.ok,
                aborted_at=summary.aborted_at,
                cycles=self._cycles,
                anonymous_workers=self._anonymous_workers,
            )
        )
        self._last, self._written_at = outcome, now


class Coordinator(Protocol):
    def run_cycle(self) -> CycleSummary: ...


CycleListener = Callable[[CycleSummary], None]


class ClusterSchedulerLifecycle:
    """The only timer of a node: one thread that runs a cycle every ``cadence_s`` seconds.

    Never two cycles at once. A wake-up during a cycle coalesces into exactly one follow-up
    cycle. ``stop()`` waits for the running cycle, and no cycle starts after it."""

    def __init__(
        self,
        coordinator: Coordinator,
        cadence_s: float,
        on_cycle: CycleListener | None = None,
    ) -> None:
        if cadence_s <= 0:
            raise ValueError("cadence must be positive")
        self._coordinator = coordinator
        self._cadence_s = cadence_s
        self._on_cycle = on_cycle
        self._condition = threading.Condition()
        self._wake_requested = False
        self._running = False
        self._cycle_thread: int | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._cycles = 0
        self._last: CycleSummary | None = None

    @property
    def cycles(self) -> int:
        return self._cycles

    @property
    def last_summary(self) -> CycleSummary | None:
        return self._last

    def start(self) -> None:
        with self._condition:
            if self._stopped:
                raise RuntimeError("a stopped lifecycle cannot start again")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name="ql3-scheduler", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Ask for a cycle now; several wake-ups during a cycle make one follow-up cycle."""
        with self._condition:
            self._wake_requested = True
            self._condition.notify_all()

    def run_cycle_now(self) -> CycleSummary | None:
        """Run a cycle in the caller's thread unless one is running (then it coalesces into one
        follow-up cycle and None is returned). Without a timer thread, the caller also runs
        the follow-up cycles requested meanwhile. Never runs after ``stop()``."""
        with self._condition:
            if self._stopped:
                return None
            if self._running:
                self._wake_requested = True
                self._condition.notify_all()
                return None
            self._begin_cycle()
        summary = self._run_one()
        while True:
            with self._condition:
                if self._thread is not None or self._stopped or not self._wake_requested:
                    return summary
                self._begin_cycle()
            summary = self._run_one()

    def stop(self, timeout: float | None = None) -> None:
        """No cycle starts after this; waits for the running cycle, whoever runs it."""
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
            me = threading.get_ident()
            while self._running and self._cycle_thread not in (me, self._timer_ident()):
                self._condition.wait()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _timer_ident(self) -> int | None:
        return self._thread.ident if self._thread is not None else None

    def _begin_cycle(self) -> None:
        """Called with the condition held."""
        self._wake_requested = False
        self._running = True
        self._cycle_thread = threading.get_ident()

    def _run_one(self) -> CycleSummary:
        try:
            summary = self._coordinator.run_cycle()
            self._last = summary
            self._cycles += 1
        finally:
            with self._condition:
                self._running = False
                self._cycle_thread = None
                self._condition.notify_all()
        if self._on_cycle is not None:
            with contextlib.suppress(Exception):  # a listener never stops the cadence
                self._on_cycle(summary)
        return summary

    def _loop(self) -> None:
        while True:
            with self._condition:
                deadline = time.monotonic() + self._cadence_s
                while not self._wake_requested and not self._stopped:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._condition.wait(remaining)
                while self._running and not self._stopped:
                    self._condition.wait()
                if self._stopped:
                    return
                self._begin_cycle()
            self._run_one()
