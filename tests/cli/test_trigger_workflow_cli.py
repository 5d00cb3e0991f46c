"""``ql3 triggers`` and ``ql3 workflows`` on PostgreSQL, and ``ql3 runs show`` of a workflow:
JSON output, one-line errors with exit 2 (bad input) or 1 (not found), nothing written."""

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


def _json(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> Any:
    code, out, err = _run(capsys, *argv, "--database-url", url, "--json")
    assert code == 0, err
    return json.loads(out)


def _names(capsys: pytest.CaptureFixture[str], url: str) -> list[str]:
    return [t["name"] for t in _json(capsys, url, "triggers", "list", "--all")["triggers"]]


def test_triggers_add_list_pause_resume_delete(
    pg_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = pg_database_url
    added = _json(
        capsys, url, "triggers", "add", "nightly", "--task", "report", "--every", "90",
        "--input", '{"to": "ops"}', "--safety", "idempotent", "--retry-on-lost",
        "--max-attempts", "3", "--catch-up", "all", "--catch-up-limit", "5",
    )
    assert (added["name"], added["task"], added["status"], added["every_s"]) == (
        "nightly", "report", "active", 90.0)
    assert (added["catch_up"], added["catch_up_limit"], added["input"]) == ("all", 5, {"to": "ops"})
    assert added["policy"]["safety"] == "idempotent" and added["policy"]["max_attempts"] == 3
    assert added["next_fire_at_ms"] - added["created_at_ms"] == 90_000
    cron = _json(capsys, url, "triggers", "add", "hourly", "--task", "t", "--cron", "0 * * * *")
    assert cron["cron"] == "0 * * * *" and cron["next_fire_at_ms"] % 3_600_000 == 0

    listed = _json(capsys, url, "triggers", "list")["triggers"]
    assert [t["name"] for t in listed] == ["hourly", "nightly"]
    assert _json(capsys, url, "triggers", "pause", "nightly")["status"] == "paused"
    assert _json(capsys, url, "triggers", "resume", "nightly")["status"] == "active"
    assert _json(capsys, url, "triggers", "delete", "hourly")["status"] == "deleted"
    assert [t["name"] for t in _json(capsys, url, "triggers", "list")["triggers"]] == ["nightly"]

    code, out, _ = _run(capsys, "triggers", "list", "--database-url", url)
    assert code == 0 and out.startswith("nightly  active  every 90s  catch-up all")


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (["triggers", "pause", "nobody"], 1, "not found: trigger nobody"),
        (["triggers", "delete", "nobody"], 1, "not found: trigger nobody"),
        (["triggers", "add", "x", "--task", "t"], 2, "exactly one of --every"),
        (["triggers", "add", "x", "--task", "t", "--every", "5", "--cron", "* * * * *"], 2,
         "exactly one of --every"),
        (["triggers", "add", "x", "--task", "t", "--every", "0"], 2, "positive"),
        (["triggers", "add", "x", "--task", "t", "--every", "0.5"], 2, "interval"),
        (["triggers", "add", "x", "--task", "t", "--cron", "61 * * * *"], 2, "not valid"),
        (["triggers", "add", "x", "--task", "t", "--every", "5", "--input", "{"], 2, "not JSON"),
        (["triggers", "add", "x", "--task", "t", "--every", "5", "--catch-up", "some"], 2,
         "some"),
    ],
)
def test_trigger_errors_are_one_line_and_write_nothing(
    pg_database_url: str,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    code: int,
    needle: str,
) -> None:
    before = _names(capsys, pg_database_url)
    got, _, err = _run(capsys, *argv, "--database-url", pg_database_url)
    assert got == code
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert _names(capsys, pg_database_url) == before


def test_a_duplicate_trigger_name_is_refused(
    pg_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _json(capsys, pg_database_url, "triggers", "add", "dup", "--task", "t", "--every", "60")
    code, _, err = _run(capsys, "triggers", "add", "dup", "--task", "t", "--every", "5",
                        "--database-url", pg_database_url)
    assert code == 2 and "already exists" in err


def test_a_workflow_is_submitted_advanced_and_shown_with_its_steps(
    pg_database_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = pg_database_url
    spec = tmp_path / "wf.json"
    spec.write_text(json.dumps({
        "name": "etl",
        "steps": [
            {"id": "extract", "task": "t", "input": {"n": 1},
             "policy": {"retry_on_lost": True, "max_attempts": 2, "safety": "idempotent"}},
            {"id": "load", "task": "t", "after": ["extract"]},
        ],
    }))
    submitted = _json(capsys, url, "workflows", "submit", str(spec))
    run_id = submitted["run_id"]
    assert submitted["steps"] == 2
    _json(capsys, url, "scheduler", "tick")  # the frontier admits "extract"

    shown = _json(capsys, url, "runs", "show", run_id)
    assert (shown["owner"], shown["status"], shown["task"]) == ("workflow", "running", "etl")
    extract, load = shown["steps"]
    assert (extract["id"], extract["status"], extract["run_status"]) == (
        "extract", "admitted", "queued")
    assert (load["id"], load["status"], load["run_id"]) == ("load", "pending", None)
    step_run = _json(capsys, url, "runs", "show", extract["run_id"])
    assert step_run["parent_run_id"] == run_id
    assert step_run["policy"]["retry_on_lost"] is True

    code, out, _ = _run(capsys, "runs", "show", run_id, "--database-url", url)
    assert code == 0
    assert f"  step extract admitted  run {extract['run_id']} queued" in out
    assert "  step load pending   no run" in out


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ({"name": "w", "steps": [{"id": "a", "task": "t", "after": ["b"]},
                                 {"id": "b", "task": "t", "after": ["a"]}]}, "cycle"),
        ({"name": "w", "steps": [{"id": "a", "task": "t"}, {"id": "a", "task": "t"}]},
         "duplicate step id"),
        ({"name": "w", "steps": [{"id": "a", "task": "t", "after": ["x"]}]}, "unknown step"),
        ("{not json", "is not JSON"),
        ([1, 2], "JSON object"),
    ],
    ids=["cycle", "duplicate", "unknown", "not-json", "not-object"],
)
def test_a_refused_workflow_exits_2_and_writes_nothing(
    pg_database_url: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    content: object,
    needle: str,
) -> None:
    spec = tmp_path / "bad.json"
    spec.write_text(content if isinstance(content, str) else json.dumps(content))
    before = _json(capsys, pg_database_url, "runs", "list", "--limit", "10000")["runs"]
    code, out, err = _run(capsys, "workflows", "submit", str(spec),
                          "--database-url", pg_database_url)
    assert code == 2 and out == ""
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert _json(capsys, pg_database_url, "runs", "list", "--limit", "10000")["runs"] == before


def test_a_missing_workflow_file_is_bad_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = _run(capsys, "workflows", "submit", str(tmp_path / "none.json"))
    assert code == 2 and "does not exist" in err
