"""Submitting loads no web framework and no dependency-injector container (ADR 0009)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("fastapi", "starlette", "uvicorn", "pydantic", "dependency_injector", "psycopg")

PROBE = """
import json, sys
{body}
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _loaded(body: str) -> list[str]:
    script = PROBE.format(body=body, heavy=HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return list(json.loads(out.splitlines()[-1]))


def test_a_cli_submit_on_sqlite_loads_none_of_them(tmp_path: Path) -> None:
    database = tmp_path / "cli.db"
    body = (
        "from adapters.cli.main import main\n"
        f"assert main(['submit', 'echo', '--input', '[1]', '--database-url', "
        f"'sqlite:///{database}']) == 0"
    )
    assert _loaded(body) == []


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
