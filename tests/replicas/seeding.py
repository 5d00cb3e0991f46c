"""Seeding expired recovery candidates through the real services, and checking the result.

:func:`seed_with_services` admits Runs, registers worker sessions, lets each worker claim
(ADR 0007: a claim starts the Attempt) as many as its capacity allows through the worker
commands, renews some of the leases, then closes every session: the closed session is the
trusted not-running evidence. Each Attempt ends in one of two shapes, round robin by claim
order: claimed (``running``, the lease as the claim granted it) and renewed (``running``, the
lease's expiry moved by a renewal). Each is a candidate whose lease generation 1 is ``leased``
at version 1.

The service path costs milliseconds per Run, far too slow for 1,000 Runs on a small machine,
so :func:`clone_runs` multiplies such service-built Runs with set-based SQL: every row of
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

from ql3.application.admission import AdmissionRequest
from ql3.bootstrap.cluster import ClusterContainer, build
from ql3.domain.fence import LeaseFence
from tests.postgres_server import connect

TASK = "replica-mail"
SHAPES = ("claimed", "renewed")


@dataclass(frozen=True)
class SeededState:
    run_ids: tuple[str, ...]
    attempt_ids: tuple[str, ...]
    shapes: Counter[str]
    seconds: float


def seed_container(database_url: str, lease_ttl_s: float) -> ClusterContainer:
    """A Cluster container used only to build the state."""
    return build(database_url=database_url, lease_ttl_s=lease_ttl_s)


def seed_with_services(
    container: ClusterContainer,
    count: int,
    *,
    workers: int = 2,
    shapes: tuple[str, ...] = SHAPES,
) -> SeededState:
    """``count`` claimed Runs whose worker sessions are then all closed. Their leases expire
    after the container's lease TTL."""
    started = time.monotonic()
    admission = container.core.admission()
    commands = container.core.worker_commands()
    run_ids = tuple(
        admission.submit_many([AdmissionRequest(task=TASK, input={"n": i}) for i in range(count)])
    )
    capacity = -(-count // workers)
    grants = [
        commands.register(f"replica-worker-{i}", capacity=capacity, tasks=[TASK])
        for i in range(workers)
    ]
    attempt_ids: list[str] = []
    tally: Counter[str] = Counter()
    renewals: dict[str, list[LeaseFence]] = {grant.session_id: [] for grant in grants}
    for grant in grants:
        answer = commands.claim(grant.session_id, grant.secret, limit=capacity)
        for claimed in answer.grants:
            shape = shapes[len(attempt_ids) % len(shapes)]
            if shape == "renewed":
                renewals[grant.session_id].append(claimed.fence)
            attempt_ids.append(claimed.attempt_id)
            tally[shape] += 1
    if len(attempt_ids) != count:
        raise AssertionError(f"claims started {len(attempt_ids)} of {count} Runs")
    time.sleep(0.005)  # a renewal moves the expiry past the one the claim granted
    for grant in grants:
        fences = renewals[grant.session_id]
        if fences:
            answer = commands.renew_many(grant.session_id, grant.secret, fences)
            assert all(result.ok for result in answer.results), answer
    for grant in grants:
        commands.close(grant.session_id, grant.secret)
    return SeededState(
        run_ids=run_ids,
        attempt_ids=tuple(attempt_ids),
        shapes=tally,
        seconds=time.monotonic() - started,
    )


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
    from ql3.adapters.sql.schema import metadata

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
    ``running`` as its claim left it, lease ``leased`` at version 1, one ``attempt_started`` and
    no ``attempt_lost`` event, Run ``running``; or never claimed: a pristine Attempt of a
    ``queued`` Run, without lease or event of either kind."""
    return conn.execute(
        """
        WITH per_attempt AS (
            SELECT r.id AS run_id, r.status AS run_status, a.id AS attempt_id,
                   a.status AS attempt_status, a.lease_version AS attempt_lease_version,
                   l.status AS lease_status, l.version AS lease_version,
                   l.release_reason AS reason,
                   (SELECT count(*) FROM run_events e
                     WHERE e.attempt_id = a.id AND e.type = 'attempt_lost') AS lost_events,
                   (SELECT count(*) FROM run_events e
                     WHERE e.attempt_id = a.id AND e.type = 'attempt_started') AS started_events
              FROM runs r
              JOIN run_attempts a ON a.run_id = r.id AND a.number = 1
              LEFT JOIN run_dispatch_leases l
                ON l.run_id = a.run_id AND l.generation = a.lease_generation
        )
        SELECT * FROM per_attempt
         WHERE NOT (
            (attempt_status = 'lost' AND lease_status = 'released' AND lease_version = 2
             AND reason = 'lease_expired' AND attempt_lease_version = 2 AND lost_events = 1
             AND started_events = 1
             AND run_status IN ('lost', 'failed', 'retry_wait', 'queued'))
            OR
            (attempt_status = 'running' AND lease_status = 'leased'
             AND lease_version = 1 AND attempt_lease_version = 1 AND lost_events = 0
             AND started_events = 1 AND run_status = 'running')
            OR
            (attempt_status = 'claimed' AND lease_status IS NULL
             AND attempt_lease_version IS NULL AND lost_events = 0 AND started_events = 0
             AND run_status = 'queued')
         )
        """
    ).fetchall()


def deadlocks(admin: psycopg.Connection[tuple[object, ...]], dbname: str) -> int:
    admin.execute("SELECT pg_stat_clear_snapshot()")
    row = admin.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = %s", (dbname,)
    ).fetchone()
    return 0 if row is None or row[0] is None else int(str(row[0]))
