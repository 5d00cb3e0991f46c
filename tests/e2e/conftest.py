"""Fixtures of the end-to-end tests: real ``ql3 serve`` and ``ql3 worker`` processes on a
PostgreSQL database, a side-effect ledger, and the services to submit and inspect runs.

``cluster``
    A :class:`Cluster` for the module: one node already serving (short lease TTL and cadence)
    whose ingress connects as its own least-privilege role (``ql3 db grant-ingress``),
    ``start_node()`` for more nodes on the same database, ``start_worker(...)`` for workers.
    Every process it started is stopped (by its id), and the role dropped, when the module is
    done.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from ql3.adapters.cli.main import main as cli_main
from ql3.application.queries import RunQueries
from ql3.bootstrap import cluster as cluster_root
from tests.postgres_server import connect, random_name

PROJECT_ROOT = Path(__file__).resolve().parents[2]
LEASE_TTL_S = 2.0
CADENCE_S = 0.5
START_TIMEOUT_S = 30.0


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    return state != "Z"


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.05)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signum)

    def wait(self, timeout: float = 30.0) -> int:
        return self.popen.wait(timeout=timeout)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(timeout=5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def run_ql3(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``ql3 ARGV`` run in this process, with ``env`` added to the environment: the status the
    console script exits with (what ``main`` returns) and what it printed. A client command
    only reads and writes the database; the nodes and workers are the real processes."""
    out, err = io.StringIO(), io.StringIO()
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = cli_main(argv)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(["ql3", *argv], code, out.getvalue(), err.getvalue())


def listening_url(process: Process) -> str:
    """The URL a ``ql3 serve`` process prints once it listens."""
    url: list[str] = []

    def ready() -> bool:
        assert process.popen.poll() is None, f"node exited:\n{process.output()}"
        for line in process.output().splitlines():
            if line.startswith("ql3 node listening on "):
                url.append(line.rsplit(" ", 1)[1])
                return True
        return False

    wait_for(ready, START_TIMEOUT_S, "the node to listen")
    return url[0]


@dataclass
class Ledger:
    path: Path

    def entries(self, event: str | None = None, run_id: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [
            r for r in rows
            if (event is None or r["event"] == event) and (run_id is None or r["run_id"] == run_id)
        ]


@dataclass
class Cluster:
    database_url: str
    workdir: Path
    processes: list[Process] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    container: Any = None
    # How start_worker's workers reach the work: through a node's ingress ("http"), or on the
    # database as the login role direct_url names (a direct worker, "direct").
    worker_form: str = "http"
    direct_url: str | None = None

    def __post_init__(self) -> None:
        self.container = cluster_root.build(database_url=self.database_url)
        self.queries = RunQueries(self.container.store().unit_of_work)

    # processes

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.workdir / f"{name}.log"
        handle = log.open("wb")
        popen = subprocess.Popen(
            [sys.executable, "-m", "ql3.adapters.cli.main", *argv],
            cwd=PROJECT_ROOT,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, "QL3_DATABASE_URL": self.database_url, **(env or {})},
        )
        handle.close()
        process = Process(name=name, popen=popen, log=log)
        self.processes.append(process)
        return process

    def grant_ingress_role(self) -> str:
        """A fresh ingress role on the database; returns its URL."""
        role = random_name("ql3_e2e_ingress_")
        granted = self.ql3("db", "grant-ingress", role)
        assert granted.returncode == 0, granted.stderr
        self.roles.append(role)
        return make_url(self.database_url).set(username=role, password=None).render_as_string(
            hide_password=False
        )

    def drop_roles(self) -> None:
        with connect(self.database_url) as conn:
            for role in self.roles:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))

    def start_node(self, ingress_database_url: str | None = None, *, port: int = 0) -> str:
        index = len(self.nodes)
        argv = ["serve", "--port", str(port), "--lease-ttl", str(LEASE_TTL_S),
                "--cadence", str(CADENCE_S)]
        if ingress_database_url:
            argv += ["--ingress-database-url", ingress_database_url]
        process = self._spawn(f"node-{index}", argv)
        url = listening_url(process)
        assert httpx.get(f"{url}/v1/health", timeout=5).json() == {"status": "ok"}
        self.nodes.append(url)
        return url

    def start_worker(self, prefix: str, worker_id: str, ledger: Ledger, *, concurrency: int = 1,
                     node: int | tuple[int, ...] = 0, name: str | None = None) -> Process:
        """``ql3 worker`` with its defaults but the concurrency: its claims wait at the node
        (a long poll) and pick work up as soon as it is queued. ``node``: the node it reaches,
        or the nodes, in turn."""
        if self.worker_form == "direct":
            assert self.direct_url is not None
            reach = ["--database-url", self.direct_url, "--lease-ttl", str(LEASE_TTL_S)]
        else:
            nodes = (node,) if isinstance(node, int) else node
            reach = [arg for n in nodes for arg in ("--ingress", self.nodes[n])]
        return self._spawn(
            name or f"worker-{worker_id}-{len(self.processes)}",
            ["worker", *reach, "--app", "tests.e2e.tasks:app",
             "--worker-id", worker_id, "--concurrency", str(concurrency)],
            env={"QL3_E2E_LEDGER": str(ledger.path), "QL3_E2E_PREFIX": prefix},
        )

    def ql3(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """A client command on the cluster's database: its exit status and output."""
        return run_ql3(list(argv), {"QL3_DATABASE_URL": self.database_url})

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    # runs

    def submit(self, task: str, payload: Any = None, policy: Any = None) -> str:
        run_id: str = self.container.core.admission().submit(task, payload, policy)
        return run_id

    def show(self, run_id: str) -> dict[str, Any]:
        view = self.queries.show(run_id)
        assert view is not None, run_id
        document: dict[str, Any] = view.as_dict()
        return document

    def status(self, run_id: str) -> str:
        return str(self.show(run_id)["status"])

    def wait_status(self, run_ids: list[str], statuses: set[str], timeout: float = 20.0) -> None:
        wait_for(lambda: all(self.status(r) in statuses for r in run_ids), timeout,
                 f"runs to reach {statuses}: " + ", ".join(self.status(r) for r in run_ids))


@pytest.fixture(scope="module")
def cluster(pg_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("e2e")
    built = Cluster(database_url=pg_database_url, workdir=workdir)
    with torn_down(built):
        built.start_node(ingress_database_url=built.grant_ingress_role())
        yield built


@contextmanager
def torn_down(built: Cluster) -> Iterator[None]:
    """On the way out: the processes' logs when it failed; every process stopped, the store
    closed and the roles dropped."""
    try:
        yield
    except BaseException:
        for process in built.processes:
            sys.stderr.write(f"--- {process.name} ---\n{process.output()[-4000:]}\n")
        raise
    finally:
        built.stop_all()
        built.container.store().close()
        built.drop_roles()


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "ledger.jsonl")


@pytest.fixture(autouse=True)
def _dump_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed and "cluster" in request.fixturenames:
        built: Cluster = request.getfixturevalue("cluster")
        for process in built.processes:
            sys.stderr.write(f"--- {process.name} ---\n{process.output()[-4000:]}\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
    return report
