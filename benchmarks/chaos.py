"""Faults under a fixed offered load: QL3 against PgQueuer and Procrastinate, phase by phase, on a
private PostgreSQL server the benchmark starts (so that it may stop and start it).

The phases are those of the public Postgres job-queue benchmark's method
(hardbyte/postgresql-job-queue-benchmarking, ``docs/method.md``); this driver is our own:

``clean``
    nothing happens: the baseline. It always runs first, after a warm-up, whatever
    ``--phases`` says, because every other phase is measured against its completion rate.
``kill-worker``
    SIGKILL of worker 0 at the phase's start; it is started again halfway through.
``repeated-kill``
    SIGKILL of worker 0 and an immediate restart, every quarter of the phase.
``pg-backend-kill``
    twice a second, ``pg_terminate_backend`` of every backend of the system's database that is
    ``active`` or ``idle in transaction``.
``postgres-restart``
    ``pg_ctl stop -m fast`` at the phase's start, ``pg_ctl start`` halfway through.
``idle-in-tx``
    one session holds a transaction with an XID assigned (``txid_current()``) for the phase.
``active-readers``
    four ``REPEATABLE READ`` sessions scan the system's hottest table, every 0.1 s, inside one
    transaction each, for the phase.
``pool-exhaustion``
    idle sessions on the system's database take every connection slot the server has but three,
    for the phase.

Each phase is ``--phase-seconds`` of fault followed by as long again at the same load without
fault (the settle window). A producer thread offers ``--rate`` jobs per second for the whole run
(open loop: a submit that falls behind goes at once), each a ledger task that sleeps
``--task-seconds``; a submit that fails (the server is down, no connection slot) is counted as
refused, not as a job. Per system, phase by phase:

* ``lost``: jobs submitted in the phase (fault or settle window) that, at the end of the run
  and of a drain of up to ``4 x lease TTL + 30 s``, neither finished nor wait for not-running
  evidence. A QL3 Run is finished when it is terminal (``failed`` is a verdict: an unsafe Run
  whose Attempt was lost fails closed); a peer's job when the ledger holds its ``end``.
* ``duplicates``: QL3, unsafe Runs of the phase executed more than once (two ``start`` lines);
  peers, jobs of the phase executed more than once.
* ``recovery_s``: seconds from the fault's start until the completion rate (ledger ``end``
  lines over a trailing 5 s window, every 0.25 s) is back at 90 % of the clean phase's median
  and stays there to the end of the settle window; 0 when it never fell below; null when it was
  still below at the end (and for ``clean``, which has no fault).
* ``pickup_p99_ms``: nearest-rank p99 of first ``start`` minus submit, over the phase's jobs
  that started.
* ``dead_tuples``: ``sum(n_dead_tup)`` over the system's database at the end of the phase.

Every system's processes (QL3: two nodes and two workers, direct workers on the database by
default, ``--ql3-workers http`` for workers of the nodes; each peer: two consumers; each worker
or consumer runs 8 tasks at once, so that one alone has room for the offered load) are
supervised: one that exits unasked is started again (``restarts`` in the details). The JSON
object's ``details`` say per phase how many jobs were refused, finished, waited for evidence,
never ran or ran more than once, and what the fault did; ``systems`` how each system ran and,
for QL3, how the Runs of each policy ended. Figures come from one run on a shared machine: read
them as noisy. Targets for QL3: 0 lost and 0 duplicates
in every phase, and ``recovery_s`` no worse than the best peer's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from benchmarks.chaos_systems import (
    FINISHED,
    KINDS,
    SYSTEMS,
    UNFINISHED,
    WAITING,
    ChaosSettings,
    Ql3,
    System,
)
from benchmarks.common import (
    BenchmarkError,
    Stopwatch,
    conninfo,
    median,
    percentile,
    print_json,
    say,
    url_for,
)
from benchmarks.latency import positive_float
from benchmarks.private_server import PrivateServer, ServerUnavailable, start_private_server
from benchmarks.processes import Processes

PHASES = (
    "clean",
    "kill-worker",
    "repeated-kill",
    "pg-backend-kill",
    "postgres-restart",
    "idle-in-tx",
    "active-readers",
    "pool-exhaustion",
)
SERVER_SETTINGS = {"max_connections": "100", "autovacuum_naptime": "10s"}
SLOTS = 8  # per worker: one worker alone still has room for the offered load
WINDOW_S = 5.0  # the completion rate's trailing window: a few jobs more or less are noise
STEP_S = 0.25
RECOVERED_FRACTION = 0.9
SUPERVISE_S = 0.25
WARM_UP_TIMEOUT_S = 120.0
KILL_RATE_PER_S = 2.0
READERS = 4
FREE_SLOTS = 3  # what pool-exhaustion leaves of the server's connections
ROUND = 3


def _names(text: str, choices: Sequence[str], what: str) -> tuple[str, ...]:
    """Comma-separated names of ``choices``, returned in the order of ``choices``."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(choices))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or '(none)'}; choose from {', '.join(choices)}"
        )
    return tuple(name for name in choices if name in names)


