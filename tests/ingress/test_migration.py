"""Migrations ``0002_ingress``, ``0005_ingress_claim``, ``0010_ingress_outcomes`` and
``0011_claim_priority_limits`` install the ingress functions and their downgrades put back what
was there before; the constants frozen in them are the application's (advisory lock namespace,
notification channel, status and safety sets) and every transition the functions take is an edge
of the domain's state diagrams."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import command
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from ql3.adapters.postgres import queries
from ql3.adapters.postgres.migrate import MIGRATIONS, alembic_config, current_revision, upgrade
from ql3.domain.events import EventType
from ql3.domain.model import AttemptStatus, RunStatus
from ql3.domain.policy import RETRYABLE_SAFETY
from ql3.domain.states import (
    ATTEMPT_EDGES,
    CLAIMABLE_RUN_STATUSES,
    NON_TERMINAL_ATTEMPT_STATUSES,
    RECOVERABLE_RUN_STATUSES,
    RELEASABLE_ATTEMPT_STATUSES,
    RUN_EDGES,
    STARTED_ATTEMPT_STATUSES,
    values,
)
from tests.postgres_server import PostgresServer, create_database, drop_database, random_name

FUNCTIONS = "SELECT count(*) FROM pg_proc WHERE proname LIKE 'ql3\\_ingress\\_%'"
APPLY_ONE = "SELECT prosrc FROM pg_proc WHERE proname = 'ql3_ingress_apply_one'"


def _revision(name: str) -> ModuleType:
    path = MIGRATIONS / "versions" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ql3_test_{name}", Path(path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _downgrade(engine: Engine, revision: str) -> None:
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def test_upgrade_and_downgrade_of_the_ingress_functions(pg_server: PostgresServer) -> None:
    name = random_name("ql3_migrate_")
    url = create_database(pg_server, name)
    engine = create_engine(url, poolclass=NullPool)
    try:
        upgrade(url, "0005_ingress_claim")
        assert current_revision(url) == "0005_ingress_claim"
        with engine.connect() as connection:
            assert connection.execute(text(FUNCTIONS)).scalar_one() == 18
            claim_source = connection.execute(text(APPLY_ONE)).scalar_one()
        assert "attempt_started" in claim_source and "attempt_accepted" not in claim_source
        _downgrade(engine, "0004_dispatch_gate")
        assert current_revision(url) == "0004_dispatch_gate"
        with engine.connect() as connection:
            assert connection.execute(text(FUNCTIONS)).scalar_one() == 15
            source = connection.execute(text(APPLY_ONE)).scalar_one()
        assert "attempt_accepted" in source and "attempt_started" not in source
        upgrade(url, "0005_ingress_claim")  # and up again
        with engine.connect() as connection:
            assert connection.execute(text(APPLY_ONE)).scalar_one() == claim_source
        _downgrade(engine, "0001_initial")
        assert current_revision(url) == "0001_initial"
        with engine.connect() as connection:
            assert connection.execute(text(FUNCTIONS)).scalar_one() == 0
            assert connection.execute(text("SELECT to_regclass('runs')")).scalar() is not None
    finally:
        engine.dispose()
        drop_database(pg_server, name)


def test_frozen_constants_are_the_applications() -> None:
    r0002 = _revision("r0002_ingress_functions")
    r0005 = _revision("r0005_ingress_claim")
    for revision in (r0002, r0005):
        assert revision.ADVISORY_LOCK_NAMESPACE == queries.ADVISORY_LOCK_NAMESPACE
    assert r0005.DISPATCH_CHANNEL == queries.DISPATCH_CHANNEL
    assert values(CLAIMABLE_RUN_STATUSES) == r0005.CLAIMABLE_RUN_STATUSES
    assert values(RECOVERABLE_RUN_STATUSES) == r0005.LOSABLE_RUN_STATUSES
    assert values(NON_TERMINAL_ATTEMPT_STATUSES) == r0005.NON_TERMINAL_ATTEMPT_STATUSES
    assert values(RELEASABLE_ATTEMPT_STATUSES) == r0005.RELEASABLE_ATTEMPT_STATUSES
    assert values(STARTED_ATTEMPT_STATUSES) == r0005.STARTED_ATTEMPT_STATUSES
    # A hand-back takes a Run back to queued from where a recoverable Run may go there.
    handed_back = frozenset(
        status for status in RECOVERABLE_RUN_STATUSES if RunStatus.QUEUED in RUN_EDGES[status]
    )
    assert values(handed_back) == r0005.HANDED_BACK_RUN_STATUSES
    assert {EventType(kind) for kind in r0005.WORKER_EVENTS} == {
        EventType.ATTEMPT_STARTED,
        EventType.ATTEMPT_RELEASED,
        EventType.ATTEMPT_SUCCEEDED,
        EventType.ATTEMPT_FAILED,
        EventType.ATTEMPT_LOST,
        EventType.EVIDENCE_RECORDED,
    }


def test_every_transition_the_functions_take_is_an_edge_of_the_domain() -> None:
    r0005 = _revision("r0005_ingress_claim")
    for kind, (runs_from, run_to, attempts_from, attempt_to) in r0005.WORKER_TRANSITIONS.items():
        for status in runs_from:
            assert RunStatus(run_to) in RUN_EDGES[RunStatus(status)], (kind, status, run_to)
        for status in attempts_from:
            assert AttemptStatus(attempt_to) in ATTEMPT_EDGES[AttemptStatus(status)], (
                kind,
                status,
                attempt_to,
            )


def test_the_outcomes_revision_edits_the_claim_revisions_function(
    pg_server: PostgresServer,
) -> None:
    name = random_name("ql3_migrate_")
    url = create_database(pg_server, name)
    engine = create_engine(url, poolclass=NullPool)
    try:
        upgrade(url, "0009_job_columns")
        with engine.connect() as connection:
            before = connection.execute(text(APPLY_ONE)).scalar_one()
        upgrade(url, "0010_ingress_outcomes")
        with engine.connect() as connection:
            after = connection.execute(text(APPLY_ONE)).scalar_one()
            functions = connection.execute(text(FUNCTIONS)).scalar_one()
        assert "retry_wait" not in before and "retry_wait" in after
        assert "next_attempt_at" in after
        _downgrade(engine, "0009_job_columns")
        with engine.connect() as connection:
            assert connection.execute(text(APPLY_ONE)).scalar_one() == before
            assert connection.execute(text(FUNCTIONS)).scalar_one() == functions
    finally:
        engine.dispose()
        drop_database(pg_server, name)


CLAIM_LOCK = "SELECT prosrc FROM pg_proc WHERE proname = 'ql3_ingress_claim_lock'"
CLAIM_ONE = "SELECT prosrc FROM pg_proc WHERE proname = 'ql3_ingress_claim_one'"
CLAIMABLE_INDEX = "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_runs_claimable'"


def test_upgrade_and_downgrade_of_the_claim_priority_and_limits(pg_server: PostgresServer) -> None:
    name = random_name("ql3_migrate_")
    url = create_database(pg_server, name)
    engine = create_engine(url, poolclass=NullPool)
    try:
        upgrade(url, "0009_job_columns")
        with engine.connect() as connection:
            before = [
                connection.execute(text(query)).scalar_one()
                for query in (CLAIM_LOCK, CLAIM_ONE, CLAIMABLE_INDEX)
            ]
        upgrade(url, "0011_claim_priority_limits")
        with engine.connect() as connection:
            lock, one, index = (
                connection.execute(text(query)).scalar_one()
                for query in (CLAIM_LOCK, CLAIM_ONE, CLAIMABLE_INDEX)
            )
            assert connection.execute(text(FUNCTIONS)).scalar_one() == 18
        assert "task_limits" in lock and "r.priority DESC" in lock
        assert "task_limits" in one and "its limit is" in one
        assert "(task, priority DESC, updated_at, id)" in index
        _downgrade(engine, "0009_job_columns")
        with engine.connect() as connection:
            after = [
                connection.execute(text(query)).scalar_one()
                for query in (CLAIM_LOCK, CLAIM_ONE, CLAIMABLE_INDEX)
            ]
        assert after == before
    finally:
        engine.dispose()
        drop_database(pg_server, name)


def test_the_outcomes_revisions_frozen_lists_are_the_domains() -> None:
    r0010 = _revision("r0010_ingress_outcomes")
    assert values(STARTED_ATTEMPT_STATUSES) == r0010.STARTED_ATTEMPT_STATUSES
    assert tuple(sorted(s.value for s in RETRYABLE_SAFETY)) == r0010.RETRYABLE_SAFETY
    assert {EventType(kind) for kind in r0010.WORKER_TRANSITIONS} <= {
        EventType(kind) for kind in _revision("r0005_ingress_claim").WORKER_EVENTS
    }
    for kind, (runs_from, runs_to, attempts_from, attempt_to) in r0010.WORKER_TRANSITIONS.items():
        for status in runs_from:
            for run_to in runs_to:
                assert RunStatus(run_to) in RUN_EDGES[RunStatus(status)], (kind, status, run_to)
        for status in attempts_from:
            assert AttemptStatus(attempt_to) in ATTEMPT_EDGES[AttemptStatus(status)], (
                kind,
                status,
                attempt_to,
            )
    # the failing completion's event keys are the ones the domain writes
    from ql3.domain.policy import RetryPolicy, Safety
    from ql3.domain.transitions import complete
    from tests.domain.builders import running

    keys: set[str] = set()
    retrying = RetryPolicy(retry_on_error=True, max_attempts=2, safety=Safety.IDEMPOTENT)
    for policy in (None, retrying):
        run, attempt, lease, fence = running(policy=policy)
        change = complete(run=run, attempt=attempt, lease=lease, fence=fence, succeeded=False,
                          output=None, error="boom", now_ms=lease.granted_at_ms + 1)
        keys |= set(change.event.data)
    assert keys == set(r0010.FAILED_EVENT_KEYS)


def test_the_constants_frozen_in_0011_are_the_applications() -> None:
    r0011 = _revision("r0011_claim_priority_limits")
    r0005 = _revision("r0005_ingress_claim")
    assert r0011.ADVISORY_LOCK_NAMESPACE == queries.ADVISORY_LOCK_NAMESPACE
    assert values(CLAIMABLE_RUN_STATUSES) == r0011.CLAIMABLE_RUN_STATUSES
    assert (r0011.MAX_BATCH_ITEMS, r0011.CLAIM_PAGE_SLACK) == (
        r0005.MAX_BATCH_ITEMS,
        r0005.CLAIM_PAGE_SLACK,
    )
    # The check is inserted into 0005's claim function exactly once.
    assert r0011.claim_one_sql(r0005).count("its limit is") == 1
