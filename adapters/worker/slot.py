"""One execution slot: a child process that runs one task at a time and can really be stopped.

Python cannot stop a thread, so every task runs in a child process (one per slot, reused from
task to task). Stopping a task kills the child's whole process group with SIGKILL; the slot then
starts a fresh child for the next task. Children die with the worker (parent-death signal), so a
killed worker leaves no task of its behind.

An ``async def`` task is stopped by cancelling it first: the child gets ``SIGUSR1`` and cancels
the task's coroutine; a task that has not ended ``cancel_grace_s`` later (it ignored the
cancellation) has its slot killed as above. A task that let itself be cancelled leaves its child
running for the next task (ADR 0009)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO, Any

READY_TIMEOUT_S = 60.0
CANCEL_GRACE_S = 5.0
CANCEL_SIGNAL = signal.SIGUSR1


class SlotError(Exception):
    """The slot's child could not be started or loaded."""


@dataclass(frozen=True, slots=True)
class Job:
    attempt_id: str
    run_id: str
    attempt_number: int
    idempotency_key: str
    task: str
    input: Any


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """``killed`` when the slot stopped the task; otherwise succeeded with ``output`` or failed
    with ``error``. ``started`` is false when the job never reached the child (it was
    cancelled first, or the child was gone): then the task did not begin."""

    succeeded: bool
    output: Any = None
    error: str | None = None
    killed: bool = False
    started: bool = True


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [os.getcwd(), *[p for p in sys.path if p]]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class SlotProcess:
    """Runs jobs in a child process. :meth:`run` is called by one thread at a time (the slot's
    own); :meth:`kill` may be called from any thread."""

    def __init__(
        self, app_spec: str, name: str = "slot", *, cancel_grace_s: float = CANCEL_GRACE_S
    ) -> None:
        self._app_spec = app_spec
        self._name = name
        self._cancel_grace_s = cancel_grace_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._current: str | None = None
        self._current_is_async = False
        self._async_tasks: frozenset[str] = frozenset()
        self._killed = False
        self._cancelled: set[str] = set()  # stopped before their job reached the child

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        """Start the child and wait until it loaded the task mapping."""
        process = subprocess.Popen(
            [sys.executable, "-m", "ql3.adapters.worker.slot_main", self._app_spec,
             str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_child_env(),
            start_new_session=True,  # its own process group: stopped as a whole, no ^C
        )
        assert process.stdout is not None
        timer = threading.Timer(READY_TIMEOUT_S, lambda: _kill_group(process))
        timer.start()
        try:
            line = process.stdout.readline()
        finally:
            timer.cancel()
        try:
            ready = json.loads(line) if line else {"ready": False, "error": "child exited"}
        except ValueError:
            ready = {"ready": False, "error": "child answered garbage"}
        if not ready.get("ready"):
            _kill_group(process)
            process.wait()
            raise SlotError(str(ready.get("error", "the slot did not start")))
        with self._lock:
            self._process = process
            self._killed = False
            names = ready.get("async_tasks")
            self._async_tasks = (
                frozenset(map(str, names)) if isinstance(names, list) else frozenset()
            )

    def run(self, job: Job) -> JobOutcome:
        with self._lock:
            process = self._process
            if job.attempt_id in self._cancelled:
                self._cancelled.discard(job.attempt_id)
                return JobOutcome(
                    succeeded=False, error="stopped by the worker", killed=True, started=False
                )
            if process is None or process.poll() is not None:
                # The child is gone (killed while idle, say): the job never reached it, and
                # ``pid`` is None from here on, so the slot starts a fresh child.
                gone = "not started" if process is None else f"exited with {process.returncode}"
                self._process = None
                return JobOutcome(succeeded=False, error=f"the slot process {gone}", started=False)
            self._current = job.attempt_id
            self._current_is_async = job.task in self._async_tasks
            self._killed = False
        assert process.stdin is not None and process.stdout is not None
        request = {
            "task": job.task,
            "input": job.input,
            "run_id": job.run_id,
            "attempt_number": job.attempt_number,
            "idempotency_key": job.idempotency_key,
        }
        line = b""
        written = False
        try:
            _write_line(process.stdin, json.dumps(request).encode())
            written = True
            line = process.stdout.readline()
        except (BrokenPipeError, OSError):
            line = b""
        with self._lock:
            self._current = None
            killed = self._killed
        if killed:
            if not _cancelled_answer(line):  # killed, or it ended some other way meanwhile
                self._reap()
            return JobOutcome(succeeded=False, error="stopped by the worker", killed=True)
        if not line:
            code = self._reap()
            return JobOutcome(
                succeeded=False, error=f"the slot process exited with {code}", started=written
            )
        try:
            answer = json.loads(line)
        except ValueError:
            self._reap()
            return JobOutcome(succeeded=False, error="the slot process answered garbage")
        if answer.get("ok"):
            return JobOutcome(succeeded=True, output=answer.get("output"))
        return JobOutcome(succeeded=False, error=str(answer.get("error") or "failed"))

    def kill(self, attempt_id: str | None = None) -> bool:
        """Stop the running task (only if it is ``attempt_id``'s, when given). True if a task
        was stopped; a job of ``attempt_id`` that has not reached the child yet will not run."""
        with self._lock:
            process = self._process
            if attempt_id is not None and self._current != attempt_id:
                self._cancelled.add(attempt_id)
                return False
            if process is None or self._current is None:
                return False
            self._killed = True
            current, cancel_first = self._current, self._current_is_async
        if cancel_first and self._cancel_grace_s > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, CANCEL_SIGNAL)
            timer = threading.Timer(self._cancel_grace_s, self._kill_if_running, (current,))
            timer.daemon = True
            timer.start()
            return True
        _kill_group(process)
        return True

    def _kill_if_running(self, attempt_id: str) -> None:
        """The end of a cancellation's grace: kill the slot if the task still runs."""
        with self._lock:
            process = self._process
            still_running = self._current == attempt_id
        if process is not None and still_running:
            _kill_group(process)

    def close(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(OSError):
            assert process.stdin is not None
            process.stdin.close()
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.wait()

    def _reap(self) -> int | None:
        with self._lock:
            process, self._process = self._process, None
        if process is None:
            return None
        _kill_group(process)
        return process.wait()


def _cancelled_answer(line: bytes) -> bool:
    """The child's answer says the async task let itself be cancelled."""
    try:
        return bool(line) and bool(json.loads(line).get("cancelled"))
    except (ValueError, AttributeError):
        return False


def _write_line(pipe: IO[bytes], data: bytes) -> None:
    pipe.write(data + b"\n")
    pipe.flush()


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    if process.returncode is not None:  # reaped: its ids may belong to others by now
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
