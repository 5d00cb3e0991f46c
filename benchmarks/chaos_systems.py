"""The three systems the chaos benchmark drives, each as processes it can kill and restart, a
producer it can call, and a verdict on every job at the end.

* **QL3**: two ``ql3 serve`` nodes (fixed ports, so a restarted node keeps its URL) and two
  ``ql3 worker`` processes on one migrated database: direct workers (``--database-url``, as a
  login role made by ``ql3 db grant-ingress``; ADR 0026) by default, or with ``--ql3-workers
  http`` workers of the nodes (``--ingress`` for each node, worker *i* on node *i* first:
  it moves to the other node while its own does not answer, ADR 0028). Jobs are Runs of
  ``bench.ledger`` admitted with ``Admission.submit`` in turn with three policies: idempotent
  with retry on lost, unsafe (retry on lost asked for, which an unsafe Run never gets) and no
  policy. A Run is finished when it is terminal; one that is not is *waiting for evidence* when
  one of its started Attempts has an expired lease and no not-running evidence (what
  ``ql3 runs show`` reports), else it is unfinished.
* **PgQueuer** and **Procrastinate**: two consumer processes each (``python -m
  benchmarks.chaos_systems pgqueuer|procrastinate``), each running the same ledger task, with the
  recovery of stalled jobs each documents: PgQueuer re-picks a job whose heartbeat is older
  than ``heartbeat_timeout``; Procrastinate's workers heartbeat and each consumer retries the
  jobs of stalled workers (``JobManager.get_stalled_jobs`` then ``retry_job``, once a second).
  Their staleness thresholds equal QL3's lease TTL. A job is finished when the ledger holds its
  ``end``.

Every system's processes are supervised alike: one that exits without being told to is started
again (``restarts`` in the details), as a service manager would.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, ClassVar

from benchmarks.common import BenchmarkError, connect
from benchmarks.private_server import free_port
from benchmarks.processes import Process, Processes, direct_worker_argv
from benchmarks.tasks import LEDGER, record
from benchmarks.throughput import asyncpg_dsn, install_pgqueuer, serve_pgqueuer

KINDS = ("idempotent", "unsafe", "none")  # QL3's policies, in turn; a label for the peers
PROCRASTINATE_QUEUE = "chaos"
SUBMIT_TIMEOUT_S = 5.0
WORKER_ROLE = "ql3_chaos_worker"  # on the benchmark's private server, gone with it
CONSUMER_ENV = "QL3_BENCH_CHAOS_CONSUMER"  # JSON: dsn, slots, ttl_s

FINISHED, WAITING, UNFINISHED = "finished", "waiting_for_evidence", "unfinished"

Submit = Callable[[str, str], None]  # (key, kind); raises when the job was not admitted


@dataclass(frozen=True)
class ChaosSettings:
    slots: int  # per worker process
    lease_ttl_s: float  # QL3's lease TTL and the peers' staleness threshold
    cadence_s: float
    task_seconds: float
    ledger: str
    ql3_workers: str = "direct"  # QL3's worker form: "direct" or "http"


@dataclass
class Member:
    """One supervised process: ``spawn`` starts it; ``wanted`` False while it is down on
    purpose."""

    name: str
    spawn: Callable[[], Process]
    process: Process | None = None
    wanted: bool = True
    restarts: int = 0

    def down(self) -> bool:
        return self.process is None or not self.process.running()


class System:
    """What every system shares: its members, their supervision and the ledger's payload."""

    name: ClassVar[str]
    hot_tables: ClassVar[tuple[str, ...]]  # the hottest first

    def __init__(self, database_url: str, processes: Processes, settings: ChaosSettings) -> None:
        self.database_url = database_url
        self.dsn = asyncpg_dsn(database_url)  # libpq's form, for asyncpg and Procrastinate
        self.processes = processes
        self.settings = settings
        self.members: list[Member] = []
        self.workers: list[Member] = []
        self.lock = threading.Lock()

    def payload(self, key: str) -> dict[str, Any]:
        return {"ledger": self.settings.ledger, "key": key, "seconds": self.settings.task_seconds}

    def start(self) -> None:
        raise NotImplementedError

    def submitter(self) -> Any:  # a context manager yielding a Submit, used in one thread
        raise NotImplementedError

    def verdicts(self, keys: set[str], ledger_ends: set[str]) -> dict[str, str]:
        """FINISHED, WAITING or UNFINISHED for each key."""
        return {key: FINISHED if key in ledger_ends else UNFINISHED for key in keys}

    def commands(self) -> str:
        """How the system's processes run, for the report."""
        raise NotImplementedError

    def close(self) -> None:
        return None

    # supervision

    def add(self, name: str, spawn: Callable[[], Process], worker: bool = False) -> Member:
        member = Member(name=name, spawn=spawn)
        member.process = spawn()
        self.members.append(member)
        if worker:
            self.workers.append(member)
        return member

    def start_consumers(self) -> None:
        """Two ``python -m benchmarks.chaos_systems NAME`` consumer processes (the peers)."""
        settings = {
            "dsn": self.dsn,
            "slots": self.settings.slots,
            "ttl_s": self.settings.lease_ttl_s,
        }
        env = {CONSUMER_ENV: json.dumps(settings)}
        for index in range(2):
            name = f"{self.name}-{index}"
            spawn = partial(
                self.processes.start, name, [self.name], module="benchmarks.chaos_systems", env=env
            )
            self.add(name, spawn, worker=True)

    def kill_worker(self, index: int) -> None:
        with self.lock:
            member = self.workers[index]
            member.wanted = False
            if member.process is not None:
                member.process.kill()

    def start_worker(self, index: int) -> None:
        with self.lock:
            member = self.workers[index]
            member.wanted = True
            if member.down():
                member.process = member.spawn()

    def supervise(self) -> None:
        """Start again every wanted member that exited."""
        with self.lock:
            for member in self.members:
                if member.wanted and member.down():
                    try:
                        member.process = member.spawn()
                    except BenchmarkError:
                        member.process = None  # e.g. the server is down: next time
                    member.restarts += 1

    def restarts(self) -> int:
        return sum(member.restarts for member in self.members)


