"""``ql3 submit --delay / --run-after / --unique-key`` (ADR 0015) on SQLite and PostgreSQL: the
runs they admit, the ``--json`` answer, and exit 2 with nothing written for bad input."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest

from ql3.adapters.cli.main import main


def _ql3(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _show(capsys: pytest.CaptureFixture[str], url: str, run_id: str) -> Any:
    code, out, err = _ql3(capsys, "runs", "show", run_id, "--database-url", url, "--json")
    assert code == 0, err
    return json.loads(out)


def _ids(capsys: pytest.CaptureFixture[str], url: str) -> list[str]:
    code, out, err = _ql3(capsys, "runs", "list", "--database-url", url, "--json")
    assert code == 0, err
    return [r["id"] for r in json.loads(out)["runs"]]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'ql3.sqlite'}"
    from ql3.adapters.postgres.store import PostgresStore

    database_url = str(request.getfixturevalue("pg_database_url"))
    store = PostgresStore.from_url(database_url, pool_size=1)
    try:
        store.testing_reset()  # the module shares its database
    finally:
        store.close()
    return database_url


def test_delay_admits_a_waiting_run_due_that_many_seconds_later(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    code, out, err = _ql3(
        capsys, "submit", "mail", "--delay", "90", "--database-url", url, "--json"
    )
    assert code == 0, err
    answer = json.loads(out)
    assert answer["existing"] is False
    shown = _show(capsys, url, answer["run_id"])
    assert shown["status"] == "retry_wait" and shown["attempt_count"] == 0
    assert shown["next_attempt_at_ms"] == shown["created_at_ms"] + 90_000
    assert [e["type"] for e in shown["events"]] == ["run_admitted"]
    assert shown["events"][0]["data"]["run_after_ms"] == shown["next_attempt_at_ms"]


def test_run_after_takes_an_offset_and_reads_a_naive_time_as_utc(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    due = dt.datetime(2031, 5, 6, 7, 8, 9, tzinfo=dt.UTC)
    expected = int(due.timestamp() * 1000)
    for text in ("2031-05-06T09:08:09+02:00", "2031-05-06T07:08:09", "2031-05-06T07:08:09Z"):
        code, out, err = _ql3(
            capsys, "submit", "mail", "--run-after", text, "--database-url", url, "--json"
        )
        assert code == 0, err
        shown = _show(capsys, url, json.loads(out)["run_id"])
        assert shown["status"] == "retry_wait", text
        assert shown["next_attempt_at_ms"] == expected, text


def test_run_after_in_the_past_admits_the_run_queued(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    code, out, err = _ql3(
        capsys, "submit", "mail", "--run-after", "2001-01-01T00:00:00Z", "--database-url", url
    )
    assert code == 0, err
    shown = _show(capsys, url, out.strip())
    assert shown["status"] == "queued" and shown["attempt_count"] == 1


def test_a_held_unique_key_answers_the_existing_run_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], url: str
) -> None:
    argv = ("submit", "mail", "--unique-key", "order-42", "--database-url", url)
    code, out, err = _ql3(capsys, *argv, "--json")
    assert code == 0, err
    first = json.loads(out)
    assert first["existing"] is False

    code, out, err = _ql3(capsys, *argv, "--json", "--input", '{"again": true}')
    assert code == 0, err
    assert json.loads(out) == {"run_id": first["run_id"], "existing": True}

    code, out, err = _ql3(capsys, *argv)
    assert code == 0, err
    assert out.strip() == first["run_id"]
    assert "existing run" in err and "order-42" in err

    assert _ids(capsys, url) == [first["run_id"]]
    shown = _show(capsys, url, first["run_id"])
    assert shown["input"] is None and len(shown["events"]) == 1

    code, out, err = _ql3(capsys, "submit", "mail", "--unique-key", "other", "--database-url", url)
    assert code == 0 and out.strip() != first["run_id"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--delay", "5", "--run-after", "2031-01-01T00:00:00Z"], "not both"),
        (["--delay", "-1"], "--delay"),
        (["--delay", "inf"], "--delay"),
        (["--delay", "soon"], "--delay"),
        (["--run-after", "tomorrow"], "ISO 8601"),
        (["--run-after", "2031-13-01T00:00:00"], "ISO 8601"),
        (["--unique-key", ""], "unique key"),
        (["--unique-key", "x" * 401], "unique key"),
    ],
)
def test_bad_timing_or_keys_exit_2_with_one_line_and_write_nothing(
    capsys: pytest.CaptureFixture[str], url: str, extra: list[str], message: str
) -> None:
    code, out, err = _ql3(capsys, "submit", "mail", *extra, "--database-url", url)
    assert code == 2, err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert out == ""
    if url.startswith("sqlite:///"):
        assert not Path(url[len("sqlite:///") :]).exists()  # not even created
    else:
        assert _ids(capsys, url) == []
