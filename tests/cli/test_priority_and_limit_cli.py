"""``ql3 submit --priority`` and ``ql3 tasks limit|limits`` on PostgreSQL and SQLite: JSON
output, one-line errors with exit 2 (bad input) or 1 (not found), nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ql3.adapters.cli.main import main

URLS = ["postgres", "sqlite"]


@pytest.fixture(params=URLS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        path = tmp_path / "cli.sqlite"
        from ql3.adapters.sql.sqlite import SqliteStore

        SqliteStore(path).close()
        return f"sqlite:///{path}"
    found: str = request.getfixturevalue("pg_database_url")
    from ql3.adapters.postgres.store import PostgresStore

    store = PostgresStore.from_url(found)
    store.testing_reset()
    store.close()
    return found


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], url: str, *argv: str) -> Any:
    code, out, err = _run(capsys, *argv, "--database-url", url, "--json")
    assert code == 0, err
    return json.loads(out)


def _priorities(url: str) -> dict[str, int]:
    from ql3.bootstrap import producer

    if url.startswith("sqlite:///"):
        store = producer.open_sqlite_store(url[len("sqlite:///") :])
    else:
        store = producer.open_postgres_store(url, pool_size=1)
    try:
        with store.unit_of_work() as uow:
            return {run.id: run.priority for run in uow.runs.list_runs(None, 100)}
    finally:
        store.close()


def test_submit_with_a_priority(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    high = _json(capsys, url, "submit", "mail", "--priority", "7")["run_id"]
    low = _json(capsys, url, "submit", "mail", "--priority", "-2")["run_id"]
    plain = _json(capsys, url, "submit", "mail")["run_id"]
    assert _priorities(url) == {high: 7, low: -2, plain: 0}


@pytest.mark.parametrize("value", ["1000001", "-1000001", "high", "1.5"])
def test_a_bad_priority_is_a_usage_error_and_writes_nothing(
    url: str, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    code, out, err = _run(capsys, "submit", "mail", "--priority", value, "--database-url", url)
    assert (code, out) == (2, "")
    assert err.startswith("ql3: ") and "--priority" in err and len(err.splitlines()) == 1
    assert _priorities(url) == {}


def test_limits_set_listed_replaced_and_cleared(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _json(capsys, url, "tasks", "limits") == {"limits": []}
    code, out, _ = _run(capsys, "tasks", "limits", "--database-url", url)
    assert (code, out) == (0, "no task limits\n")

    mail = _json(capsys, url, "tasks", "limit", "mail", "3")
    assert (mail["task"], mail["max_running"]) == ("mail", 3)
    assert mail["updated_at"].startswith("20") and isinstance(mail["updated_at_ms"], int)
    _json(capsys, url, "tasks", "limit", "archive", "0")
    assert _json(capsys, url, "tasks", "limit", "mail", "5")["max_running"] == 5
    listed = _json(capsys, url, "tasks", "limits")["limits"]
    assert [(x["task"], x["max_running"]) for x in listed] == [("archive", 0), ("mail", 5)]
    code, out, _ = _run(capsys, "tasks", "limits", "--database-url", url)
    assert code == 0 and out.splitlines()[1].split()[:2] == ["archive", "0"]

    assert _json(capsys, url, "tasks", "limit", "mail", "--clear") == {
        "task": "mail",
        "cleared": True,
    }
    code, out, err = _run(capsys, "tasks", "limit", "mail", "--clear", "--database-url", url)
    assert (code, out) == (1, "")
    assert err == "ql3: not found: no limit on task mail\n"
    assert [x["task"] for x in _json(capsys, url, "tasks", "limits")["limits"]] == ["archive"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["tasks", "limit", "mail", "-1"], "-1 is not in the range"),
        (["tasks", "limit", "mail", "many"], "is not a valid integer"),
        (["tasks", "limit", "mail", "1000001"], "is not in the range"),
        (["tasks", "limit", "mail"], "give either MAX_RUNNING or --clear"),
        (["tasks", "limit", "mail", "2", "--clear"], "give either MAX_RUNNING or --clear"),
        (["tasks", "limit", " mail", "2"], "no padding"),
    ],
)
def test_bad_limits_are_usage_errors_and_write_nothing(
    url: str, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, out, err = _run(capsys, *argv, "--database-url", url)
    assert (code, out) == (2, "")
    assert needle in err and err.startswith("ql3: ") and len(err.splitlines()) == 1
    assert _json(capsys, url, "tasks", "limits") == {"limits": []}
