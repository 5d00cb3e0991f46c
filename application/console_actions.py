"""The console's actions (ADR 0020): each one of the existing commands, taken by a named
operator, answered with what changed.

The operator's name goes into what the command itself records: the reason of a cancel (kept as
the Run's error and in its ``run_cancelled`` event), of a quarantine or its lift (their
events), of an attestation (the stop report and its ``evidence_recorded`` event) and of a
credential's revocation (its audit line). A task limit has no audit of its own in the store; its
change is written to the ``ql3.console.audit`` log with the operator's name. Running a Run again
is the one new use case: an admission whose event names the old Run and the operator."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ql3.application.admission import Admission, UnknownRun
from ql3.application.console import operator_reason
from ql3.application.operations import Quarantines
from ql3.application.ports import (
    CredentialUnitOfWorkFactory,
    Identities,
    UnitOfWorkFactory,
)
from ql3.application.task_limits import TaskLimits
from ql3.application.worker_commands import WorkerCommands
from ql3.domain.model import JsonValue, Run, RunStatus
from ql3.domain.rerun import run_again

audit = logging.getLogger("ql3.console.audit")


@dataclass(frozen=True, slots=True)
class Done:
    """What an action changed, in words, and the Run (if any) to look at next."""

    message: str
    run_id: str | None = None


class ConsoleActions:
    def __init__(
        self,
        uow_factory: UnitOfWorkFactory,
        identities: Identities,
        credentials: CredentialUnitOfWorkFactory | None = None,
    ) -> None:
        self._uow_factory = uow_factory
        self._identities = identities
        self._credentials = credentials
        self._admission = Admission(uow_factory, identities)
        self._quarantines = Quarantines(uow_factory)
        self._limits = TaskLimits(uow_factory)
        # The lease TTL is not used by an attestation.
        self._workers = WorkerCommands(uow_factory, identities, lease_ttl_ms=30_000)

    @property
    def keeps_credentials(self) -> bool:
        return self._credentials is not None

    def cancel(self, operator: str, run_id: str, reason: str) -> Done:
        was = self._admission.cancel(run_id, operator_reason(operator, reason or "cancelled"))
        audit.info("%s cancelled run %s (was %s)", operator, run_id, was.value)
        return Done(f"cancelled run {run_id} (was {was.value})", run_id)

    def quarantine(self, operator: str, run_id: str, reason: str) -> Done:
        if not reason.strip():
            from ql3.domain.errors import InvalidAdmission

            raise InvalidAdmission("a quarantine needs a reason")
        run = self._quarantines.quarantine(run_id, operator_reason(operator, reason))
        audit.info("%s quarantined run %s", operator, run_id)
        return Done(f"quarantined run {run.id} ({run.status.value})", run.id)

    def unquarantine(self, operator: str, run_id: str, reason: str) -> Done:
        run = self._quarantines.unquarantine(run_id, operator_reason(operator, reason))
        audit.info("%s unquarantined run %s", operator, run_id)
        return Done(f"unquarantined run {run.id} ({run.status.value})", run.id)

    def attest_stopped(self, operator: str, attempt_id: str, reason: str) -> Done:
        if not reason.strip():
            from ql3.domain.errors import InvalidAdmission

            raise InvalidAdmission("an attestation needs a reason")
        self._workers.attest_stopped(attempt_id, operator_reason(operator, reason))
        audit.info("%s attested attempt %s stopped", operator, attempt_id)
        with self._uow_factory() as uow:
            attempt = uow.runs.get_attempt(attempt_id)
        run_id = attempt.run_id if attempt is not None else None
        return Done(f"attested: attempt {attempt_id} is not running", run_id)

    def set_limit(self, operator: str, task: str, max_running: int) -> Done:
        limit = self._limits.set(task, max_running)
        audit.info("%s set the limit of task %s to %d", operator, task, max_running)
        return Done(f"{limit.task}: at most {limit.max_running} running at once")

    def clear_limit(self, operator: str, task: str) -> Done:
        cleared = self._limits.clear(task)
        audit.info("%s cleared the limit of task %s (%s)", operator, task, cleared)
        return Done(f"{task}: no limit" if cleared else f"{task} had no limit; nothing changed")

    def revoke_credential(self, operator: str, credential_id: str, reason: str) -> Done:
        if self._credentials is None:
            raise LookupError("this store keeps no worker credentials")
        from ql3.application.credentials import CredentialCommands

        commands = CredentialCommands(self._credentials, self._identities)
        revoked = commands.revoke(credential_id, operator_reason(operator, reason))
        audit.info("%s revoked credential %s", operator, credential_id)
        sessions = len(revoked.revoked_session_ids)
        return Done(f"revoked credential {credential_id} and {sessions} open session(s)")

    def run_of(self, run_id: str) -> Run | None:
        with self._uow_factory() as uow:
            return uow.runs.get_run(run_id)

    def run_again(
        self, operator: str, run_id: str, input: JsonValue, confirmation: str | None
    ) -> Done:
        """Admit ``run_id`` again with ``input`` (see :func:`ql3.domain.rerun.run_again`)."""
        with self._uow_factory() as uow:
            old = uow.runs.get_run(run_id)
            if old is None:
                raise UnknownRun(run_id)
            change = run_again(
                old=old,
                run_id=self._identities.new_id(),
                attempt_id=self._identities.new_id(),
                input=input,
                operator=operator,
                confirmation=confirmation,
                now_ms=uow.now_ms(),
            )
            uow.runs.add(change)
            uow.commit()
        audit.info("%s ran run %s again as %s", operator, run_id, change.run.id)
        return Done(f"run {run_id} runs again as {change.run.id}", change.run.id)


EventRow = tuple[int, str, int, str | None, dict[str, JsonValue]]


def again_of(events: Sequence[EventRow]) -> str | None:
    """The Run this one runs again, read from its admission event."""
    for _seq, kind, _at, _attempt, data in events:
        if kind == "run_admitted" and isinstance(data.get("again_of"), str):
            return str(data["again_of"])
    return None


RERUNNABLE = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})
