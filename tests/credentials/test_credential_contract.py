"""The credential port and its commands on every store that keeps credentials: issue, use,
rotation, expiry, scope, revocation and its audit; a refused registration writes nothing; a
revoked session is shut out but is not not-running evidence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from ql3.application.admission import Admission, AdmissionRequest
from ql3.application.credentials import SECRET_PREFIX, CredentialCommands
from ql3.application.recovery import RuntimeRecovery
from ql3.application.worker_commands import NoGrant, WorkerCommands
from ql3.domain.credentials import (
    CredentialEventType,
    CredentialRefusal,
    CredentialRejected,
    UnknownCredential,
)
from ql3.domain.errors import ConcurrencyConflict, InvalidTransition, SessionRejected
from ql3.domain.fence import hash_token
from ql3.domain.model import AttemptStatus, CredentialStatus, EvidenceKind, SessionStatus
from tests.application.support import CountingIdentities, current_attempt
from tests.contract.conftest import advance_time

HOUR_MS = 3_600_000


@dataclass
class Services:
    store: Any
    identities: CountingIdentities
    admission: Admission
    workers: WorkerCommands
    recovery: RuntimeRecovery


@pytest.fixture
def svc(store: Any) -> Services:
    identities = CountingIdentities()
    return Services(
        store=store,
        identities=identities,
        admission=Admission(store.unit_of_work, identities),
        workers=WorkerCommands(store.unit_of_work, identities, lease_ttl_ms=30_000),
        recovery=RuntimeRecovery(store.unit_of_work, store),
    )


@pytest.fixture
def creds(svc: Services) -> CredentialCommands:
    return CredentialCommands(svc.store.unit_of_work, svc.identities)


def _sessions(store: Any) -> dict[str, SessionStatus]:
    with store.unit_of_work() as uow:
        return {s.id: s.status for s in _all_sessions(uow)}


def _all_sessions(uow: Any) -> list[Any]:
    found = []
    for worker in ("host-a-1", "host-a-2", "host-b-1"):
        found.extend(uow.sessions.open_sessions_of(worker))
    return found


def test_issue_keeps_only_a_hash_and_audits(creds: CredentialCommands, store: Any) -> None:
    issued = creds.issue("host-a-*", tasks=["resize", "thumb"], expires_in_ms=HOUR_MS)
    assert issued.secret.startswith(SECRET_PREFIX) and len(issued.secret) >= 40
    (listed,) = creds.list_credentials()
    assert listed == issued.credential
    assert listed.secret_hash == hash_token(issued.secret)
    assert issued.secret not in repr(listed)
    assert listed.tasks == ("resize", "thumb")
    assert listed.expires_at_ms == listed.issued_at_ms + HOUR_MS
    assert [e.type for e in creds.audit(listed.id)] == [CredentialEventType.ISSUED]


def test_a_registration_with_a_credential_is_audited_with_its_session(
    creds: CredentialCommands,
) -> None:
    issued = creds.issue("host-a-*")
    grant, credential_id = creds.register(issued.secret, "host-a-1", 2, ["t"])
    assert credential_id == issued.credential.id
    used = creds.audit(credential_id)[-1]
    assert used.type is CredentialEventType.USED
    assert (used.worker_id, used.session_id) == ("host-a-1", grant.session_id)


@pytest.mark.parametrize(
    ("presented", "reason"),
    [
        (None, CredentialRefusal.MISSING),
        ("", CredentialRefusal.MISSING),
        ("not-a-credential", CredentialRefusal.UNKNOWN),
        (SECRET_PREFIX + "x" * 43, CredentialRefusal.UNKNOWN),
    ],
)
def test_missing_or_unknown_credentials_are_refused(
    creds: CredentialCommands, svc: Services, presented: str | None, reason: CredentialRefusal
) -> None:
    creds.issue("*")
    with pytest.raises(CredentialRejected) as refused:
        creds.register(presented, "host-a-1", 1, ["t"])
    assert refused.value.reason is reason and refused.value.unauthenticated
    assert _sessions(svc.store) == {}


def test_worker_id_and_tasks_outside_the_scope_are_refused_and_write_nothing(
    creds: CredentialCommands, svc: Services
) -> None:
    issued = creds.issue("host-a-*", tasks=["resize"])
    with pytest.raises(CredentialRejected) as wrong_worker:
        creds.register(issued.secret, "host-b-1", 1, ["resize"])
    assert wrong_worker.value.reason is CredentialRefusal.WORKER_NOT_ALLOWED
    with pytest.raises(CredentialRejected) as wrong_task:
        creds.register(issued.secret, "host-a-1", 1, ["resize", "billing"])
    assert wrong_task.value.reason is CredentialRefusal.TASK_NOT_ALLOWED
    assert not wrong_task.value.unauthenticated
    assert _sessions(svc.store) == {}
    assert [e.type for e in creds.audit(issued.credential.id)] == [CredentialEventType.ISSUED]


def test_an_expired_credential_is_refused(creds: CredentialCommands, svc: Services) -> None:
    issued = creds.issue("*", expires_in_ms=60_000)
    creds.register(issued.secret, "host-a-1", 1, ["t"])
    advance_time(svc.store, 60_000)
    with pytest.raises(CredentialRejected) as refused:
        creds.register(issued.secret, "host-a-2", 1, ["t"])
    assert refused.value.reason is CredentialRefusal.EXPIRED
    assert list(_sessions(svc.store)) != [] and "host-a-2" not in str(_sessions(svc.store))


def test_rotation_keeps_both_credentials_valid_until_the_old_one_is_revoked(
    creds: CredentialCommands, svc: Services
) -> None:
    old = creds.issue("host-a-*", tasks=["t"])
    first, _ = creds.register(old.secret, "host-a-1", 1, ["t"])
    new = creds.rotate(old.credential.id)
    assert new.credential.worker_pattern == "host-a-*" and new.credential.tasks == ("t",)
    assert new.credential.rotates_id == old.credential.id
    # Workers restart one at a time: each old session is replaced under the new credential.
    second, _ = creds.register(new.secret, "host-a-1", 1, ["t"])
    assert second.replaced_session_ids == (first.session_id,)
    _, still_old = creds.register(old.secret, "host-a-2", 1, ["t"])
    assert still_old == old.credential.id
    revocation = creds.revoke(old.credential.id, "rotated")
    assert revocation.revoked_session_ids != (second.session_id,)
    assert _sessions(svc.store) == {second.session_id: SessionStatus.ACTIVE}
    with pytest.raises(CredentialRejected):
        creds.register(old.secret, "host-a-2", 1, ["t"])


def test_revocation_shuts_the_sessions_out_and_is_audited(
    creds: CredentialCommands, svc: Services
) -> None:
    issued = creds.issue("host-a-*")
    grant, _ = creds.register(issued.secret, "host-a-1", 1, ["t"])
    revocation = creds.revoke(issued.credential.id, "host lost")
    assert revocation.credential.status is CredentialStatus.REVOKED
    assert revocation.revoked_session_ids == (grant.session_id,)
    with svc.store.unit_of_work() as uow:
        session = uow.sessions.get(grant.session_id)
    assert session is not None and session.status is SessionStatus.REVOKED
    with pytest.raises(SessionRejected):
        svc.workers.claim(grant.session_id, grant.secret, limit=1)
    with pytest.raises(SessionRejected):
        svc.workers.poll(grant.session_id, grant.secret)
    with pytest.raises(CredentialRejected) as refused:
        creds.register(issued.secret, "host-a-1", 1, ["t"])
    assert refused.value.reason is CredentialRefusal.REVOKED
    audit = creds.audit(issued.credential.id)
    assert [e.type for e in audit] == [
        CredentialEventType.ISSUED,
        CredentialEventType.USED,
        CredentialEventType.REVOKED,
    ]
    assert grant.session_id in audit[-1].detail and "host lost" in audit[-1].detail
    with pytest.raises(InvalidTransition):
        creds.revoke(issued.credential.id)
    with pytest.raises(UnknownCredential):
        creds.revoke("no-such-credential")


def test_a_stale_update_is_a_conflict(creds: CredentialCommands, svc: Services) -> None:
    issued = creds.issue("*")
    before = issued.credential
    creds.revoke(before.id)
    with svc.store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.credentials.update(before, before)


def test_a_secret_hash_is_stored_once(creds: CredentialCommands, svc: Services) -> None:
    issued = creds.issue("*")
    from attrs import evolve

    twin = evolve(issued.credential, id="another")
    with svc.store.unit_of_work() as uow, pytest.raises(ConcurrencyConflict):
        uow.credentials.add(twin)


def test_a_credential_limited_to_tasks_gets_no_other_work(
    creds: CredentialCommands, svc: Services
) -> None:
    issued = creds.issue("*", tasks=["resize"])
    svc.admission.submit_many([AdmissionRequest(task="billing")] * 2)
    grant, _ = creds.register(issued.secret, "host-a-1", 4, ["resize"])
    answer = svc.workers.claim(grant.session_id, grant.secret, limit=4)
    assert answer.grants == () and answer.no_grant is NoGrant.NOTHING_QUEUED
    resize = svc.admission.submit("resize")
    answer = svc.workers.claim(grant.session_id, grant.secret, limit=4)
    assert [g.run_id for g in answer.grants] == [resize]


def test_revocation_is_not_not_running_evidence(creds: CredentialCommands, svc: Services) -> None:
    issued = creds.issue("*")
    run_id = svc.admission.submit("t")
    grant, _ = creds.register(issued.secret, "host-a-1", 1, ["t"])
    (started,) = svc.workers.claim(grant.session_id, grant.secret, limit=1).grants
    creds.revoke(issued.credential.id, "host unreachable")
    # The revoked worker cannot renew: the lease runs out, and recovery still waits.
    advance_time(svc.store, svc.workers.lease_ttl_ms + 1_000)
    report = svc.recovery.run_once()
    assert report.recovered == 0 and report.awaiting_evidence == 1
    assert current_attempt(svc.store, run_id).status is AttemptStatus.RUNNING
    # A new session of the same worker id does not replace a revoked one: still no evidence.
    again = creds.issue("*")
    creds.register(again.secret, "host-a-1", 1, ["t"])
    assert svc.recovery.run_once().recovered == 0
    # Trusted evidence settles it.
    svc.workers.attest_stopped(started.attempt_id, "host powered off")
    assert svc.recovery.run_once().recovered == 1
    attempt = current_attempt(svc.store, run_id)
    assert attempt.status is AttemptStatus.LOST
    with svc.store.unit_of_work() as uow:
        kinds = [r.kind for r in uow.evidence.reports_for(attempt.id)]
    assert kinds == [EvidenceKind.OPERATOR_ATTESTED]
