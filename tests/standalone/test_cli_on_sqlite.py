"""``ql3 submit`` and ``ql3 runs`` on a ``sqlite:///`` URL: the Standalone store, no server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ql3.adapters.cli.main import main


def test_submit_then_list_and_show_on_a_sqlite_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'ql3.sqlite'}"
    argv = ["submit", "resize", "--input", '{"w": 64}', "--safety", "idempotent",
            "--retry-on-lost", "--max-attempts", "3", "--database-url", url, "--json"]
    assert main(argv) == 0
    run_id = json.loads(capsys.readouterr().out)["run_id"]

    assert main(["runs", "list", "--database-url", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["runs"]
    assert listed == [
        {"id": run_id, "task": "resize", "status": "queued", "attempts": 1, "quarantined": False}
    ]

    assert main(["runs", "show", run_id, "--database-url", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["input"] == {"w": 64}
    assert shown["policy"]["safety"] == "idempotent"
    assert shown["policy"]["retry_on_lost"] is True
    assert [e["type"] for e in shown["events"]] == ["run_admitted"]

    assert main(["runs", "show", "no-such-run", "--database-url", url]) == 1
    assert "not found" in capsys.readouterr().err
