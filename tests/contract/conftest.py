"""Fixtures of the port contract suite: every test runs once per store.

``store``
    A fresh, empty store implementing :class:`ql3.application.ports.RuntimeStore`, parametrised as
    ``memory`` (:class:`ql3.adapters.memory.MemoryStore` on a
    :class:`ql3.adapters.memory.FakeClock`) and ``postgres``
    (``ql3.adapters.postgres.store.PostgresStore`` on the module's database, reset before each
    test) and ``sqlite`` (``ql3.adapters.sql.sqlite.SqliteStore`` on a fresh database file). The
    ``postgres`` case is skipped only while that module does not exist.
``advance``
    ``advance(ms)`` moves the store's clock forward by ``ms`` milliseconds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ql3.adapters.memory import FakeClock, MemoryStore

POSTGRES_STORE_MODULE = "ql3.adapters.postgres.store"


def _postgres_store_built() -> bool:
    try:
        return importlib.util.find_spec(POSTGRES_STORE_MODULE) is not None
    except ModuleNotFoundError as error:
        # A missing ql3.adapters.postgres package means "not built yet"; anything else is a bug.
        if error.name in {"ql3.adapters.postgres", POSTGRES_STORE_MODULE}:
            return False
        raise


STORES = [
    pytest.param("memory", id="memory"),
    pytest.param(
        "postgres",
        id="postgres",
        marks=[
            pytest.mark.postgres,
            pytest.mark.skipif(
                not _postgres_store_built(), reason="PostgreSQL store not built yet"
            ),
        ],
    ),
    pytest.param("sqlite", id="sqlite"),
]


# The databases whose migrations a store of this suite has run.
_MIGRATED: set[str] = set()


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from open_store(request.param, request)


def open_store(kind: str, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh, empty store of ``kind`` (``memory``, ``sqlite``, ``postgres``), closed after."""
    if kind == "memory":
        memory = MemoryStore(FakeClock())
        try:
            yield memory
        finally:
            memory.close()
        return
    if kind == "sqlite":
        from ql3.adapters.sql.sqlite import SqliteStore

        tmp_path = request.getfixturevalue("tmp_path")
        sqlite = SqliteStore(tmp_path / "contract.sqlite")
        try:
            yield sqlite
        finally:
            sqlite.close()
        return
    url: str = request.getfixturevalue("pg_database_url")
    from ql3.adapters.postgres.store import PostgresStore

    # The migrations run on the first store of each database; the later ones find them done.
    postgres = PostgresStore.from_url(url, create_schema=url not in _MIGRATED)
    _MIGRATED.add(url)
    try:
        postgres.testing_reset()
        yield postgres
    finally:
        postgres.close()


def advance_time(store: Any, ms: int) -> None:
    """Move a store's clock forward: the fake clock in memory, an offset added to
    ``statement_timestamp()`` in PostgreSQL and to the host's clock in SQLite."""
    if isinstance(store, MemoryStore):
        store.clock.advance(ms)
    else:
        store.testing_advance_clock(ms)


@pytest.fixture
def advance(store: Any) -> Callable[[int], None]:
    def move(ms: int) -> None:
        advance_time(store, ms)

    return move
