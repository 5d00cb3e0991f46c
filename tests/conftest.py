"""Shared pytest fixtures: a PostgreSQL server per session and a fresh database per module.

Fixtures
--------
``pg_server`` (session)
    A ``PostgresServer`` with ``admin_url`` and ``url_for(dbname)``.
``pg_template`` (session)
    A ``TemplateDatabase``: the database every test module's database is cloned from. Its schema
    is installed by ``prepare_template(url: str) -> None`` from ``tests/pg_schema.py`` when that
    module exists; otherwise it stays empty.
``pg_database_url`` (module)
    The SQLAlchemy URL (``postgresql+psycopg://...``) of a fresh database cloned from the template,
    dropped when the module's tests are done.

Tests that use any of them are marked ``postgres`` (so ``-m "not postgres"`` deselects them). When
no server can be found or started they are skipped, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest

from tests.postgres_server import (
    PostgresServer,
    ServerUnavailable,
    close_connections,
    create_database,
    drop_database,
    find_server,
    random_name,
    user_tables,
)

POSTGRES_FIXTURES = frozenset({"pg_server", "pg_template", "pg_database_url"})
SCHEMA_MODULE = "tests.pg_schema"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if POSTGRES_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    try:
        server = find_server()
    except ServerUnavailable as error:
        if in_ci():
            pytest.fail(f"CI=true and {error}", pytrace=False)
        pytest.skip(str(error))
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class TemplateDatabase:
    """The session's template database; ``tables`` are what ``prepare_template`` installed."""

    name: str
    url: str
    tables: frozenset[str]


def _template_preparer() -> Callable[[str], None] | None:
    try:
        module: ModuleType = importlib.import_module(SCHEMA_MODULE)
    except ModuleNotFoundError as error:
        # Only a missing tests/pg_schema.py means "no schema"; a broken import inside it must fail.
        if error.name in {SCHEMA_MODULE, "tests"}:
            return None
        raise
    prepare: Callable[[str], None] = module.prepare_template
    return prepare


@pytest.fixture(scope="session")
def pg_template(pg_server: PostgresServer) -> Iterator[TemplateDatabase]:
    name = random_name("ql3_template_")
    url = create_database(pg_server, name)
    try:
        prepare = _template_preparer()
        if prepare is not None:
            prepare(url)
        tables = user_tables(url)
        # Cloning needs the template idle: cut connections prepare_template may have left
        # behind and refuse new ones.
        close_connections(pg_server, name)
        with pg_server.connect_admin() as conn:
            conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        yield TemplateDatabase(name=name, url=url, tables=tables)
    finally:
        drop_database(pg_server, name)


@pytest.fixture(scope="module")
def pg_database_url(pg_server: PostgresServer, pg_template: TemplateDatabase) -> Iterator[str]:
    name = random_name("ql3_test_")
    url = create_database(pg_server, name, template=pg_template.name)
    try:
        yield url
    finally:
        drop_database(pg_server, name)
