"""The worker protocol carried by the database itself: a direct worker (ADR 0026).

A worker inside the database's network runs the worker commands
(:class:`ql3.application.worker_commands.WorkerCommands`) in its own process, on the worker
ingress's store (:class:`ql3.adapters.postgres.ingress.PostgresIngressStore`) signed in as a
login role that holds exactly the ingress role's grants (``ql3 db grant-ingress ROLE``): it may
call the fenced ``ql3_ingress_*`` functions and read, and nothing else. The functions check
every change as they do for the node's ingress, so a direct worker makes the same transitions as
one that goes through a node, without the HTTP hop.

This transport wraps :class:`~ql3.adapters.worker.inprocess.InProcessTransport` and gives it what
the remote worker's loop (:class:`ql3.adapters.worker.runtime.Worker`) expects of a transport:

- a refusal of the commands is raised as :class:`~ql3.adapters.worker.protocol.IngressRefused`
  with the status the node would answer (:func:`~ql3.adapters.worker.inprocess.refusal`);
- a call the store could not make (the database is down or restarting, a connection broke) is
  made again after a pause, doubling up to :data:`RETRY_CAP_S`: for as long as the database
  stays away while the worker has a session (ADR 0028), with a warning each budget spent,
  within the budget otherwise; past it the call raises
  :class:`~ql3.adapters.worker.protocol.IngressUnavailable`. A failed transaction rolled back:
  nothing is known to have changed;
- the long poll: a claim that got nothing because nothing is queued (or the dispatch gate is
  closed) waits up to ``wait_ms`` for a wake-up of the dispatch channel, heard on the worker's
  own LISTEN connection, and claims again; another call of the session (a completion sent
  alone, say) ends the wait at once, as it ends a claim parked at a node. While the LISTEN
  connection is down the wait claims again every :data:`UNHEARD_POLL_S`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar

from ql3.adapters.worker.inprocess import InProcessTransport, refusal
from ql3.adapters.worker.protocol import (
    Abandonment,
    BatchResult,
    ClaimResult,
    Completion,
    Fence,
    Heartbeat,
    IngressUnavailable,
    Registration,
    Release,
)
from ql3.application.worker_commands import WorkerCommands

T = TypeVar("T")

log = logging.getLogger("ql3.worker")

RETRY_INITIAL_S = 0.05
RETRY_CAP_S = 2.0
GIVE_UP_POLL_S = 0.05
DEFAULT_RETRY_BUDGET_S = 5.0
HEARD_POLL_S = 0.25  # how often a parked claim looks at giving up
UNHEARD_POLL_S = 1.0  # how often a parked claim claims again while the LISTEN connection is down
# A claim that got nothing for one of these reasons may wait for work.
WAITS_FOR = frozenset({"nothing_queued", "gate_closed"})


class WakeSource(Protocol):
    """The dispatch channel's LISTEN connection (:class:`ql3.adapters.postgres.listen.
    DispatchListener`): it calls back on every notification and after each reconnection."""

    @property
    def connected(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...


class DirectTransport:
    """One direct worker's session. Its calls may come from several threads (the claimer's and
    the reporter's): each runs in a transaction of its own on the store's pool."""

    def __init__(
        self,
        commands: WorkerCommands,
        *,
        open_wake: Callable[[Callable[[], None]], WakeSource] | None = None,
        close_store: Callable[[], None] | None = None,
    ) -> None:
        self._inner = InProcessTransport(commands)
        self._close_store = close_store or (lambda: None)
        self.retry_budget_s = DEFAULT_RETRY_BUDGET_S
        # Asked between tries: true stops the repeating (the worker is stopping).
        self.give_up: Callable[[], bool] = lambda: False
        # A session's call is repeated past the budget until answered (false once stopping).
        self.keep_trying = True
        self._changed = threading.Condition()
        self._wakes = 0
        self._other_calls = 0
        self._wake = open_wake(self._on_wake) if open_wake is not None else None
        if self._wake is not None:
            self._wake.start()

    @property
    def other_calls(self) -> int:
        return self._other_calls

    def set_timeout(self, timeout_s: float) -> None:
        """Nothing to set: a statement waits as long as the database makes it."""

    def close_connection(self) -> None:
        if self._wake is not None:
            self._wake.stop(timeout=1.0)
        self._close_store()

    # --- the calls --------------------------------------------------------------------------

    def register(
        self,
        worker_id: str,
        capacity: int,
        tasks: Sequence[str],
        *,
        budget_s: float | None = None,
    ) -> Registration:
        return self._call(
            "register",
            lambda: self._inner.register(worker_id, capacity, tasks),
            budget_s=budget_s,
            until_answered=False,
        )

    def heartbeat(self) -> Heartbeat:
        return self._other("heartbeat", self._inner.heartbeat)

    def drain(self) -> None:
        self._other("drain", self._inner.drain)

    def close(self) -> None:
        self._other("close", self._inner.close)

    def renew(self, fences: Sequence[Fence]) -> BatchResult:
        return self._other("renew", lambda: self._inner.renew(fences))

    def complete(self, items: Sequence[Completion]) -> BatchResult:
        return self._other("complete", lambda: self._inner.complete(items))

    def abandon(self, items: Sequence[Abandonment]) -> BatchResult:
        return self._other("abandon", lambda: self._inner.abandon(items))

    def release(self, items: Sequence[Release]) -> BatchResult:
        return self._other("release", lambda: self._inner.release(items))

    def claim(
        self,
        limit: int,
        wait_ms: int = 0,
        held: Sequence[str] | None = None,
        completions: Sequence[Completion] = (),
    ) -> ClaimResult:
        """One claim's transaction; then, while it granted nothing for want of work, wait for a
        wake-up (at most ``wait_ms``) and claim again, without completions or a statement (the
        first transaction committed them). ``completed`` and ``released`` are the first
        transaction's, the grants the last one's."""
        deadline = time.monotonic() + wait_ms / 1000
        with self._changed:
            wakes, others = self._wakes, self._other_calls
        first = self._call(
            "claim", lambda: self._inner.claim(limit, held=held, completions=completions)
        )
        last = first
        while limit > 0 and not last.grants and last.no_grant in WAITS_FOR:
            woken_at = self._wait_for_work(deadline, wakes, others)
            if woken_at is None:
                break
            wakes = woken_at
            last = self._call("claim", lambda: self._inner.claim(limit))
        if last is first:
            return first
        return replace(last, completed=first.completed, released=first.released)

    # --- how a call is made ------------------------------------------------------------------

    def _wait_for_work(self, deadline: float, wakes: int, others: int) -> int | None:
        """Wait for a wake-up after the ``wakes``-th: its count, to claim again. None at the
        deadline, when the worker gives up, or when another call of the session went out after
        the ``others``-th (it ends the wait). While the LISTEN connection is down, every
        :data:`UNHEARD_POLL_S` counts as a wake-up: nobody else would say."""
        with self._changed:
            while True:
                if self._other_calls != others or self.give_up():
                    return None
                if self._wakes != wakes:
                    return self._wakes
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                heard = self._wake is not None and self._wake.connected
                notified = self._changed.wait(min(left, HEARD_POLL_S if heard else UNHEARD_POLL_S))
                if not notified and not heard and time.monotonic() < deadline:
                    return self._wakes

    def _on_wake(self) -> None:
        with self._changed:
            self._wakes += 1
            self._changed.notify_all()

    def _other(self, what: str, call: Callable[[], T]) -> T:
        """A call of the session other than a claim: it ends a parked claim."""
        with self._changed:
            self._other_calls += 1
            self._changed.notify_all()
        return self._call(what, call)

    def _call(
        self,
        what: str,
        call: Callable[[], T],
        *,
        budget_s: float | None = None,
        until_answered: bool = True,
    ) -> T:
        budget = self.retry_budget_s if budget_s is None else budget_s
        started = time.monotonic()
        deadline = started + budget
        pause = RETRY_INITIAL_S
        tries = 0
        while True:
            tries += 1
            try:
                return call()
            except Exception as error:
                refused = refusal(error)
                if refused is not None:
                    raise refused from None
                now = time.monotonic()
                if now >= deadline and until_answered and self.keep_trying and not self.give_up():
                    log.warning(
                        "the database has not answered %s for %.0f s (%d tries: %s: %s); trying on",
                        what,
                        now - started,
                        tries,
                        type(error).__name__,
                        _first_line(error),
                    )
                    deadline = now + budget
                if now >= deadline or self.give_up():
                    raise IngressUnavailable(
                        f"the database did not answer {what} within {budget:.1f} s "
                        f"({tries} tries): {type(error).__name__}: {_first_line(error)}"
                    ) from None
                until = min(now + random.uniform(pause / 2, pause), deadline)
                while (left := until - time.monotonic()) > 0 and not self.give_up():
                    time.sleep(min(left, GIVE_UP_POLL_S))
                pause = min(pause * 2, RETRY_CAP_S)


def _first_line(error: BaseException) -> str:
    return str(error).split("\n", 1)[0][:200]
