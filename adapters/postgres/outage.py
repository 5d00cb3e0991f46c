"""Leases do not age while the PostgreSQL server is down (ADR 0018).

A lease expires by the database's clock, and that clock runs on while the server is stopped:
nobody can renew, complete or abandon then, so without this every lease of a running Attempt
would come back expired after an outage longer than its remaining time, and its worker's late
completion would be refused. Instead, the first connection of any runtime store to a server
that has started since it last checkpointed gives every ``leased`` lease that expired while the
server was down (after the server stopped, by the server's start) the time it had left when the
server stopped, counted from the start.

The server itself says when it was down: ``pg_control_checkpoint().checkpoint_time`` is the
shutdown checkpoint's time after a clean stop (``pg_ctl stop -m smart|fast``: one second
resolution, so at most one second early), and ``pg_postmaster_start_time()`` when it started
again. The statement changes nothing once the server has checkpointed after its start (then
``checkpoint_time`` is later than the start), after a crash (the end-of-recovery checkpoint is
later than the start too: leases expire as the clock says), or a second time (a resumed lease
expires after the start, outside the window it selects): every replica's every new connection
may run it. A lease only ever expires later by it, and only one no replica could observe."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Engine, event

log = logging.getLogger("ql3.store")

RESUME_LEASES = """
UPDATE run_dispatch_leases AS l
SET expires_at = outage.started_at + (l.expires_at - outage.stopped_at)
FROM (
    SELECT c.checkpoint_time AS stopped_at, pg_postmaster_start_time() AS started_at
    FROM pg_control_checkpoint() AS c
    WHERE c.checkpoint_time < pg_postmaster_start_time()
) AS outage
WHERE l.status = 'leased'
  AND l.expires_at > outage.stopped_at
  AND l.expires_at <= outage.started_at
"""
# Whether the server started since its last checkpoint (and the schema is there): only then is
# there anything to resume, so every other new connection costs one small read.
RESTARTED = """
SELECT c.checkpoint_time < pg_postmaster_start_time()
    AND to_regclass('run_dispatch_leases') IS NOT NULL
FROM pg_control_checkpoint() AS c
"""
LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s'"


def resume_leases(dbapi_connection: Any) -> int:
    """Run the resumption on a psycopg connection, in a transaction of its own; returns how
    many leases it resumed. A failure (a lock held too long, say) resumes nothing: the next
    new connection tries again."""
    try:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(RESTARTED)
            row = cursor.fetchone()
            resumed = 0
            if row is not None and row[0]:
                cursor.execute(LOCK_TIMEOUT)
                cursor.execute(RESUME_LEASES)
                resumed = max(0, cursor.rowcount)
        dbapi_connection.commit()
    except Exception as error:
        dbapi_connection.rollback()
        log.warning("leases could not be resumed after a server restart: %s", error)
        return 0
    if resumed:
        log.warning(
            "the database server was down: %d lease(s) that expired meanwhile resumed", resumed
        )
    return resumed


def resume_leases_on_connect(engine: Engine) -> None:
    """Every new connection of ``engine`` resumes the leases an outage expired before it is
    used (the engine's role must be allowed to update ``run_dispatch_leases``)."""

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        resume_leases(dbapi_connection)

    event.listen(engine, "connect", on_connect)
