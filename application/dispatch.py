"""Step 5 of the cadence, task attempt admission: the dispatch gate (ADR 0007).

Workers claim queued Attempts themselves
(:meth:`ql3.application.worker_commands.WorkerCommands.claim`); what the cadence keeps is the
reason ADR-0232 runs admission after recovery and lost retry: no new work is dispatched while lease
authority is unknown. A failed recovery or lost-retry step closes the gate
(:meth:`DispatchGateStep.close`, called by the cluster coordinator); step 5 of a later cycle whose
earlier steps all succeeded opens it again, unless the gate closed after that cycle's recovery
step began (another replica's failure, reported meanwhile). Claims grant nothing while it is
closed and say why."""

from __future__ import annotations

from dataclasses import dataclass

from ql3.application.diagnosis import FailingCandidate, next_failure
from ql3.application.ports import DispatchGate, DispatchGateSource, SchedulerUnitOfWorkFactory

MAX_REASON_LENGTH = 500


@dataclass(frozen=True, slots=True)
class GateReport:
    opened: int = 0

    def counts(self) -> dict[str, int]:
        return {"gate_opened": self.opened}


class DispatchGateStep:
    """Opens the dispatch gate when a cycle reaches step 5; one read when it is open already."""

    def __init__(self, uow_factory: SchedulerUnitOfWorkFactory, source: DispatchGateSource) -> None:
        self._uow_factory = uow_factory
        self._source = source

    def run_once(self, cycle_started_at_ms: int | None = None) -> GateReport:
        """Open the gate unless it closed at or after ``cycle_started_at_ms``, the store's
        clock when this cycle's recovery step read its page (a compare-and-set: a close
        committed since is kept, and the next cycle opens it). None for a cycle without a
        recovery step (Standalone, Edge)."""
        if self._source.dispatch_gate().open:
            return GateReport()
        with self._uow_factory() as uow:
            opened = uow.gate.open(cycle_started_at_ms, uow.now_ms())
            if opened:
                uow.commit()
        return GateReport(opened=int(opened))

    def close(self, reason: str, candidate: FailingCandidate | None = None) -> None:
        """Close the gate: claims grant nothing until a later cycle reaches step 5. With the
        candidate the step failed on, the gate keeps the streak of failures on it."""
        with self._uow_factory() as uow:
            now_ms = uow.now_ms()
            previous = uow.gate.get().failure if candidate is not None else None
            uow.gate.set(
                DispatchGate(
                    open=False,
                    reason=reason[:MAX_REASON_LENGTH],
                    changed_at_ms=now_ms,
                    failure=next_failure(previous, candidate, now_ms),
                )
            )
            uow.commit()
