"""The shop's web app: ``POST /orders`` writes the order and admits its runs in one transaction.

``create_app(runtime, engine)`` builds the app on any runtime (the tests pass the in-memory
one); ``create_production_app`` is the factory uvicorn calls: the Cluster runtime on the same
PostgreSQL database as the shop's own table, started and stopped with the app, its worker
ingress mounted at ``/ql3``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
    select,
)
from sqlalchemy.orm import Session

import ql3
from shop.tasks import email_receipt, ship_order, tasks

metadata = MetaData()
orders = Table(
    "shop_orders",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("item", String(100), nullable=False),
    Column("quantity", Integer, nullable=False),
    Column("email", String(200), nullable=False),
    Column("ship_run_id", String(64)),
)
STOCK = {"mug": 10, "poster": 2}


class OrderIn(BaseModel):
    item: str = Field(min_length=1, max_length=100)
    quantity: int = Field(ge=1, le=100)
    email: str = Field(min_length=3, max_length=200)


def create_app(runtime: ql3.Runtime, engine: Engine, *, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="shop", lifespan=lifespan)

    @app.post("/orders", status_code=201)
    def place_order(order: OrderIn) -> dict[str, Any]:
        with Session(engine) as session, session.begin():
            order_id = session.execute(
                insert(orders).values(item=order.item, quantity=order.quantity, email=order.email)
            ).inserted_primary_key[0]
            payload = {"order_id": order_id, "email": order.email}
            ship_id, _receipt_id = runtime.submit_many(
                [(ship_order, payload), (email_receipt, payload)], transaction=session
            )
            session.execute(
                orders.update().where(orders.c.id == order_id).values(ship_run_id=ship_id)
            )
            if order.quantity > STOCK.get(order.item, 0):
                # Raising inside the transaction rolls back the order and both runs.
                raise HTTPException(409, f"only {STOCK.get(order.item, 0)} {order.item} in stock")
        return {"order_id": order_id, "ship_run_id": ship_id}

    @app.get("/orders/{order_id}")
    async def show_order(order_id: int) -> dict[str, Any]:
        with engine.connect() as connection:
            row = connection.execute(select(orders).where(orders.c.id == order_id)).first()
        if row is None:
            raise HTTPException(404, f"no order {order_id}")
        shipping = await runtime.aget(row.ship_run_id)
        return {
            "order_id": row.id,
            "item": row.item,
            "shipping": shipping.status.value,
            "tracking": (shipping.output or {}).get("tracking") if shipping.succeeded else None,
        }

    return app


def create_production_app() -> FastAPI:
    """``uvicorn --factory shop.app:create_production_app`` with ``SHOP_DATABASE_URL`` set."""
    url = os.environ["SHOP_DATABASE_URL"]
    runtime = ql3.cluster(url, tasks=tasks)
    engine = create_engine(url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        metadata.create_all(engine)
        runtime.start()  # startup recovery, then this process's scheduler replica
        try:
            yield
        finally:
            runtime.close()
            engine.dispose()

    app = create_app(runtime, engine, lifespan=lifespan)
    app.mount("/ql3", runtime.ingress_app())  # workers: ql3 worker --ingress http://HOST/ql3
    return app
