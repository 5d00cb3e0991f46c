"""Operators' commands and reads (ADR 0010): quarantine of a broken Run, ``ql3 doctor``.

Quarantine is never automatic: runtime recovery and lost retry fail closed on a candidate
they cannot settle, and a person decides, with what ``ql3 doctor`` tells them, to take that Run
out of both steps so that they proceed. Lifting it puts the Run back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ql3.application.admission import UnknownRun
from ql3.application.ports import (
    HARD_PAGE_CAP,
    NodeCycle,
    OperationsSource,
    OperationsView,
    StepFailure,
    UnitOfWorkFactory,
)
from ql3.domain.model import JsonValue, Run
from ql3.domain.quarantine import quarantine, unquarantine
from ql3.domain.transitions import Change


class Quarantines:
    def __init__(self, uow_factory: UnitOfWorkFactory) -> None:
        self._uow_factory = uow_factory

    def quarantine(self, run_id: str, reason: str) -> Run:
        """Take the Run out of runtime recovery and lost retry; one audited event."""
        return self._change(
            run_id, lambda run, now_ms: quarantine(run=run, reason=reason, now_ms=now_ms)
        )

    def unquarantine(self, run_id: str, reason: str = "") -> Run:
        """Give the Run back to runtime recovery and lost retry; one audited event."""
        return self._change(
            run_id, lambda run, now_ms: unquarantine(run=run, reason=reason, now_ms=now_ms)
        )

    def _change(self, run_id: str, decide: Callable[[Run, int], Change]) -> Run:
        with self._uow_factory() as uow:
            snapshot = uow.runs.lock_run(run_id)
            if snapshot is None:
                raise UnknownRun(run_id)
            change = decide(snapshot.run, uow.now_ms())
            uow.runs.apply(snapshot, change)
            uow.commit()
            return change.run


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing ``ql3 doctor`` reports. ``problem``: the runtime is not making progress."""

    problem: bool
    what: str
    advice: str
    details: dict[str, JsonValue]

    def as_dict(self) -> dict[str, JsonValue]:
        return {
            "problem": self.problem,
            "what": self.what,
            "advice": self.advice,
            "details": self.details,
        }


def failure_details(failure: StepFailure) -> dict[str, JsonValue]:
    return {
        "step": failure.step,
        "run_id": failure.run_id,
        "attempt_id": failure.attempt_id,
        "error": failure.error,
        "since_ms": failure.since_ms,
        "cycles": failure.cycles,
    }


# A node records its cycle at least every 30 s while it cycles (``NodeHeartbeat``).
NODE_SILENT_AFTER_MS = 60_000


def node_dict(node: NodeCycle) -> dict[str, JsonValue]:
    return {
        "node_id": node.node_id,
        "ok": node.ok,
        "aborted_at": node.aborted_at,
        "cycles": node.cycles,
        "started_at_ms": node.started_at_ms,
        "last_cycle_at_ms": node.last_cycle_at_ms,
        "anonymous_workers": node.anonymous_workers,
    }


def diagnose(view: OperationsView) -> tuple[Finding, ...]:
    """What an operator should look at, most urgent first."""
    findings: list[Finding] = []
    latest = max((n.last_cycle_at_ms or 0 for n in view.nodes), default=None)
    silent_ms = view.observed_at_ms - latest if latest is not None else 0
    if silent_ms > NODE_SILENT_AFTER_MS:
        findings.append(
            Finding(
                problem=True,
                what=f"no node has run a scheduler cycle for {silent_ms // 1000} s",
                advice="start `ql3 serve`, or look at why its cadence stopped",
                details={"last_cycle_at_ms": latest},
            )
        )
    gate, failure = view.gate, view.gate.failure
    if failure is not None:
        findings.append(
            Finding(
                problem=True,
                what=(
                    f"{failure.step} fails on run {failure.run_id}"
                    f" (attempt {failure.attempt_id}), {failure.cycles} cycle(s) in a row:"
                    f" {failure.error}"
                ),
                advice=(
                    "the step stops at this run every cycle and no claim is granted meanwhile;"
                    " fix the cause, or take the run out of recovery and retry with"
                    f" `ql3 runs quarantine {failure.run_id} --reason TEXT`"
                ),
                details={**failure_details(failure), "gate_open": gate.open},
            )
        )
    elif not gate.open:
        findings.append(
            Finding(
                problem=True,
                what=f"the dispatch gate is closed: {gate.reason}",
                advice="claims grant nothing until a cycle's recovery and lost retry succeed",
                details={"reason": gate.reason, "since_ms": gate.changed_at_ms},
            )
        )
    if view.evidence.count:
        findings.append(
            Finding(
                problem=False,
                what=(f"{view.evidence.count} started attempt(s) wait for not-running evidence"),
                advice=(
                    "each stays as it is until its worker's session is closed or replaced, or"
                    " `ql3 attempts attest-stopped ATTEMPT_ID --reason TEXT`"
                ),
                details={"count": view.evidence.count, "oldest_ms": view.evidence.oldest_ms},
            )
        )
    if view.quarantined_count:
        findings.append(
            Finding(
                problem=False,
                what=f"{view.quarantined_count} run(s) are quarantined",
                advice="lift a quarantine with `ql3 runs unquarantine RUN_ID`",
                details={
                    "count": view.quarantined_count,
                    "runs": [quarantined_dict(run) for run in view.quarantined],
                },
            )
        )
    return tuple(findings)


def quarantined_dict(run: Run) -> dict[str, JsonValue]:
    return {
        "run_id": run.id,
        "task": run.task,
        "status": run.status.value,
        "reason": run.quarantine.reason if run.quarantine else None,
        "since_ms": run.quarantine.since_ms if run.quarantine else None,
    }


class Doctor:
    def __init__(self, source: OperationsSource) -> None:
        self._source = source

    def examine(self) -> tuple[OperationsView, tuple[Finding, ...]]:
        view = self._source.operations_view(HARD_PAGE_CAP)
        return view, diagnose(view)
