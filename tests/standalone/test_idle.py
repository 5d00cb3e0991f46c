"""An idle ``ql3 standalone`` process writes nothing: no write system call of any kind (its
database, its WAL, its log, its pipes) and no change to its files, once its work is done."""

from __future__ import annotations

import time
from pathlib import Path

from ql3.adapters.sql.sqlite import SqliteStore
from ql3.application.admission import Admission
from ql3.application.identities import RandomIdentities
from ql3.domain.model import RunStatus
from tests.standalone.support import Child, views, wait_for

# A short lease TTL: renewals, and anything else kept on the TTL's schedule, would come often.
LEASE_TTL = "0.6"
WATCHED_S = 3.0  # several resident cycles (one a second) and TTLs


def _write_calls(pid: int) -> int:
    fields = dict(
        line.split(": ", 1) for line in Path(f"/proc/{pid}/io").read_text().splitlines()
    )
    return int(fields["syscw"])


def _files(database: Path) -> dict[str, tuple[int, int]]:
    return {
        path.name: (path.stat().st_size, path.stat().st_mtime_ns)
        for path in database.parent.iterdir()
        if path.name.startswith(database.name)
    }


def test_an_idle_standalone_process_makes_no_write(tmp_path: Path) -> None:
    database = tmp_path / "ql3.sqlite"
    store = SqliteStore(database)
    try:
        run_id = Admission(store.unit_of_work, RandomIdentities()).submit("echo", {"n": 1}, None)
    finally:
        store.close()
    child = Child(database, tmp_path / "child.log", "--lease-ttl", LEASE_TTL)
    try:
        wait_for(
            lambda: (view := views(database, [run_id]).get(run_id)) is not None
            and view.run.status is RunStatus.SUCCEEDED,
            30,
            "the run to succeed",
            child,
        )
        time.sleep(1.5)  # the cycle after the completion, and the last renewal's schedule
        pid = child.process.pid
        calls, files = _write_calls(pid), _files(database)
        time.sleep(WATCHED_S)
        assert child.process.poll() is None, child.output()
        assert _write_calls(pid) == calls, "the idle process made write calls"
        assert _files(database) == files, "the idle process changed its database files"
        assert child.stop() == 0
    finally:
        child.ensure_dead()
