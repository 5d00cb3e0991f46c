"""Fixtures of the ingress tests: the module's database, a throw-away ingress role granted on
it (dropped at the end), the runtime's store as the schema owner and the ingress store as the
role."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.pool import NullPool

from ql3.adapters.postgres.grants import grant_ingress
from ql3.adapters.postgres.ingress import PostgresIngressStore
from ql3.adapters.postgres.store import PostgresStore
from tests.ingress.support import Env, build_env, drop_role, role_url, unique_role


@pytest.fixture(scope="module")
def admin_engine(pg_database_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_database_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def ingress_role(pg_database_url: str, admin_engine: Engine) -> Iterator[str]:
    role = unique_role()
    try:
        grant_ingress(admin_engine, role)
        yield role
    finally:
        drop_role(pg_database_url, role)


@pytest.fixture(scope="module")
def ingress_url(pg_database_url: str, ingress_role: str) -> str:
    return role_url(pg_database_url, ingress_role)


@pytest.fixture(scope="module")
def admin_store(pg_database_url: str) -> Iterator[PostgresStore]:
    store = PostgresStore.from_url(pg_database_url, pool_size=2)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(scope="module")
def ingress_store(ingress_url: str) -> Iterator[PostgresIngressStore]:
    store = PostgresIngressStore.from_url(ingress_url, pool_size=2)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def env(admin_store: PostgresStore, ingress_store: PostgresIngressStore) -> Env:
    """Empty tables, fresh identities."""
    admin_store.testing_reset()
    return build_env(admin_store, ingress_store)
