"""On PostgreSQL a revocation waits for a registration that is using the credential (it holds
the credential's row locked for share) and then revokes the session it opened: no session
registered with a revoked credential stays open."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ql3.adapters.postgres.store import PostgresStore
from ql3.application.credentials import CredentialCommands, Revocation
from ql3.application.worker_commands import open_session
from ql3.domain.credentials import credential_used
from ql3.domain.fence import hash_token
from ql3.domain.model import SessionStatus
from tests.application.support import CountingIdentities

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(pg_database_url: str) -> Iterator[PostgresStore]:
    postgres = PostgresStore.from_url(pg_database_url, create_schema=True, pool_size=3)
    try:
        postgres.testing_reset()
        yield postgres
    finally:
        postgres.close()


def test_a_revocation_waits_for_a_registration_in_flight_and_revokes_its_session(
    store: PostgresStore,
) -> None:
    identities = CountingIdentities()
    credentials = CredentialCommands(store.unit_of_work, identities)
    issued = credentials.issue("*")
    revoked: list[Revocation] = []
    with store.unit_of_work() as uow:
        found = uow.credentials.find_by_secret_hash(hash_token(issued.secret))
        assert found is not None
        revoking = threading.Thread(
            target=lambda: revoked.append(credentials.revoke(issued.credential.id))
        )
        revoking.start()
        revoking.join(0.5)
        assert revoking.is_alive()  # blocked by the registration's share lock
        _, session = open_session(uow, identities, "host-a-1", 1, ["t"])
        uow.credentials.record(credential_used(found, session))
        uow.commit()
    revoking.join(10)
    assert [r.revoked_session_ids for r in revoked] == [(session.id,)]
    with store.unit_of_work() as uow:
        stored = uow.sessions.get(session.id)
    assert stored is not None and stored.status is SessionStatus.REVOKED
