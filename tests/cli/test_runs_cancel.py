"""``ql3 runs cancel``: text and ``--json`` answers, exit 1 for a finished or unknown run, exit 2
for bad arguments, and nothing written when refused (ADR 0017)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ql3.adapters.cli.main import main


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ql3.sqlite'}"
    database_url: str = request.getfixturevalue("pg_database_url")
    from ql3.adapters.postgres.migrate import upgrade

    upgrade(database_url)
    return database_url


def _submit(url: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["submit", "resize", "--database-url", url, "--json"]) == 0
    run_id: str = json.loads(capsys.readouterr().out)["run_id"]
    return run_id


def _show(url: str, run_id: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["runs", "show", run_id, "--database-url", url, "--json"]) == 0
    shown: dict[str, Any] = json.loads(capsys.readouterr().out)
    return shown


def test_cancel_a_queued_run_then_refuse_it_twice(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _submit(url, capsys)
    argv = ["runs", "cancel", run_id, "--reason", "no longer wanted", "--database-url", url]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "run_id": run_id,
        "status": "cancelled",
        "was": "queued",
    }
    shown = _show(url, run_id, capsys)
    assert shown["status"] == "cancelled"
    assert shown["error"] == "no longer wanted"
    assert [e["type"] for e in shown["events"]] == ["run_admitted", "run_cancelled"]

    # A finished run: exit 1, one line, nothing written.
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "is cancelled" in captured.err and "nothing changed" in captured.err
    assert _show(url, run_id, capsys) == shown


def test_cancel_answers_in_text(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    run_id = _submit(url, capsys)
    assert main(["runs", "cancel", run_id, "--database-url", url]) == 0
    assert capsys.readouterr().out == f"cancelled run {run_id} (was queued)\n"
    assert _show(url, run_id, capsys)["error"] == "cancelled by operator"


def test_an_unknown_run_is_not_found(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _submit(url, capsys)
    assert main(["runs", "cancel", "no-such-run", "--database-url", url]) == 1
    err = capsys.readouterr().err
    assert "not found" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--reason", ""], "--reason"),
        (["--reason", "   "], "--reason"),
        (["--reason", "x" * 501], "--reason"),
        (["--no-such-option"], "no-such-option"),
    ],
)
def test_bad_arguments_exit_2_and_write_nothing(
    url: str, extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _submit(url, capsys)
    before = _show(url, run_id, capsys)
    assert main(["runs", "cancel", run_id, *extra, "--database-url", url]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert _show(url, run_id, capsys) == before


def test_a_run_id_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "cancel"]) == 2
    assert "RUN_ID" in capsys.readouterr().err
