"""Admission of Runs (single and in bulk) and cancellation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from application.ports import Identities, UnitOfWorkFactory
from domain.model import JsonValue, RunOwner, RunStatus
from domain.policy import RetryPolicy
from domain.transitions import admit, cancel

MAX_BATCH = 10_000


class UnknownRun(LookupError):
    """No Run with that id."""


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    task: str
    input: JsonValue = None
    policy: RetryPolicy | None = None
    priority: int = 0
    unique_key: str | None = None
    timeout_ms: int | None = None


class Admission:
    """Admits Runs: each a ``queued`` Run with a pristine Attempt 1 and its policy snapshot."""

    def __init__(self, uow_factory: UnitOfWorkFactory, identities: Identities) -> None:
        self._uow_factory = uow_factory
        self._identities = identities

    def submit(self, task: str, input: JsonValue = None, policy: RetryPolicy | None = None) -> str:
        return self.submit_many([AdmissionRequest(task=task, input=input, policy=policy)])[0]

    def submit_many(self, requests: Sequence[AdmissionRequest]) -> list[str]:
        """Admit a batch in one transaction: all or none."""
        if not 1 <= len(requests) <= MAX_BATCH:
            raise ValueError(f"a batch holds 1..{MAX_BATCH} runs")
        with self._uow_factory() as uow:
            now_ms = uow.now_ms()
            changes = [
                admit(
                    run_id=self._identities.new_id(),
                    attempt_id=self._identities.new_id(),
                    task=request.task,
                    input=request.input,
                    policy=request.policy,
                    owner=RunOwner.RUNTIME,
                    priority=request.priority,
                    unique_key=request.unique_key,
                    timeout_ms=request.timeout_ms,
                    now_ms=now_ms,
                )
                for request in requests
            ]
            uow.runs.add_many(changes)
            uow.commit()
        return [change.run.id for change in changes]

    def cancel(self, run_id: str, reason: str = "cancelled") -> RunStatus:
        """Cancel an unfinished Run at once and return the status it had (ADR 0017). A waiting
        Run (``created``, ``queued``, ``retry_wait``) simply ends; a running Attempt is
        cancelled with it and its lease released for ``cancelled`` (version + 1), so the fence
        refuses the worker's renewal, completion or hand-back with reason ``cancelled`` and the
        worker stops the task. A finished Run is refused (:class:`InvalidTransition`) and
        nothing changes; an unknown id raises :class:`UnknownRun`."""
        with self._uow_factory() as uow:
            snapshot = uow.runs.lock_run(run_id)
            if snapshot is None:
                raise UnknownRun(run_id)
            change = cancel(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=snapshot.lease,
                reason=reason,
                now_ms=uow.now_ms(),
            )
            uow.runs.apply(snapshot, change)
            uow.commit()
        return snapshot.run.status
