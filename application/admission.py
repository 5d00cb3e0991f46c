"""Admission of Runs (single and in bulk) and cancellation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from application.ports import Identities, UnitOfWorkFactory
from domain.errors import InvalidTransition
from domain.model import JsonValue, RunOwner
from domain.policy import RetryPolicy
from domain.states import WAITING_RUN_STATUSES
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

    def submit(
        self,
        task: str,
        input: JsonValue = None,
        policy: RetryPolicy | None = None,
        *,
        timeout_ms: int | None = None,
    ) -> str:
        return self.submit_many(
            [AdmissionRequest(task=task, input=input, policy=policy, timeout_ms=timeout_ms)]
        )[0]

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

    def cancel(self, run_id: str, reason: str = "cancelled by operator") -> None:
        """Cancel a non-terminal Run; its live lease is released, so a late worker's completion
        is refused by the fence."""
        self._cancel(run_id, reason, waiting_only=False)

    def cancel_waiting(self, run_id: str, reason: str = "cancelled") -> None:
        """Cancel a Run that no Attempt executes yet (``created``, ``queued``, ``retry_wait``);
        a started or finished Run is refused and nothing changes."""
        self._cancel(run_id, reason, waiting_only=True)

    def _cancel(self, run_id: str, reason: str, *, waiting_only: bool) -> None:
        with self._uow_factory() as uow:
            snapshot = uow.runs.lock_run(run_id)
            if snapshot is None:
                raise UnknownRun(run_id)
            status = snapshot.run.status
            if status.is_terminal:
                raise InvalidTransition("run", run_id, status.value, "be cancelled")
            if waiting_only and status not in WAITING_RUN_STATUSES:
                raise InvalidTransition("run", run_id, status.value, "be cancelled once started")
            change = cancel(
                run=snapshot.run,
                attempt=snapshot.attempt,
                lease=snapshot.lease,
                reason=reason,
                now_ms=uow.now_ms(),
            )
            uow.runs.apply(snapshot, change)
            uow.commit()