def phase_list(text: str) -> tuple[str, ...]:
    """The phases named, in their fixed order; ``clean`` (the baseline) always first."""
    return ("clean", *(name for name in _names(text, PHASES, "phase") if name != "clean"))


def system_list(text: str) -> tuple[str, ...]:
    return _names(text, tuple(SYSTEMS), "system")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--phases",
        type=phase_list,
        default=PHASES,
        metavar="P,P",
        help=f"phases to run, of {','.join(PHASES)} (clean always runs first)",
    )
    parser.add_argument(
        "--systems",
        type=system_list,
        default=tuple(SYSTEMS),
        metavar="S,S",
        help=f"systems to run, of {','.join(SYSTEMS)}",
    )
    parser.add_argument(
        "--ql3-workers",
        choices=("direct", "http"),
        default="direct",
        help="QL3's workers: direct (--database-url, the default) or of the nodes (--ingress)",
    )
    for flag, high, default, metavar, meaning in (
        (
            "--phase-seconds",
            3_600,
            20.0,
            "S",
            "each phase's fault; as long again follows without it",
        ),
        ("--rate", 1_000, 20.0, "PER_S", "jobs offered per second, for the whole run"),
        ("--task-seconds", 60, 0.2, "S", "what each job's task sleeps"),
        ("--lease-ttl", 600, 4.0, "S", "QL3's lease TTL, and the peers' heartbeat staleness limit"),
        ("--cadence", 60, 0.5, "S", "QL3's scheduler cadence"),
    ):
        parser.add_argument(
            flag, type=positive_float(high), default=default, metavar=metavar, help=meaning
        )


# --- what the run records ----------------------------------------------------------------------


@dataclass
class Job:
    key: str
    kind: str
    submitted_at: float  # time.time()
    admitted: bool


@dataclass
class PhaseWindow:
    name: str
    start: float  # the fault begins (time.time())
    fault_end: float = 0.0
    end: float = 0.0  # the settle window ends
    dead_tuples: int | None = None
    restarts: int = 0
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ledger:
    """Parsed ledger lines: per key the ``start`` times and the first ``end``."""

    starts: dict[str, list[float]]
    ends: dict[str, float]

    @classmethod
    def read(cls, path: str) -> Ledger:
        starts: dict[str, list[float]] = {}
        ends: dict[str, float] = {}
        if os.path.exists(path):
            with open(path) as handle:
                for line in handle:
                    if not line.endswith("\n"):
                        continue  # a line still being written
                    entry = json.loads(line)
                    key, at = str(entry["key"]), float(entry["t"])
                    if entry["event"] == "start":
                        starts.setdefault(key, []).append(at)
                    elif entry["event"] == "end":
                        ends[key] = min(at, ends.get(key, at))
        return cls(starts=starts, ends=ends)


