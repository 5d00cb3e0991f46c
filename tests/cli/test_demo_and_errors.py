"""The ``ql3`` command line: the demo story and error handling (one line, exit 2 or 1, no
traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ql3.adapters.cli.demo import postgres_url
from ql3.adapters.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def _demo(database_url: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QL3_")}
    env.update({"QL3_DEMO_SHORT": "1", "COLUMNS": "200"})
    if database_url is not None:
        env["QL3_DATABASE_URL"] = database_url
    done = subprocess.run(
        [sys.executable, "-m", "ql3.adapters.cli.main", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


def _check_story(out: str, executor: str) -> None:
    assert f"2. started `{executor}`" in out
    assert "SIGKILL to pid" in out
    # Right after the kill nothing is lost: the three runs still run under their leases.
    killed = out[out.index("Right after the SIGKILL") : out.index("4. restarted")]
    assert killed.count("#1 running, lease gen 1 v1 leased") == 3
    assert "exited with status 0" in out
    summary = out[out.index("Summary") :]
    rows = {line.split("│")[1].strip(): line for line in summary.splitlines() if "│" in line}
    assert "succeeded" in rows["ping"]
    assert "#1 lost, lease gen 1 v2 released: lease_expired" in rows["resize-image"]
    assert "succeeded" in rows["resize-image"]
    assert "failed" in rows["charge-card"] and "failed" in rows["send-report"]
    assert "#2 succeeded, lease gen 2 v2 released: completed" in summary
    retried = summary[summary.index("Retried") : summary.index("Failed closed")]
    assert "resize-image" in retried and "session_replaced" in retried
    failed_closed = summary[summary.index("Failed closed") : summary.index("Failed by their")]
    assert "charge-card: attempt 1 lost: unsafe" in failed_closed
    assert "send-report: attempt 1 lost: no_policy" in failed_closed
    assert "parse-upload: ValueError" in summary[summary.index("Failed by their") :]
    assert summary.count("#2 ") == 1  # only the idempotent run ran twice


def test_demo_kills_a_real_standalone_process_and_retries_only_the_safe_run() -> None:
    out = _demo(None)
    assert "(Standalone on SQLite)" in out
    _check_story(out, "ql3 standalone")


def test_demo_on_postgresql_kills_a_real_worker_of_a_cluster_node(pg_database_url: str) -> None:
    out = _demo(pg_database_url)
    assert "(Cluster: a node and a worker process)" in out
    _check_story(out, "ql3 worker")


def test_only_a_postgresql_url_selects_the_cluster_story() -> None:
    url = "postgresql+psycopg://u@h/db"
    assert postgres_url({"QL3_DATABASE_URL": url}) == url
    assert postgres_url({}) is None
    assert postgres_url({"QL3_DATABASE_URL": "sqlite:///x.sqlite"}) is None


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["submit", "t"], "no database"),
        (["submit", "t", "--database-url", "mysql://x"], "postgresql"),
        (["submit", "t", "--input", "{bad", "--database-url", "postgresql://x/y"], "not JSON"),
        (["runs", "list", "--status", "nope", "--database-url", "postgresql://x/y"], "nope"),
        (["db", "upgrade", "--database-url", "sqlite:///x.sqlite"], "SQLite"),
        (["submit", "t", "--database-url", "sqlite:///"], "database file"),
        (["standalone"], "--app"),
        (["standalone", "--app", "no_such_module_anywhere:TASKS"], "no_such_module_anywhere"),
        (["standalone", "--app", "ql3.adapters.cli.demo_tasks"], "MODULE:ATTR"),
        (["no-such-command"], "No such command"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QL3_DATABASE_URL", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_a_missing_sqlite_database_is_not_found_and_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.sqlite"
    assert main(["runs", "list", "--database-url", f"sqlite:///{missing}"]) == 1
    assert "no database" in capsys.readouterr().err
    assert not missing.exists()


def test_unreachable_database_is_a_failure_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["runs", "list", "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/none"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("ql3: ")
    assert "Traceback" not in err


@pytest.mark.parametrize("module", ["ql3", "ql3.adapters.cli.main"])
def test_a_failure_reads_the_same_whichever_module_runs_the_command(module: str) -> None:
    """``python -m ql3.adapters.cli.main`` runs the module as ``__main__``; a command's failure
    is still one line with exit 1, not the catch-all's "Failure: ..."."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QL3_")}
    done = subprocess.run(
        [
            sys.executable, "-m", module, "worker", "--app", "benchmarks.tasks:TASKS",
            "--worker-id", "w", "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/none",
        ],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("ql3: cannot connect to the database:"), done.stderr
    assert "Failure" not in done.stderr and "Traceback" not in done.stderr
