"""A SQLite database of schema version 3 (before ADRs 0013 to 0015) is brought to version 4 when
it is opened: the job columns of ``runs`` (a Run admitted before has priority 0, no unique key,
no timeout and no retry on error), ``task_limits`` and ``ix_runs_claimable`` by priority, its
rows kept."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ql3.adapters.sql.sqlite import SCHEMA_VERSION, SqliteStore
from ql3.application.admission import Admission
from ql3.application.identities import RandomIdentities
from ql3.domain.policy import RetryPolicy, Safety

JOB_COLUMNS = (
    "retry_on_error",
    "timeout_ms",
    "priority",
    "unique_key",
)
NEW_CHECKED = JOB_COLUMNS
# ``ix_runs_claimable`` as version 3 declared it, before it led with the priority (ADR 0014).
VERSION_3_CLAIMABLE = (
    "CREATE INDEX ix_runs_claimable ON runs (task, updated_at, id) WHERE status IN ('queued')"
)


def _as_version_3(path: Path) -> None:
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        (runs_ddl,) = connection.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'runs'"
        ).fetchone()
        indexes = connection.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'runs'"
            " AND sql IS NOT NULL"
        ).fetchall()
        lines = runs_ddl.splitlines()
        version_3_ddl = "\n".join(
            line
            for line in lines
            if not any(f"\t{c} " in line or f"ck_runs_{c} " in line for c in NEW_CHECKED)
        ).replace(", \n)", "\n)")
        assert version_3_ddl != runs_ddl
        kept = [
            row[1]
            for row in connection.execute("PRAGMA table_info(runs)").fetchall()
            if row[1] not in JOB_COLUMNS
        ]
        columns = ", ".join(kept)
        # the other tables' foreign keys keep naming ``runs``, not the renamed table
        connection.execute("PRAGMA legacy_alter_table = ON")
        connection.execute("ALTER TABLE runs RENAME TO runs_new")
        connection.execute(version_3_ddl)
        connection.execute(f"INSERT INTO runs ({columns}) SELECT {columns} FROM runs_new")
        connection.execute("DROP TABLE runs_new")
        for (index,) in indexes:
            if "ix_runs_claimable" in index:
                index = VERSION_3_CLAIMABLE
            if not any(column in index for column in JOB_COLUMNS):  # no index of version 4
                connection.execute(index)
        connection.execute("DROP TABLE task_limits")
        connection.execute("PRAGMA user_version = 3")
        connection.execute("COMMIT")
    finally:
        connection.close()


def test_a_version_3_database_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "v3.sqlite"
    old = SqliteStore(path)
    policy = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)
    queued = Admission(old.unit_of_work, RandomIdentities()).submit("t", {"n": 1}, policy)
    old.close()
    _as_version_3(path)

    upgraded = SqliteStore(path)
    try:
        with upgraded.unit_of_work() as uow:
            version = uow.connection.exec_driver_sql("PRAGMA user_version").scalar()
            tables = {
                name
                for (name,) in uow.connection.exec_driver_sql(
                    "SELECT name FROM sqlite_master WHERE type = 'table'"
                )
            }
            indexes = {
                name
                for (name,) in uow.connection.exec_driver_sql(
                    "SELECT name FROM sqlite_master WHERE type = 'index'"
                )
            }
            run = uow.runs.get_run(queued)
            (claimable,) = uow.connection.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE name = 'ix_runs_claimable'"
            ).one()
        assert version == SCHEMA_VERSION == 5
        assert "(task, priority DESC, updated_at, id)" in claimable
        assert "task_limits" in tables
        assert "uq_runs_unique_key" in indexes  # ADR 0015
        assert run is not None and run.input == {"n": 1}
        assert (run.priority, run.unique_key, run.timeout_ms) == (0, None, None)
        assert run.policy == policy and not run.policy.retry_on_error
        assert Admission(upgraded.unit_of_work, RandomIdentities()).submit("t")
    finally:
        upgraded.close()
