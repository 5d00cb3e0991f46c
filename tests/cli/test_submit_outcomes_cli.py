"""``ql3 submit --retry-on-error`` and ``--timeout`` on PostgreSQL and SQLite: retry on error is
refused for work that is not idempotent or deduplicated, and a bad timeout is refused, each with
one line and exit 2, nothing written; an accepted submit snapshots both on the Run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ql3.adapters.cli.main import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(params=["postgres", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_database_url"))
    return f"sqlite:///{tmp_path / 'ql3.db'}"


def _runs(capsys: pytest.CaptureFixture[str], url: str) -> list[dict[str, Any]]:
    code, out, err = _run(capsys, "runs", "list", "--database-url", url, "--json")
    if code != 0 and "no database" in err:  # SQLite: nothing was ever written
        return []
    assert code == 0, err
    runs: list[dict[str, Any]] = json.loads(out)["runs"]
    return runs


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--safety", "unsafe", "--retry-on-error", "--max-attempts", "3"], "idempotent or"),
        (["--retry-on-error", "--max-attempts", "3"], "no safety"),
        (["--timeout", "0"], "--timeout"),
        (["--timeout", "-1"], "--timeout"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "999999999"], "--timeout"),
    ],
)
def test_refused_submits_exit_2_with_one_line_and_write_nothing(
    url: str, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    before = _runs(capsys, url)
    code, out, err = _run(capsys, "submit", "t", *argv, "--database-url", url)
    assert code == 2
    assert out == "" and needle in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    assert _runs(capsys, url) == before


def test_retry_on_error_and_timeout_are_snapshotted_on_the_run(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(
        capsys, "submit", "t", "--safety", "idempotent", "--retry-on-error", "--max-attempts",
        "3", "--backoff-initial", "0.5", "--timeout", "2.5", "--database-url", url, "--json",
    )
    assert code == 0, err
    run_id = json.loads(out)["run_id"]
    code, out, err = _run(capsys, "runs", "show", run_id, "--database-url", url, "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["timeout_ms"] == 2_500
    assert shown["policy"]["retry_on_error"] is True
    assert (shown["policy"]["safety"], shown["policy"]["max_attempts"]) == ("idempotent", 3)
    assert shown["policy"]["backoff_initial_ms"] == 500
