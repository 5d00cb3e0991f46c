"""Fixtures of the console's browser tests (ADR 0020): a real ``ql3 serve`` node and a real
worker on PostgreSQL (the end-to-end tests' cluster), a real ``ql3 console`` process on the
same database with a viewer and an operator, and Playwright driving Debian's chromium
(``/usr/bin/chromium``, installed by ``make test`` through apt-get; Playwright downloads no
browser)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Playwright, sync_playwright

from ql3.adapters.console.auth import hash_password
from tests.e2e.conftest import PROJECT_ROOT, Cluster, Ledger, torn_down

CHROMIUM = os.environ.get("QL3_CHROMIUM", "/usr/bin/chromium")
PASSWORDS = {"vera": "viewer-pass", "otto": "operator-pass"}
SCREENSHOTS = PROJECT_ROOT / "docs" / "console"
PREFIX = "ui"


@dataclass
class ConsoleProcess:
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(pg_database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("console-e2e")
    built = Cluster(database_url=pg_database_url, workdir=workdir)
    with torn_down(built):
        built.start_node(ingress_database_url=built.grant_ingress_role())
        built.start_worker(PREFIX, "ui-worker", Ledger(workdir / "ledger.jsonl"), concurrency=2)
        yield built


@pytest.fixture(scope="module")
def console(cluster: Cluster) -> Iterator[ConsoleProcess]:
    users = " ".join(
        [
            f"vera:viewer:{hash_password(PASSWORDS['vera'])}",
            f"otto:operator:{hash_password(PASSWORDS['otto'])}",
        ]
    )
    port = _free_port()
    log = cluster.workdir / "console.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen(
            [sys.executable, "-m", "ql3.adapters.cli.main", "console", "--port", str(port)],
            cwd=PROJECT_ROOT,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "QL3_DATABASE_URL": cluster.database_url,
                "QL3_CONSOLE_USERS": users,
            },
        )
    process = ConsoleProcess(f"http://127.0.0.1:{port}", popen, log)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(process.url + "/static/console.css", timeout=5)
                break
            except httpx.TransportError:
                assert popen.poll() is None, process.output()
                assert time.monotonic() < deadline, process.output()
                time.sleep(0.1)
        yield process
    finally:
        if popen.poll() is None:
            popen.terminate()
            popen.wait(timeout=30)
        # No traceback: every failure of the console is one line (ADR 0020).
        assert "Traceback" not in process.output(), process.output()


# Playwright for this module only, stopped when it ends: its sync API keeps an event loop
# running on this thread while it lives, and the tests after these ones call asyncio.run().
@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as started:
        yield started


@pytest.fixture(scope="module")
def browser(playwright: Playwright, browser_type_launch_args: dict[str, Any]) -> Iterator[Browser]:
    launched = playwright.chromium.launch(**browser_type_launch_args)
    try:
        yield launched
    finally:
        launched.close()


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    if not shutil.which(CHROMIUM):
        raise AssertionError(
            f"no {CHROMIUM}: `make test` installs Debian's chromium (apt-get install chromium)"
        )
    return {
        **browser_type_launch_args,
        "executable_path": CHROMIUM,
        "args": ["--no-sandbox", "--disable-dev-shm-usage"],
    }


@pytest.fixture(scope="module")
def browser_context_args() -> dict[str, Any]:
    # Not the plugin's (it asks a session-wide Playwright for its devices).
    return {
        "viewport": {"width": 1280, "height": 900},
        "http_credentials": {"username": "otto", "password": PASSWORDS["otto"]},
    }
