"""``ql3 workflows list / show / cancel`` on PostgreSQL and on a SQLite file (ADR 0021): the
steps as an indented tree or JSON with each step's status, the parents' outputs a step of a
workflow file receives, cancellation of every unfinished step, one-line errors with exit 2 for
bad input and 1 for not found or finished, nothing written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ql3.adapters.cli.main import main
from ql3.adapters.memory import FakeClock
from ql3.domain import step_input
from tests.scheduling_support import WorkerDriver, runtime

DIAMOND = {
    "name": "nightly",
    "steps": [
        {"id": "a", "task": "t", "input": {"n": 1}},
        {"id": "b", "task": "t", "after": ["a"]},
        {"id": "c", "task": "t", "after": ["a"]},
        {"id": "d", "task": "t", "after": ["b", "c"]},
    ],
}


@pytest.fixture(params=["postgres", "sqlite"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A database URL and the store on it (the in-process worker's)."""
    if request.param == "postgres":
        request.applymarker(pytest.mark.postgres)
        from ql3.adapters.postgres.store import PostgresStore

        url = request.getfixturevalue("pg_database_url")
        store: Any = PostgresStore.from_url(url, pool_size=2)
        store.testing_reset()
    else:
        from ql3.adapters.sql.sqlite import SqliteStore

        path = tmp_path / "cli.sqlite"
        url = f"sqlite:///{path}"
        store = SqliteStore(path)
    try:
        yield url, store
    finally:
        store.close()


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_workflows_list_show_and_cancel(
    database: tuple[str, Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url, store = database
    clock = FakeClock()
    rt = runtime(store, clock.advance)
    document = tmp_path / "diamond.json"
    document.write_text(json.dumps(DIAMOND), encoding="utf-8")
    code, out, err = _run(capsys, "workflows", "submit", str(document), "--database-url", url)
    assert code == 0, err
    workflow_id = out.strip()

    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=1)
    rt.cycle()
    (a,) = worker.claim_all()
    worker.finish(a.run_id, output={"rows": 3})
    rt.cycle()
    (running,) = worker.claim_all()  # b or c runs; the other waits
    _, envelope = step_input.split(running.input)
    assert envelope is not None and envelope["parents"] == {"a": {"rows": 3}}

    code, out, err = _run(capsys, "workflows", "show", workflow_id, "--database-url", url)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == f"workflow {workflow_id}  nightly  running"
    assert lines[1].startswith("  - a  succeeded task t  run ") and lines[1].endswith(
        "succeeded, 1 attempt(s)")
    assert lines[2].startswith("    - b  admitted  task t  run ")
    assert lines[3] == "      - d  pending   task t  no run yet  (also after c)"
    assert lines[4].startswith("    - c  admitted  task t  run ")
    assert len(lines) == 5

    code, out, err = _run(capsys, "workflows", "show", workflow_id, "--database-url", url,
                          "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert [(s["id"], s["status"]) for s in shown["steps"]] == [
        ("a", "succeeded"), ("b", "admitted"), ("c", "admitted"), ("d", "pending")]
    assert shown["steps"][0]["output"] == {"rows": 3}
    assert shown["steps"][3]["after"] == ["b", "c"]

    code, out, err = _run(capsys, "workflows", "list", "--database-url", url, "--json")
    assert code == 0, err
    (listed,) = json.loads(out)["workflows"]
    assert (listed["run_id"], listed["status"], listed["steps"]) == (workflow_id, "running", 4)
    code, out, _ = _run(capsys, "workflows", "list", "--status", "failed", "--database-url", url)
    assert (code, out.strip()) == (0, "no workflows")

    code, out, err = _run(capsys, "workflows", "cancel", workflow_id, "--reason", "stop",
                          "--database-url", url, "--json")
    assert code == 0, err
    assert json.loads(out) == {"run_id": workflow_id, "status": "cancelled", "was": "running"}
    code, out, _ = _run(capsys, "workflows", "show", workflow_id, "--database-url", url,
                        "--json")
    after = json.loads(out)
    assert (after["status"], after["error"]) == ("cancelled", "stop")
    assert [s["status"] for s in after["steps"]] == [
        "succeeded", "cancelled", "cancelled", "cancelled"]
    assert {s["run_status"] for s in after["steps"][1:3]} == {"cancelled"}

    # Finished, unknown, bad input: one line, exit 1 or 2, nothing changes.
    for argv, expected, message in [
        (("cancel", workflow_id), 1, "a finished workflow cannot be cancelled"),
        (("cancel", a.run_id), 1, f"not found: workflow {a.run_id}"),
        (("show", "nope"), 1, "not found: workflow nope"),
        (("cancel", workflow_id, "--reason", ""), 2, "--reason must be"),
        (("list", "--status", "sleepy"), 2, "Invalid value for '--status'"),
    ]:
        code, out, err = _run(capsys, "workflows", *argv, "--database-url", url)
        assert code == expected, (argv, err)
        assert message in err and len(err.strip().splitlines()) == 1, err
    code, out, _ = _run(capsys, "workflows", "show", workflow_id, "--database-url", url,
                        "--json")
    assert json.loads(out) == after
