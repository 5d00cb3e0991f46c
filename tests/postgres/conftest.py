"""Fixtures of the PostgreSQL adapter tests: one store per module on the module's database."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ql3.adapters.postgres.store import PostgresStore


@pytest.fixture(scope="module")
def pg_store(pg_database_url: str) -> Iterator[PostgresStore]:
    store = PostgresStore.from_url(pg_database_url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def store(pg_store: PostgresStore) -> PostgresStore:
    """The module's store, emptied and with its clock offset back at zero."""
    pg_store.testing_reset()
    return pg_store
