"""An order is admitted with its runs in one transaction; the runs do what their policy says."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, select
from sqlalchemy.pool import StaticPool

from ql3 import RunStatus
from ql3.testing import InMemoryRuntime
from shop.app import create_app, metadata, orders

ORDER = {"item": "mug", "quantity": 1, "email": "ada@example.com"}


@pytest.fixture
def engine():  # the shop's own database, in memory
    engine = create_engine(
        "sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}
    )
    metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def client(ql3_runtime: InMemoryRuntime, engine) -> Iterator[TestClient]:
    with TestClient(create_app(ql3_runtime, engine)) as client:
        yield client


def test_an_order_ships_once_its_runs_ran(client: TestClient, ql3_runtime: InMemoryRuntime) -> None:
    placed = client.post("/orders", json=ORDER)
    assert placed.status_code == 201
    order_id = placed.json()["order_id"]
    assert client.get(f"/orders/{order_id}").json()["shipping"] == "queued"

    assert ql3_runtime.run_due() == 2  # ship_order and email_receipt (async)

    shown = client.get(f"/orders/{order_id}").json()
    assert shown["shipping"] == "succeeded"
    assert shown["tracking"].startswith("TRK-")
    receipts = [run for run in ql3_runtime.runs() if run.task == "email_receipt"]
    assert [run.output for run in receipts] == [{"sent_to": "ada@example.com"}]


def test_a_refused_order_leaves_no_row_and_no_run(
    client: TestClient, ql3_runtime: InMemoryRuntime, engine
) -> None:
    refused = client.post("/orders", json={**ORDER, "item": "poster", "quantity": 5})
    assert refused.status_code == 409
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(orders)).scalar_one() == 0
    assert ql3_runtime.runs() == []


def test_shipping_is_retried_when_its_worker_is_lost_but_the_receipt_is_not(
    client: TestClient, ql3_runtime: InMemoryRuntime
) -> None:
    order_id = client.post("/orders", json=ORDER).json()["order_id"]
    ql3_runtime.run_due(vanish=lambda started: True)  # the worker dies mid-task
    ql3_runtime.advance(seconds=ql3_runtime.lease_ttl_s + 1)  # its leases expire
    ql3_runtime.run_due()  # lost: ship_order waits 2 s to retry, email_receipt fails
    ql3_runtime.advance(seconds=2)
    ql3_runtime.run_due()

    assert client.get(f"/orders/{order_id}").json()["shipping"] == "succeeded"
    by_task = {run.task: run for run in ql3_runtime.runs()}
    assert by_task["ship_order"].attempts == 2
    assert by_task["email_receipt"].status is RunStatus.FAILED  # unsafe: never sent twice