# --- QL3 ---------------------------------------------------------------------------------------


class Ql3(System):
    name = "ql3"
    hot_tables = ("runs", "run_attempts", "run_dispatch_leases", "run_events")

    def __init__(self, database_url: str, processes: Processes, settings: ChaosSettings) -> None:
        super().__init__(database_url, processes, settings)
        self.node_flags = [
            "--lease-ttl",
            f"{settings.lease_ttl_s:g}",
            "--cadence",
            f"{settings.cadence_s:g}",
            "--log-level",
            "warning",
        ]
        self.worker_flags = ["--concurrency", str(settings.slots), "--log-level", "warning"]

    def start(self) -> None:
        urls = []
        for index in range(2):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            self.add(f"node-{index}", partial(self._node, port))
        direct_url = (
            self.processes.grant_login_role(WORKER_ROLE)
            if self.settings.ql3_workers == "direct"
            else None
        )
        for index, url in enumerate(urls):
            worker_id = f"chaos-worker-{index}"
            if direct_url is None:
                reach = [url, *(u for u in urls if u != url)]
                spawn = partial(self.processes.start_worker, reach, worker_id, self.worker_flags)
            else:
                argv = direct_worker_argv(direct_url, worker_id, self.worker_flags)
                spawn = partial(self.processes.start, worker_id, argv)
            self.add(worker_id, spawn, worker=True)

    def _node(self, port: int) -> Process:
        process, _ = self.processes.start_node(self.node_flags, port)
        return process

    def commands(self) -> str:
        nodes, workers = " ".join(self.node_flags), " ".join(self.worker_flags)
        target = "--database-url URL" if self.settings.ql3_workers == "direct" else "--ingress URL"
        return f"ql3 serve {nodes} (x2); ql3 worker {target} {workers} (x2)"

    @contextmanager
    def submitter(self) -> Iterator[Submit]:
        from ql3.bootstrap.cluster import build
        from ql3.domain.policy import Backoff, RetryPolicy, Safety

        policies = {
            "idempotent": RetryPolicy(
                retry_on_lost=True,
                max_attempts=5,
                safety=Safety.IDEMPOTENT,
                backoff=Backoff(initial_ms=0, cap_ms=0),
            ),
            "unsafe": RetryPolicy(retry_on_lost=True, max_attempts=5, safety=Safety.UNSAFE),
            "none": None,
        }
        container = build(database_url=self.database_url, pool_size=2)
        try:
            admission = container.core.admission()

            def submit(key: str, kind: str) -> None:
                admission.submit(LEDGER, self.payload(key), policies[kind])

            yield submit
        finally:
            container.store().close()

    def verdicts(self, keys: set[str], ledger_ends: set[str]) -> dict[str, str]:
        from ql3.application.queries import RunQueries
        from ql3.bootstrap.cluster import build
        from ql3.domain.model import TERMINAL_RUN_STATUSES

        terminal = {status.value for status in TERMINAL_RUN_STATUSES}
        with connect(self.database_url, autocommit=True) as conn:
            rows = conn.execute("SELECT input->>'key', id, status FROM runs").fetchall()
        found = {str(key): (str(run_id), str(status)) for key, run_id, status in rows}
        verdicts: dict[str, str] = {}
        open_runs = {key: found[key][0] for key in keys if key in found}
        open_runs = {k: r for k, r in open_runs.items() if found[k][1] not in terminal}
        for key in keys:
            if key in found and key not in open_runs:
                verdicts[key] = FINISHED
            elif key not in found:
                verdicts[key] = UNFINISHED  # acknowledged, yet no Run: should never be
        if open_runs:
            container = build(database_url=self.database_url, pool_size=1)
            try:
                queries = RunQueries(container.store().unit_of_work)
                for key, run_id in open_runs.items():
                    view = queries.show(run_id)
                    waiting = view is not None and any(
                        attempt.awaiting_evidence_since_ms is not None for attempt in view.attempts
                    )
                    verdicts[key] = WAITING if waiting else UNFINISHED
            finally:
                container.store().close()
        return verdicts

    def outcomes(self) -> dict[str, tuple[str, str, int]]:
        """key -> (status, run id, attempts) of every Run."""
        with connect(self.database_url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT input->>'key', status, id, attempt_count FROM runs"
            ).fetchall()
        return {str(key): (str(status), str(run_id), int(n)) for key, status, run_id, n in rows}


