"""Time to recover: from the SIGKILL of a worker in the middle of a task to the Run queued again
and to its success, with real ``ql3 serve`` and ``ql3 worker`` processes.

A migrated throwaway database; one ``ql3 serve`` node with a short lease TTL and cadence; one
``ql3 worker`` (concurrency 1) with a fixed worker id. Each round admits one idempotent
retry-on-lost Run (at most 2 attempts, no backoff) of ``bench.sleep``, whose first attempt sleeps
far longer than the round. Once its Attempt 1 is ``running``, the worker is SIGKILLed (t0) and a
worker with the SAME worker id is started at once: its registration replaces the old session,
which is the not-running evidence recovery needs. Polling the database every ~20 ms, the round
records t0 -> Attempt 2 exists (the Run was queued again; the poll may first see it already
offered) and t0 -> the Run ``succeeded``; then it checks what recovery wrote (Attempt 1 ``lost``
on ``session_replaced``, its lease ``released``/``lease_expired`` at version 2, Attempt 2
``succeeded``). The restarted worker is the victim of the next round.

Figures are medians over the rounds. Target: ``to_queued_s_median <= lease_ttl_s +
2 * cadence_s``. The lease still had ``lease_left_s`` to live at t0 (the worker renews it every
third of the TTL), so ``to_queued_s - lease_left_s`` is what recovery added after expiry.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import psycopg

from benchmarks.common import (
    BenchmarkError,
    Stopwatch,
    bounded_int,
    connect,
    migrated_database,
    print_json,
    print_table,
    say,
)
from benchmarks.processes import Process, Processes, wait_until
from benchmarks.tasks import SLEEP

WORKER_ID = "bench-recover-worker"
POLL_S = 0.02
FIRST_ATTEMPT_SLEEP_S = 3600.0  # attempt 1 never finishes by itself
START_TIMEOUT_S = 60.0
RECOVER_GRACE_S = 60.0  # beyond the lease TTL, before a round is declared stuck
WORKER_FLAGS = ("--concurrency", "1", "--log-level", "warning")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be within (0, 3600], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds", type=bounded_int(1, 50), default=5, metavar="R", help="kills to time"
    )
    parser.add_argument(
        "--lease-ttl", type=positive_float, default=2.0, metavar="S", help="the node's lease TTL"
    )
    parser.add_argument(
        "--cadence", type=positive_float, default=0.5, metavar="S", help="the node's cadence"
    )


# --- the database as the benchmark polls it ----------------------------------------------------

_STATE = """
SELECT r.status,
       (SELECT max(a.number) FROM run_attempts AS a WHERE a.run_id = r.id),
       (SELECT count(*) FROM worker_sessions AS s WHERE s.worker_id = %(worker)s)
