"""Standalone and Edge never load the PostgreSQL adapter: in a fresh interpreter, build both
SQLite-backed containers on a database file, boot a runner and serve work, use the command line
on a ``sqlite:///`` URL, and then look at ``sys.modules``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.standalone.support import REPO

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from ql3.adapters.cli.main import main
    from ql3.application.queries import RunQueries
    from ql3.bootstrap import edge, standalone
    from tests.standalone.tasks import TASKS

    database = sys.argv[1]
    for profile in (standalone, edge):
        container = profile.build(database_path=database)
        container.startup_recovery().run()
        container.coordinator().run_cycle()
        container.store().close()

    container = edge.build(database_path=database)
    runner = container.runner(tasks=TASKS)
    runner.boot()
    thread = threading.Thread(target=runner.serve)
    thread.start()
    run_id = container.core.admission().submit("echo", 1)
    deadline = time.monotonic() + 20
    while RunQueries(container.store().unit_of_work).show(run_id).run.status.value != "succeeded":
        assert time.monotonic() < deadline, "the run did not finish"
        time.sleep(0.05)
    runner.request_stop()
    thread.join()
    container.store().close()

    url = "sqlite:///" + database
    assert main(["submit", "echo", "--database-url", url]) == 0
    assert main(["runs", "list", "--database-url", url]) == 0
    assert main(["runs", "show", run_id, "--database-url", url]) == 0

    loaded = sorted(m for m in sys.modules
                    if m == "psycopg" or m.startswith(("psycopg.", "psycopg_",
                                                       "ql3.adapters.postgres",
                                                       "ql3.bootstrap.cluster")))
    print("LOADED:" + ",".join(loaded))
    """
)


def test_sqlite_profiles_and_their_command_line_never_load_postgres(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "ql3.sqlite")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "LOADED:", result.stdout
