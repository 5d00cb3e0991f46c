"""The credential store's contract runs on both stores that keep credentials (the Cluster
profile's): memory and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from adapters.memory import FakeClock, MemoryStore

CREDENTIAL_STORES = [
    pytest.param("memory", id="memory"),
    pytest.param("postgres", id="postgres", marks=[pytest.mark.postgres]),
]


@pytest.fixture(params=CREDENTIAL_STORES)
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "memory":
        memory = MemoryStore(FakeClock())
        try:
            yield memory
        finally:
            memory.close()
        return
    from adapters.postgres.store import PostgresStore

    postgres = PostgresStore.from_url(
        request.getfixturevalue("pg_database_url"), create_schema=True
    )
    try:
        postgres.testing_reset()
        yield postgres
    finally:
        postgres.close()
