"""The PostgreSQL test fixtures themselves: fresh isolated databases and the private server."""

from __future__ import annotations

import os
import time

import pytest
from sqlalchemy.engine import make_url

from tests.conftest import TemplateDatabase, in_ci
from tests.postgres_server import (
    PostgresServer,
    ServerUnavailable,
    connect,
    create_database,
    drop_database,
    random_name,
    start_private_server,
    user_tables,
)


def test_module_database_is_a_fresh_clone_of_the_template(
    pg_server: PostgresServer, pg_template: TemplateDatabase, pg_database_url: str
) -> None:
    name = make_url(pg_database_url).database
    assert name is not None and name.startswith("ql3_test_")
    assert pg_database_url == pg_server.url_for(name)
    assert make_url(pg_database_url).drivername == "postgresql+psycopg"
    assert user_tables(pg_database_url) == pg_template.tables

    with connect(pg_database_url) as conn:
        conn.execute("CREATE TABLE fixture_probe (id integer PRIMARY KEY)")
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)

    # Another module's database, cloned from the same template, does not see this module's table.
    other = random_name("ql3_test_")
    other_url = create_database(pg_server, other, template=pg_template.name)
    try:
        assert other != name
        assert user_tables(other_url) == pg_template.tables
        assert "public.fixture_probe" in user_tables(pg_database_url)
    finally:
        drop_database(pg_server, other)


def test_private_server_starts_answers_and_is_removed() -> None:
    started = time.monotonic()
    try:
        server = start_private_server()
    except ServerUnavailable as error:
        if in_ci():
            raise
        pytest.skip(f"cannot start a private PostgreSQL server: {error}")
    try:
        with connect(server.admin_url) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
            rows = conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN"
                " ('fsync', 'synchronous_commit', 'full_page_writes', 'max_connections')"
            ).fetchall()
        settings = {str(name): str(value) for name, value in rows}
        assert settings == {
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
        }
    finally:
        server.stop()
    assert not os.path.exists(server.base_dir)
    assert time.monotonic() - started < 15
