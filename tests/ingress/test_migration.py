"""Migration ``0002_ingress`` installs the ingress functions and its downgrade removes them."""

from __future__ import annotations

from alembic import command
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from adapters.postgres.migrate import alembic_config, current_revision, upgrade
from tests.postgres_server import PostgresServer, create_database, drop_database, random_name

FUNCTIONS = "SELECT count(*) FROM pg_proc WHERE proname LIKE 'ql3\\_ingress\\_%'"


def test_upgrade_and_downgrade_of_the_ingress_functions(pg_server: PostgresServer) -> None:
    name = random_name("ql3_migrate_")
    url = create_database(pg_server, name)
    engine = create_engine(url, poolclass=NullPool)
    try:
        upgrade(url, "0002_ingress")
        assert current_revision(url) == "0002_ingress"
        with engine.connect() as connection:
            assert connection.execute(text(FUNCTIONS)).scalar_one() == 15
        with engine.begin() as connection:
            config = alembic_config()
            config.attributes["connection"] = connection
            command.downgrade(config, "0001_initial")
        assert current_revision(url) == "0001_initial"
        with engine.connect() as connection:
            assert connection.execute(text(FUNCTIONS)).scalar_one() == 0
            assert connection.execute(text("SELECT to_regclass('runs')")).scalar() is not None
    finally:
        engine.dispose()
        drop_database(pg_server, name)