FROM runs AS r WHERE r.id = %(run)s
"""

_LEASE_LEFT = """
SELECT extract(epoch FROM l.expires_at - statement_timestamp())
FROM run_dispatch_leases AS l WHERE l.run_id = %(run)s AND l.status = 'leased'
"""


def _state(conn: psycopg.Connection[Any], run_id: str) -> tuple[str, int, int]:
    row = conn.execute(_STATE, {"run": run_id, "worker": WORKER_ID}).fetchone()
    if row is None:
        raise BenchmarkError(f"run {run_id} disappeared")
    return str(row[0]), int(row[1] or 0), int(row[2])


def _attempt_running(conn: psycopg.Connection[Any], run_id: str) -> bool:
    row = conn.execute(
        "SELECT status FROM run_attempts WHERE run_id = %s AND number = 1", (run_id,)
    ).fetchone()
    return row is not None and row[0] == "running"


def _lease_left_s(conn: psycopg.Connection[Any], run_id: str) -> float | None:
    row = conn.execute(_LEASE_LEFT, {"run": run_id}).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def verify(conn: psycopg.Connection[Any], run_id: str) -> None:
    """What recovery and the retry wrote for one round; BenchmarkError naming what is wrong."""
    attempts = conn.execute(
        "SELECT number, status, lost_evidence FROM run_attempts WHERE run_id = %s ORDER BY number",
        (run_id,),
    ).fetchall()
    leases = conn.execute(
        "SELECT generation, status, release_reason, version FROM run_dispatch_leases"
        " WHERE run_id = %s ORDER BY generation",
        (run_id,),
    ).fetchall()
    lost_events = conn.execute(
        "SELECT data->>'evidence' FROM run_events WHERE run_id = %s AND type = 'attempt_lost'",
        (run_id,),
    ).fetchall()
    problems = []
    if [(n, s) for n, s, _ in attempts] != [(1, "lost"), (2, "succeeded")]:
        problems.append(f"attempts {[(n, s) for n, s, _ in attempts]}")
    if not leases or tuple(leases[0]) != (1, "released", "lease_expired", 2):
        problems.append(f"first lease {tuple(leases[0]) if leases else None}")
    if [row[0] for row in lost_events] != ["session_replaced"]:
        problems.append(f"attempt_lost evidence {[row[0] for row in lost_events]}")
    if problems:
        raise BenchmarkError(f"run {run_id} recovered wrongly: " + "; ".join(problems))


# --- one round ---------------------------------------------------------------------------------


def recover_round(
    processes: Processes,
    conn: psycopg.Connection[Any],
    admission: Any,
    node: Process,
    node_url: str,
    victim: Process,
    timeout_s: float,
) -> tuple[dict[str, float | None], Process]:
    """Kill ``victim`` mid-task, restart its worker id, time the recovery. Returns the
    round's figures and the restarted worker (the next round's victim)."""
    from ql3.domain.policy import Backoff, RetryPolicy, Safety

    policy = RetryPolicy(
        retry_on_lost=True,
        max_attempts=2,
        safety=Safety.IDEMPOTENT,
        backoff=Backoff(initial_ms=0, cap_ms=0),
    )
    run_id = admission.submit(SLEEP, {"first_attempt_seconds": FIRST_ATTEMPT_SLEEP_S}, policy)
    wait_until(
        lambda: _attempt_running(conn, run_id),
        START_TIMEOUT_S,
        "attempt 1 to run",
        watch=[node, victim],
    )
    _, _, sessions_before = _state(conn, run_id)

    t0 = victim.kill()
    lease_left = _lease_left_s(conn, run_id)
    restarted = processes.start_worker(node_url, WORKER_ID, WORKER_FLAGS)

    registered = to_queued = to_succeeded = None
    deadline = t0 + timeout_s
    while to_succeeded is None:
        status, attempts, sessions = _state(conn, run_id)
        now = time.monotonic()
        if registered is None and sessions > sessions_before:
            registered = now - t0
        if to_queued is None and (attempts >= 2 or status == "queued"):
            to_queued = now - t0
        if status == "succeeded":
            to_succeeded = now - t0
            break
        if status in ("failed", "cancelled"):
            raise BenchmarkError(f"run {run_id} ended {status} instead of being retried")
        if now > deadline:
            raise BenchmarkError(
                f"run {run_id} still {status} with {attempts} attempt(s)"
                f" {timeout_s:g}s after the kill"
            )
        node.check_alive()
        restarted.check_alive()
        time.sleep(POLL_S)
    verify(conn, run_id)
    figures: dict[str, float | None] = {
        "to_queued_s": to_queued,
        "to_succeeded_s": to_succeeded,
        "registered_s": registered,
        "lease_left_s": lease_left,
    }
    return figures, restarted


# --- the command -------------------------------------------------------------------------------


def _rounded(values: list[float | None], digits: int = 3) -> list[float | None]:
    return [None if v is None else round(v, digits) for v in values]


def main(args: argparse.Namespace, admin: str) -> int:
    from ql3.bootstrap.cluster import build

    total = Stopwatch()
    lease_ttl, cadence = args.lease_ttl, args.cadence
    target_s = lease_ttl + 2 * cadence
    node_flags = [
        "--lease-ttl",
        str(lease_ttl),
        "--cadence",
        str(cadence),
        "--log-level",
        "warning",
    ]
    say(
        f"recover-time: {args.rounds} rounds; node {' '.join(node_flags)};"
        f" worker {' '.join(WORKER_FLAGS)}"
    )
    rounds: list[dict[str, float | None]] = []
    with migrated_database(admin, "ql3_bench_recover") as url, Processes(url) as processes:
        container = build(database_url=url)
        try:
            admission = container.core.admission()
            node, node_url = processes.start_node(node_flags)
            worker = processes.start_worker(node_url, WORKER_ID, WORKER_FLAGS)
            with connect(url, autocommit=True) as conn:
                for index in range(1, args.rounds + 1):
                    figures, worker = recover_round(
                        processes,
                        conn,
                        admission,
                        node,
                        node_url,
                        worker,
                        lease_ttl + RECOVER_GRACE_S,
                    )
                    rounds.append(figures)
                    say(
                        f"recover-time: round {index}/{args.rounds}:"
                        f" queued again {figures['to_queued_s']:.3f}s,"
                        f" succeeded {figures['to_succeeded_s']:.3f}s after the kill"
                    )
            status = worker.terminate()
            if status != 0:
                raise BenchmarkError(
                    f"the last worker did not drain cleanly ({status}): {worker.last_line()}"
                )
        finally:
            container.store().close()

    to_queued = [float(r["to_queued_s"] or 0.0) for r in rounds]
    to_succeeded = [float(r["to_succeeded_s"] or 0.0) for r in rounds]
    lease_left = [r["lease_left_s"] for r in rounds]
    after_expiry = [
        None if left is None else queued - left
        for queued, left in zip(to_queued, lease_left, strict=True)
    ]
    queued_median = statistics.median(to_queued)
    succeeded_median = statistics.median(to_succeeded)
    known_after = [value for value in after_expiry if value is not None]
    result: dict[str, Any] = {
        "to_queued_s_median": round(queued_median, 3),
        "to_succeeded_s_median": round(succeeded_median, 3),
        "lease_ttl_s": lease_ttl,
        "cadence_s": cadence,
        "target_s": round(target_s, 3),
        "meets_target": queued_median <= target_s,
        "rounds": len(rounds),
        "to_queued_s": _rounded(list(to_queued)),
        "to_succeeded_s": _rounded(list(to_succeeded)),
        "registered_s": _rounded([r["registered_s"] for r in rounds]),
        "lease_left_s": _rounded(lease_left),
        "after_expiry_s_median": (
            round(statistics.median(known_after), 3) if known_after else None
        ),
        "to_queued_s_max": round(max(to_queued), 3),
        "worker_id": WORKER_ID,
        "backoff_s": 0.0,
        "poll_interval_s": POLL_S,
        "total_seconds": round(total.seconds(), 1),
    }
    print_table(
        "Time to recover after SIGKILL of a worker, medians over rounds",
        [
            ("rounds", result["rounds"], "a kill per round; the same worker id restarts"),
            ("lease_ttl_s", lease_ttl, "ql3 serve --lease-ttl"),
            ("cadence_s", cadence, "ql3 serve --cadence"),
            ("registered_s", _middle(result["registered_s"]), "kill -> new session (evidence)"),
            ("lease_left_s", _middle(result["lease_left_s"]), "lease life left at the kill"),
            ("to_queued_s_median", result["to_queued_s_median"], "kill -> attempt 2 exists"),
            (
                "after_expiry_s_median",
                result["after_expiry_s_median"],
                "queued again after the lease expired",
            ),
            ("to_succeeded_s_median", result["to_succeeded_s_median"], "kill -> run succeeded"),
            (
                "meets_target",
                result["meets_target"],
                f"to_queued <= lease TTL + 2 cadences = {target_s:g}s",
            ),
            ("total_seconds", result["total_seconds"], ""),
        ],
    )
    if args.json:
        print_json(result)
    return 0


def _middle(values: list[float | None]) -> float | str:
    known = [value for value in values if value is not None]
    return round(statistics.median(known), 3) if known else "-"
