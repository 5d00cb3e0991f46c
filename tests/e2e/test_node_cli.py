"""``ql3 serve`` and ``ql3 worker`` refuse bad input and unreachable peers with one line on
stderr (exit 2 for bad input, 1 for a failure), never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ql3.adapters.cli.main import main
from tests.e2e.conftest import PROJECT_ROOT


def _one_line(err: str, needle: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("ql3: ")]
    assert len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize(
    ("argv", "status", "needle"),
    [
        pytest.param(["worker", "--ingress", "http://127.0.0.1:9", "--app", "no_such_module:x",
                      "--worker-id", "w"], 2, "cannot import", id="worker-bad-app"),
        pytest.param(["worker", "--ingress", "ftp://x", "--app", "tests.e2e.tasks:app",
                      "--worker-id", "w"], 2, "http://", id="worker-bad-ingress"),
        pytest.param(["worker", "--ingress", "http://127.0.0.1:9", "--ingress",
                      "http://a:1,http://b:1", "--app", "tests.e2e.tasks:app", "--worker-id", "w"],
                     2, "once per node", id="worker-ingress-list-in-one"),
        pytest.param(["worker", "--ingress", "http://127.0.0.1:9", "--app",
                      "tests.e2e.tasks:app", "--worker-id", "w", "--concurrency", "0"],
                     2, "concurrency", id="worker-bad-concurrency"),
        pytest.param(["serve", "--database-url", "sqlite:///tmp/x.sqlite"], 2, "PostgreSQL",
                     id="serve-not-postgres"),
        pytest.param(["serve", "--database-url", "postgresql://u@127.0.0.1:9/x", "--port", "0"],
                     1, "OperationalError", id="serve-no-database"),
        pytest.param(["serve", "--database-url", "postgresql://u@h/x", "--lease-ttl", "-1"],
                     2, "lease-ttl", id="serve-bad-ttl"),
    ],
)
def test_errors_are_one_line(argv: list[str], status: int, needle: str,
                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == status
    _one_line(capsys.readouterr().err, needle)


def test_a_worker_that_cannot_reach_its_ingress_fails() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ql3.adapters.cli.main", "worker", "--ingress", "http://127.0.0.1:9",
         "--ingress", "http://127.0.0.1:7", "--app", "tests.e2e.tasks:app", "--worker-id", "w",
         "--register-timeout", "0.3"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 1
    _one_line(done.stderr, "cannot reach the ingress")


def test_serve_on_a_busy_port_fails(pg_database_url: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        status = main(["serve", "--database-url", pg_database_url, "--port", str(port)])
    assert status == 1
    _one_line(capsys.readouterr().err, "Address already in use")