# --- PgQueuer ----------------------------------------------------------------------------------


def _consumer_settings() -> dict[str, Any]:
    settings: dict[str, Any] = json.loads(os.environ[CONSUMER_ENV])
    return settings


class PgQueuerSystem(System):
    name = "pgqueuer"
    hot_tables = ("pgqueuer", "pgqueuer_log", "pgqueuer_statistics")

    def start(self) -> None:
        asyncio.run(install_pgqueuer(self.dsn))
        self.start_consumers()

    def commands(self) -> str:
        return (
            f"QueueManager.run(batch_size={max(1, self.settings.slots // 2)},"
            f" max_concurrent_tasks={self.settings.slots},"
            f" heartbeat_timeout={self.settings.lease_ttl_s:g}s) (x2)"
        )

    @contextmanager
    def submitter(self) -> Iterator[Submit]:
        import asyncpg
        from pgqueuer import AsyncpgDriver, Queries

        with asyncio.Runner() as runner:
            held: list[Any] = []

            async def enqueue(key: str) -> None:
                if not held:
                    conn = await asyncpg.connect(
                        self.dsn, timeout=SUBMIT_TIMEOUT_S, command_timeout=SUBMIT_TIMEOUT_S
                    )
                    held.append(conn)
                body = json.dumps(self.payload(key)).encode()
                try:
                    await Queries(AsyncpgDriver(held[0])).enqueue(LEDGER, body, 0)
                except BaseException:
                    conn = held.pop()
                    conn.terminate()
                    raise

            def submit(key: str, kind: str) -> None:
                runner.run(enqueue(key))

            try:
                yield submit
            finally:
                for conn in held:
                    conn.terminate()


