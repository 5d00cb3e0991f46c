"""The credential store's contract runs on both stores that keep credentials (the Cluster
profile's): memory and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.contract.conftest import STORES, open_store

CREDENTIAL_STORES = [param for param in STORES if param.values != ("sqlite",)]


@pytest.fixture(params=CREDENTIAL_STORES)
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield from open_store(request.param, request)
