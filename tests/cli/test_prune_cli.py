"""``ql3 runs prune`` on PostgreSQL and on a SQLite file: a dry run counts and deletes nothing,
a prune deletes the finished runs older than the duration in batches and reports them (text and
``--json``), bad input exits 2 with one line and writes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ql3.adapters.cli.main import main
from tests.contract.builders import committed, finish, given_queued, given_session, given_started

DAY_MS = 86_400_000


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """A database URL and a store on it holding two finished runs last changed two days ago,
    one finished just now and one queued."""
    store: Any
    if request.param == "sqlite":
        from ql3.adapters.sql.sqlite import SqliteStore

        path = tmp_path / "ql3.sqlite"
        store = SqliteStore(path)
        url = f"sqlite:///{path}"
        age = "updated_at - :age"
    else:
        from ql3.adapters.postgres.store import PostgresStore

        url = request.getfixturevalue("pg_database_url")
        store = PostgresStore.from_url(url)
        store.testing_reset()
        age = "updated_at - make_interval(secs => :age / 1000.0)"
    try:
        given_session(store, "s1")
        for run_id in ("old1", "old2", "recent"):
            attempt_id = given_started(store, run_id, "s1")
            with committed(store) as uow:
                finish(uow, attempt_id)
        given_queued(store, "queued")
        with store.engine.begin() as connection:
            connection.execute(
                text(f"UPDATE runs SET updated_at = {age} WHERE id IN ('old1', 'old2')"),
                {"age": 2 * DAY_MS},
            )
        yield url, store
    finally:
        store.close()


def _ids(capsys: pytest.CaptureFixture[str], url: str) -> list[str]:
    code, out, err = _run(capsys, "runs", "list", "--database-url", url, "--json")
    assert code == 0, err
    return sorted(r["id"] for r in json.loads(out)["runs"])


def test_a_dry_run_then_a_prune_in_batches(
    database: tuple[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = database
    everything = ["old1", "old2", "queued", "recent"]
    assert _ids(capsys, url) == everything

    code, out, err = _run(
        capsys, "runs", "prune", "--finished-before", "1d", "--dry-run", "--database-url", url,
        "--json",
    )
    assert code == 0, err
    dry = json.loads(out)
    assert dry["dry_run"] is True and dry["batches"] == 1
    assert dry["removed"] == {
        "runs": 2, "attempts": 2, "leases": 2, "events": 6, "stop_reports": 0,
        "trigger_firings": 0, "workflow_steps": 0,
    }
    assert _ids(capsys, url) == everything

    code, out, err = _run(
        capsys, "runs", "prune", "--finished-before", "24h", "--batch-size", "1",
        "--database-url", url, "--json",
    )
    assert code == 0, err
    done = json.loads(out)
    assert (done["dry_run"], done["batches"], done["removed"]) == (False, 2, dry["removed"])
    assert _ids(capsys, url) == ["queued", "recent"]

    code, out, err = _run(
        capsys, "runs", "prune", "--finished-before", "1440m", "--database-url", url
    )
    assert code == 0, err
    assert out.startswith("pruned 0 run(s) finished before ")
    assert "in 0 batch(es): 0 attempt(s), 0 lease(s), 0 event(s)" in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--finished-before", "30 days"], "not a duration"),
        (["--finished-before", "-1d"], "not a duration"),
        (["--finished-before", "1w"], "not a duration"),
        (["--finished-before", ""], "not a duration"),
        ([], "Missing option '--finished-before'"),
        (["--finished-before", "1d", "--batch-size", "0"], "--batch-size"),
        (["--finished-before", "1d", "--batch-size", "10001"], "--batch-size"),
    ],
    ids=["words", "negative", "weeks", "empty", "missing", "batch-0", "batch-big"],
)
def test_bad_input_exits_2_with_one_line_and_deletes_nothing(
    database: tuple[str, Any], capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    url, _ = database
    code, out, err = _run(capsys, "runs", "prune", *argv, "--database-url", url)
    assert code == 2
    assert out == "" and needle in err and len(err.strip().splitlines()) == 1, err
    assert _ids(capsys, url) == ["old1", "old2", "queued", "recent"]


def test_a_missing_sqlite_file_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "absent.sqlite"
    code, _, err = _run(
        capsys, "runs", "prune", "--finished-before", "1d", "--database-url", f"sqlite:///{path}"
    )
    assert code == 1 and "no database" in err
    assert not path.exists()
