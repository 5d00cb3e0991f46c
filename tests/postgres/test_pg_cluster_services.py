"""The Cluster profile's services and command line on real PostgreSQL: recovery that is never
starved by candidates waiting for evidence, lost retry that fails closed, and ``ql3`` end to
end on a database it migrated itself."""

from __future__ import annotations

import json
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

from ql3.adapters.cli.main import main
from ql3.adapters.postgres.store import PostgresStore
from ql3.application.worker_commands import Grant, SessionGrant
from ql3.bootstrap import cluster
from ql3.domain.policy import RetryPolicy, Safety
from tests.postgres_server import PostgresServer, create_database, drop_database, random_name

TTL_S = 5.0


def _psycopg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _start_all(
    container: cluster.ClusterContainer, worker_id: str, tasks: list[str], n: int
) -> tuple[SessionGrant, tuple[Grant, ...]]:
    """A worker of capacity ``n`` claims (and so starts) up to ``n`` queued Attempts."""
    commands = container.core.worker_commands()
    session = commands.register(worker_id, capacity=n, tasks=tasks)
    answer = commands.claim(session.session_id, session.secret, limit=n)
    return session, answer.grants


def test_unknown_candidates_do_not_starve_a_resolvable_one(store: PostgresStore) -> None:
    container = cluster.build(store=store, lease_ttl_s=TTL_S)
    admission = container.core.admission()
    admission.submit_many([admission_request("slow") for _ in range(64)])
    (resolvable_run,) = admission.submit_many([admission_request("other")])
    _, slow_offers = _start_all(container, "w-slow", ["slow"], 64)
    grant, other_offers = _start_all(container, "w-other", ["other"], 1)
    assert len(slow_offers) == 64 and len(other_offers) == 1
    container.core.worker_commands().close(grant.session_id, grant.secret)  # evidence
    store.testing_advance_clock(round(TTL_S * 1000) + 1_000)

    report = container.runtime_recovery().run_once(16)

    assert report.examined == 16 and report.has_more
    assert report.recovered == 1
    assert report.recovered_attempt_ids == (other_offers[0].attempt_id,)
    assert report.awaiting_evidence == 15
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(resolvable_run)
        assert run is not None and run.status.value == "lost"


def admission_request(task: str):  # type: ignore[no-untyped-def]
    from ql3.application.admission import AdmissionRequest

    return AdmissionRequest(
        task=task,
        input={"task": task},
        policy=RetryPolicy(retry_on_lost=True, max_attempts=2, safety=Safety.IDEMPOTENT),
    )


def test_lost_retry_fails_closed_at_a_broken_head_candidate(
    store: PostgresStore, pg_database_url: str
) -> None:
    container = cluster.build(store=store, lease_ttl_s=TTL_S)
    admission = container.core.admission()
    first, second = admission.submit_many([admission_request("t"), admission_request("t")])
    grant, offers = _start_all(container, "w-1", ["t"], 2)
    assert len(offers) == 2
    container.core.worker_commands().close(grant.session_id, grant.secret)
    store.testing_advance_clock(round(TTL_S * 1000) + 1_000)
    assert container.runtime_recovery().run_once().recovered == 2
    lost = [c.run_id for c in store.lost_runs(16).items]
    head, tail = lost
    with psycopg.connect(_psycopg_url(pg_database_url), autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION ql3_test_break() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN IF NEW.run_id = '{head}' THEN RAISE EXCEPTION 'broken head'; END IF; "
            "RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER ql3_test_break BEFORE INSERT ON run_events "
            "FOR EACH ROW EXECUTE FUNCTION ql3_test_break()"
        )
        try:
            summary = container.coordinator().run_cycle()
        finally:
            conn.execute("DROP TRIGGER ql3_test_break ON run_events")
            conn.execute("DROP FUNCTION ql3_test_break()")

    assert summary.aborted_at == "lost_retry"
    assert [s.name for s in summary.steps] == ["runtime_recovery", "lost_retry"]
    assert "broken head" in (summary.steps[-1].error or "")
    with store.unit_of_work() as uow:
        for run_id in (head, tail):
            run = uow.runs.get_run(run_id)
            assert run is not None and run.status.value == "lost"  # neither was touched
            assert [e.event.type.value for e in uow.runs.events_of(run_id)][-1] == "attempt_lost"

    healed = container.coordinator().run_cycle()
    assert healed.ok
    step = healed.step("lost_retry")
    assert step is not None and step.counts["retries_scheduled"] == 2
    assert {first, second} == {head, tail}


@pytest.fixture
def empty_database(pg_server: PostgresServer) -> Iterator[str]:
    name = random_name("ql3_cli")
    url = create_database(pg_server, name)
    try:
        yield url
    finally:
        drop_database(pg_server, name)


def _ql3(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ql3_upgrades_submits_ticks_and_shows_on_postgres(
    empty_database: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--database-url", empty_database]
    code, out, err = _ql3(capsys, "db", "upgrade", *url)
    assert code == 0, err
    assert "revision" in out

    code, out, err = _ql3(
        capsys,
        "submit",
        "resize",
        "--input",
        '{"id": 7}',
        "--safety",
        "idempotent",
        "--retry-on-lost",
        "--max-attempts",
        "3",
        "--json",
        *url,
    )
    assert code == 0, err
    run_id = json.loads(out)["run_id"]

    code, out, err = _ql3(capsys, "scheduler", "tick", "--json", *url)
    assert code == 0, err
    tick = json.loads(out)
    assert tick["ok"] is True
    assert [s["name"] for s in tick["steps"]] == [
        "runtime_recovery",
        "lost_retry",
        "trigger_schedule",
        "workflow_frontier",
        "task_attempt_admission",
    ]

    code, out, err = _ql3(capsys, "runs", "show", run_id, "--json", *url)
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["id"], shown["status"], shown["task"]) == (run_id, "queued", "resize")
    assert shown["policy"]["safety"] == "idempotent"
    assert [a["number"] for a in shown["attempts"]] == [1]
    assert shown["attempts"][0]["lease"] is None
    assert [e["type"] for e in shown["events"]] == ["run_admitted"]

    code, out, err = _ql3(capsys, "runs", "list", "--status", "queued", "--json", *url)
    assert code == 0 and [r["id"] for r in json.loads(out)["runs"]] == [run_id]

    code, out, err = _ql3(capsys, "runs", "show", "no-such-run", *url)
    assert code == 1 and err.startswith("ql3: not found") and "Traceback" not in err

    code, out, err = _ql3(capsys, "submit", "bad task ", *url)
    assert code == 2 and "Traceback" not in err
    code, out, err = _ql3(capsys, "runs", "list", "--json", *url)
    assert [r["id"] for r in json.loads(out)["runs"]] == [run_id]  # nothing written
