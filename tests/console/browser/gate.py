"""A Run whose recovery the database refuses, so that the node's runtime recovery fails on it
cycle after cycle and the dispatch gate stays shut (as in ``tests/operations``): its Attempt
was claimed by a session that closed (not-running evidence), and a trigger refuses every event
of it but its quarantine's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy.engine import make_url

from ql3.domain.policy import RetryPolicy, Safety
from tests.e2e.conftest import LEASE_TTL_S, Cluster

POLICY = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)
TASK = "gate.double"


def _psycopg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def broken_head_candidate(cluster: Cluster) -> Iterator[str]:
    run_id = cluster.submit(TASK, {"n": 1}, POLICY)
    # A lease as short as the node's: recovery takes the Attempt up once it expired.
    from ql3.bootstrap import cluster as cluster_root

    container = cluster_root.build(store=cluster.container.store(), lease_ttl_s=LEASE_TTL_S)
    commands = container.core.worker_commands()
    session = commands.register("gate-worker", capacity=1, tasks=[TASK])
    assert len(commands.claim(session.session_id, session.secret, limit=1).grants) == 1
    with psycopg.connect(_psycopg_url(cluster.database_url), autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION ql3_console_break() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            f" IF NEW.run_id = '{run_id}' AND NEW.type <> 'run_quarantined' THEN"
            " RAISE EXCEPTION 'run % cannot be settled', NEW.run_id; END IF;"
            " RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER ql3_console_break BEFORE INSERT ON run_events "
            "FOR EACH ROW EXECUTE FUNCTION ql3_console_break()"
        )
        try:
            commands.close(session.session_id, session.secret)
            yield run_id
        finally:
            conn.execute("DROP TRIGGER ql3_console_break ON run_events")
            conn.execute("DROP FUNCTION ql3_console_break()")
