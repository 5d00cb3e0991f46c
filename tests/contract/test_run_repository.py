"""RunRepository: inserts, locked snapshots, compare-and-set writes, renewals and reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from attrs import evolve

from ql3.application.ports import Snapshot
from ql3.domain.events import EventType, RunEvent
from ql3.domain.fence import hash_token
from ql3.domain.model import (
    Attempt,
    AttemptStatus,
    DispatchLease,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunOwner,
    RunStatus,
)
from ql3.domain.retry import settle_lost_run
from ql3.domain.transitions import Change, admit, claim, complete, release
from tests.contract.builders import (
    RETRY_SAFELY,
    TTL_MS,
    admit_run,
    attempt_id_of,
    claim_attempt,
    committed,
    fence_of,
    finish,
    given_created,
    given_lost,
    given_offered,
    given_queued,
    given_retry_wait,
    given_session,
    given_started,
    hand_back,
    locked_attempt,
    locked_run,
    lose,
    next_attempt,
    refused,
    settle,
    token_of,
)


def _marker_event(run_id: str, attempt_id: str | None, at_ms: int) -> RunEvent:
    return RunEvent(
        run_id=run_id, attempt_id=attempt_id, type=EventType.EVIDENCE_RECORDED, at_ms=at_ms
    )


def _lease(uow: Any, run_id: str, generation: int) -> DispatchLease:
    leases = {lease.generation: lease for lease in uow.runs.leases_of(run_id)}
    return leases[generation]


# --- add ---------------------------------------------------------------------------------------


def test_add_inserts_the_run_its_attempt_and_its_event(store: Any) -> None:
    with committed(store) as uow:
        change = admit_run(uow, "r1", policy=RETRY_SAFELY)

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1") == change.run
        assert uow.runs.get_run("r1").policy == RETRY_SAFELY
        assert list(uow.runs.attempts_of("r1")) == list(change.attempts)
        assert uow.runs.get_attempt(attempt_id_of("r1")) == change.attempts[0]
        assert list(uow.runs.leases_of("r1")) == []
        events = list(uow.runs.events_of("r1"))
        assert [e.event for e in events] == [change.event]
        assert events[0].sequence >= 1


def test_add_a_created_run_without_attempts(store: Any) -> None:
    given_created(store, "r1")
    with store.unit_of_work() as uow:
        run = uow.runs.get_run("r1")
        assert run is not None and run.status is RunStatus.CREATED and run.attempt_count == 0
        assert list(uow.runs.attempts_of("r1")) == []
        assert uow.runs.lock_run("r1") == Snapshot(run=run, attempt=None, lease=None)


def test_add_refuses_a_run_id_that_exists(store: Any) -> None:
    given_queued(store, "r1")
    refused(store, lambda uow: admit_run(uow, "r1", queued=False, task="other"))
    with store.unit_of_work() as uow:
        run = uow.runs.get_run("r1")
        assert run is not None and run.task == "mail" and run.status is RunStatus.QUEUED


def test_add_refuses_an_attempt_id_that_exists_and_inserts_nothing(store: Any) -> None:
    given_queued(store, "r1")
    with store.unit_of_work() as uow:
        change = admit(
            run_id="r2",
            attempt_id=attempt_id_of("r1"),
            task="mail",
            input=None,
            policy=None,
            now_ms=uow.now_ms(),
        )
    refused(store, lambda uow: uow.runs.add(change))
    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r2") is None
        assert list(uow.runs.events_of("r2")) == []
        assert uow.runs.get_attempt(attempt_id_of("r1")).run_id == "r1"


# --- lock_attempt / lock_run -------------------------------------------------------------------


def test_locking_something_unknown_gives_none(store: Any) -> None:
    with store.unit_of_work() as uow:
        assert uow.runs.lock_attempt("nope") is None
        assert uow.runs.lock_run("nope") is None
        assert uow.runs.get_run("nope") is None
        assert uow.runs.get_attempt("nope") is None
        assert list(uow.runs.events_of("nope")) == []


def test_lock_attempt_of_a_pristine_attempt_has_no_lease(store: Any) -> None:
    attempt_id = given_queued(store, "r1")
    with store.unit_of_work() as uow:
        snapshot = locked_attempt(uow, attempt_id)
        assert snapshot.run == uow.runs.get_run("r1")
        assert snapshot.attempt == uow.runs.get_attempt(attempt_id)
        assert snapshot.lease is None
        assert locked_run(uow, "r1") == snapshot


def test_lock_attempt_gives_the_lease_of_the_attempts_generation(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        snapshot = locked_attempt(uow, attempt_id)
        assert snapshot.attempt is not None and snapshot.attempt.lease_generation == 1
        assert snapshot.lease == _lease(uow, "r1", 1)
        assert snapshot.lease.attempt_id == attempt_id
        assert locked_run(uow, "r1") == snapshot


def test_a_fresh_attempt_after_a_retry_sees_the_runs_latest_lease(
    store: Any, advance: Callable[[int], None]
) -> None:
    given_session(store, "s1")
    first = given_retry_wait(store, "r1", "s1")
    advance(RETRY_SAFELY.backoff.cap_ms + 1)
    with committed(store) as uow:
        second = next_attempt(uow, "r1").attempts[0].id

    with store.unit_of_work() as uow:
        by_run = locked_run(uow, "r1")
        assert by_run.attempt is not None and by_run.attempt.id == second
        assert by_run.attempt.number == 2 and by_run.attempt.is_pristine
        # No lease of its own yet: the Run's latest lease (the released generation 1).
        assert by_run.lease == _lease(uow, "r1", 1)
        assert by_run.lease.status is LeaseStatus.RELEASED
        assert locked_attempt(uow, second) == by_run
        lost = locked_attempt(uow, first)
        assert lost.attempt is not None and lost.attempt.status is AttemptStatus.LOST

    with committed(store) as uow:
        change = claim_attempt(uow, second, "s1")
    assert change.lease is not None and change.lease.generation == 2

    with store.unit_of_work() as uow:
        assert [lease.generation for lease in uow.runs.leases_of("r1")] == [1, 2]
        assert locked_attempt(uow, first).lease == _lease(uow, "r1", 1)
        assert locked_attempt(uow, second).lease == _lease(uow, "r1", 2)
        assert locked_run(uow, "r1").lease == _lease(uow, "r1", 2)


# --- apply -------------------------------------------------------------------------------------


def test_apply_persists_run_attempt_lease_and_event_together(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_queued(store, "r1")
    with committed(store) as uow:
        change = claim_attempt(uow, attempt_id, "s1")

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1") == change.run
        assert uow.runs.get_run("r1").status is RunStatus.RUNNING
        attempt = uow.runs.get_attempt(attempt_id)
        assert attempt == change.attempts[0]
        assert attempt.status is AttemptStatus.RUNNING and attempt.started_at_ms is not None
        assert list(uow.runs.leases_of("r1")) == [change.lease]
        assert change.lease is not None and change.lease.token_hash == hash_token(
            token_of(attempt_id)
        )
        events = list(uow.runs.events_of("r1"))
        assert [e.event.type for e in events] == [
            EventType.RUN_ADMITTED,
            EventType.ATTEMPT_STARTED,
        ]
        assert events[1].event == change.event
        assert events[0].sequence < events[1].sequence


def test_a_whole_lifecycle_writes_one_event_per_change_in_order(store: Any) -> None:
    given_session(store, "s1")
    given_session(store, "s2")
    changes: list[Change] = []
    with committed(store) as uow:
        changes.append(admit_run(uow, "r1"))
    attempt_id = attempt_id_of("r1")
    with committed(store) as uow:
        changes.append(claim_attempt(uow, attempt_id, "s1"))
    with committed(store) as uow:
        changes.append(hand_back(uow, attempt_id))
    with committed(store) as uow:
        changes.append(claim_attempt(uow, attempt_id, "s2"))
    with committed(store) as uow:
        changes.append(finish(uow, attempt_id))

    with store.unit_of_work() as uow:
        events = list(uow.runs.events_of("r1"))
        assert [e.event for e in events] == [c.event for c in changes]
        assert [e.event.type for e in events] == [
            EventType.RUN_ADMITTED,
            EventType.ATTEMPT_STARTED,
            EventType.ATTEMPT_RELEASED,
            EventType.ATTEMPT_STARTED,
            EventType.ATTEMPT_SUCCEEDED,
        ]
        sequences = [e.sequence for e in events]
        assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences)
        run = uow.runs.get_run("r1")
        assert run is not None and run.status is RunStatus.SUCCEEDED and run.output == {"ok": True}
        attempt = uow.runs.get_attempt(attempt_id)
        assert attempt is not None and attempt.status is AttemptStatus.SUCCEEDED
        assert attempt.session_id == "s2" and attempt.lease_generation == 2
        first, second = uow.runs.leases_of("r1")
        assert (first.generation, first.holder_session_id) == (1, "s1")
        assert first.status is LeaseStatus.RELEASED
        assert first.release_reason is ReleaseReason.HANDED_BACK and first.version == 2
        assert (second.generation, second.holder_session_id) == (2, "s2")
        assert second.status is LeaseStatus.RELEASED
        assert second.release_reason is ReleaseReason.COMPLETED
        assert second.version == 2 == attempt.lease_version
        assert second.token_hash == hash_token(token_of(attempt_id))


# --- apply_many --------------------------------------------------------------------------------


def _claim_change(uow: Any, snapshot: Snapshot, session_id: str, token: str) -> Change:
    session = uow.sessions.get(session_id)
    assert session is not None and snapshot.attempt is not None
    return claim(
        run=snapshot.run,
        attempt=snapshot.attempt,
        previous_lease=snapshot.lease,
        session=session,
        token_hash=hash_token(token),
        ttl_ms=TTL_MS,
        now_ms=uow.now_ms(),
    )


def test_apply_many_of_claims_inserts_each_lease_and_writes_one_event_each(store: Any) -> None:
    given_session(store, "s1")
    first, second = given_queued(store, "r1"), given_queued(store, "r2")
    with committed(store) as uow:
        snapshots = uow.runs.lock_attempts([first, second])
        assert all(s is not None for s in snapshots)
        writes = [
            (s, _claim_change(uow, s, "s1", f"token{s.run.id}"))
            for s in snapshots
            if s is not None
        ]
        uow.runs.apply_many(writes)

    with store.unit_of_work() as uow:
        for snapshot, change in writes:
            run_id = snapshot.run.id
            assert uow.runs.get_run(run_id) == change.run
            assert change.run.status is RunStatus.RUNNING
            assert list(uow.runs.attempts_of(run_id)) == list(change.attempts)
            assert change.attempts[0].status is AttemptStatus.RUNNING
            assert change.attempts[0].session_id == "s1"
            (lease,) = uow.runs.leases_of(run_id)
            assert lease == change.lease
            assert lease.token_hash == hash_token(f"token{run_id}") and lease.generation == 1
            assert [e.event for e in uow.runs.events_of(run_id)][1:] == [change.event]
            assert uow.runs.lock_attempt(change.attempts[0].id) == Snapshot(
                run=change.run, attempt=change.attempts[0], lease=change.lease
            )


def test_apply_many_of_a_release_and_a_claim_writes_both(store: Any) -> None:
    """What one claim writes: an Attempt handed back and another one claimed."""
    given_session(store, "s1")
    held = given_started(store, "r1", "s1")
    queued = given_queued(store, "r2")
    with committed(store) as uow:
        back, claimed = uow.runs.lock_attempts([held, queued])
        assert back is not None and back.attempt is not None and back.lease is not None
        assert claimed is not None
        released = release(
            run=back.run,
            attempt=back.attempt,
            lease=back.lease,
            session_id="s1",
            cause="not_held",
            now_ms=uow.now_ms(),
        )
        granted = _claim_change(uow, claimed, "s1", "tokenr2")
        uow.runs.apply_many([(back, released), (claimed, granted)])

    with store.unit_of_work() as uow:
        run = uow.runs.get_run("r1")
        attempt = uow.runs.get_attempt(held)
        assert run == released.run and run.status is RunStatus.QUEUED
        assert attempt == released.attempts[0] and attempt.is_pristine
        (lease,) = uow.runs.leases_of("r1")
        assert lease == released.lease
        assert lease.status is LeaseStatus.RELEASED and lease.version == 2
        assert lease.release_reason is ReleaseReason.HANDED_BACK
        assert [e.event for e in uow.runs.events_of("r1")][-1] == released.event
        assert released.event.type is EventType.ATTEMPT_RELEASED
        assert released.event.data["cause"] == "not_held"
        assert len(uow.runs.events_of("r1")) == 3
        # the pristine Attempt locks with the Run's latest lease, as any Attempt without one
        assert uow.runs.lock_attempt(held) == Snapshot(run=run, attempt=attempt, lease=lease)
        assert uow.runs.get_run("r2") == granted.run
        assert list(uow.runs.leases_of("r2")) == [granted.lease]
        assert [e.event.type for e in uow.runs.events_of("r2")] == [
            EventType.RUN_ADMITTED,
            EventType.ATTEMPT_STARTED,
        ]


def test_apply_many_of_two_changes_of_one_run_chains_them(store: Any) -> None:
    """A later change of the same Run starts from the result of the earlier one."""
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with committed(store) as uow:
        before = locked_attempt(uow, attempt_id)
        assert before.attempt is not None and before.lease is not None
        released = release(
            run=before.run,
            attempt=before.attempt,
            lease=before.lease,
            session_id="s1",
            cause="not_held",
            now_ms=uow.now_ms(),
        )
        middle = Snapshot(run=released.run, attempt=released.attempts[0], lease=released.lease)
        again = _claim_change(uow, middle, "s1", "again")
        uow.runs.apply_many([(before, released), (middle, again)])

    with store.unit_of_work() as uow:
        assert [(x.generation, x.status) for x in uow.runs.leases_of("r1")] == [
            (1, LeaseStatus.RELEASED),
            (2, LeaseStatus.LEASED),
        ]
        attempt = uow.runs.get_attempt(attempt_id)
        assert attempt == again.attempts[0] and attempt.lease_generation == 2
        assert [e.event.type for e in uow.runs.events_of("r1")] == [
            EventType.RUN_ADMITTED,
            EventType.ATTEMPT_STARTED,
            EventType.ATTEMPT_RELEASED,
            EventType.ATTEMPT_STARTED,
        ]


def test_apply_many_is_all_or_nothing(store: Any) -> None:
    given_session(store, "s1")
    given_session(store, "s2")
    first, second = given_queued(store, "r1"), given_queued(store, "r2")
    with store.unit_of_work() as uow:
        stale = locked_attempt(uow, second)
    with committed(store) as uow:
        claim_attempt(uow, second, "s2")  # the second Attempt is taken meanwhile

    def write(uow: Any) -> None:
        fresh = locked_attempt(uow, first)
        uow.runs.apply_many(
            [
                (fresh, _claim_change(uow, fresh, "s1", "tokenr1")),
                (stale, _claim_change(uow, stale, "s1", "tokenr2")),
            ]
        )

    refused(store, write)
    with store.unit_of_work() as uow:
        run = uow.runs.get_run("r1")
        assert run is not None and run.status is RunStatus.QUEUED
        assert list(uow.runs.leases_of("r1")) == []
        assert len(uow.runs.events_of("r1")) == 1
        assert [x.holder_session_id for x in uow.runs.leases_of("r2")] == ["s2"]


def test_marking_lost_releases_the_lease_in_the_same_write(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with committed(store) as uow:
        change = lose(uow, attempt_id, EvidenceKind.OPERATOR_ATTESTED)

    with store.unit_of_work() as uow:
        run = uow.runs.get_run("r1")
        attempt = uow.runs.get_attempt(attempt_id)
        (lease,) = uow.runs.leases_of("r1")
        assert run is not None and run.status is RunStatus.LOST
        assert attempt is not None and attempt.status is AttemptStatus.LOST
        assert attempt.lost_evidence is EvidenceKind.OPERATOR_ATTESTED
        assert lease == change.lease
        assert lease.status is LeaseStatus.RELEASED and lease.version == 2
        assert lease.release_reason is ReleaseReason.LEASE_EXPIRED
        assert attempt.lease_version == 2
        assert uow.runs.events_of("r1")[-1].event == change.event


def test_apply_refuses_a_stale_run_status(store: Any) -> None:
    given_session(store, "s1")
    given_lost(store, "r1", "s1")
    with store.unit_of_work() as uow:
        stale = locked_run(uow, "r1")
    with committed(store) as uow:
        settle(uow, "r1")  # lost -> failed

    with store.unit_of_work() as uow:
        assert stale.attempt is not None
        change = settle_lost_run(run=stale.run, lost_attempt=stale.attempt, now_ms=uow.now_ms())
    refused(store, lambda uow: uow.runs.apply(stale, change))

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1").status is RunStatus.FAILED
        assert [e.event.type for e in uow.runs.events_of("r1")][-1] is EventType.RUN_FAILED
        assert len(uow.runs.events_of("r1")) == 4


def test_apply_refuses_a_stale_run_attempt_count(store: Any) -> None:
    given_session(store, "s1")
    given_lost(store, "r1", "s1")
    with store.unit_of_work() as uow:
        current = locked_run(uow, "r1")
        assert current.attempt is not None
        change = settle_lost_run(run=current.run, lost_attempt=current.attempt, now_ms=uow.now_ms())
    stale = replace(current, run=evolve(current.run, attempt_count=2))
    refused(store, lambda uow: uow.runs.apply(stale, change))
    with committed(store) as uow:
        uow.runs.apply(current, change)  # the same change against the true state goes through
    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1").status is RunStatus.FAILED


def test_apply_refuses_a_stale_attempt_status(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        stale = locked_attempt(uow, attempt_id)
    with committed(store) as uow:
        hand_back(uow, attempt_id)  # running -> claimed (pristine)

    with store.unit_of_work() as uow:
        assert stale.attempt is not None
        now = uow.now_ms()
        change = Change(
            run=stale.run,
            attempts=(evolve(stale.attempt, error="noted", updated_at_ms=now),),
            lease=None,
            event=_marker_event("r1", attempt_id, now),
        )
    refused(store, lambda uow: uow.runs.apply(stale, change))  # only the attempt is written
    with store.unit_of_work() as uow:
        attempt = uow.runs.get_attempt(attempt_id)
        assert attempt is not None and attempt.is_pristine and attempt.error is None
        assert len(uow.runs.events_of("r1")) == 3


def test_apply_refuses_a_stale_attempt_lease_version(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        current = locked_attempt(uow, attempt_id)
        assert current.attempt is not None
        now = uow.now_ms()
        change = Change(
            run=current.run,
            attempts=(evolve(current.attempt, error="noted", updated_at_ms=now),),
            lease=None,
            event=_marker_event("r1", attempt_id, now),
        )
    stale = replace(current, attempt=evolve(current.attempt, lease_version=7))
    refused(store, lambda uow: uow.runs.apply(stale, change))
    with store.unit_of_work() as uow:
        assert uow.runs.get_attempt(attempt_id).error is None
    with committed(store) as uow:
        uow.runs.apply(current, change)
    with store.unit_of_work() as uow:
        assert uow.runs.get_attempt(attempt_id).error == "noted"


def test_apply_refuses_a_completion_after_the_attempt_was_handed_back(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        stale = locked_attempt(uow, attempt_id)
    with committed(store) as uow:
        hand_back(uow, attempt_id)

    with store.unit_of_work() as uow:
        assert stale.attempt is not None
        change = complete(
            run=stale.run,
            attempt=stale.attempt,
            lease=stale.lease,
            fence=fence_of(stale),
            succeeded=True,
            output=None,
            error=None,
            now_ms=uow.now_ms(),
        )
    refused(store, lambda uow: uow.runs.apply(stale, change))

    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1").status is RunStatus.QUEUED
        assert _lease(uow, "r1", 1).release_reason is ReleaseReason.HANDED_BACK


@pytest.mark.parametrize(
    "stale_field",
    ["version", "status", "token_hash"],
)
def test_apply_refuses_a_stale_lease(store: Any, stale_field: str) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        current = locked_attempt(uow, attempt_id)
        assert current.lease is not None
        now = uow.now_ms()
        change = Change(
            run=current.run,
            attempts=(),
            lease=evolve(current.lease, expires_at_ms=current.lease.expires_at_ms + 1_000),
            event=_marker_event("r1", attempt_id, now),
        )
        stale_values: dict[str, Any] = {
            "version": current.lease.version + 1,
            "status": LeaseStatus.RELEASED,
            "token_hash": hash_token("someone else"),
        }
    stale = replace(
        current, lease=evolve(current.lease, **{stale_field: stale_values[stale_field]})
    )
    refused(store, lambda uow: uow.runs.apply(stale, change))
    with store.unit_of_work() as uow:
        assert _lease(uow, "r1", 1) == current.lease
    with committed(store) as uow:
        uow.runs.apply(current, change)
    with store.unit_of_work() as uow:
        assert _lease(uow, "r1", 1) == change.lease


def test_apply_refuses_an_attempt_id_that_exists(store: Any) -> None:
    given_session(store, "s1")
    given_lost(store, "r1", "s1")
    taken = given_queued(store, "r2")
    with store.unit_of_work() as uow:
        before = locked_run(uow, "r1")
        now = uow.now_ms()
        intruder = Attempt(
            id=taken,
            run_id="r1",
            number=2,
            status=AttemptStatus.CLAIMED,
            created_at_ms=now,
            updated_at_ms=now,
        )
        change = Change(
            run=before.run,
            attempts=(intruder,),
            lease=None,
            event=_marker_event("r1", taken, now),
        )
    refused(store, lambda uow: uow.runs.apply(before, change))
    with store.unit_of_work() as uow:
        assert uow.runs.get_attempt(taken).run_id == "r2"
        assert [a.id for a in uow.runs.attempts_of("r1")] == [attempt_id_of("r1")]


def test_apply_refuses_a_second_attempt_with_the_same_number(store: Any) -> None:
    given_session(store, "s1")
    given_lost(store, "r1", "s1")
    with store.unit_of_work() as uow:
        before = locked_run(uow, "r1")
        now = uow.now_ms()
        twin = Attempt(
            id="r1twin",
            run_id="r1",
            number=1,
            status=AttemptStatus.CLAIMED,
            created_at_ms=now,
            updated_at_ms=now,
        )
        change = Change(
            run=before.run, attempts=(twin,), lease=None, event=_marker_event("r1", "r1twin", now)
        )
    refused(store, lambda uow: uow.runs.apply(before, change))
    with store.unit_of_work() as uow:
        assert uow.runs.get_attempt("r1twin") is None


def test_apply_refuses_a_second_non_terminal_attempt(store: Any) -> None:
    attempt_id = given_queued(store, "r1")
    with store.unit_of_work() as uow:
        before = locked_attempt(uow, attempt_id)
        now = uow.now_ms()
        second = Attempt(
            id=attempt_id_of("r1", 2),
            run_id="r1",
            number=2,
            status=AttemptStatus.CLAIMED,
            created_at_ms=now,
            updated_at_ms=now,
        )
        change = Change(
            run=evolve(before.run, attempt_count=2, updated_at_ms=now),
            attempts=(second,),
            lease=None,
            event=_marker_event("r1", second.id, now),
        )
    refused(store, lambda uow: uow.runs.apply(before, change))
    with store.unit_of_work() as uow:
        assert [a.number for a in uow.runs.attempts_of("r1")] == [1]
        assert uow.runs.get_run("r1").attempt_count == 1


def test_apply_refuses_a_second_leased_lease(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        before = locked_attempt(uow, attempt_id)
        assert before.lease is not None
        now = uow.now_ms()
        change = Change(
            run=before.run,
            attempts=(),
            lease=evolve(before.lease, generation=2, granted_at_ms=now),
            event=_marker_event("r1", attempt_id, now),
        )
    refused(store, lambda uow: uow.runs.apply(before, change))
    with store.unit_of_work() as uow:
        assert [lease.generation for lease in uow.runs.leases_of("r1")] == [1]


def test_apply_refuses_to_insert_a_lease_that_exists(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        current = locked_attempt(uow, attempt_id)
        assert current.lease is not None
        now = uow.now_ms()
        blind = replace(current, lease=None)  # as if no lease had been read
        change = Change(
            run=current.run,
            attempts=(),
            lease=evolve(current.lease, holder_session_id="s2"),
            event=_marker_event("r1", attempt_id, now),
        )
    refused(store, lambda uow: uow.runs.apply(blind, change))
    with store.unit_of_work() as uow:
        assert _lease(uow, "r1", 1).holder_session_id == "s1"


def test_a_refused_apply_leaves_the_committed_state_as_it_was(store: Any) -> None:
    given_session(store, "s1")
    given_session(store, "s2")
    attempt_id = given_queued(store, "r1")
    with store.unit_of_work() as uow:
        stale = locked_attempt(uow, attempt_id)
    with committed(store) as uow:
        claim_attempt(uow, attempt_id, "s1")

    with store.unit_of_work() as uow:
        rival = _claim_change(uow, stale, "s2", "rival")
    refused(store, lambda uow: uow.runs.apply(stale, rival))

    with store.unit_of_work() as uow:
        (lease,) = uow.runs.leases_of("r1")
        assert lease.holder_session_id == "s1"
        assert lease.token_hash == hash_token(token_of(attempt_id))
        assert uow.runs.get_attempt(attempt_id).session_id == "s1"
        assert len(uow.runs.events_of("r1")) == 2


# --- renew_lease -------------------------------------------------------------------------------


def test_renew_moves_only_the_expiry_and_writes_no_event(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with committed(store) as uow:
        before = locked_attempt(uow, attempt_id).lease
        assert before is not None
        after = evolve(before, expires_at_ms=before.expires_at_ms + 30_000)
        uow.runs.renew_lease(before, after)
        events = len(uow.runs.events_of("r1"))

    with store.unit_of_work() as uow:
        stored = _lease(uow, "r1", 1)
        assert stored == after
        assert stored.version == before.version and stored.token_hash == before.token_hash
        assert stored.status is LeaseStatus.LEASED
        assert len(uow.runs.events_of("r1")) == events == 2


def test_renew_is_refused_once_the_lease_expired(
    store: Any, advance: Callable[[int], None]
) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1", ttl_ms=10_000)
    with store.unit_of_work() as uow:
        before = locked_attempt(uow, attempt_id).lease
    assert before is not None
    advance(10_001)
    after = evolve(before, expires_at_ms=before.expires_at_ms + 60_000)
    refused(store, lambda uow: uow.runs.renew_lease(before, after))
    with store.unit_of_work() as uow:
        assert _lease(uow, "r1", 1).expires_at_ms == before.expires_at_ms


@pytest.mark.parametrize("stale_field", ["version", "status", "token_hash"])
def test_renew_is_refused_for_a_stale_lease(store: Any, stale_field: str) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        current = locked_attempt(uow, attempt_id).lease
        assert current is not None
        stale_values: dict[str, Any] = {
            "version": current.version + 1,
            "status": LeaseStatus.RELEASED,
            "token_hash": hash_token("someone else"),
        }
        stale = evolve(current, **{stale_field: stale_values[stale_field]})
    after = evolve(stale, expires_at_ms=current.expires_at_ms + 30_000)
    refused(store, lambda uow: uow.runs.renew_lease(stale, after))
    with store.unit_of_work() as uow:
        assert _lease(uow, "r1", 1) == current


def test_renew_is_refused_after_the_lease_was_released(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        before = locked_attempt(uow, attempt_id).lease
    assert before is not None
    with committed(store) as uow:
        finish(uow, attempt_id)
    refused(
        store,
        lambda uow: uow.runs.renew_lease(
            before, evolve(before, expires_at_ms=before.expires_at_ms + 1)
        ),
    )
    with store.unit_of_work() as uow:
        assert _lease(uow, "r1", 1).status is LeaseStatus.RELEASED


# --- reads -------------------------------------------------------------------------------------


def test_attempts_leases_and_events_are_read_in_order(
    store: Any, advance: Callable[[int], None]
) -> None:
    given_session(store, "s1")
    given_retry_wait(store, "r1", "s1")
    advance(RETRY_SAFELY.backoff.cap_ms + 1)
    with committed(store) as uow:
        next_attempt(uow, "r1")
    with committed(store) as uow:
        claim_attempt(uow, attempt_id_of("r1", 2), "s1")

    with store.unit_of_work() as uow:
        assert [a.number for a in uow.runs.attempts_of("r1")] == [1, 2]
        assert [a.id for a in uow.runs.attempts_of("r1")] == [
            attempt_id_of("r1", 1),
            attempt_id_of("r1", 2),
        ]
        assert [(le.generation, le.status) for le in uow.runs.leases_of("r1")] == [
            (1, LeaseStatus.RELEASED),
            (2, LeaseStatus.LEASED),
        ]
        assert [e.event.type for e in uow.runs.events_of("r1")] == [
            EventType.RUN_ADMITTED,
            EventType.ATTEMPT_STARTED,
            EventType.ATTEMPT_LOST,
            EventType.RETRY_SCHEDULED,
            EventType.ATTEMPT_CREATED,
            EventType.ATTEMPT_STARTED,
        ]


def test_events_belong_to_their_run(store: Any) -> None:
    given_queued(store, "r1")
    given_created(store, "r2")
    with store.unit_of_work() as uow:
        assert [e.event.run_id for e in uow.runs.events_of("r1")] == ["r1"]
        assert [e.event.run_id for e in uow.runs.events_of("r2")] == ["r2"]
        assert uow.runs.events_of("r1")[0].sequence != uow.runs.events_of("r2")[0].sequence


def test_list_runs_filters_by_status_orders_by_creation_and_limits(
    store: Any, advance: Callable[[int], None]
) -> None:
    # Created in the order r3, r1, r2 so that creation order differs from id order.
    given_queued(store, "r3")
    advance(1_000)
    given_created(store, "r1")
    advance(1_000)
    given_queued(store, "r2", owner=RunOwner.WORKFLOW)

    with store.unit_of_work() as uow:
        assert [r.id for r in uow.runs.list_runs(None, 10)] == ["r3", "r1", "r2"]
        assert [r.id for r in uow.runs.list_runs(None, 2)] == ["r3", "r1"]
        assert [r.id for r in uow.runs.list_runs(RunStatus.QUEUED, 10)] == ["r3", "r2"]
        assert [r.id for r in uow.runs.list_runs(RunStatus.CREATED, 10)] == ["r1"]
        assert list(uow.runs.list_runs(RunStatus.FAILED, 10)) == []
        assert uow.runs.list_runs(RunStatus.CREATED, 10)[0] == uow.runs.get_run("r1")


def test_renewing_a_legacy_offer_that_was_not_accepted_is_refused(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_offered(store, "r1", "s1")
    with store.unit_of_work() as uow:
        before = locked_attempt(uow, attempt_id).lease
    assert before is not None and before.token_hash is None
    after = evolve(before, expires_at_ms=before.expires_at_ms + 30_000)
    refused(store, lambda uow: uow.runs.renew_lease(before, after))
    with store.unit_of_work() as uow:
        assert _lease(uow, "r1", 1) == before


# --- what the schema enforces ------------------------------------------------------------------


def test_add_refuses_an_attempt_of_a_run_that_does_not_exist(store: Any) -> None:
    with store.unit_of_work() as uow:
        change = admit(
            run_id="r1",
            attempt_id="r1a1",
            task="mail",
            input=None,
            policy=None,
            now_ms=uow.now_ms(),
        )
    stray = evolve(change.attempts[0], run_id="r9")
    refused(store, lambda uow: uow.runs.add(evolve(change, attempts=(stray,))))
    with store.unit_of_work() as uow:
        assert uow.runs.get_run("r1") is None
        assert uow.runs.get_attempt("r1a1") is None


def test_apply_refuses_a_lease_of_an_attempt_that_does_not_exist(store: Any) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        before = locked_attempt(uow, attempt_id)
        assert before.lease is not None
        now = uow.now_ms()
    released = evolve(
        before.lease,
        status=LeaseStatus.RELEASED,
        version=2,
        release_reason=ReleaseReason.CANCELLED,
        released_at_ms=now,
    )
    # Released, so that only the missing Attempt can be the reason for the refusal.
    orphan = evolve(released, generation=2, attempt_id="nowhere", granted_at_ms=now)
    refused(
        store,
        lambda uow: uow.runs.apply(
            replace(before, lease=None),
            Change(run=before.run, attempts=(), lease=orphan, event=_marker_event("r1", None, now)),
        ),
    )
    with store.unit_of_work() as uow:
        assert [lease.generation for lease in uow.runs.leases_of("r1")] == [1]
    # The refusal was about the missing Attempt: a write of the real lease goes through.
    with committed(store) as uow:
        uow.runs.apply(
            before,
            Change(
                run=before.run, attempts=(), lease=released, event=_marker_event("r1", None, now)
            ),
        )
    with store.unit_of_work() as uow:
        assert list(uow.runs.leases_of("r1")) == [released]


@pytest.mark.parametrize("inconsistency", ["leased_with_reason", "released_without_reason"])
def test_apply_refuses_a_lease_whose_release_reason_contradicts_its_status(
    store: Any, inconsistency: str
) -> None:
    given_session(store, "s1")
    attempt_id = given_started(store, "r1", "s1")
    with store.unit_of_work() as uow:
        before = locked_attempt(uow, attempt_id)
        assert before.lease is not None
        now = uow.now_ms()
    if inconsistency == "leased_with_reason":
        bad = evolve(before.lease, release_reason=ReleaseReason.CANCELLED)
    else:
        bad = evolve(before.lease, status=LeaseStatus.RELEASED, version=2, released_at_ms=now)
    change = Change(run=before.run, attempts=(), lease=bad, event=_marker_event("r1", None, now))
    refused(store, lambda uow: uow.runs.apply(before, change))
    with store.unit_of_work() as uow:
        assert _lease(uow, "r1", 1) == before.lease
