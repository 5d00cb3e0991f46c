"""The Alembic migrations build exactly the schema declared in ``ql3.adapters.sql.schema``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.pool import NullPool

from ql3.adapters.postgres.migrate import current_revision, head_revision, upgrade
from ql3.adapters.sql.schema import ALL_TABLES, metadata

DECLARED = "declared"


@pytest.fixture(scope="module")
def engine(pg_database_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_database_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


def test_the_template_database_is_migrated_to_head(pg_database_url: str) -> None:
    assert current_revision(pg_database_url) == head_revision()


def test_upgrading_again_is_a_no_op(pg_database_url: str) -> None:
    upgrade(pg_database_url)
    assert current_revision(pg_database_url) == head_revision()


def test_alembic_finds_no_difference_between_migrations_and_metadata(engine: Engine) -> None:
    with engine.connect() as connection:
        context = MigrationContext.configure(
            connection, opts={"compare_type": True, "compare_server_default": True}
        )
        assert compare_metadata(context, metadata) == []


def _catalog(connection: Connection, schema: str) -> dict[str, list[tuple[str, ...]]]:
    """What Alembic does not compare: CHECK constraints, partial index predicates, collations
    and storage parameters, as PostgreSQL itself prints them."""
    qualifier = f"{schema}."
    params = {"schema": schema}
    constraints = connection.execute(
        text(
            "SELECT cl.relname, c.conname, c.contype::text, pg_get_constraintdef(c.oid)"
            " FROM pg_constraint c JOIN pg_class cl ON cl.oid = c.conrelid"
            " JOIN pg_namespace n ON n.oid = cl.relnamespace WHERE n.nspname = :schema"
            " ORDER BY 1, 2"
        ),
        params,
    ).all()
    indexes = connection.execute(
        text(
            "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = :schema"
            " ORDER BY 1, 2"
        ),
        params,
    ).all()
    columns = connection.execute(
        text(
            "SELECT table_name, column_name, data_type, is_nullable,"
            " coalesce(collation_name, ''), coalesce(is_identity, '')"
            " FROM information_schema.columns WHERE table_schema = :schema"
            " ORDER BY 1, ordinal_position"
        ),
        params,
    ).all()
    options = connection.execute(
        text(
            "SELECT cl.relname, coalesce(array_to_string(cl.reloptions, ','), '')"
            " FROM pg_class cl JOIN pg_namespace n ON n.oid = cl.relnamespace"
            " WHERE n.nspname = :schema AND cl.relkind = 'r' ORDER BY 1"
        ),
        params,
    ).all()
    tables = {table.name for table in ALL_TABLES}
    return {
        "constraints": [
            tuple(str(v).replace(qualifier, "") for v in row)
            for row in constraints
            if row[0] in tables
        ],
        "indexes": [
            tuple(str(v).replace(qualifier, "") for v in row) for row in indexes if row[0] in tables
        ],
        "columns": [tuple(str(v) for v in row) for row in columns if row[0] in tables],
        "options": [tuple(str(v) for v in row) for row in options if row[0] in tables],
    }


def test_catalog_of_migrations_equals_catalog_of_metadata(engine: Engine) -> None:
    with engine.begin() as connection:
        connection.execute(text(f"DROP SCHEMA IF EXISTS {DECLARED} CASCADE"))
        connection.execute(text(f"CREATE SCHEMA {DECLARED}"))
        declared = connection.execution_options(schema_translate_map={None: DECLARED})
        metadata.create_all(declared)
    try:
        with engine.connect() as connection:
            migrated = _catalog(connection, "public")
            created = _catalog(connection, DECLARED)
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"DROP SCHEMA {DECLARED} CASCADE"))
    assert migrated["columns"]
    for part in ("constraints", "indexes", "columns", "options"):
        assert migrated[part] == created[part], part


def test_every_status_column_is_checked(engine: Engine) -> None:
    with engine.connect() as connection:
        checks = set(
            connection.execute(
                text("SELECT conname FROM pg_constraint WHERE contype = 'c'")
            ).scalars()
        )
    expected = {
        "ck_runs_status",
        "ck_runs_owner",
        "ck_runs_safety",
        "ck_runs_max_attempts",
        "ck_runs_policy_iff_has_policy",
        "ck_run_attempts_status",
        "ck_run_attempts_number",
        "ck_run_attempts_lost_evidence",
        "ck_run_dispatch_leases_status",
        "ck_run_dispatch_leases_version",
        "ck_run_dispatch_leases_generation",
        "ck_run_dispatch_leases_release_reason",
        "ck_run_dispatch_leases_release_reason_iff_released",
        "ck_run_events_type",
        "ck_worker_sessions_status",
        "ck_attempt_stop_reports_kind",
    }
    assert expected <= checks


def test_lease_expiry_is_in_no_index_and_leases_keep_room_for_hot_renewals(
    engine: Engine,
) -> None:
    with engine.connect() as connection:
        definitions = connection.execute(
            text("SELECT indexdef FROM pg_indexes WHERE tablename = 'run_dispatch_leases'")
        ).scalars()
        assert not any("expires_at" in definition for definition in definitions)
        options = connection.execute(
            text("SELECT reloptions FROM pg_class WHERE relname = 'run_dispatch_leases'")
        ).scalar_one()
    assert options == ["fillfactor=70"]
