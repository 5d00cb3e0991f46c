"""The ingress role gets nothing on the worker credential tables (ADR 0008): registration with
a credential runs on the node's own role, and the ingress role cannot even read the hashes."""

from __future__ import annotations

import pytest
from psycopg import errors

from tests.postgres_server import connect

pytestmark = pytest.mark.postgres


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT secret_hash FROM worker_credentials",
        "SELECT * FROM worker_credential_events",
        "INSERT INTO worker_credential_events (credential_id, type, at, detail)"
        " VALUES ('x', 'used', now(), '')",
        "UPDATE worker_credentials SET status = 'active'",
    ],
)
def test_the_ingress_role_cannot_touch_credentials(ingress_url: str, statement: str) -> None:
    with connect(ingress_url) as connection, pytest.raises(errors.InsufficientPrivilege):
        connection.execute(statement)