class Producer(threading.Thread):
    """Offers ``rate`` jobs per second on a fixed schedule until stopped."""

    def __init__(self, system: System, rate: float) -> None:
        super().__init__(name=f"producer-{system.name}", daemon=True)
        self.system = system
        self.rate = rate
        self.jobs: list[Job] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.lag_s = 0.0

    def run(self) -> None:
        try:
            with self.system.submitter() as submit:
                begin = time.perf_counter()
                index = 0
                while not self.stopping.is_set():
                    due = begin + index / self.rate
                    delay = due - time.perf_counter()
                    if delay > 0 and self.stopping.wait(delay):
                        break
                    self.lag_s = max(self.lag_s, time.perf_counter() - due)
                    key = f"{self.system.name}-{index}"
                    kind = KINDS[index % len(KINDS)]
                    submitted_at = time.time()
                    try:
                        submit(key, kind)
                        admitted = True
                    except Exception:
                        admitted = False
                    self.jobs.append(Job(key, kind, submitted_at, admitted))
                    index += 1
        except BaseException as error:
            self.error = error

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=60)


# --- the faults --------------------------------------------------------------------------------


class Faults:
    """The faults applied to one system, and the supervisor that keeps its processes up."""

    def __init__(self, system: System, server: PrivateServer, database: str, seconds: float):
        self.system = system
        self.server = server
        self.database = database
        self.seconds = seconds
        self.stopping = threading.Event()
        self.supervisor = threading.Thread(target=self._supervise, daemon=True)

    def _supervise(self) -> None:
        while not self.stopping.wait(SUPERVISE_S):
            self.system.supervise()

    def hold(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def session(self, autocommit: bool = True) -> psycopg.Connection[Any]:
        return psycopg.connect(conninfo(self.system.database_url), autocommit=autocommit)

    def dead_tuples(self) -> int | None:
        try:
            with self.session() as conn:
                row = conn.execute(
                    "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables"
                ).fetchone()
        except psycopg.Error:
            return None
        return int(row[0]) if row else None

    # each fault takes the phase's seconds and returns notes

    def clean(self) -> dict[str, Any]:
        self.hold(self.seconds)
        return {}

    def kill_worker(self) -> dict[str, Any]:
        self.system.kill_worker(0)
        self.hold(self.seconds / 2)
        self.system.start_worker(0)
        self.hold(self.seconds / 2)
        return {"kills": 1}

    def repeated_kill(self) -> dict[str, Any]:
        period = self.seconds / 4
        kills = 0
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline:
            self.system.kill_worker(0)
            self.system.start_worker(0)
            kills += 1
            self.hold(min(period, deadline - time.monotonic()))
        return {"kills": kills}

    def pg_backend_kill(self) -> dict[str, Any]:
        terminated = 0
        deadline = time.monotonic() + self.seconds
        with psycopg.connect(conninfo(self.server.admin_url), autocommit=True) as admin:
            while time.monotonic() < deadline:
                rows = admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()"
                    " AND state IN ('active', 'idle in transaction')",
                    (self.database,),
                ).fetchall()
                terminated += sum(1 for (done,) in rows if done)
                self.hold(min(1 / KILL_RATE_PER_S, deadline - time.monotonic()))
        return {"backends_terminated": terminated}

    def postgres_restart(self) -> dict[str, Any]:
        watch = Stopwatch()
        self.server.shut_down("fast")
        stopped = watch.seconds()
        self.hold(self.seconds / 2 - stopped)
        self.server.start()
        started = watch.seconds()
        self.hold(self.seconds - started)
        return {"down_s": round(started - stopped, ROUND)}

    def idle_in_tx(self) -> dict[str, Any]:
        with self.session(autocommit=False) as conn:
            xid = conn.execute("SELECT txid_current()").fetchone()
            self.hold(self.seconds)
            conn.rollback()
        return {"xid": int(xid[0]) if xid else None}

    def active_readers(self) -> dict[str, Any]:
        table = self.system.hot_tables[0]
        stop = threading.Event()
        scans = [0] * READERS

        def read(index: int) -> None:
            with self.session(autocommit=False) as conn:
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                while not stop.is_set():
                    conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()
                    scans[index] += 1
                    stop.wait(0.1)
                conn.rollback()

        threads = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(READERS)]
        for thread in threads:
            thread.start()
        self.hold(self.seconds)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        return {"table": table, "scans": sum(scans)}

    def pool_exhaustion(self) -> dict[str, Any]:
        held: list[psycopg.Connection[Any]] = []
        watch = Stopwatch()
        try:
            with psycopg.connect(conninfo(self.server.admin_url), autocommit=True) as admin:
                row = admin.execute(
                    "SELECT current_setting('max_connections')::int,"
                    " (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')"
                ).fetchone()
            assert row is not None
            room = int(row[0]) - int(row[1]) - FREE_SLOTS + 1  # the admin session has gone
            for _ in range(max(0, room)):
                try:
                    held.append(self.session())
                except psycopg.Error:
                    break
            self.hold(self.seconds - watch.seconds())
        finally:
            for conn in held:
                conn.close()
        return {"held_connections": len(held)}

    def fault(self, phase: str) -> Callable[[], dict[str, Any]]:
        faults: dict[str, Callable[[], dict[str, Any]]] = {
            "clean": self.clean,
            "kill-worker": self.kill_worker,
            "repeated-kill": self.repeated_kill,
            "pg-backend-kill": self.pg_backend_kill,
            "postgres-restart": self.postgres_restart,
            "idle-in-tx": self.idle_in_tx,
            "active-readers": self.active_readers,
            "pool-exhaustion": self.pool_exhaustion,
        }
        return faults[phase]


