"""The database functions have one current text (ADR 0022): ``adapters/postgres/sql/functions.sql``
is what :mod:`ql3.adapters.postgres.functions` renders from the domain's data, and a migrated
database holds exactly the functions that file defines. A change to a guard (in the template or
in the domain's data) fails here until the file is regenerated
(``python -m ql3.adapters.postgres.functions > adapters/postgres/sql/functions.sql``) and a new
migration carries it."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.pool import NullPool

from ql3.adapters.postgres import functions
from ql3.adapters.sql import schema
from ql3.domain.model import TERMINAL_RUN_STATUSES, AttemptStatus, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from ql3.domain.states import ATTEMPT_EDGES, RUN_EDGES, values
from ql3.domain.transitions import complete
from tests.domain.builders import running

FILE_SCHEMA = "ql3_functions_file"
DEFINITIONS = r"""
SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS arguments,
       pg_get_functiondef(p.oid) AS definition,
       -- the migrations' own privileges: not those that grant_ingress gives the ingress roles
       -- (the default role of ql3 db upgrade, the tests' login roles)
       coalesce((SELECT string_agg(entry::text, ',' ORDER BY entry::text)
                 FROM unnest(p.proacl) AS entry
                 WHERE entry::text NOT LIKE 'ql3\_ingress%'), '') AS acl
FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
WHERE n.nspname = :schema ORDER BY 1, 2
"""


@pytest.fixture(scope="module")
def engine(pg_database_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_database_url, poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


def test_the_checked_in_file_is_what_the_renderer_renders() -> None:
    regenerate = (
        "python -m ql3.adapters.postgres.functions > adapters/postgres/sql/functions.sql"
    )
    assert functions.RENDERED.read_text(encoding="utf-8") == functions.render(), regenerate


def test_no_placeholder_is_left_and_every_rule_is_rendered_from_the_domain() -> None:
    rendered = functions.render()
    assert "{{" not in rendered and "}}" not in rendered
    assert functions.claimable_run("r") in rendered
    assert functions.pristine_attempt("a") in rendered
    assert functions.lease_expired("v_lease") in rendered
    assert functions.retries_on_error("v_run", "v_attempt") in rendered


def test_a_change_to_the_domains_data_changes_the_rendered_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = functions.render()
    monkeypatch.setattr(schema, "RETRYABLE_SAFETY", frozenset(Safety))
    after = functions.render()
    assert after != before
    assert "v_run.safety IN ('idempotent', 'deduplicated', 'unsafe')" in after


def _definitions(
    connection: Connection, schema_name: str
) -> dict[tuple[str, str], tuple[str, str]]:
    found = connection.execute(text(DEFINITIONS), {"schema": schema_name}).all()
    return {
        (row.proname, row.arguments): (
            row.definition.replace(f"{schema_name}.", "public.").replace(
                f"'{schema_name}'", "'public'"
            ),
            row.acl,
        )
        for row in found
    }


def test_every_function_of_the_migrated_database_is_the_files(engine: Engine) -> None:
    """The file, run into a schema of its own, defines the very functions the migrations left
    in ``public``: the same definitions as PostgreSQL prints them (but for the schema's name)
    and the same privileges. The migrated ones are the baseline's frozen copy and any later
    revision's: a function changed in the file and not by a migration differs here."""
    with engine.begin() as connection:
        connection.execute(text(f"DROP SCHEMA IF EXISTS {FILE_SCHEMA} CASCADE"))
        connection.execute(text(f"CREATE SCHEMA {FILE_SCHEMA}"))
        connection.execute(text(f"SET LOCAL search_path = {FILE_SCHEMA}, public"))
        # The bodies name the tables, which are not in the file's schema: not compiled here.
        connection.execute(text("SET LOCAL check_function_bodies = off"))
        rendered = functions.RENDERED.read_text(encoding="utf-8")
        connection.execute(text(functions.bind_schema(rendered, FILE_SCHEMA)))
    try:
        with engine.connect() as connection:
            connection.execute(text("SET search_path = public"))
            migrated = _definitions(connection, "public")
            from_file = _definitions(connection, FILE_SCHEMA)
    finally:
        with engine.begin() as connection:
            connection.execute(text(f"DROP SCHEMA {FILE_SCHEMA} CASCADE"))
    assert len(from_file) == len(functions.signatures(rendered)) == 19
    assert sorted(migrated) == sorted(from_file)
    for key, definition in from_file.items():
        assert migrated[key] == definition, key


def test_the_entry_points_pin_their_search_path_to_the_tables_schema(engine: Engine) -> None:
    with engine.connect() as connection:
        configs = connection.execute(
            text(
                "SELECT DISTINCT array_to_string(proconfig, ',') FROM pg_proc"
                " WHERE proname LIKE 'ql3\\_ingress\\_%'"
            )
        ).scalars()
        assert list(configs) == ["search_path=pg_catalog, public, pg_temp"]


def test_the_finished_trigger_names_the_domains_terminal_statuses(engine: Engine) -> None:
    with engine.connect() as connection:
        trigger = connection.execute(
            text(
                "SELECT pg_get_triggerdef(oid) FROM pg_trigger"
                " WHERE tgname = 'runs_finished_notify'"
            )
        ).scalar_one()
    (written,) = {
        frozenset(re.findall(r"'(\w+)'::text", part)) for part in trigger.split(" AND ")
    }
    assert sorted(written) == list(values(TERMINAL_RUN_STATUSES))


def test_every_transition_the_functions_take_is_an_edge_of_the_domain() -> None:
    """The status sets the functions check a transition's starting point against, each with
    where the transition goes: every pair is an edge of the domain's diagrams."""
    runs = {
        "claim": (functions.SETS["CLAIMABLE_RUN_STATUSES"], (RunStatus.RUNNING,)),
        "hand-back": (functions.SETS["HANDED_BACK_RUN_STATUSES"], (RunStatus.QUEUED,)),
        "abandon": (functions.SETS["RECOVERABLE_RUN_STATUSES"], (RunStatus.LOST,)),
    }
    attempts = {
        "hand-back": (functions.SETS["RELEASABLE_ATTEMPT_STATUSES"], AttemptStatus.CLAIMED),
        "abandon": (functions.SETS["NON_TERMINAL_ATTEMPT_STATUSES"], AttemptStatus.LOST),
        "succeed": (functions.SETS["STARTED_ATTEMPT_STATUSES"], AttemptStatus.SUCCEEDED),
        "fail": (functions.SETS["STARTED_ATTEMPT_STATUSES"], AttemptStatus.FAILED),
    }
    for kind, (run_from, run_to) in runs.items():
        assert run_from, kind
        for status in run_from:
            for to in run_to:
                assert to in RUN_EDGES[status], (kind, status, to)  # type: ignore[index]
    for kind, (attempt_from, attempt_to) in attempts.items():
        assert attempt_from, kind
        for status in attempt_from:
            assert attempt_to in ATTEMPT_EDGES[status], (kind, status)  # type: ignore[index]
    for status in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.RETRY_WAIT):
        assert status in RUN_EDGES[RunStatus.RUNNING]


def test_a_failures_event_keys_are_the_ones_the_domain_writes() -> None:
    keys: set[str] = set()
    retrying = RetryPolicy(
        retry_on_error=True,
        max_attempts=2,
        safety=Safety.IDEMPOTENT,
        backoff=Backoff(initial_ms=1, multiplier=1.0, cap_ms=1),
    )
    for policy in (None, retrying):
        run, attempt, lease, fence = running(policy=policy)
        change = complete(
            run=run,
            attempt=attempt,
            lease=lease,
            fence=fence,
            succeeded=False,
            output=None,
            error="boom",
            now_ms=lease.granted_at_ms + 1,
        )
        keys |= set(change.event.data)
    (allowed,) = re.findall(
        r"IF v_end = 'failed' THEN\n\s*PERFORM ql3_ingress_only\(v_event->'data', ARRAY\[([^]]*)\]",
        functions.render(),
    )
    assert keys == set(re.findall(r"'(\w+)'", allowed))
