"""Real ``ql3 serve``, ``ql3 worker`` and ``ql3 standalone`` processes (and the consumers of the
reference queues) for the benchmarks that drive them.

:class:`Processes` starts them as ``python -m ql3.adapters.cli.main ...`` (or ``python -m MODULE``)
children of the benchmark (each with its output in a log file of a private temporary directory),
waits until a node listens, and stops every process it started, by its id, when the ``with``
block ends: SIGTERM, then SIGKILL if it does not end in time. A process that dies early or never
gets ready becomes a :class:`~benchmarks.common.BenchmarkError` quoting the last line of its log.

CPU time is read from ``/proc/<pid>/stat`` (Linux): :func:`tree_cpu_seconds` is what a process
and all its descendants have used so far, :class:`ServerCpu` the same for a PostgreSQL server
running on this machine.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
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


def node_argv(flags: Sequence[str], port: int = 0) -> list[str]:
    """The command line of a benchmark's node: ``ql3 serve --port PORT FLAGS...`` (0: a free
    port, printed when it listens)."""
    return ["serve", "--port", str(port), *flags]


def worker_argv(node_url: str | Sequence[str], worker_id: str, flags: Sequence[str]) -> list[str]:
    """The command line of a benchmark's worker on the benchmark tasks, reaching one node or
    several, in turn."""
    urls = [node_url] if isinstance(node_url, str) else list(node_url)
    reach = [arg for url in urls for arg in ("--ingress", url)]
    return ["worker", *reach, "--app", APP_SPEC, "--worker-id", worker_id, *flags]


def direct_worker_argv(database_url: str, worker_id: str, flags: Sequence[str]) -> list[str]:
    """The command line of a benchmark's direct worker (ADR 0026) on the benchmark tasks:
    ``database_url`` connects as a login role of ``ql3 db grant-ingress``."""
    return [
        "worker",
        "--database-url",
        database_url,
        "--app",
        APP_SPEC,
        "--worker-id",
        worker_id,
        *flags,
    ]


def shown_argv(argv: list[str]) -> str:
    """A command line as printed: database URLs without their passwords."""
    shown = list(argv)
    for index, flag in enumerate(shown[:-1]):
        if flag in ("--ingress-database-url", "--database-url"):
            shown[index + 1] = make_url(shown[index + 1]).render_as_string(hide_password=True)
    return "ql3 " + " ".join(shown)


class Processes:
    """The cluster processes of one benchmark; a context manager that stops them all.
    ``database_url`` None: the children get no ``QL3_DATABASE_URL`` (a Standalone process names
    its database file itself)."""

    def __init__(self, database_url: str | None) -> None:
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

    def _spawn(
        self,
        name: str,
        argv: Sequence[str],
        module: str = "ql3.adapters.cli.main",
        extra_env: Mapping[str, str] | None = None,
    ) -> Process:
        log = Path(self._workdir.name) / f"{name}-{len(self._started)}.log"
        env = dict(os.environ)
        env.pop("QL3_DATABASE_URL", None)
        if self.database_url is not None:
            env["QL3_DATABASE_URL"] = self.database_url
        env.pop("QL3_INGRESS_DATABASE_URL", None)
        env.pop("QL3_REGISTRATION_TOKEN", None)
        env.update(extra_env or {})
        with log.open("wb") as handle:
            started_at = time.monotonic()
            popen = subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                cwd=PROJECT_ROOT,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env=env,
            )
        process = Process(name=name, popen=popen, log=log, started_at=started_at)
        self._started.append(process)
        return process

    def start(
        self,
        name: str,
        argv: Sequence[str],
        module: str = "ql3.adapters.cli.main",
        env: Mapping[str, str] | None = None,
    ) -> Process:
        """``python -m MODULE ARGV...`` (``ql3 ARGV...`` by default) with ``env`` added to its
        environment; stopped with the others."""
        return self._spawn(name, argv, module, env)

    def start_node(self, flags: Sequence[str], port: int = 0) -> tuple[Process, str]:
        """``ql3 serve --port PORT FLAGS...``; returns the process and its URL once it listens.
        A fixed ``port`` lets a restarted node keep the URL its workers know."""
        process = self._spawn("node", node_argv(flags, port))
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

    def start_worker(
        self, node_url: str | Sequence[str], worker_id: str, flags: Sequence[str]
    ) -> Process:
        """``ql3 worker`` on the benchmark tasks; it registers in the background."""
        return self._spawn(f"worker-{worker_id}", worker_argv(node_url, worker_id, flags))

    def ql3(self, *argv: str, env: dict[str, str] | None = None) -> None:
        """A one-shot ``ql3`` command on the benchmark's database; fails with its stderr."""
        done = subprocess.run(
            [sys.executable, "-m", "ql3.adapters.cli.main", *argv],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "QL3_DATABASE_URL": self.database_url or "", **(env or {})},
            check=False,
        )
        if done.returncode != 0:
            detail = " ".join(done.stderr.split())[-300:]
            raise BenchmarkError(f"ql3 {' '.join(argv)} failed ({done.returncode}): {detail}")

    def grant_login_role(self, role: str) -> str:
        """``ql3 db grant-ingress ROLE`` with a fresh password: a login role holding the
        ingress's grants (a direct worker's, or a node's ``--ingress-database-url``); the
        benchmark's database URL signed in as it."""
        assert self.database_url is not None
        password = secrets.token_urlsafe(16)
        self.ql3(
            "db",
            "grant-ingress",
            role,
            "--password-env",
            "QL3_BENCH_ROLE_PASSWORD",
            env={"QL3_BENCH_ROLE_PASSWORD": password},
        )
        return role_url(self.database_url, role, password)


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


