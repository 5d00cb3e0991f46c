"""A broken head candidate on PostgreSQL, diagnosed and handled by a person (ADR 0010).

Two scheduler replicas share one database. A trigger makes every event of one lost Run fail
(but its quarantine's), so lost retry fails on it cycle after cycle, whichever replica runs the
cycle, and the gate stays closed. ``ql3 doctor`` names the Run, the step, the error and since
when; ``ql3 runs quarantine`` takes it out, the next cycle of either replica proceeds with the
other Runs, and ``ql3 runs unquarantine`` (the trigger gone) gives it back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

from ql3.adapters.cli.main import main
from ql3.adapters.postgres.store import PostgresStore
from ql3.application.admission import AdmissionRequest
from ql3.bootstrap import cluster
from ql3.domain.model import RunStatus
from ql3.domain.policy import RetryPolicy, Safety

pytestmark = pytest.mark.postgres

TTL_S = 5.0
POLICY = RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.IDEMPOTENT)


def _psycopg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def replicas(pg_database_url: str) -> Iterator[list[Any]]:
    stores = [PostgresStore.from_url(pg_database_url) for _ in range(2)]
    stores[0].testing_reset()
    try:
        yield [cluster.build(store=store, lease_ttl_s=TTL_S) for store in stores]
    finally:
        for store in stores:
            store.close()


def _ql3(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main(list(args))
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in args else out


def _advance(replicas: list[Any], ms: int) -> None:
    for container in replicas:
        container.store().testing_advance_clock(ms)


def test_a_broken_head_candidate_is_named_quarantined_and_given_back(
    replicas: list[Any], pg_database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = replicas
    runs = a.core.admission().submit_many([AdmissionRequest(task="t", policy=POLICY)] * 3)
    commands = a.core.worker_commands()
    session = commands.register("w-1", capacity=3, tasks=["t"])
    assert len(commands.claim(session.session_id, session.secret, limit=3).grants) == 3
    commands.close(session.session_id, session.secret)  # not-running evidence for all three
    _advance(replicas, round(TTL_S * 1000) + 1_000)
    assert a.runtime_recovery().run_once().recovered == 3
    head, *others = (c.run_id for c in a.store().lost_runs(16).items)
    assert set(runs) == {head, *others}
    url = pg_database_url
    with psycopg.connect(_psycopg_url(url), autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION ql3_test_break() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
            f" IF NEW.run_id = '{head}' AND NEW.type <> 'run_quarantined' THEN"
            " RAISE EXCEPTION 'run % cannot be settled', NEW.run_id; END IF;"
            " RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER ql3_test_break BEFORE INSERT ON run_events "
            "FOR EACH ROW EXECUTE FUNCTION ql3_test_break()"
        )

        # Cycle after cycle, whichever replica: the same candidate stops lost retry.
        summaries = [container.coordinator().run_cycle() for container in (a, b, a)]
        for summary in summaries:
            assert summary.aborted_at == "lost_retry"
            failed = summary.step("lost_retry")
            assert failed is not None and failed.candidate is not None
            assert failed.candidate.run_id == head
            assert "cannot be settled" in (failed.error or "")
        gate = b.store().dispatch_gate()
        assert not gate.open and gate.failure is not None
        assert (gate.failure.step, gate.failure.run_id, gate.failure.cycles) == (
            "lost_retry",
            head,
            3,
        )
        assert gate.failure.since_ms < (gate.changed_at_ms or 0)

        code, doctor = _ql3(capsys, "doctor", "--json", "--database-url", url)
        assert code == 1 and doctor["healthy"] is False
        problem = doctor["findings"][0]
        assert problem["problem"] and problem["details"]["run_id"] == head
        assert problem["details"]["step"] == "lost_retry"
        assert problem["details"]["cycles"] == 3
        assert problem["details"]["since_ms"] == gate.failure.since_ms
        assert "cannot be settled" in problem["details"]["error"]
        assert f"ql3 runs quarantine {head}" in problem["advice"]
        code, text = _ql3(capsys, "doctor", "--database-url", url)
        assert code == 1 and head in text and "failing since" in text

        # A person decides: the run is taken out, and the step proceeds with the others.
        code, _ = _ql3(
            capsys, "runs", "quarantine", head, "--reason", "events refused", "--database-url", url
        )
        assert code == 0
        healed = b.coordinator().run_cycle()
        assert healed.ok, healed.as_dict()
        step = healed.step("lost_retry")
        assert step is not None and step.counts["retries_scheduled"] == len(others)
        assert b.store().dispatch_gate().open
        with a.store().unit_of_work() as uow:
            head_run = uow.runs.get_run(head)
            assert head_run is not None and head_run.status is RunStatus.LOST
            assert head_run.quarantine is not None
            assert head_run.quarantine.reason == "events refused"
            for run_id in others:
                other = uow.runs.get_run(run_id)
                assert other is not None and other.status is RunStatus.RETRY_WAIT
        code, doctor = _ql3(capsys, "doctor", "--json", "--database-url", url)
        assert code == 0 and doctor["healthy"] is True
        (note,) = doctor["findings"]
        assert note["details"]["runs"][0]["run_id"] == head
        code, status = _ql3(capsys, "status", "--json", "--database-url", url)
        assert status["gate"]["open"] and status["gate"]["failure"] is None
        assert status["quarantined"]["count"] == 1
        code, listed = _ql3(capsys, "runs", "list", "--json", "--database-url", url)
        flags = {row["id"]: row["quarantined"] for row in listed["runs"]}
        assert flags == {head: True, **{run_id: False for run_id in others}}
        code, shown = _ql3(capsys, "runs", "show", head, "--json", "--database-url", url)
        assert shown["quarantine"]["reason"] == "events refused"
        # Quarantine is no way around the state machine: a queued run cannot be quarantined.
        queued = a.core.admission().submit("t")
        code, _ = _ql3(capsys, "runs", "quarantine", queued, "--reason", "x", "--database-url", url)
        assert code == 2
        conn.execute("DROP TRIGGER ql3_test_break ON run_events")
        conn.execute("DROP FUNCTION ql3_test_break()")

    code, _ = _ql3(
        capsys, "runs", "unquarantine", head, "--reason", "trigger dropped", "--database-url", url
    )
    assert code == 0
    again = a.coordinator().run_cycle()
    assert again.ok
    step = again.step("lost_retry")
    assert step is not None and step.counts["retries_scheduled"] == 1
    with a.store().unit_of_work() as uow:
        types = [e.event.type.value for e in uow.runs.events_of(head)]
    assert types[-3:] == ["run_quarantined", "run_unquarantined", "retry_scheduled"]