def _pgqueuer_entrypoint(manager: Any) -> None:
    @manager.entrypoint(LEDGER)
    async def ledger(job: Any) -> None:
        payload = json.loads(job.payload)
        record(payload["ledger"], "start", payload["key"])
        await asyncio.sleep(float(payload["seconds"]))
        record(payload["ledger"], "end", payload["key"])


def consume_pgqueuer() -> None:
    settings = _consumer_settings()
    slots = int(settings["slots"])
    asyncio.run(
        serve_pgqueuer(
            settings["dsn"],
            _pgqueuer_entrypoint,
            batch_size=max(1, slots // 2),
            max_concurrent_tasks=slots,
            heartbeat_timeout=timedelta(seconds=float(settings["ttl_s"])),
        )
    )


# --- Procrastinate -----------------------------------------------------------------------------


def procrastinate_app(conninfo: str, **pool: Any) -> Any:
    """An App with the ledger task on the chaos queue; the producer and the consumers share it."""
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo, **pool))

    @app.task(name=LEDGER, queue=PROCRASTINATE_QUEUE, pass_context=True)
    async def ledger(context: Any, ledger: str, key: str, seconds: float) -> None:
        attempt = int(context.job.attempts) + 1
        record(ledger, "start", key, attempt)
        await asyncio.sleep(float(seconds))
        record(ledger, "end", key, attempt)

    return app


class ProcrastinateSystem(System):
    name = "procrastinate"
    hot_tables = ("procrastinate_jobs", "procrastinate_events", "procrastinate_workers")

    def start(self) -> None:
        async def install() -> None:
            app = procrastinate_app(self.dsn)
            async with app.open_async():
                await app.schema_manager.apply_schema_async()

        asyncio.run(install())
        self.start_consumers()

    def commands(self) -> str:
        ttl = self.settings.lease_ttl_s
        return (
            f"run_worker_async(concurrency={self.settings.slots},"
            f" update_heartbeat_interval={ttl / 3:g}, stalled_worker_timeout={ttl:g}),"
            " stalled jobs retried every 1s (x2)"
        )

    @contextmanager
    def submitter(self) -> Iterator[Submit]:
        with asyncio.Runner() as runner:
            app = procrastinate_app(self.dsn, min_size=1, max_size=2, timeout=SUBMIT_TIMEOUT_S)
            runner.run(app.open_async().__aenter__())
            task = app.tasks[LEDGER]
            try:

                def submit(key: str, kind: str) -> None:
                    runner.run(task.defer_async(**self.payload(key)))

                yield submit
            finally:
                runner.run(app.close_async())


async def _retry_stalled(app: Any, ttl_s: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        try:
            for job in await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=ttl_s):
                await app.job_manager.retry_job(job)
        except Exception as error:  # the server may be away: try again next second
            print(f"retrying stalled jobs failed: {error}", file=sys.stderr, flush=True)


async def _consume_procrastinate() -> None:
    settings = _consumer_settings()
    ttl = float(settings["ttl_s"])
    app = procrastinate_app(settings["dsn"])
    async with app.open_async():
        retrier = asyncio.create_task(_retry_stalled(app, ttl))
        try:
            await app.run_worker_async(
                queues=[PROCRASTINATE_QUEUE],
                concurrency=int(settings["slots"]),
                wait=True,
                listen_notify=True,
                delete_jobs="never",
                install_signal_handlers=True,
                update_heartbeat_interval=ttl / 3,
                stalled_worker_timeout=ttl,
            )
        finally:
            retrier.cancel()


def consume_procrastinate() -> None:
    asyncio.run(_consume_procrastinate())


SYSTEMS: dict[str, type[System]] = {
    "ql3": Ql3,
    "pgqueuer": PgQueuerSystem,
    "procrastinate": ProcrastinateSystem,
}


if __name__ == "__main__":
    {"pgqueuer": consume_pgqueuer, "procrastinate": consume_procrastinate}[sys.argv[1]]()
