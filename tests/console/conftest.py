"""Fixtures of the console's route tests: a store (SQLite and PostgreSQL), the console on it
with a viewer and an operator who sign in, and a client for each."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ql3.adapters.console.auth import Role, User, hash_password
from ql3.bootstrap import console as root
from tests.contract.conftest import open_store

PASSWORDS = {"vera": "viewer-secret", "otto": "operator-secret"}
# Hashed once: scrypt is slow on purpose.
USERS = {
    "vera": User("vera", Role.VIEWER, hash_password(PASSWORDS["vera"])),
    "otto": User("otto", Role.OPERATOR, hash_password(PASSWORDS["otto"])),
}
ORIGIN = "http://testserver"


def basic(name: str, password: str | None = None) -> dict[str, str]:
    secret = f"{name}:{password or PASSWORDS[name]}".encode()
    return {"Authorization": "Basic " + base64.b64encode(secret).decode()}


@pytest.fixture(
    params=[pytest.param("sqlite"), pytest.param("postgres", marks=pytest.mark.postgres)]
)
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from open_store(request.param, request)


@pytest.fixture
def console(store: Any) -> Iterator[root.Console]:
    built = root.build(store, users=USERS)
    try:
        yield built
    finally:
        built.close()


@pytest.fixture
def viewer(console: root.Console) -> TestClient:
    return TestClient(console.app, headers={**basic("vera"), "Origin": ORIGIN})


@pytest.fixture
def operator(console: root.Console) -> TestClient:
    return TestClient(console.app, headers={**basic("otto"), "Origin": ORIGIN})
