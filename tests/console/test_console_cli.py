"""Where the console runs (ADR 0020): ``ql3 console`` on its own port, refusing to listen off
loopback without users who sign in; ``ql3 standalone --console-port``; ``console_app()``
mounted in an application with the application's own sign-in."""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import ql3
from ql3.adapters.cli.main import main
from ql3.adapters.console.auth import InvalidUsers, load_users, verify_password

QL3 = [sys.executable, "-m", "ql3.adapters.cli.main"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _database(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'console.sqlite'}"
    assert main(["submit", "mail", "--input", '{"n": 1}', "--database-url", url]) == 0
    return url


def test_off_loopback_without_users_it_refuses_to_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _database(tmp_path)
    capsys.readouterr()
    assert main(["console", "--host", "0.0.0.0", "--database-url", url]) == 2
    assert "needs users who sign in" in capsys.readouterr().err
    app = "ql3.adapters.cli.demo_tasks:TASKS"
    db = str(tmp_path / "sa.sqlite")
    args = ["standalone", "--app", app, "--db", db, "--console-port", "1", "--console-host", "::"]
    assert main(args) == 2
    assert not os.path.exists(db)


def test_a_bad_users_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = _database(tmp_path)
    bad = tmp_path / "users"
    bad.write_text("otto:admin:scrypt$1$2$3$x$y\n")
    capsys.readouterr()
    assert main(["console", "--users-file", str(bad), "--database-url", url]) == 2
    assert "role is viewer or operator" in capsys.readouterr().err
    missing = str(tmp_path / "nope")
    assert main(["console", "--users-file", missing, "--database-url", url]) == 2
    with pytest.raises(InvalidUsers):
        load_users(None, {"QL3_CONSOLE_USERS": "justaname"})


def test_hash_password_makes_a_hash_that_verifies() -> None:
    made = subprocess.run(
        [*QL3, "console", "hash-password"],
        input="s3cret\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    assert made.startswith("scrypt$") and "s3cret" not in made
    assert verify_password("s3cret", made) and not verify_password("other", made)


def test_ql3_console_serves_the_users_of_the_environment(tmp_path: Path) -> None:
    url = _database(tmp_path)
    hashed = subprocess.run(
        [*QL3, "console", "hash-password"],
        input="pw\n",
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    port = _free_port()
    env = {**os.environ, "QL3_CONSOLE_USERS": f"vera:viewer:{hashed}"}
    process = subprocess.Popen(
        [*QL3, "console", "--port", str(port), "--database-url", url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                first = httpx.get(base + "/", timeout=5)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert first.status_code == 401
        auth = {"Authorization": "Basic " + base64.b64encode(b"vera:pw").decode()}
        page = httpx.get(base + "/runs", headers=auth, timeout=10)
        assert page.status_code == 200 and "1 run(s) match" in page.text
        refused = httpx.post(
            base + "/tasks/limit",
            headers={**auth, "Origin": base},
            data={"task": "mail", "max_running": "1"},
            timeout=10,
        )
        assert refused.status_code == 403
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_console_app_mounts_with_the_applications_own_sign_in() -> None:
    tasks = ql3.TaskRegistry()

    @tasks.task(safety="idempotent")
    def mail(payload: object) -> object:
        return payload

    runtime = ql3.testing.in_memory(tasks)
    with pytest.raises(ValueError, match="users= or identify="):
        runtime.console_app()

    def identify(request: object) -> ql3.ConsoleOperator | None:
        name = getattr(request, "headers", {}).get("x-user")
        return ql3.ConsoleOperator(name, ql3.ConsoleRole.OPERATOR) if name else None

    app = FastAPI()
    app.mount("/ops", runtime.console_app(identify=identify))
    run_id = runtime.submit(mail, {"n": 1})
    client = TestClient(app)
    assert client.get("/ops/").status_code == 401
    headers = {"x-user": "ada", "Origin": "http://testserver"}
    page = client.get(f"/ops/runs/{run_id}", headers=headers)
    assert page.status_code == 200 and 'href="/ops/static/console.css"' in page.text
    done = client.post(f"/ops/runs/{run_id}/cancel", headers=headers, data={"reason": "no"})
    assert done.status_code == 200
    assert runtime.get(run_id).status is ql3.RunStatus.CANCELLED
    runtime.close()


def test_ql3_standalone_serves_the_console_beside_it(tmp_path: Path) -> None:
    url = _database(tmp_path)
    database = url[len("sqlite:///") :]
    port = _free_port()
    process = subprocess.Popen(
        [
            *QL3,
            "standalone",
            "--app",
            "ql3.adapters.cli.demo_tasks:TASKS",
            "--db",
            database,
            "--console-port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                page = httpx.get(base + "/runs", timeout=5)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert page.status_code == 200 and "1 run(s) match" in page.text
        assert "Content-Security-Policy" in page.headers
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert f"ql3 console on http://127.0.0.1:{port}/" in output
