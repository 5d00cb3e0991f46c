"""Seeding expired recovery candidates through the real services, and checking the result.

:func:`seed_with_services` admits Runs, registers worker sessions, dispatches through the
scheduler's own task-attempt admission step, lets each worker accept (and for most, activate and
report running) its offers through the worker commands, then closes every session: the closed
session is the trusted not-running evidence. Each Attempt ends in one of four shapes, round robin
by dispatch order: offered only (claimed, no token), accepted (claimed), activated (starting) and
running. Each is a candidate whose lease generation 1 is ``leased`` at version 1.

The service path costs about 50 ms per Run and step on a small machine, far too slow for 1,000
Runs, so :func:`clone_runs` multiplies such service-built Runs with set-based SQL: every row of
``runs``, ``run_attempts``, ``run_dispatch_leases`` and ``run_events`` of a template Run is copied
with fresh ids and nothing else changed, so the copies satisfy every constraint of the schema and
the domain's candidate predicate exactly as their templates do (sessions are shared: a closed
session is evidence for all the Attempts it held).

Leases expire for real (a short lease TTL and :func:`wait_until_leases_expired`): the store's
clock offset is per store instance and cannot be shared with replicas in other processes.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import psycopg

from application.admission import AdmissionRequest
from application.worker_commands import SessionGrant, WorkerCommands
from bootstrap.cluster import ClusterContainer, build
from domain.fence import LeaseFence
from tests.postgres_server import connect

TASK = "replica-mail"
TOKEN_PREFIX = "replica-token-"  # + attempt id: >= 22 characters
SHAPES = ("offered", "accepted", "starting", "running")


@dataclass(frozen=True)
class SeededState:
    run_ids: tuple[str, ...]
    attempt_ids: tuple[str, ...]
    shapes: Counter[str]
    seconds: float


def seed_container(database_url: str, lease_ttl_s: float) -> ClusterContainer:
    """A Cluster container used only to build the state."""
    return build(
        database_url=database_url,
        lease_ttl_s=lease_ttl_s,
        dispatch_page_size=16,
        session_silence_s=300.0,
    )


def seed_with_services(
    container: ClusterContainer,
    count: int,
    *,
    workers: int = 2,
    shapes: tuple[str, ...] = SHAPES,
) -> SeededState:
    """``count`` dispatched Runs whose worker sessions are then all closed. Their leases expire
    after the container's lease TTL."""
    started = time.monotonic()
    admission = container.core.admission()
    commands = container.core.worker_commands()
    dispatch = container.core.task_attempt_admission()
    run_ids = tuple(
        admission.submit_many([AdmissionRequest(task=TASK, input={"n": i}) for i in range(count)])
    )
    capacity = -(-count // workers)
    grants = [
        commands.register(f"replica-worker-{i}", capacity=capacity, tasks=[TASK])
        for i in range(workers)
    ]
    attempt_ids: list[str] = []
    seen: set[str] = set()
    tally: Counter[str] = Counter()
    while len(attempt_ids) < count:
        report = dispatch.run_once()
        if report.offered == 0:
            raise AssertionError(f"dispatch stalled after {len(attempt_ids)} offers: {report}")
        for grant in grants:
            for offer in commands.heartbeat(grant.session_id, grant.secret):
                if offer.attempt_id in seen:  # an offer left unaccepted on purpose
                    continue
                seen.add(offer.attempt_id)
                shape = shapes[len(attempt_ids) % len(shapes)]
                _drive(commands, grant, offer.attempt_id, offer.generation, offer.version, shape)
                attempt_ids.append(offer.attempt_id)
                tally[shape] += 1
    for grant in grants:
        commands.close(grant.session_id, grant.secret)
    return SeededState(
        run_ids=run_ids,
        attempt_ids=tuple(attempt_ids),
        shapes=tally,
        seconds=time.monotonic() - started,
    )


def _drive(
    commands: WorkerCommands,
    grant: SessionGrant,
    attempt_id: str,
    generation: int,
    version: int,
    shape: str,
) -> None:
    if shape == "offered":
        return
    token = TOKEN_PREFIX + attempt_id
    commands.accept(grant.session_id, grant.secret, attempt_id, generation, version, token)
    if shape == "accepted":
        return
    fence = LeaseFence(attempt_id=attempt_id, generation=generation, version=version, token=token)
    commands.activate(grant.session_id, grant.secret, fence)
    if shape == "running":
        commands.mark_running(grant.session_id, grant.secret, fence)


def clone_runs(database_url: str, total: int) -> int:
    """Copy the Runs already in the database (with their Attempts, leases and events) until
    there are ``total`` Runs; copy ``g`` of template ``t`` gets ids ``<t id>-<g>``. Returns how
    many Runs were added. One transaction."""
    with connect(database_url) as conn:
        with conn.transaction():
            conn.execute(
                """
                CREATE TEMPORARY TABLE clone_map ON COMMIT DROP AS
                WITH templates AS (
                    SELECT id, row_number() OVER (ORDER BY id) - 1 AS k, count(*) OVER () AS n
                      FROM runs
                )
                SELECT t.id AS src, t.id || '-' || g AS dst, '-' || g AS suffix
                  FROM generate_series(1, %(total)s) AS g
                  JOIN templates t ON t.k = (g - 1) %% t.n
                 WHERE g > t.n
                """,
                {"total": total},
            )
            added = conn.execute("SELECT count(*) FROM clone_map").fetchone()
            _copy(conn, "runs", {"id": "m.dst"}, "x.id = m.src")
            _copy(
                conn,
                "run_attempts",
                {"id": "x.id || m.suffix", "run_id": "m.dst"},
                "x.run_id = m.src",
            )
            _copy(
                conn,
                "run_dispatch_leases",
                {"run_id": "m.dst", "attempt_id": "x.attempt_id || m.suffix"},
                "x.run_id = m.src",
            )
            _copy(
                conn,
                "run_events",
                {"run_id": "m.dst", "attempt_id": "x.attempt_id || m.suffix"},
                "x.run_id = m.src",
                skip=("id",),
                order_by="m.dst, x.id",
            )
        conn.execute("ANALYZE")
    return 0 if added is None else int(str(added[0]))


def _copy(
    conn: psycopg.Connection[tuple[object, ...]],
    table: str,
    replaced: dict[str, str],
    join_on: str,
    *,
    skip: tuple[str, ...] = (),
    order_by: str | None = None,
) -> None:
    from adapters.sql.schema import metadata

    columns = [c.name for c in metadata.tables[table].columns if c.name not in skip]
    values = [replaced.get(name, f"x.{name}") for name in columns]
    order = f" ORDER BY {order_by}" if order_by else ""
    conn.execute(
        f"INSERT INTO {table} ({', '.join(columns)})"
        f" SELECT {', '.join(values)} FROM {table} x JOIN clone_map m ON {join_on}{order}"
    )


def wait_until_leases_expired(database_url: str, timeout_s: float = 30.0) -> None:
    """Sleep until the database clock has passed every leased lease's ``expires_at``."""
    deadline = time.monotonic() + timeout_s
    with connect(database_url) as conn:
        while True:
            row = conn.execute(
                "SELECT extract(epoch FROM max(expires_at) - statement_timestamp())"
                " FROM run_dispatch_leases WHERE status = 'leased'"
            ).fetchone()
            remaining = None if row is None or row[0] is None else float(row[0])
            if remaining is None or remaining < 0:
                return
            if time.monotonic() + remaining > deadline:
                raise AssertionError(f"leases still live for {remaining:.1f}s")
            time.sleep(remaining + 0.05)


# --- checks on the database, in plain SQL ------------------------------------------------------


def lost_events_per_attempt(
    conn: psycopg.Connection[tuple[object, ...]],
) -> dict[str, int]:
    rows = conn.execute(
        "SELECT attempt_id, count(*) FROM run_events WHERE type = 'attempt_lost'"
        " GROUP BY attempt_id"
    ).fetchall()
    return {str(attempt_id): int(str(n)) for attempt_id, n in rows}


def leases_by_attempt(
    conn: psycopg.Connection[tuple[object, ...]],
) -> dict[str, tuple[str, int, str | None, int]]:
    """attempt id -> (status, version, release_reason, generation) of its lease rows."""
    rows = conn.execute(
        "SELECT attempt_id, status, version, release_reason, generation FROM run_dispatch_leases"
    ).fetchall()
    found: dict[str, tuple[str, int, str | None, int]] = {}
    for attempt_id, status, version, reason, generation in rows:
        key = str(attempt_id)
        assert key not in found, f"attempt {key} has more than one lease row"
        found[key] = (
            str(status),
            int(str(version)),
            None if reason is None else str(reason),
            int(str(generation)),
        )
    return found


def half_written(conn: psycopg.Connection[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """Runs whose Run, Attempt, lease and events disagree about whether the Attempt was lost.

    Lost together means: Attempt ``lost`` with ``lease_version`` = its lease's version, that
    lease ``released`` (``lease_expired``, version 2), exactly one ``attempt_lost`` event, Run
    ``lost`` or settled (``failed``/``retry_wait``/``queued``). Untouched means: Attempt still
    active, lease ``leased`` at version 1, no ``attempt_lost`` event, Run dispatching/running."""
    return conn.execute(
        """
        WITH per_attempt AS (
            SELECT r.id AS run_id, r.status AS run_status, a.id AS attempt_id,
                   a.status AS attempt_status, a.lease_version AS attempt_lease_version,
                   l.status AS lease_status, l.version AS lease_version,
                   l.release_reason AS reason,
                   (SELECT count(*) FROM run_events e
                     WHERE e.attempt_id = a.id AND e.type = 'attempt_lost') AS lost_events
              FROM runs r
              JOIN run_attempts a ON a.run_id = r.id AND a.number = 1
              LEFT JOIN run_dispatch_leases l
                ON l.run_id = a.run_id AND l.generation = a.lease_generation
        )
        SELECT * FROM per_attempt
         WHERE NOT (
            (attempt_status = 'lost' AND lease_status = 'released' AND lease_version = 2
             AND reason = 'lease_expired' AND attempt_lease_version = 2 AND lost_events = 1
             AND run_status IN ('lost', 'failed', 'retry_wait', 'queued'))
            OR
            (attempt_status IN ('claimed', 'starting', 'running') AND lease_status = 'leased'
             AND lease_version = 1 AND attempt_lease_version = 1 AND lost_events = 0
             AND run_status IN ('dispatching', 'running'))
         )
        """
    ).fetchall()


def deadlocks(admin: psycopg.Connection[tuple[object, ...]], dbname: str) -> int:
    admin.execute("SELECT pg_stat_clear_snapshot()")
    row = admin.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = %s", (dbname,)
    ).fetchone()
    return 0 if row is None or row[0] is None else int(str(row[0]))
