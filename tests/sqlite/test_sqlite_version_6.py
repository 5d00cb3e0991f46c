"""A SQLite database of schema version 5 (the baseline, before the operator console, ADR 0020)
is brought to version 6 when it is opened: the console's two indexes, its rows kept."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ql3.adapters.sql.sqlite import SCHEMA_VERSION, SqliteStore
from ql3.application.admission import Admission
from ql3.application.identities import RandomIdentities

CONSOLE_INDEXES = {"ix_runs_status_created", "ix_runs_workflows"}


def _indexes(path: Path) -> set[str]:
    with sqlite3.connect(path) as connection:
        rows = connection.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        return {str(name) for (name,) in rows}


def test_a_version_5_database_gets_the_console_indexes(tmp_path: Path) -> None:
    path = tmp_path / "v5.sqlite"
    store = SqliteStore(path)
    run_id = Admission(store.unit_of_work, RandomIdentities()).submit("mail", {"n": 1})
    store.close()
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        for name in CONSOLE_INDEXES:
            connection.execute(f"DROP INDEX {name}")
        connection.execute("PRAGMA user_version = 5")
    finally:
        connection.close()
    assert not CONSOLE_INDEXES & _indexes(path)

    upgraded = SqliteStore(path)
    try:
        with upgraded.unit_of_work() as uow:
            run = uow.runs.get_run(run_id)
        assert run is not None and run.input == {"n": 1}
    finally:
        upgraded.close()
    assert _indexes(path) >= CONSOLE_INDEXES
    with sqlite3.connect(path) as connection:
        (version,) = connection.execute("PRAGMA user_version").fetchone()
    assert version == SCHEMA_VERSION == 6
