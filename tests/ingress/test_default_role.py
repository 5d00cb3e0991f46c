"""Least privilege at the defaults (ADR 0024): ``ql3 db upgrade`` makes a NOLOGIN ingress role with
exactly the ingress's grants, and a node given no ingress URL runs its ingress pool as that role
on its own URL: its sessions cannot write a table, while claims and completions work through the
fenced functions."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import ProgrammingError

from ql3.adapters.postgres.grants import (
    DEFAULT_INGRESS_ROLE,
    INGRESS_FUNCTIONS,
    INGRESS_TABLES,
    grant_default_ingress,
)
from ql3.adapters.postgres.ingress import PostgresIngressStore
from ql3.adapters.postgres.migrate import upgrade
from ql3.adapters.postgres.store import PostgresStore
from ql3.adapters.sql.schema import ALL_TABLES
from ql3.application.worker_commands import Completion
from ql3.bootstrap import node
from tests.ingress.support import build_env, register
from tests.postgres_server import connect

pytestmark = pytest.mark.postgres


@pytest.fixture
def default_ingress(pg_database_url: str) -> Iterator[PostgresIngressStore]:
    """The ingress store of a node at its defaults: no ingress URL."""
    store = node.open_ingress_store(pg_database_url, None, 2)
    try:
        yield store
    finally:
        store.close()


def test_upgrade_makes_a_nologin_role_with_exactly_the_ingress_grants(
    pg_database_url: str,
) -> None:
    upgrade(pg_database_url)  # again: the role is brought back, not duplicated
    with connect(pg_database_url) as conn:
        login, inherit, superuser = conn.execute(
            "SELECT rolcanlogin, rolinherit, rolsuper FROM pg_roles WHERE rolname = %s",
            (DEFAULT_INGRESS_ROLE,),
        ).fetchone()
        assert (login, inherit, superuser) == (False, False, False)
        for table in ALL_TABLES:
            for privilege in ("INSERT", "UPDATE", "DELETE", "TRUNCATE"):
                allowed = conn.execute(
                    "SELECT has_table_privilege(%s, %s, %s)",
                    (DEFAULT_INGRESS_ROLE, table.name, privilege),
                ).fetchone()[0]
                assert not allowed, (table.name, privilege)
            readable = conn.execute(
                "SELECT has_table_privilege(%s, %s, 'SELECT')", (DEFAULT_INGRESS_ROLE, table.name)
            ).fetchone()[0]
            assert readable == (table.name in INGRESS_TABLES), table.name
        for signature in INGRESS_FUNCTIONS:
            executable = conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE')",
                (DEFAULT_INGRESS_ROLE, signature),
            ).fetchone()[0]
            assert executable, signature


def test_a_grant_given_by_hand_is_taken_back(pg_database_url: str) -> None:
    with connect(pg_database_url) as conn:
        conn.execute(f"GRANT UPDATE ON runs TO {DEFAULT_INGRESS_ROLE}")
    store = PostgresStore.from_url(pg_database_url, pool_size=1)
    try:
        grant_default_ingress(store.engine)
    finally:
        store.close()
    with connect(pg_database_url) as conn:
        assert not conn.execute(
            "SELECT has_table_privilege(%s, 'runs', 'UPDATE')", (DEFAULT_INGRESS_ROLE,)
        ).fetchone()[0]


def test_the_default_ingress_pool_cannot_write_a_table_but_claims_and_completes(
    pg_database_url: str, default_ingress: PostgresIngressStore
) -> None:
    assert default_ingress.acting_role() == DEFAULT_INGRESS_ROLE
    with default_ingress.engine.connect() as connection:
        for statement in (
            "UPDATE runs SET status = 'failed'",
            "DELETE FROM run_dispatch_leases",
            "INSERT INTO run_events (run_id, type, at, data) VALUES ('x', 'y', now(), '{}')",
            "SELECT * FROM worker_credentials",
        ):
            with pytest.raises(ProgrammingError) as refused:
                connection.execute(text(statement))
            assert isinstance(refused.value.orig, psycopg.errors.InsufficientPrivilege)
            connection.rollback()
            # a rolled-back transaction keeps the role
            assert connection.execute(text("SELECT current_user")).scalar() == DEFAULT_INGRESS_ROLE

    admin = PostgresStore.from_url(pg_database_url, pool_size=2)
    try:
        env = build_env(admin, default_ingress)
        run_id = env.admission.submit("t", {"n": 1})
        worker = register(env)
        answer = worker.claim(1)
        assert [grant.run_id for grant in answer.grants] == [run_id]
        fence = answer.grants[0].fence
        done = worker.claim(1, completions=[Completion(fence=fence, succeeded=True, output=7)])
        assert [result.outcome.value for result in done.completed] == ["succeeded"]
        with admin.unit_of_work() as uow:
            run = uow.runs.lock_run(run_id)
            assert run is not None and run.run.status.value == "succeeded"
            assert run.run.output == 7
    finally:
        admin.close()


def test_a_node_at_its_defaults_serves_its_ingress_as_the_default_role(
    pg_database_url: str,
) -> None:
    container = node.build(database_url=pg_database_url)
    try:
        ingress = container.ingress_store()
        assert isinstance(ingress, PostgresIngressStore)
        assert ingress.acting_role() == DEFAULT_INGRESS_ROLE
    finally:
        node.close_stores(container)


def test_an_upgrade_by_a_role_that_cannot_grant_the_role_says_so(pg_database_url: str) -> None:
    import subprocess
    import sys

    from sqlalchemy.engine import make_url

    from tests.ingress.support import drop_role, unique_role

    owner = unique_role()
    database = f"{owner}_db"
    admin = make_url(pg_database_url)
    with connect(pg_database_url) as conn:
        conn.execute(f"CREATE ROLE {owner} LOGIN NOCREATEROLE")
    with connect(pg_database_url) as conn:
        conn.execute(f"CREATE DATABASE {database} OWNER {owner}")
    url = admin.set(username=owner, database=database).render_as_string(hide_password=False)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "ql3", "db", "upgrade", "--database-url", url],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert done.returncode == 1, done.stderr
        err = done.stderr.splitlines()[-1]
        assert err.startswith("ql3: database at revision "), done.stderr
        assert "Traceback" not in done.stderr
        assert f"the default ingress role {DEFAULT_INGRESS_ROLE} could not be made" in err
    finally:
        with connect(pg_database_url) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        drop_role(pg_database_url, owner)
