"""A SQLite database of schema version 2 (before ADR 0010) is brought to version 3 when it is
opened: the quarantine and failing-candidate columns, ``ix_runs_quarantined``, the quarantine
event types and ``scheduler_nodes``, its rows kept."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from ql3.adapters.sql.sqlite import SCHEMA_VERSION, SqliteStore
from ql3.application.admission import Admission
from ql3.application.identities import RandomIdentities
from ql3.application.operations import Quarantines
from ql3.application.ports import HARD_PAGE_CAP, NodeCycle
from ql3.domain.events import EventType
from ql3.domain.model import EvidenceKind
from tests.contract.builders import committed, given_session, given_started, lose

QUARANTINE_TYPES = " OR type = 'run_quarantined' OR type = 'run_unquarantined'"


def _as_version_2(path: Path) -> None:
    """What version 2 created: no quarantine, no failing candidate, no nodes, the narrower
    check of event types."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("DROP INDEX ix_runs_quarantined")
        for column in ("quarantined_at", "quarantine_reason"):
            connection.execute(f"ALTER TABLE runs DROP COLUMN {column}")
        for column in ("step", "run_id", "attempt_id", "error", "since", "cycles"):
            connection.execute(f"ALTER TABLE dispatch_gate DROP COLUMN failed_{column}")
        connection.execute("DROP TABLE scheduler_nodes")
        (ddl,) = connection.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'run_events'"
        ).fetchone()
        assert QUARANTINE_TYPES in ddl
        connection.execute("DROP INDEX ix_run_events_run_id")
        connection.execute("ALTER TABLE run_events RENAME TO run_events_new")
        connection.execute(ddl.replace(QUARANTINE_TYPES, ""))
        connection.execute("INSERT INTO run_events SELECT * FROM run_events_new")
        connection.execute("DROP TABLE run_events_new")
        connection.execute("CREATE INDEX ix_run_events_run_id ON run_events (run_id, id)")
        connection.execute("PRAGMA user_version = 2")
        connection.execute("COMMIT")
    finally:
        connection.close()


def test_a_version_2_database_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "v2.sqlite"
    old = SqliteStore(path)
    given_session(old, "s1")
    attempt = given_started(old, "lost-run", "s1")
    with committed(old) as uow:
        lose(uow, attempt, EvidenceKind.WORKER_ABANDONED)
    queued = Admission(old.unit_of_work, RandomIdentities()).submit("t")
    old.close()
    _as_version_2(path)
    with pytest.raises(sqlite3.IntegrityError):  # the old check refuses the new event type
        connection = sqlite3.connect(path)
        try:
            connection.execute(
                "INSERT INTO run_events (run_id, type, at, data) VALUES (?, ?, 1, '{}')",
                (queued, "run_quarantined"),
            )
        finally:
            connection.close()

    upgraded = SqliteStore(path)
    try:
        with upgraded.unit_of_work() as uow:
            version = uow.connection.exec_driver_sql("PRAGMA user_version").scalar()
            indexes = {
                name
                for (name,) in uow.connection.exec_driver_sql(
                    "SELECT name FROM sqlite_master WHERE type = 'index'"
                )
            }
        assert version == SCHEMA_VERSION == 5
        assert {"ix_runs_quarantined", "ix_run_events_run_id"} <= indexes
        assert [c.run_id for c in upgraded.lost_runs(16).items] == ["lost-run"]
        Quarantines(upgraded.unit_of_work).quarantine("lost-run", "held")
        assert upgraded.lost_runs(16).items == ()
        with upgraded.unit_of_work() as uow:
            types = [stored.event.type for stored in uow.runs.events_of("lost-run")]
        assert types[-1] is EventType.RUN_QUARANTINED and len(types) >= 3
        upgraded.record_node_cycle(NodeCycle(node_id="n1", ok=True, aborted_at=None, cycles=1))
        view = upgraded.operations_view(HARD_PAGE_CAP)
        assert [n.node_id for n in view.nodes] == ["n1"]
        assert view.quarantined_count == 1 and view.gate.open and view.gate.failure is None
        assert [(q.task, q.queued) for q in view.queues] == [("t", 1)]
    finally:
        upgraded.close()
