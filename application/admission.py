"""Admission of Runs (single and in bulk), delayed and unique submissions (ADR 0015), and
cancellation."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ql3.domain.errors import ConcurrencyConflict, Error, InvalidAdmission
from ql3.domain.model import MAX_DELAY_MS, JsonValue, RunOwner, RunStatus
from ql3.domain.policy import RetryPolicy
from ql3.domain.transitions import Change, admit, cancel, due_time

if TYPE_CHECKING:
    from ql3.application.ports import (
        AdmissionUnitOfWork,
        AdmissionUnitOfWorkFactory,
        Identities,
        UnitOfWorkFactory,
    )

MAX_BATCH = 10_000
# How often one admission reads the unique keys again after another transaction took one of
# them between its read and its insert (each time at least one more key is found taken).
KEY_ROUNDS = 3


class UnknownRun(Error, LookupError):
    """No Run with that id."""


def delay_ms(delay: float | dt.timedelta) -> int:
    """A delay (seconds, or a ``timedelta``) in whole milliseconds; a negative, infinite or
    non-numeric one is refused."""
    if isinstance(delay, dt.timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        seconds = float(delay)
    else:
        raise InvalidAdmission("a delay is a number of seconds or a timedelta")
    if not math.isfinite(seconds) or not 0 <= seconds * 1000 <= MAX_DELAY_MS:
        raise InvalidAdmission(
            f"a delay must be a finite number of seconds within 0..{MAX_DELAY_MS // 1000}"
        )
    return round(seconds * 1000)


def epoch_ms(moment: dt.datetime) -> int:
    """A due time in epoch milliseconds; a naive ``datetime`` is taken as UTC."""
    if not isinstance(moment, dt.datetime):
        raise InvalidAdmission("a due time is a datetime")
    if moment.tzinfo is None or moment.utcoffset() is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return round(moment.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class AdmissionRequest:
    task: str
    input: JsonValue = None
    policy: RetryPolicy | None = None
    priority: int = 0
    unique_key: str | None = None
    timeout_ms: int | None = None
    # ADR 0015: a delay from the store's clock at admission, or a due time (epoch ms), not both
    delay_ms: int | None = None
    run_after_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    """The answer to one request: its Run's id, and whether that Run existed already (an
    unfinished Run held the request's unique key, and nothing was written for it)."""

    run_id: str
    existing: bool = False


class Admission:
    """Admits Runs: each a ``queued`` Run with a pristine Attempt 1 and its policy snapshot, or,
    delayed, a ``retry_wait`` Run due at its time (ADR 0015). A request whose unique key an
    unfinished Run holds is answered with that Run, and nothing is written for it."""

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
        """Admit a batch in one transaction: all or none. The ids in order (for a request whose
        unique key was held, the holder's)."""
        return [answer.run_id for answer in self.admit_many(requests)]

    def admit_many(self, requests: Sequence[AdmissionRequest]) -> list[Admitted]:
        """:meth:`submit_many`, each answer saying whether its Run existed already; see
        :func:`admit_requests`."""
        return admit_requests(self._uow_factory, self._identities, requests)

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


def admit_requests(
    uow_factory: AdmissionUnitOfWorkFactory,
    identities: Identities,
    requests: Sequence[AdmissionRequest],
) -> list[Admitted]:
    """Admit a batch in one transaction of ``uow_factory``: all or none, the answers in order.
    Requests of the batch with one unique key share one Run: the first of them is admitted
    (unless an unfinished Run holds the key), the later ones are answered ``existing``. Every
    admission goes through here, ``ql3 submit`` on its submit-only stores included."""
    if not 1 <= len(requests) <= MAX_BATCH:
        raise ValueError(f"a batch holds 1..{MAX_BATCH} runs")
    keys = sorted({r.unique_key for r in requests if r.unique_key is not None})
    with uow_factory() as uow:
        held = _held(uow, keys)
        for round_ in range(1, KEY_ROUNDS + 1):
            answers, changes = _changes(identities, requests, held, uow.now_ms())
            if not changes:
                break
            try:
                uow.runs.add_many(changes)
                break
            except ConcurrencyConflict:
                # Another transaction may have admitted a Run with one of the keys after they
                # were read (the partial unique index refused this batch, which left nothing
                # behind): read them again; a conflict of any other kind is raised.
                before, held = held, _held(uow, keys)
                if not keys or set(held) == set(before) or round_ == KEY_ROUNDS:
                    raise
        uow.commit()
    return answers


def _changes(
    identities: Identities,
    requests: Sequence[AdmissionRequest],
    held: Mapping[str, str],
    now_ms: int,
) -> tuple[list[Admitted], list[Change]]:
    taken = dict(held)
    answers: list[Admitted] = []
    changes: list[Change] = []
    for request in requests:
        key = request.unique_key
        if key is not None and key in taken:
            answers.append(Admitted(run_id=taken[key], existing=True))
            continue
        change = admit(
            run_id=identities.new_id(),
            attempt_id=identities.new_id(),
            task=request.task,
            input=request.input,
            policy=request.policy,
            owner=RunOwner.RUNTIME,
            priority=request.priority,
            unique_key=key,
            timeout_ms=request.timeout_ms,
            run_after_ms=due_time(
                now_ms, delay_ms=request.delay_ms, run_after_ms=request.run_after_ms
            ),
            now_ms=now_ms,
        )
        if key is not None:
            taken[key] = change.run.id
        changes.append(change)
        answers.append(Admitted(run_id=change.run.id))
    return answers, changes


def _held(uow: AdmissionUnitOfWork, keys: Sequence[str]) -> Mapping[str, str]:
    """The unfinished Runs holding any of ``keys``, by key (no read for none)."""
    return uow.runs.unfinished_with_keys(keys) if keys else {}