# --- the figures -------------------------------------------------------------------------------


def completion_rates(ends: Sequence[float], start: float, end: float) -> list[tuple[float, float]]:
    """(t, completions per second over (t - WINDOW_S, t]) every STEP_S from ``start`` to ``end``."""
    ordered = sorted(ends)
    rates = []
    steps = max(0, math.floor((end - start) / STEP_S))
    low = high = 0
    for n in range(steps + 1):
        at = start + n * STEP_S
        while high < len(ordered) and ordered[high] <= at:
            high += 1
        while low < high and ordered[low] <= at - WINDOW_S:
            low += 1
        rates.append((at, (high - low) / WINDOW_S))
    return rates


def baseline_rate(ends: Sequence[float], clean: PhaseWindow) -> float:
    """The clean phase's median completion rate (its first window skipped)."""
    rates = completion_rates(ends, clean.start + WINDOW_S, clean.end)
    return median([rate for _, rate in rates]) if rates else 0.0


def recovery_seconds(ends: Sequence[float], phase: PhaseWindow, baseline: float) -> float | None:
    """Seconds from the fault's start to the rate back at RECOVERED_FRACTION of the baseline for
    good; 0.0 when it never fell below; None when it is still below at the phase's end."""
    threshold = RECOVERED_FRACTION * baseline
    rates = completion_rates(ends, phase.start, phase.end)
    below = [at for at, rate in rates if rate < threshold]
    if not below:
        return 0.0
    if below[-1] >= rates[-1][0]:
        return None
    return below[-1] + STEP_S - phase.start


def phase_of(at: float, windows: Sequence[PhaseWindow]) -> PhaseWindow | None:
    for window in windows:
        if window.start <= at < window.end:
            return window
    return None


