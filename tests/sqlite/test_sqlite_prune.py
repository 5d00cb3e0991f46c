"""Pruning on SQLite (ADR 0016): a database has the prune's indexes, and the pick reads
``ix_runs_finished``."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy.dialects import sqlite

from ql3.adapters.sql.history import prunable_query
from ql3.adapters.sql.sqlite import SqliteStore
from ql3.adapters.sql.sqlite.queries import SQLITE
from ql3.application.ports import PruneMark

PRUNE_INDEXES = ("ix_runs_finished", "ix_run_dispatch_leases_attempt_id")


def _indexes(path: Path) -> set[str]:
    with sqlite3.connect(path) as connection:
        found = connection.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        return {str(name) for (name,) in found}


def test_a_new_database_has_the_prune_indexes(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite"
    SqliteStore(path).close()
    assert set(PRUNE_INDEXES) <= _indexes(path)


def test_the_pick_reads_the_finished_index(tmp_path: Path) -> None:
    path = tmp_path / "plan.sqlite"
    SqliteStore(path).close()
    for after in (None, PruneMark(finished_at_ms=5, run_id="r5")):
        statement = prunable_query(1_000, 16, after, SQLITE, skip_locked=False)
        compiled = statement.compile(
            dialect=sqlite.dialect(), compile_kwargs={"render_postcompile": True}
        )
        params = [compiled.params[name] for name in compiled.positiontup or ()]
        with sqlite3.connect(path) as connection:
            plan = connection.execute(f"EXPLAIN QUERY PLAN {compiled}", params).fetchall()
        details = [str(row[-1]) for row in plan]
        assert any("ix_runs_finished" in d for d in details), details
        assert not any(d.startswith("SCAN runs") for d in details), details
        assert not any("TEMP B-TREE" in d for d in details), details
