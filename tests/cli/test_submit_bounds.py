"""Every option of ``ql3 submit`` at its boundaries: a value inside its range is admitted as
given; a value outside it is refused with exit 2 and one line, and nothing is written, whatever
else is passed. No value is ever taken for "not given"."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from ql3.adapters.cli.main import main, submit
from ql3.domain.model import MAX_DELAY_MS, MAX_PRIORITY, MAX_TIMEOUT_MS, MIN_PRIORITY
from ql3.domain.policy import MAX_ATTEMPTS_LIMIT, MAX_BACKOFF_MS

# Each option with the values at the edges of its range (admitted) and just past them (refused).
ACCEPTED: dict[str, list[list[str]]] = {
    "input_json": [["--input", "null"], ["--input", '{"a": [1, "x"]}']],
    "safety": [["--safety", "unsafe"], ["--safety", "idempotent"], ["--safety", "deduplicated"]],
    "retry_on_lost": [["--retry-on-lost", "--safety", "idempotent"]],
    "retry_on_error": [["--retry-on-error", "--safety", "idempotent"]],
    "max_attempts": [["--max-attempts", "1"], ["--max-attempts", str(MAX_ATTEMPTS_LIMIT)]],
    "backoff_initial": [
        ["--backoff-initial", "0"],
        ["--backoff-initial", str(MAX_BACKOFF_MS // 1000)],
    ],
    "timeout_s": [["--timeout", "0.001"], ["--timeout", str(MAX_TIMEOUT_MS // 1000)]],
    "delay": [["--delay", "0"], ["--delay", str(MAX_DELAY_MS // 1000)]],
    "run_after": [["--run-after", "2030-01-31T09:00:00+01:00"], ["--run-after", "2020-01-01"]],
    "unique_key": [["--unique-key", "k"], ["--unique-key", "k" * 400]],
    "priority": [["--priority", str(MIN_PRIORITY)], ["--priority", str(MAX_PRIORITY)]],
}
REFUSED: dict[str, list[list[str]]] = {
    "input_json": [["--input", "{"], ["--input", '"a\\u0000b"']],
    "safety": [["--safety", "careful"], ["--safety", ""]],
    "retry_on_lost": [["--retry-on-lost=yes"]],
    "retry_on_error": [
        ["--retry-on-error", "--safety", "unsafe"],
        ["--retry-on-error", "--max-attempts", "0"],
    ],
    "max_attempts": [
        ["--max-attempts", "0"],
        ["--max-attempts", "-3"],
        ["--max-attempts", str(MAX_ATTEMPTS_LIMIT + 1)],
        ["--max-attempts", "1.5"],
    ],
    "backoff_initial": [
        ["--backoff-initial", "-0.001"],
        ["--backoff-initial", str(MAX_BACKOFF_MS // 1000 + 1)],
        ["--backoff-initial", "nan"],
        ["--backoff-initial", "inf"],
    ],
    "timeout_s": [
        ["--timeout", "0"],
        ["--timeout", "-1"],
        ["--timeout", str(MAX_TIMEOUT_MS // 1000 + 1)],
        ["--timeout", "nan"],
    ],
    "delay": [
        ["--delay", "-0.001"],
        ["--delay", str(MAX_DELAY_MS // 1000 + 1)],
        ["--delay", "inf"],
        ["--delay", "nan"],
        ["--delay", "1", "--run-after", "2030-01-01"],
    ],
    "run_after": [["--run-after", "tomorrow"], ["--run-after", ""]],
    "unique_key": [["--unique-key", ""], ["--unique-key", "k" * 401]],
    "priority": [
        ["--priority", str(MIN_PRIORITY - 1)],
        ["--priority", str(MAX_PRIORITY + 1)],
        ["--priority", "1.5"],
    ],
}
# What else may stand beside a refused value: it is refused all the same.
COMPANIONS = [
    [],
    ["--safety", "idempotent"],
    ["--safety", "idempotent", "--retry-on-lost", "--priority", "5", "--input", "[1]"],
]


def _refusals() -> list[object]:
    """Each refused value alone and beside each companion that does not give its option again
    (click takes the last of two values)."""
    cases: list[object] = []
    for values in REFUSED.values():
        for argv in values:
            given = {word.split("=")[0] for word in argv if word.startswith("--")}
            for companion in COMPANIONS:
                if given & {word for word in companion if word.startswith("--")}:
                    continue
                label = " ".join([*argv, "|", *companion])[:70]
                cases.append(pytest.param(argv, companion, id=label))
    return cases


def _run_count(database: Path) -> int:
    if not database.exists():
        return 0
    with sqlite3.connect(database) as connection:
        return int(connection.execute("SELECT count(*) FROM runs").fetchone()[0])


def test_the_tables_name_every_option_of_submit() -> None:
    options = {param.name for param in submit.params if param.param_type_name == "option"}
    options -= {"database_url", "as_json"}
    assert set(ACCEPTED) == options
    assert set(REFUSED) == options


@pytest.mark.parametrize(
    "argv",
    [pytest.param(argv, id=" ".join(argv)[:60]) for values in ACCEPTED.values() for argv in values],
)
def test_a_value_inside_its_range_is_admitted(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = tmp_path / "bounds.db"
    url = f"sqlite:///{database}"
    assert main(["submit", "quick", *argv, "--json", "--database-url", url]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["existing"] is False
    assert _run_count(database) == 1


def test_given_values_are_the_admitted_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'given.db'}"
    argv = ["submit", "quick", "--safety", "idempotent", "--retry-on-error", "--max-attempts",
            "1000", "--backoff-initial", "0", "--timeout", "0.001", "--unique-key", "k",
            "--json", "--database-url", url]
    assert main(argv) == 0
    run_id = json.loads(capsys.readouterr().out)["run_id"]
    assert main(["runs", "show", run_id, "--json", "--database-url", url]) == 0
    shown = json.loads(capsys.readouterr().out)
    policy = shown["policy"]
    assert policy["max_attempts"] == 1000 and policy["retry_on_error"] is True
    assert policy["safety"] == "idempotent" and policy["backoff_initial_ms"] == 0
    assert shown["timeout_ms"] == 1 and shown["unique_key"] == "k"


@pytest.mark.parametrize(("argv", "companion"), _refusals())
def test_a_value_outside_its_range_is_refused_and_nothing_is_written(
    argv: list[str], companion: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = tmp_path / "bounds.db"
    url = f"sqlite:///{database}"
    assert main(["submit", "quick", "--database-url", url]) == 0  # the database exists
    capsys.readouterr()
    code = main(["submit", "quick", *argv, *companion, "--database-url", url])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("ql3: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert _run_count(database) == 1
