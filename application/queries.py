"""Read models for operators: a Run with its Attempts, leases and events."""

from __future__ import annotations

from dataclasses import dataclass

from ql3.application.ports import SchedulerUnitOfWorkFactory
from ql3.domain.model import Attempt, DispatchLease, JsonValue, Run, RunOwner, RunStatus
from ql3.domain.recovery import find_not_running_evidence, is_recovery_candidate
from ql3.domain.workflows import WorkflowStep


@dataclass(frozen=True, slots=True)
class AttemptView:
    attempt: Attempt
    lease: DispatchLease | None
    awaiting_evidence_since_ms: int | None


@dataclass(frozen=True, slots=True)
class StepView:
    """A workflow step and the Run it became, if it was admitted."""

    step: WorkflowStep
    run: Run | None


@dataclass(frozen=True, slots=True)
class RunView:
    run: Run
    attempts: tuple[AttemptView, ...]
    events: tuple[tuple[int, str, int, str | None, dict[str, JsonValue]], ...]
    observed_at_ms: int
    steps: tuple[StepView, ...] = ()

    def as_dict(self) -> dict[str, JsonValue]:
        run = self.run
        policy = run.policy
        return {
            "id": run.id,
            "task": run.task,
            "owner": run.owner.value,
            "status": run.status.value,
            "input": run.input,
            "output": run.output,
            "error": run.error,
            "parent_run_id": run.parent_run_id,
            "attempt_count": run.attempt_count,
            "next_attempt_at_ms": run.next_attempt_at_ms,
            "timeout_ms": run.timeout_ms,
            "unique_key": run.unique_key,
            "created_at_ms": run.created_at_ms,
            "updated_at_ms": run.updated_at_ms,
            "quarantine": None
            if run.quarantine is None
            else {"reason": run.quarantine.reason, "since_ms": run.quarantine.since_ms},
            "policy": None
            if policy is None
            else {
                "retry_on_lost": policy.retry_on_lost,
                "retry_on_error": policy.retry_on_error,
                "max_attempts": policy.max_attempts,
                "safety": policy.safety.value if policy.safety else None,
                "backoff_initial_ms": policy.backoff.initial_ms,
                "backoff_multiplier": policy.backoff.multiplier,
                "backoff_cap_ms": policy.backoff.cap_ms,
                "backoff_jitter": policy.backoff.jitter,
            },
            "attempts": [_attempt_dict(view) for view in self.attempts],
            "events": [
                {"sequence": seq, "type": kind, "at": at, "attempt_id": attempt_id, "data": data}
                for seq, kind, at, attempt_id, data in self.events
            ],
            "steps": [_step_dict(view) for view in self.steps],
        }


def _step_dict(view: StepView) -> dict[str, JsonValue]:
    step, run = view.step, view.run
    return {
        "id": step.step_id,
        "task": step.task,
        "after": list(step.after),
        "status": step.status.value,
        "run_id": step.run_id,
        "run_status": run.status.value if run is not None else None,
        "attempts": run.attempt_count if run is not None else 0,
    }


def _attempt_dict(view: AttemptView) -> dict[str, JsonValue]:
    attempt, lease = view.attempt, view.lease
    return {
        "id": attempt.id,
        "number": attempt.number,
        "status": attempt.status.value,
        "worker_id": attempt.worker_id,
        "session_id": attempt.session_id,
        "started_at_ms": attempt.started_at_ms,
        "finished_at_ms": attempt.finished_at_ms,
        "error": attempt.error,
        "lost_evidence": attempt.lost_evidence.value if attempt.lost_evidence else None,
        "awaiting_evidence_since_ms": view.awaiting_evidence_since_ms,
        "lease": None
        if lease is None
        else {
            "generation": lease.generation,
            "version": lease.version,
            "status": lease.status.value,
            "release_reason": lease.release_reason.value if lease.release_reason else None,
            "expires_at_ms": lease.expires_at_ms,
        },
    }


class RunQueries:
    def __init__(self, uow_factory: SchedulerUnitOfWorkFactory) -> None:
        self._uow_factory = uow_factory

    def show(self, run_id: str) -> RunView | None:
        with self._uow_factory() as uow:
            run = uow.runs.get_run(run_id)
            if run is None:
                return None
            now_ms = uow.now_ms()
            leases = {
                (lease.attempt_id, lease.generation): lease for lease in uow.runs.leases_of(run_id)
            }
            views = []
            for attempt in uow.runs.attempts_of(run_id):
                lease = (
                    leases.get((attempt.id, attempt.lease_generation))
                    if attempt.lease_generation is not None
                    else None
                )
                waiting_since: int | None = None
                if attempt.status.is_started and is_recovery_candidate(run, attempt, lease, now_ms):
                    session = uow.sessions.get(attempt.session_id) if attempt.session_id else None
                    evidence = find_not_running_evidence(
                        attempt, session, uow.evidence.reports_for(attempt.id)
                    )
                    if evidence is None:
                        waiting_since = lease.expires_at_ms if lease else attempt.updated_at_ms
                views.append(
                    AttemptView(
                        attempt=attempt, lease=lease, awaiting_evidence_since_ms=waiting_since
                    )
                )
            events = tuple(
                (
                    stored.sequence,
                    stored.event.type.value,
                    stored.event.at_ms,
                    stored.event.attempt_id,
                    dict(stored.event.data),
                )
                for stored in uow.runs.events_of(run_id)
            )
            steps: tuple[StepView, ...] = ()
            if run.owner is RunOwner.WORKFLOW:
                steps = tuple(
                    StepView(step=step, run=uow.runs.get_run(step.run_id) if step.run_id else None)
                    for step in uow.workflows.steps_of(run_id)
                )
            return RunView(
                run=run, attempts=tuple(views), events=events, observed_at_ms=now_ms, steps=steps
            )

    def list(self, status: RunStatus | None = None, limit: int = 100) -> list[Run]:
        with self._uow_factory() as uow:
            return list(uow.runs.list_runs(status, limit))