@dataclass(frozen=True)
class PhaseFigures:
    system: str
    phase: str
    lost: int
    duplicates: int
    recovery_s: float | None
    pickup_p99_ms: float | None
    dead_tuples: int | None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def figures(
    system: str,
    windows: Sequence[PhaseWindow],
    jobs: Sequence[Job],
    ledger: Ledger,
    verdicts: dict[str, str],
    duplicate_kinds: frozenset[str] | None,
) -> tuple[list[PhaseFigures], list[dict[str, Any]]]:
    """The figures of every phase, and the details behind them. ``duplicate_kinds``: the kinds
    whose second execution is a duplicate (None: every kind)."""
    ends = list(ledger.ends.values())
    clean = next(window for window in windows if window.name == "clean")
    baseline = baseline_rate(ends, clean)
    by_phase: dict[str, list[Job]] = {window.name: [] for window in windows}
    for job in jobs:
        window = phase_of(job.submitted_at, windows)
        if window is not None:
            by_phase[window.name].append(job)
    rows, details = [], []
    for window in windows:
        admitted = [job for job in by_phase[window.name] if job.admitted]
        lost = [job.key for job in admitted if verdicts.get(job.key) == UNFINISHED]
        waiting = sum(1 for job in admitted if verdicts.get(job.key) == WAITING)
        executions = {job.key: len(ledger.starts.get(job.key, ())) for job in admitted}
        duplicates = [
            job.key
            for job in admitted
            if executions[job.key] > 1 and (duplicate_kinds is None or job.kind in duplicate_kinds)
        ]
        pickups = [
            1000 * (min(ledger.starts[job.key]) - job.submitted_at)
            for job in admitted
            if ledger.starts.get(job.key)
        ]
        recovery = None if window.name == "clean" else recovery_seconds(ends, window, baseline)
        rows.append(
            PhaseFigures(
                system=system,
                phase=window.name,
                lost=len(lost),
                duplicates=len(duplicates),
                recovery_s=None if recovery is None else round(recovery, 2),
                pickup_p99_ms=round(percentile(pickups, 0.99), 1) if pickups else None,
                dead_tuples=window.dead_tuples,
            )
        )
        details.append(
            {
                "system": system,
                "phase": window.name,
                "submitted": len(by_phase[window.name]),
                "admitted": len(admitted),
                "refused": len(by_phase[window.name]) - len(admitted),
                "finished": sum(1 for job in admitted if verdicts.get(job.key) == FINISHED),
                "waiting_for_evidence": waiting,
                "never_executed": sum(1 for key in executions if executions[key] == 0),
                "executed_more_than_once": sum(1 for key in executions if executions[key] > 1),
                "lost_keys": lost[:10],
                "duplicate_keys": duplicates[:10],
                "restarts": window.restarts,
                "baseline_per_s": round(baseline, 2),
                **window.notes,
            }
        )
    return rows, details


# --- one system --------------------------------------------------------------------------------


def _wait_for_completions(ledger: str, count: int, timeout_s: float, system: System) -> None:
    deadline = time.monotonic() + timeout_s
    while len(Ledger.read(ledger).ends) < count:
        if time.monotonic() > deadline:
            raise BenchmarkError(
                f"{system.name}: fewer than {count} jobs finished in the {timeout_s:g}s warm-up"
            )
        time.sleep(0.25)