# --- CPU time from /proc -----------------------------------------------------------------------

PROC = Path("/proc")


def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, OSError, ValueError):
        return 100


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, first);
    None when the process is gone or /proc is not there."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _ticks(fields: list[str]) -> int:
    """utime + stime + cutime + cstime: the process's own CPU time and that of the children it
    has waited for (fields 14 to 17)."""
    return sum(int(value) for value in fields[11:15])


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    try:
        entries = [entry.name for entry in PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        return children
    for name in entries:
        fields = _stat_fields(int(name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(name))
    return children


def _descendants(pid: int, children: dict[int, list[int]]) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, ()))
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds one process (and the children it has reaped) has used; 0.0 once gone."""
    fields = _stat_fields(pid)
    return 0.0 if fields is None else _ticks(fields) / _clock_ticks()


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and every process under it. A live descendant counts
    itself; one that exited and was reaped is in its parent's cutime and cstime, so nothing is
    counted twice. Read it before the processes of the tree exit."""
    total = 0
    for member in _descendants(pid, _children_by_parent()):
        fields = _stat_fields(member)
        if fields is not None:
            total += _ticks(fields)
    return total / _clock_ticks()


def tree_rss_mb(pid: int) -> float | None:
    """The resident memory of ``pid`` and every process under it, in MiB (``VmRSS``: pages
    shared between them, such as a forked child's, count in each); None when ``pid`` is gone
    or /proc is not there."""
    total_kb = 0
    found = False
    for member in _descendants(pid, _children_by_parent()):
        try:
            lines = (PROC / str(member) / "status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
                found = found or member == pid
    return round(total_kb / 1024, 1) if found else None


def _command(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ServerCpu:
    """The CPU time of a PostgreSQL server that runs on this machine: its postmaster and every
    process under it (backends, checkpointer, WAL writer, ...). A backend that exits between two
    readings is counted through the postmaster's reaped children."""

    postmaster: int

    @classmethod
    def of(cls, backend_pid: int) -> ServerCpu | None:
        """The server of a session whose backend is ``backend_pid``; None when that backend is
        not a ``postgres`` process of this machine (a remote server, another pid namespace)."""
        fields = _stat_fields(backend_pid)
        if fields is None or _command(backend_pid) != "postgres":
            return None
        postmaster = int(fields[1])
        return cls(postmaster) if _command(postmaster) == "postgres" else None

    def seconds(self, excluding: Sequence[int] = ()) -> float:
        """CPU seconds the server has used so far, less that of the backends ``excluding`` (the
        benchmark's own sessions)."""
        return tree_cpu_seconds(self.postmaster) - sum(cpu_seconds(pid) for pid in excluding)
