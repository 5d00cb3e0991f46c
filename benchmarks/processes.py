"""Real ``ql3 serve`` and ``ql3 worker`` processes for the benchmarks that drive a cluster.

:class:`Processes` starts them as ``python -m adapters.cli.main ...`` children of the benchmark
(each with its output in a log file of a private temporary directory), waits until a node
listens, and stops every process it started, by its id, when the ``with`` block ends: SIGTERM,
then SIGKILL if it does not end in time. A process that dies early or never gets ready becomes a
:class:`~benchmarks.common.BenchmarkError` quoting the last line of its log.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx
from psycopg import sql
from sqlalchemy.engine import make_url

from benchmarks.common import BenchmarkError, connect
from benchmarks.tasks import APP_SPEC

PROJECT_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
READY_LINE = "ql3 node listening on "


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    started_at: float  # time.monotonic() right before the spawn

    @property
    def pid(self) -> int:
        return self.popen.pid

    def running(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> float:
        """SIGKILL; returns time.monotonic() right after the signal was sent."""
        if self.running():
            os.kill(self.popen.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        self.popen.wait(timeout=STOP_TIMEOUT_S)
        return killed_at

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM and wait; SIGKILL after ``timeout_s``. Returns the exit status."""
        if self.running():
            os.kill(self.popen.pid, signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.popen.pid, signal.SIGKILL)
            return self.popen.wait(timeout=STOP_TIMEOUT_S)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def last_line(self) -> str:
        lines = [line for line in self.output().splitlines() if line.strip()]
        return lines[-1].strip()[-300:] if lines else "(no output)"

    def check_alive(self) -> None:
        if not self.running():
            raise BenchmarkError(
                f"{self.name} exited with {self.popen.returncode}: {self.last_line()}"
            )


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    what: str,
    interval_s: float = 0.02,
    watch: Sequence[Process] = (),
) -> None:
    """Poll ``predicate`` until true; a watched process that exits, or the timeout, raises."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for process in watch:
            process.check_alive()
        if time.monotonic() > deadline:
            raise BenchmarkError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)


class Processes:
    """The cluster processes of one benchmark; a context manager that stops them all."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url
        self._workdir = tempfile.TemporaryDirectory(prefix="ql3-bench-")
        self._started: list[Process] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            for process in reversed(self._started):
                if process.running():
                    process.terminate()
        finally:
            self._workdir.cleanup()

    def _spawn(self, name: str, argv: list[str]) -> Process:
        log = Path(self._workdir.name) / f"{name}-{len(self._started)}.log"
        env = {**os.environ, "QL3_DATABASE_URL": self.database_url}
        env.pop("QL3_INGRESS_DATABASE_URL", None)
        env.pop("QL3_REGISTRATION_TOKEN", None)
        with log.open("wb") as handle:
            started_at = time.monotonic()
            popen = subprocess.Popen(
                [sys.executable, "-m", "adapters.cli.main", *argv],
                cwd=PROJECT_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
            )
        process = Process(name=name, popen=popen, log=log, started_at=started_at)
        self._started.append(process)
        return process

    def start_node(self, flags: Sequence[str]) -> tuple[Process, str]:
        """``ql3 serve --port 0 FLAGS...``; returns the process and its URL once it listens."""
        process = self._spawn("node", ["serve", "--port", "0", *flags])
        url: list[str] = []

        def listening() -> bool:
            for line in process.output().splitlines():
                if line.startswith(READY_LINE):
                    url.append(line.rsplit(" ", 1)[1].strip())
                    return True
            return False

        wait_until(listening, READY_TIMEOUT_S, "the node to listen", 0.05, watch=[process])
        try:
            health = httpx.get(f"{url[0]}/v1/health", timeout=5).json()
        except (httpx.HTTPError, ValueError) as error:
            raise BenchmarkError(f"the node at {url[0]} does not answer: {error}") from None
        if health != {"status": "ok"}:
            raise BenchmarkError(f"the node at {url[0]} is not healthy: {health}")
        return process, url[0]

    def start_worker(self, node_url: str, worker_id: str, flags: Sequence[str]) -> Process:
        """``ql3 worker`` on the benchmark tasks; it registers in the background."""
        return self._spawn(
            f"worker-{worker_id}",
            [
                "worker",
                "--ingress",
                node_url,
                "--app",
                APP_SPEC,
                "--worker-id",
                worker_id,
                *flags,
            ],
        )

    def ql3(self, *argv: str, env: dict[str, str] | None = None) -> None:
        """A one-shot ``ql3`` command on the benchmark's database; fails with its stderr."""
        done = subprocess.run(
            [sys.executable, "-m", "adapters.cli.main", *argv],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "QL3_DATABASE_URL": self.database_url, **(env or {})},
            check=False,
        )
        if done.returncode != 0:
            detail = " ".join(done.stderr.split())[-300:]
            raise BenchmarkError(f"ql3 {' '.join(argv)} failed ({done.returncode}): {detail}")


@contextmanager
def ingress_role(admin: str) -> Iterator[str]:
    """A name for a throwaway ingress role (``ql3 db grant-ingress`` creates it); dropped on the
    way out. Enter it before the database it is granted on, so that the database (and with it
    the role's grants) is gone when the role is dropped."""
    name = f"ql3_bench_ingress_{secrets.token_hex(4)}"
    try:
        yield name
    finally:
        with connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def role_url(database_url: str, role: str, password: str) -> str:
    """``database_url`` connecting as ``role``."""
    return make_url(database_url).set(username=role, password=password).render_as_string(
        hide_password=False
    )
