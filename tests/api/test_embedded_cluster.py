"""The Cluster runtime embedded in an application's process on PostgreSQL: its ingress mounted
in the application's own ASGI server, a real `ql3 worker` running an async and a sync task, the
asyncio submit and the wait woken by the run-finished notification."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

import ql3
from ql3.bootstrap.node import bind_socket
from tests.api.tasks import TASKS

pytestmark = pytest.mark.postgres
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def embedded(pg_database_url: str) -> Iterator[ql3.ClusterRuntime]:
    runtime = ql3.cluster(pg_database_url, tasks=TASKS, lease_ttl_s=6, cadence_s=0.5)
    app = FastAPI()
    app.mount("/ql3", runtime.ingress_app())
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    serving = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    runtime.start()
    serving.start()
    worker = subprocess.Popen(
        [sys.executable, "-m", "ql3.adapters.cli.main", "worker", "--ingress",
         f"http://127.0.0.1:{port}/ql3", "--app", "tests.api.tasks:TASKS",
         "--worker-id", "embedded-1", "--concurrency", "2"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        yield runtime
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
        server.should_exit = True
        serving.join(30)
        runtime.close()


def test_asyncio_submit_and_wait_through_a_real_worker(embedded: ql3.ClusterRuntime) -> None:
    async def scenario() -> tuple[object, object]:
        doubled, echoed = await embedded.asubmit_many([("double", 21), ("echo", {"a": 1})])
        first = await embedded.await_run(doubled, timeout=60)
        second = await embedded.await_run(echoed, timeout=60)
        return first.output, second.output

    assert asyncio.run(scenario()) == (42, {"a": 1})


def test_a_failure_is_read_back_with_its_error(embedded: ql3.ClusterRuntime) -> None:
    run_id = embedded.submit("explode", "x")
    info = embedded.wait(run_id, timeout=60)
    assert info.status is ql3.RunStatus.FAILED
    assert info.error is not None
    assert info.error.splitlines()[0] == "ValueError: bad payload 'x'"