def run_system(
    name: str, server: PrivateServer, args: argparse.Namespace, workdir: str
) -> tuple[list[PhaseFigures], list[dict[str, Any]], dict[str, Any]]:
    from ql3.adapters.postgres.migrate import upgrade

    database = f"chaos_{name}"
    with psycopg.connect(conninfo(server.admin_url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{database}"')
    url = url_for(server.admin_url, database)
    ledger = os.path.join(workdir, f"ledger-{name}.jsonl")
    settings = ChaosSettings(
        slots=SLOTS,
        lease_ttl_s=args.lease_ttl,
        cadence_s=args.cadence,
        task_seconds=args.task_seconds,
        ledger=ledger,
        ql3_workers=args.ql3_workers,
    )
    with Processes(url) as processes:
        system = SYSTEMS[name](url, processes, settings)
        if isinstance(system, Ql3):
            upgrade(url)
        system.start()
        faults = Faults(system, server, database, args.phase_seconds)
        producer = Producer(system, args.rate)
        producer.start()
        faults.supervisor.start()
        try:
            _wait_for_completions(ledger, max(4, round(args.rate)), WARM_UP_TIMEOUT_S, system)
            faults.hold(WINDOW_S)
            windows: list[PhaseWindow] = []
            for phase in args.phases:
                say(f"chaos: {name}: {phase} ...")
                window = PhaseWindow(name=phase, start=time.time())
                restarts_before = system.restarts()
                window.notes = faults.fault(phase)()
                window.fault_end = time.time()
                faults.hold(args.phase_seconds)
                window.end = time.time()
                window.dead_tuples = faults.dead_tuples()
                window.restarts = system.restarts() - restarts_before
                windows.append(window)
                if producer.error is not None:
                    raise BenchmarkError(f"{name}: the producer failed: {producer.error}")
            producer.stop()
            keys = {job.key for job in producer.jobs if job.admitted}
            drain_s = drain(system, keys, ledger, 4 * args.lease_ttl + 30)
        finally:
            faults.stopping.set()
            producer.stop()
            faults.supervisor.join(timeout=30)
        read = Ledger.read(ledger)
        verdicts = system.verdicts(keys, set(read.ends))
        rows, details = figures(
            name,
            windows,
            producer.jobs,
            read,
            verdicts,
            frozenset({"unsafe"}) if isinstance(system, Ql3) else None,
        )
        extra: dict[str, Any] = {
            "system": name,
            "processes": system.commands(),
            "jobs": len(producer.jobs),
            "producer_lag_ms_max": round(1000 * producer.lag_s, 1),
            "drain_s": round(drain_s, 2),
            "restarts": system.restarts(),
        }
        if isinstance(system, Ql3):
            extra["runs"] = ql3_summary(system, producer.jobs, read)
        system.close()
    return rows, details, extra


def drain(system: System, keys: set[str], ledger: str, timeout_s: float) -> float:
    """Wait until every admitted job finished or waits for evidence; returns the seconds."""
    watch = Stopwatch()
    while watch.seconds() < timeout_s:
        verdicts = system.verdicts(keys, set(Ledger.read(ledger).ends))
        if all(verdict != UNFINISHED for verdict in verdicts.values()):
            break
        time.sleep(1.0)
    return watch.seconds()


def ql3_summary(system: Ql3, jobs: Sequence[Job], ledger: Ledger) -> dict[str, Any]:
    """How QL3's Runs ended, per policy: statuses, and how often each kind ran."""
    outcomes = system.outcomes()
    summary: dict[str, Any] = {}
    for kind in KINDS:
        mine = [job for job in jobs if job.admitted and job.kind == kind]
        statuses: dict[str, int] = {}
        for job in mine:
            status = outcomes.get(job.key, ("missing", "", 0))[0]
            statuses[status] = statuses.get(status, 0) + 1
        summary[kind] = {
            "statuses": statuses,
            "executed_twice_or_more": sum(
                1 for job in mine if len(ledger.starts.get(job.key, ())) > 1
            ),
            "failed_without_executing": sum(
                1
                for job in mine
                if outcomes.get(job.key, ("",))[0] == "failed" and not ledger.starts.get(job.key)
            ),
            # its task ended, but the completion came after the lease had expired
            "failed_after_finishing": sum(
                1
                for job in mine
                if outcomes.get(job.key, ("",))[0] == "failed" and job.key in ledger.ends
            ),
        }
    return summary


# --- the command -------------------------------------------------------------------------------


@contextmanager
def private_server() -> Iterator[PrivateServer]:
    try:
        server = start_private_server(settings=SERVER_SETTINGS)
    except ServerUnavailable as error:
        raise BenchmarkError(
            f"the chaos benchmark needs its own PostgreSQL server: {error}"
        ) from None
    try:
        yield server
    finally:
        server.stop()


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def print_phase_table(rows: Sequence[PhaseFigures]) -> None:
    """One line per system and phase; the names left-aligned, the figures right-aligned."""
    header = tuple(item.name for item in dataclasses.fields(PhaseFigures))
    cells = [tuple(_cell(value) for value in dataclasses.astuple(row)) for row in rows]
    widths = [max(len(name), *(len(line[i]) for line in cells)) for i, name in enumerate(header)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            value.ljust(width) if i < 2 else value.rjust(width)
            for i, (value, width) in enumerate(zip(values, widths, strict=True))
        )

    rule = "  ".join("-" * width for width in widths)
    print("Faults under a fixed load, per system and phase (one run; noisy machine)")
    print(rule, line(header), rule, *(line(values) for values in cells), rule, sep="\n", flush=True)


def verdict(rows: Sequence[PhaseFigures]) -> dict[str, Any]:
    """QL3 against its targets: 0 lost, 0 duplicates, recovery no worse than the best peer."""
    ours = [row for row in rows if row.system == "ql3"]
    recovery_ok = True
    for row in ours:
        if row.phase == "clean":
            continue
        peers = [
            other.recovery_s
            for other in rows
            if other.system != "ql3" and other.phase == row.phase and other.recovery_s is not None
        ]
        if peers and (row.recovery_s is None or row.recovery_s > min(peers)):
            recovery_ok = False
    return {
        "zero_lost": all(row.lost == 0 for row in ours),
        "zero_duplicates": all(row.duplicates == 0 for row in ours),
        "recovery_no_worse_than_best_peer": recovery_ok,
    }


def main(args: argparse.Namespace, admin: str) -> int:
    """``admin`` is unused: the benchmark starts and stops its own server."""
    total = Stopwatch()
    if set(args.systems) - {"ql3"}:
        from benchmarks.throughput import require_pgqueuer

        require_pgqueuer()
        if "procrastinate" in args.systems:
            try:
                import procrastinate  # noqa: F401
            except ImportError:
                raise BenchmarkError(
                    "the Procrastinate reference needs the bench extra: pip install -e '.[bench]'"
                ) from None
    say(
        f"chaos: {','.join(args.systems)}; phases {','.join(args.phases)};"
        f" {args.phase_seconds:g}s of fault + {args.phase_seconds:g}s after each;"
        f" {args.rate:g} jobs/s of {args.task_seconds:g}s; lease TTL {args.lease_ttl:g}s"
    )
    rows: list[PhaseFigures] = []
    details: list[dict[str, Any]] = []
    systems: list[dict[str, Any]] = []
    with private_server() as server, tempfile.TemporaryDirectory(prefix="ql3-chaos-") as workdir:
        for name in args.systems:
            mine, more, extra = run_system(name, server, args, workdir)
            rows.extend(mine)
            details.extend(more)
            systems.append(extra)
    print_phase_table(rows)
    targets = verdict(rows)
    for key, value in targets.items():
        print(f"{key}: {value}")
    if args.json:
        print_json(
            {
                "phases": [row.as_json() for row in rows],
                "targets": targets,
                "details": details,
                "systems": systems,
                "settings": {
                    "phase_seconds": args.phase_seconds,
                    "rate_per_s": args.rate,
                    "task_seconds": args.task_seconds,
                    "lease_ttl_s": args.lease_ttl,
                    "cadence_s": args.cadence,
                    "ql3_workers": args.ql3_workers,
                    "slots_per_worker": SLOTS,
                    "server": SERVER_SETTINGS,
                    "rate_window_s": WINDOW_S,
                    "recovered_fraction": RECOVERED_FRACTION,
                },
                "total_seconds": round(total.seconds(), 1),
            }
        )
    return 0
