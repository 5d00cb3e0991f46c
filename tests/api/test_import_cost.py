"""Submitting loads no web framework and no dependency-injector container; ``ql3 submit`` loads
no SQLAlchemy either, nor what the other commands need (ADR 0009)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = (
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "dependency_injector",
    "psycopg",
    "jinja2",
    "ql3.adapters.console.app",
    "ql3.bootstrap.console",
)
# What ``ql3 submit`` does without: the stores' SQL toolkit and migrations, the other commands
# and what only they use (the worker, the ingress, triggers, workflows, credentials, metrics).
SUBMIT_HEAVY = (
    *HEAVY,
    "sqlalchemy",
    "alembic",
    "ql3.adapters.sql.schema",
    "ql3.adapters.postgres.fenced",
    "ql3.adapters.postgres.store",
    "ql3.adapters.sql.sqlite.store",
    "ql3.adapters.cli.node_cmds",
    "ql3.adapters.cli.standalone_cmds",
    "ql3.adapters.cli.trigger_cmds",
    "ql3.adapters.cli.credential_cmds",
    "ql3.adapters.cli.ops_cmds",
    "ql3.adapters.cli.task_cmds",
    "ql3.adapters.cli.console_cmds",
    "ql3.application.console_actions",
    "ql3.adapters.worker",
    "ql3.application.ports",
    "ql3.application.worker_commands",
    "ql3.application.queries",
    "ql3.domain.credentials",
    "ql3.domain.triggers",
    "ql3.domain.workflows",
    "croniter",
    "httpx",
    "prometheus_client",
    "rich",
)

PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _loaded(body: str, heavy: tuple[str, ...] = HEAVY) -> list[str]:
    script = PROBE.format(body=body, heavy=heavy)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return list(json.loads(out.splitlines()[-1]))


def _cli_submit(url: str) -> str:
    return (
        "from ql3.adapters.cli.main import main\n"
        f"assert main(['submit', 'echo', '--input', '[1]', '--unique-key', 'k', '--json', "
        f"'--database-url', {url!r}]) == 0"
    )


def test_a_cli_submit_creating_a_sqlite_database_loads_none_of_them(tmp_path: Path) -> None:
    # The Standalone store creates the schema, with SQLAlchemy.
    assert _loaded(_cli_submit(f"sqlite:///{tmp_path / 'cli.db'}")) == []


def test_a_cli_submit_into_a_sqlite_database_loads_no_sqlalchemy(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    subprocess.run(
        [sys.executable, "-m", "ql3.adapters.cli.main", "submit", "first", "--database-url", url],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert _loaded(_cli_submit(url), SUBMIT_HEAVY) == []


def test_a_cli_submit_on_postgres_loads_only_the_driver(pg_database_url: str) -> None:
    heavy = tuple(name for name in SUBMIT_HEAVY if name != "psycopg")
    assert _loaded(_cli_submit(pg_database_url), heavy) == []
    assert _loaded(_cli_submit(pg_database_url), ("psycopg",)) == ["psycopg"]


def test_the_api_submits_and_reads_without_them(tmp_path: Path) -> None:
    database = tmp_path / "api.db"
    body = (
        "import ql3\n"
        "from tests.api.tasks import TASKS\n"
        f"rt = ql3.standalone({str(database)!r}, tasks=TASKS)\n"
        "run_id = rt.submit('echo', {'a': 1})\n"
        "assert rt.get(run_id).status is ql3.RunStatus.QUEUED\n"
        "rt.cancel(run_id)\n"
        "rt.close()"
    )
    assert _loaded(body) == []
