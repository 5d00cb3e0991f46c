"""The node's LISTEN connection on PostgreSQL: a NOTIFY on ``ql3_dispatch`` wakes the claim
signal; a connection the server ends is replaced, with ``connected`` false meanwhile, and the
new one wakes the signal at once (for what it may have missed) and on the next NOTIFY; an
admission's commit wakes a parked claim through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from ql3.adapters.http import ClaimSignal, Woken
from ql3.adapters.postgres.listen import DispatchListener, libpq_conninfo
from ql3.adapters.postgres.queries import DISPATCH_CHANNEL
from ql3.bootstrap import node as node_root
from tests.http.conftest import services
from tests.postgres_server import PostgresServer


@pytest.fixture
def notifier(pg_database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(libpq_conninfo(pg_database_url), autocommit=True) as conn:
        yield conn


def _notify(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    conn.execute("SELECT pg_notify(%s, '')", (DISPATCH_CHANNEL,))


def _woken_by_notify(
    signal: ClaimSignal, conn: psycopg.Connection[tuple[object, ...]], timeout: float = 5.0
) -> tuple[Woken, float]:
    """A parked ticket's wake-up after a NOTIFY sent from another thread, and how long after."""

    async def scenario() -> tuple[Woken, float]:
        with signal.ticket("s1") as ticket:
            waiting = asyncio.create_task(ticket.wait(timeout))
            while signal.waiting < 1:
                await asyncio.sleep(0.001)
            sent = time.monotonic()
            await asyncio.to_thread(_notify, conn)
            woken = await waiting
            return woken, time.monotonic() - sent

    return asyncio.run(scenario())


def test_a_notify_wakes_the_signal_and_a_lost_connection_is_replaced(
    pg_server: PostgresServer,
    pg_database_url: str,
    notifier: psycopg.Connection[tuple[object, ...]],
) -> None:
    signal = ClaimSignal()
    container = node_root.build(store=object(), database_url=pg_database_url)
    container.claim_signal.override(signal)
    listener = container.dispatch_listener()
    assert isinstance(listener, DispatchListener)
    listener.start()
    database = pg_database_url.rsplit("/", 1)[1].split("?")[0]
    refused = False
    try:
        assert listener.wait_connected(10)
        assert signal.generation == 1  # the wake-up for what was sent before it listened
        woken, after = _woken_by_notify(signal, notifier)
        assert woken is Woken.DISPATCH
        assert after < 1.0

        # Keep it from reconnecting, then end its connection.
        with pg_server.connect_admin() as admin:
            admin.execute(
                sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(
                    sql.Identifier(database)
                )
            )
            refused = True
            pid = listener.backend_pid
            assert pid is not None
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        assert listener.wait_disconnected(5)
        time.sleep(0.3)  # it tries again, and is refused
        assert not listener.connected
        assert listener.backend_pid is None
        before = signal.generation
        _notify(notifier)  # nobody listens: lost, as a NOTIFY to a down node is
        time.sleep(0.1)
        assert signal.generation == before

        with pg_server.connect_admin() as admin:
            admin.execute(
                sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
                    sql.Identifier(database)
                )
            )
            refused = False
        assert listener.wait_connected(10, connections=2)
        assert listener.backend_pid not in (None, pid)
        assert signal.generation == before + 1  # the catch-up wake-up on reconnection
        woken, after = _woken_by_notify(signal, notifier)
        assert woken is Woken.DISPATCH
        assert after < 1.0
    finally:
        if refused:
            with pg_server.connect_admin() as admin:
                admin.execute(
                    sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(
                        sql.Identifier(database)
                    )
                )
        listener.stop(5)
    assert not listener.connected


def test_stop_ends_the_listener_quickly(pg_database_url: str) -> None:
    listener = DispatchListener(pg_database_url, lambda: None)
    listener.start()
    assert listener.wait_connected(10)
    started = time.monotonic()
    listener.stop(5)
    assert time.monotonic() - started < 1.0
    assert not listener.connected
    with pytest.raises(RuntimeError):
        listener.start()


def test_an_unreachable_database_is_retried_without_failing() -> None:
    calls: list[int] = []
    listener = DispatchListener(
        "postgresql+psycopg://nobody@127.0.0.1:1/none", lambda: calls.append(1),
        min_backoff_s=0.01, max_backoff_s=0.05,
    )
    listener.start()
    time.sleep(0.3)
    assert not listener.connected
    assert listener.connections == 0 and calls == []
    listener.stop(5)


def test_an_admission_on_postgresql_wakes_a_parked_claim(pg_database_url: str) -> None:
    from ql3.adapters.postgres.store import PostgresStore

    store = PostgresStore.from_url(pg_database_url)
    try:
        store.testing_reset()
        ingress = services(store, store.testing_advance_clock)
        listener = DispatchListener(pg_database_url, ingress.signal.wake)
        listener.start()
        try:
            assert listener.wait_connected(10)
            session = ingress.register()
            pending = session.claim_in_thread(1, wait_ms=10_000)
            ingress.wait_until_waiting()
            (run_id,) = ingress.queued(1)  # its commit notifies; nothing else wakes the claim
            admitted = time.monotonic()
            answer = pending.result()
            assert [g["run_id"] for g in answer["grants"]] == [run_id]
            assert pending.answered_at - admitted < 0.5
        finally:
            listener.stop(5)
    finally:
        store.close()
