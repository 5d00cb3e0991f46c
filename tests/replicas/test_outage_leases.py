"""Leases do not age while the server is down (ADR 0018), on a private server this module stops
and starts: a lease that expired during the outage has, from the server's start, the time it
had left at the stop, so its worker's completion after the outage is accepted; a lease that had
expired before the stop stays expired; the first connection of every store may resume, and a
second one changes nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ql3.application.admission import AdmissionRequest
from ql3.application.worker_commands import Completion, Grant
from ql3.bootstrap.cluster import ClusterContainer, build
from tests.postgres_server import (
    PrivateServer,
    connect,
    private_database,
)

pytestmark = pytest.mark.postgres

TASK = "outage-mail"
LEASE_TTL_S = 2.0
DOWN_S = 3.5  # longer than the lease TTL
CHECKPOINT_RESOLUTION_S = 1.0  # the shutdown checkpoint's time is kept in whole seconds


@dataclass
class Server:
    private: PrivateServer
    url: str


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with private_database("ql3_outage") as (private, url):
        yield Server(private=private, url=url)


def claim_one(container: ClusterContainer, worker_id: str) -> tuple[str, str, Grant]:
    admission = container.core.admission()
    commands = container.core.worker_commands()
    admission.submit_many([AdmissionRequest(task=TASK, input={"worker": worker_id})])
    session = commands.register(worker_id, capacity=1, tasks=[TASK])
    (grant,) = commands.claim(session.session_id, session.secret, limit=1).grants
    return session.session_id, session.secret, grant


def lease_expiry(url: str, attempt_id: str) -> tuple[float, str]:
    """(seconds from now to the lease's expiry, its status), by the server's clock."""
    with connect(url.replace("postgresql+psycopg", "postgresql")) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM expires_at - statement_timestamp()), status"
            " FROM run_dispatch_leases WHERE attempt_id = %s",
            (attempt_id,),
        ).fetchone()
    assert row is not None
    return float(row[0]), str(row[1])


def test_a_lease_that_expired_while_the_server_was_down_resumes_at_its_start(
    server: Server,
) -> None:
    container = build(database_url=server.url, lease_ttl_s=LEASE_TTL_S, pool_size=2)
    try:
        commands = container.core.worker_commands()
        stale = claim_one(container, "outage-worker-stale")
        # Expired well before the stop (more than the checkpoint's resolution): it stays so.
        time.sleep(LEASE_TTL_S + CHECKPOINT_RESOLUTION_S + 0.5)
        fresh = claim_one(container, "outage-worker-fresh")

        server.private.shut_down("fast")
        time.sleep(DOWN_S)
        server.private.start()

        # The store's pooled connections died with the server; its next one resumes first.
        left, status = lease_expiry(server.url, fresh[2].attempt_id)
        assert status == "leased"
        stale_left, _ = lease_expiry(server.url, stale[2].attempt_id)
        # Not resumed yet: only a runtime store's new connection resumes.
        assert left < 0 and stale_left < 0
        session_id, secret, grant = fresh
        answer = commands.complete_many(
            session_id, secret, [Completion(fence=grant.fence, succeeded=True, output={})]
        )
        (result,) = answer.results
        assert result.ok, result
        stale_session, stale_secret, stale_grant = stale
        (refused,) = commands.renew_many(stale_session, stale_secret, [stale_grant.fence]).results
        assert not refused.ok and refused.reason == "expired"
    finally:
        container.store().close()


def test_resuming_twice_changes_nothing(server: Server) -> None:
    container = build(database_url=server.url, lease_ttl_s=LEASE_TTL_S, pool_size=1)
    try:
        _, _, grant = claim_one(container, "outage-worker-twice")
        server.private.shut_down("fast")
        time.sleep(DOWN_S)
        server.private.start()
        with container.store().engine.connect():  # a new connection: it resumes
            pass
        first, status = lease_expiry(server.url, grant.attempt_id)
        assert status == "leased" and 0 < first <= LEASE_TTL_S + CHECKPOINT_RESOLUTION_S
        other = build(database_url=server.url, lease_ttl_s=LEASE_TTL_S, pool_size=1)
        try:
            with other.store().engine.connect():  # another store's first connection
                pass
        finally:
            other.store().close()
        second, _ = lease_expiry(server.url, grant.attempt_id)
        assert second <= first  # the clock moved on; the expiry did not
    finally:
        container.store().close()
