"""The ``ql3`` command line: the demo story and error handling (one line, exit 2 or 1, no
traceback)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from adapters.cli.demo import run_demo
from adapters.cli.main import main


def test_demo_story_retries_only_the_safe_run() -> None:
    lines: list[str] = []
    final = run_demo(lines.append)
    assert final == {
        "resize-image": "succeeded",
        "charge-card": "failed",
        "send-report": "failed",
        "ping": "succeeded",
    }
    text = "\n".join(lines)
    assert "awaiting_evidence=3" in text  # fail closed while there is no evidence
    assert "recovered=3" in text
    assert "#1 lost (1/2/lease_expired); #2 succeeded" in text
    assert "attempt 1 lost: unsafe" in text
    assert "attempt 1 lost: no_policy" in text


def test_ql3_demo_console_entry_exits_zero() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "adapters.cli.main", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Summary" in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["submit", "t"], "no database"),
        (["submit", "t", "--database-url", "mysql://x"], "postgresql"),
        (["submit", "t", "--input", "{bad", "--database-url", "postgresql://x/y"], "not JSON"),
        (["runs", "list", "--status", "nope", "--database-url", "postgresql://x/y"], "nope"),
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


def test_unreachable_database_is_a_failure_not_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["runs", "list", "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/none"])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("ql3: ")
    assert "Traceback" not in err
