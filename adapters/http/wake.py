"""The signal parked claims wait on (ADR 0007): an asyncio-level wake-up, set from any thread.

A claim that found nothing to start may park until work may be there. It takes a
:class:`ClaimTicket` *before* its claim transaction; the ticket remembers the signal's
generation at that moment. :meth:`ClaimSignal.wake` (a dispatch wake-up: a NOTIFY seen by the
node's LISTEN connection, or a scheduler cycle's end while that connection is down) increments
the generation and resolves the futures of the tickets that wait. A wake-up that happens while
the transaction runs, before the wait begins, changed the generation: the wait returns at
once and the claim claims again, so no wake-up is lost.

:meth:`ClaimSignal.wake_session` wakes the tickets of one session (another call of that
session frees its parked claim); :meth:`ClaimSignal.close` (shutdown) releases every ticket,
now and later. A parked claim holds no thread: it awaits a future of its event loop, which the
waking thread resolves with ``call_soon_threadsafe``."""

from __future__ import annotations

import asyncio
import enum
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress


class Woken(enum.Enum):
    """Why a wait ended (the first of these that holds, in this order)."""

    SHUTDOWN = "shutdown"  # the node stops: answer now
    GONE = "gone"  # the client went away: answer nothing more
    SESSION = "session"  # another call of the same session: answer now
    DISPATCH = "dispatch"  # work may be queued: claim again
    TIMEOUT = "timeout"  # the wait is over


class ClaimTicket:
    """One claim's place in the signal, from before its first transaction to its answer.

    Used by one coroutine at a time, on the event loop it was taken on."""

    def __init__(self, signal: ClaimSignal, session_id: str, loop: asyncio.AbstractEventLoop):
        self.session_id = session_id
        self._signal = signal
        self._loop = loop
        self._seen = signal.generation
        self._session_woken = False
        self._gone = False
        self._future: asyncio.Future[None] | None = None

    async def wait(self, timeout_s: float) -> Woken:
        """Wait for a wake-up newer than the last transaction, at most ``timeout_s``. On
        :attr:`Woken.DISPATCH` the ticket takes the current generation: a wake-up during the
        next transaction will end the next wait at once."""
        with self._signal._lock:
            woken = self._woken()
            if woken is None and timeout_s > 0:
                self._future = self._loop.create_future()
            future = self._future
        if woken is None and future is not None:
            try:
                await asyncio.wait((future,), timeout=timeout_s)
            finally:
                with self._signal._lock:
                    self._future = None
                    future.cancel()
        with self._signal._lock:
            woken = self._woken() or Woken.TIMEOUT
            if woken is Woken.DISPATCH:
                self._seen = self._signal.generation
        return woken

    @property
    def waiting(self) -> bool:
        return self._future is not None

    def gone(self) -> None:
        """The client disconnected: end the wait (on the ticket's event loop)."""
        with self._signal._lock:
            self._gone = True
            self._resolve()

    # Called with the signal's lock held.

    def _woken(self) -> Woken | None:
        if self._signal.closed:
            return Woken.SHUTDOWN
        if self._gone:
            return Woken.GONE
        if self._session_woken:
            return Woken.SESSION
        if self._signal.generation != self._seen:
            return Woken.DISPATCH
        return None

    def _wake_session(self) -> None:
        self._session_woken = True
        self._resolve()

    def _resolve(self) -> None:
        future = self._future
        if future is None or future.done():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            future.set_result(None)
        else:
            with suppress(RuntimeError):  # the loop is closed: nobody waits any more
                self._loop.call_soon_threadsafe(_set_result, future)


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class ClaimSignal:
    """The wake-ups of a node's parked claims; every method may be called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._closed = False
        self._tickets: dict[str, set[ClaimTicket]] = {}

    @property
    def generation(self) -> int:
        """How many dispatch wake-ups there were."""
        return self._generation

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def claims(self) -> int:
        """Claims being answered (in a transaction or waiting)."""
        with self._lock:
            return sum(len(tickets) for tickets in self._tickets.values())

    @property
    def waiting(self) -> int:
        """Claims waiting now for a wake-up."""
        with self._lock:
            return sum(t.waiting for tickets in self._tickets.values() for t in tickets)

    def wake(self) -> None:
        """A dispatch wake-up: work may be queued. Every waiting claim claims again; a claim
        in its transaction now will claim again instead of waiting."""
        with self._lock:
            self._generation += 1
            for tickets in self._tickets.values():
                for ticket in tickets:
                    ticket._resolve()

    def wake_session(self, session_id: str) -> None:
        """Another call of this session: its parked claims answer now, without claiming
        again."""
        with self._lock:
            for ticket in self._tickets.get(session_id, ()):
                ticket._wake_session()

    def close(self) -> None:
        """Shutdown: every parked claim answers now, and no claim parks any more."""
        with self._lock:
            self._closed = True
            for tickets in self._tickets.values():
                for ticket in tickets:
                    ticket._resolve()

    @contextmanager
    def ticket(self, session_id: str) -> Iterator[ClaimTicket]:
        """A ticket for one claim of ``session_id``, taken on the running event loop; take it
        before the claim's first transaction."""
        loop = asyncio.get_running_loop()
        with self._lock:
            ticket = ClaimTicket(self, session_id, loop)
            self._tickets.setdefault(session_id, set()).add(ticket)
        try:
            yield ticket
        finally:
            with self._lock:
                tickets = self._tickets.get(session_id)
                if tickets is not None:
                    tickets.discard(ticket)
                    if not tickets:
                        del self._tickets[session_id]
