"""The migrations (ADR 0022): one baseline revision, then append-only revisions, each running its
own frozen text. The baseline is upgraded by the later revision (and downgraded again); a
database at a revision the migrations do not know (one made before the baseline) is refused
with nothing written."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from ql3.adapters.postgres.migrate import (
    MIGRATIONS,
    UnknownRevision,
    alembic_config,
    current_revision,
    head_revision,
    upgrade,
)
from tests.postgres_server import PostgresServer, create_database, drop_database, random_name

BASELINE = "r0001_baseline"
LATER = "r0002_retry_on_error_safety"
CONSOLE = "r0003_console_indexes"
HEAD = "r0004_claim_reads_by_key"
VERSIONS = MIGRATIONS / "versions"
CHECK = (
    "SELECT count(*) FROM pg_constraint WHERE conname = 'ck_runs_retry_on_error_safety'"
)
INSERT_RUN = (
    "INSERT INTO runs (id, task, owner, status, has_policy, retry_on_lost, max_attempts, safety,"
    " backoff_initial_ms, backoff_multiplier, backoff_cap_ms, backoff_jitter, attempt_count,"
    " created_at, updated_at, retry_on_error)"
    " VALUES (:id, 't', 'runtime', 'created', true, false, 3, :safety, 0, 1, 0, 0, 0, now(),"
    " now(), true)"
)


@pytest.fixture
def fresh(pg_server: PostgresServer) -> Iterator[tuple[str, Engine]]:
    name = random_name("ql3_migrate_")
    url = create_database(pg_server, name)
    engine = create_engine(url, poolclass=NullPool)
    try:
        yield url, engine
    finally:
        engine.dispose()
        drop_database(pg_server, name)


def _downgrade(engine: Engine, revision: str) -> None:
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def test_the_revisions_are_a_baseline_and_then_one_line(fresh: tuple[str, Engine]) -> None:
    url, _engine = fresh
    assert current_revision(url) is None
    assert head_revision() == HEAD
    chain = [s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()]
    assert chain == [HEAD, CONSOLE, LATER, BASELINE]
    upgrade(url, BASELINE)
    assert current_revision(url) == BASELINE


def test_the_baseline_is_upgraded_by_the_later_revision_and_back(
    fresh: tuple[str, Engine],
) -> None:
    url, engine = fresh
    upgrade(url, BASELINE)
    with engine.begin() as connection:
        assert connection.execute(text(CHECK)).scalar_one() == 0
        # The baseline still takes a row the later revision refuses; remove it before upgrading.
        connection.execute(text(INSERT_RUN), {"id": "unsafe", "safety": "unsafe"})
        connection.execute(text("DELETE FROM runs WHERE id = 'unsafe'"))
        connection.execute(text(INSERT_RUN), {"id": "kept", "safety": "idempotent"})
    upgrade(url, LATER)
    assert current_revision(url) == LATER
    with engine.begin() as connection:
        assert connection.execute(text(CHECK)).scalar_one() == 1
        assert connection.execute(text("SELECT id FROM runs")).scalars().all() == ["kept"]
    with (
        pytest.raises(IntegrityError, match="ck_runs_retry_on_error_safety"),
        engine.begin() as connection,
    ):
        connection.execute(text(INSERT_RUN), {"id": "unsafe", "safety": "unsafe"})
    _downgrade(engine, BASELINE)
    assert current_revision(url) == BASELINE
    with engine.connect() as connection:
        assert connection.execute(text(CHECK)).scalar_one() == 0


def test_the_baseline_downgrade_leaves_nothing_behind(fresh: tuple[str, Engine]) -> None:
    url, engine = fresh
    upgrade(url)
    _downgrade(engine, "base")
    assert current_revision(url) is None
    with engine.connect() as connection:
        tables = connection.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ).scalars()
        assert set(tables) == {"alembic_version"}
        functions = connection.execute(
            text(
                "SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
                " WHERE n.nspname = 'public'"
            )
        ).scalar_one()
        assert functions == 0
    upgrade(url)  # and up again
    assert current_revision(url) == HEAD


def test_a_database_made_before_the_baseline_is_refused_and_left_alone(
    fresh: tuple[str, Engine],
) -> None:
    url, engine = fresh
    upgrade(url, BASELINE)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '0013_prune_index'"))
    with pytest.raises(UnknownRevision, match=r"0013_prune_index.*must be recreated"):
        upgrade(url)
    assert current_revision(url) == "0013_prune_index"
    with engine.connect() as connection:
        assert connection.execute(text(CHECK)).scalar_one() == 0


def test_ql3_db_upgrade_refuses_it_with_a_message_and_exit_1(fresh: tuple[str, Engine]) -> None:
    url, engine = fresh
    upgrade(url, BASELINE)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '0013_prune_index'"))
    done = subprocess.run(
        [sys.executable, "-m", "ql3", "db", "upgrade", "--database-url", url],
        capture_output=True, text=True, timeout=120, check=False,
    )
    out, err = done.stdout, done.stderr
    assert done.returncode == 1
    assert "0013_prune_index" in err and "must be recreated" in err
    assert "Traceback" not in err + out
    assert current_revision(url) == "0013_prune_index"


def test_a_revision_runs_only_its_own_frozen_text() -> None:
    """No revision imports another, reads another's file or the live functions.sql, or imports
    the application (whose declarations change after the revision is frozen)."""
    revisions = sorted(VERSIONS.glob("*.py"))
    assert [path.stem for path in revisions] == [BASELINE, LATER, CONSOLE, HEAD]
    for path in revisions:
        source = path.read_text(encoding="utf-8")
        assert "importlib" not in source, path.name
        assert not re.search(r"^\s*(from|import) ql3", source, re.MULTILINE), path.name
        assert "functions.sql" not in source, path.name
        # A revision names the one it revises, and no other.
        revises = re.search(r'^down_revision = "(\w+)"', source, re.MULTILINE)
        named = {revises.group(1)} if revises else set()
        others = [other.stem for other in revisions if other != path]
        assert not any(other in source for other in others if other not in named), path.name
    frozen = sorted(path.name for path in VERSIONS.glob("*.sql"))
    assert frozen == [f"{BASELINE}.sql"]
