"""SIGKILL of a real ``ql3 standalone`` process mid-task, then a restart.

Three runs are mid-task when the process dies: one declared idempotent with retry-on-lost, one
declared unsafe, one admitted without a policy. Nothing may be lost with the process; on restart
startup recovery marks the three attempts lost (the old session was replaced: evidence that they
no longer run) and the lost-retry rules decide: only the idempotent run gets an attempt 2 and
succeeds; the other two fail closed and never run again."""

from __future__ import annotations

from pathlib import Path

from ql3.adapters.sql.sqlite import SqliteStore
from ql3.application.admission import Admission
from ql3.application.identities import RandomIdentities
from ql3.domain.model import AttemptStatus, EvidenceKind, LeaseStatus, ReleaseReason, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.standalone.support import Child, views, wait_for

LEASE_TTL = "1.5"


def _admit(database: Path, markers: Path) -> dict[str, str]:
    store = SqliteStore(database)
    try:
        admission = Admission(store.unit_of_work, RandomIdentities())
        policies = {
            "idempotent": RetryPolicy(
                retry_on_lost=True,
                max_attempts=3,
                safety=Safety.IDEMPOTENT,
                backoff=Backoff(initial_ms=200, cap_ms=1_000),
            ),
            "unsafe": RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.UNSAFE),
            "no-policy": None,
        }
        return {
            name: admission.submit(
                "hold", {"dir": str(markers), "name": name, "first_s": 60, "later_s": 0.1}, policy
            )
            for name, policy in policies.items()
        }
    finally:
        store.close()


def test_sigkill_mid_task_loses_no_run_and_retries_only_the_declared_safe_one(
    tmp_path: Path,
) -> None:
    database = tmp_path / "ql3.sqlite"
    markers = tmp_path / "markers"
    markers.mkdir()
    runs = _admit(database, markers)
    ids = list(runs.values())

    first = Child(database, tmp_path / "first.log", "--lease-ttl", LEASE_TTL)
    try:

        def all_running() -> bool:
            found = views(database, ids)
            return len(found) == 3 and all(
                v.attempts and v.attempts[-1].attempt.status is AttemptStatus.RUNNING
                for v in found.values()
            )

        wait_for(all_running, 30, "three attempts running", first)
        wait_for(lambda: len(list(markers.iterdir())) == 3, 10, "three task bodies", first)
        first.kill()
    finally:
        first.ensure_dead()

    # Nothing is lost with the process: every run, its attempt and its lease are as they were.
    after_kill = views(database, ids)
    assert set(after_kill) == set(ids)
    for view in after_kill.values():
        assert view.run.status is RunStatus.RUNNING
        assert [a.attempt.status for a in view.attempts] == [AttemptStatus.RUNNING]
        assert view.attempts[0].lease is not None
        assert view.attempts[0].lease.status is LeaseStatus.LEASED

    second = Child(database, tmp_path / "second.log", "--lease-ttl", LEASE_TTL)
    try:

        def all_settled() -> bool:
            found = views(database, ids)
            return all(v.run.status.is_terminal for v in found.values())

        wait_for(all_settled, 30, "every run settled after the restart", second)
        code = second.stop()
    finally:
        second.ensure_dead()
    assert code == 0, second.output()
    assert "stopped" in second.output()

    final = views(database, ids)
    idempotent, unsafe, no_policy = (final[runs[n]] for n in ("idempotent", "unsafe", "no-policy"))

    assert idempotent.run.status is RunStatus.SUCCEEDED
    assert idempotent.run.output == {"name": "idempotent", "attempt": 2}
    first_attempt, second_attempt = idempotent.attempts
    assert first_attempt.attempt.status is AttemptStatus.LOST
    assert first_attempt.attempt.lost_evidence is EvidenceKind.SESSION_REPLACED
    assert first_attempt.lease is not None
    assert first_attempt.lease.status is LeaseStatus.RELEASED
    assert first_attempt.lease.release_reason is ReleaseReason.LEASE_EXPIRED
    assert first_attempt.lease.version == 2
    assert second_attempt.attempt.status is AttemptStatus.SUCCEEDED
    assert second_attempt.lease is not None
    assert second_attempt.lease.generation == 2
    assert second_attempt.lease.release_reason is ReleaseReason.COMPLETED
    kinds = [kind for _, kind, _, _, _ in idempotent.events]
    assert kinds.index("attempt_lost") < kinds.index("retry_scheduled") < kinds.index(
        "attempt_created"
    )

    for view, reason in ((unsafe, "unsafe"), (no_policy, "no_policy")):
        assert view.run.status is RunStatus.FAILED
        assert view.run.error is not None and reason in view.run.error
        assert [a.attempt.status for a in view.attempts] == [AttemptStatus.LOST]
        assert view.attempts[0].attempt.lost_evidence is EvidenceKind.SESSION_REPLACED

    # Each task body ran exactly as often as the rules allow: the unsafe run never twice.
    assert sorted(p.name for p in markers.iterdir()) == [
        "idempotent-1",
        "idempotent-2",
        "no-policy-1",
        "unsafe-1",
    ]
    # Same idempotency key on both attempts of the retried run.
    assert (markers / "idempotent-1").read_text() == (markers / "idempotent-2").read_text()
