"""The ingress role's privileges: the whole grant set pinned, direct writes refused, the grant
repaired when it drifted, unfit roles refused, the password stored as a SCRAM verifier, and the
``ql3 db grant-ingress`` command."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from ql3.adapters.cli.main import main
from ql3.adapters.postgres.grants import (
    IngressGrantRefused,
    IngressSchemaMissing,
    grant_ingress,
    scram_verifier,
)
from tests.ingress.support import drop_role, unique_role
from tests.postgres_server import (
    PostgresServer,
    connect,
    create_database,
    drop_database,
    random_name,
)

INGRESS_TABLES = {"runs", "run_attempts", "run_dispatch_leases", "worker_sessions", "dispatch_gate"}
# The entry points that write or lock rows run as the schema's owner; the batch read of Attempts
# under their advisory locks runs as the caller (it can do nothing the role cannot).
DEFINER_FUNCTIONS = {
    "ql3_ingress_register_sessions(jsonb)",
    "ql3_ingress_update_sessions(jsonb)",
    "ql3_ingress_apply(jsonb)",
    "ql3_ingress_renew(jsonb)",
    "ql3_ingress_claim_lock(text,text,text[],integer)",
}
INVOKER_FUNCTIONS = {"ql3_ingress_lock_attempts(text[],boolean)"}
INGRESS_FUNCTIONS = DEFINER_FUNCTIONS | INVOKER_FUNCTIONS
INGRESS_HELPERS = 12  # not executable but by their owner

TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
COLUMN_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "REFERENCES")
WRITTEN_ONLY_THROUGH_FUNCTIONS = (
    "runs",
    "run_attempts",
    "run_dispatch_leases",
    "worker_sessions",
    "dispatch_gate",
    "run_events",
    "attempt_stop_reports",
)

# Every privilege granted to the role itself, anywhere in the database or the cluster's roles:
# (kind of object, object, privilege). A new grant must change this set.
GRANTS_QUERY = """
WITH me AS (SELECT oid FROM pg_roles WHERE rolname = :role)
SELECT 'database', d.datname::text, a.privilege_type
  FROM pg_database d, aclexplode(d.datacl) a, me
 WHERE a.grantee = me.oid AND d.datname = current_database()
UNION ALL
SELECT 'schema', n.nspname::text, a.privilege_type
  FROM pg_namespace n, aclexplode(n.nspacl) a, me WHERE a.grantee = me.oid
UNION ALL
SELECT 'relation', c.relname::text, a.privilege_type
  FROM pg_class c, aclexplode(c.relacl) a, me WHERE a.grantee = me.oid
UNION ALL
SELECT 'column', c.relname || '.' || t.attname, a.privilege_type
  FROM pg_attribute t JOIN pg_class c ON c.oid = t.attrelid, aclexplode(t.attacl) a, me
 WHERE a.grantee = me.oid
UNION ALL
SELECT 'function', p.oid::regprocedure::text, a.privilege_type
  FROM pg_proc p, aclexplode(p.proacl) a, me WHERE a.grantee = me.oid
UNION ALL
SELECT 'type', y.typname::text, a.privilege_type
  FROM pg_type y, aclexplode(y.typacl) a, me WHERE a.grantee = me.oid
UNION ALL
SELECT 'default', d.defaclobjtype::text, a.privilege_type
  FROM pg_default_acl d, aclexplode(d.defaclacl) a, me WHERE a.grantee = me.oid
UNION ALL
SELECT 'member of', m.roleid::regrole::text, 'MEMBER'
  FROM pg_auth_members m, me WHERE m.member = me.oid
"""


def granted(engine: Engine, role: str) -> set[tuple[str, str, str]]:
    with engine.connect() as connection:
        found = connection.execute(text(GRANTS_QUERY), {"role": role}).all()
    return {(str(kind), str(name), str(privilege)) for kind, name, privilege in found}


def expected_grants(database: str) -> set[tuple[str, str, str]]:
    return {
        ("database", database, "CONNECT"),
        ("schema", "public", "USAGE"),
        *{("relation", table, "SELECT") for table in INGRESS_TABLES},
        *{("function", function, "EXECUTE") for function in INGRESS_FUNCTIONS},
    }


def database_of(engine: Engine) -> str:
    with engine.connect() as connection:
        return str(connection.execute(text("SELECT current_database()")).scalar_one())


@pytest.fixture(scope="module")
def as_ingress(ingress_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection as the ingress role."""
    with connect(ingress_url) as connection:
        yield connection


# --- the grant set ------------------------------------------------------------------------------


def test_the_role_holds_exactly_the_ingress_grants(admin_engine: Engine, ingress_role: str) -> None:
    assert granted(admin_engine, ingress_role) == expected_grants(database_of(admin_engine))


def test_effective_privilege_matrix(admin_engine: Engine, ingress_role: str) -> None:
    """What the role can do, PUBLIC's defaults included, on every object of the schema."""
    params = {"role": ingress_role}
    with admin_engine.connect() as connection:
        relations = connection.execute(
            text(
                "SELECT c.oid, c.relname, c.relkind FROM pg_class c"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')"
            )
        ).all()
        tables = {(oid, name) for oid, name, kind in relations if kind != "S"}
        assert {name for _, name in tables} >= set(WRITTEN_ONLY_THROUGH_FUNCTIONS)
        table_matrix = {
            (name, privilege)
            for oid, name in tables
            for privilege in TABLE_PRIVILEGES
            if connection.execute(
                text("SELECT has_table_privilege(:role, :oid, :privilege)"),
                {**params, "oid": oid, "privilege": privilege},
            ).scalar_one()
        }
        columns = connection.execute(
            text(
                "SELECT c.relname, a.attname FROM pg_attribute a"
                " JOIN pg_class c ON c.oid = a.attrelid"
                " JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f')"
                " AND a.attnum > 0 AND NOT a.attisdropped"
            )
        ).all()
        column_matrix = {
            (table, column, privilege)
            for table, column in columns
            for privilege in COLUMN_PRIVILEGES
            if connection.execute(
                text("SELECT has_column_privilege(:role, :table, :column, :privilege)"),
                {**params, "table": f"public.{table}", "column": column, "privilege": privilege},
            ).scalar_one()
        }
        sequence_matrix = {
            (name, privilege)
            for oid, name, kind in relations
            if kind == "S"
            for privilege in ("USAGE", "SELECT", "UPDATE")
            if connection.execute(
                text("SELECT has_sequence_privilege(:role, :oid, :privilege)"),
                {**params, "oid": oid, "privilege": privilege},
            ).scalar_one()
        }
        executable = set(
            connection.execute(
                text(
                    "SELECT p.oid::regprocedure::text FROM pg_proc p"
                    " JOIN pg_namespace n ON n.oid = p.pronamespace"
                    " WHERE n.nspname = 'public'"
                    " AND has_function_privilege(:role, p.oid, 'EXECUTE')"
                ),
                params,
            ).scalars()
        )
        ingress_helpers = set(
            connection.execute(
                text(
                    "SELECT oid::regprocedure::text FROM pg_proc"
                    " WHERE proname LIKE 'ql3\\_ingress\\_%'"
                )
            ).scalars()
        )
        schema = connection.execute(
            text(
                "SELECT has_schema_privilege(:role, 'public', 'USAGE'),"
                " has_schema_privilege(:role, 'public', 'CREATE')"
            ),
            params,
        ).one()
        database = connection.execute(
            text(
                "SELECT has_database_privilege(:role, current_database(), 'CONNECT'),"
                " has_database_privilege(:role, current_database(), 'CREATE'),"
                " has_database_privilege(:role, current_database(), 'TEMPORARY')"
            ),
            params,
        ).one()
        names = [column for table, column in columns if table in INGRESS_TABLES]
    assert table_matrix == {(table, "SELECT") for table in INGRESS_TABLES}
    assert column_matrix == {
        (table, column, "SELECT") for table, column in columns if table in INGRESS_TABLES
    }
    assert "secret_hash" in names and "token_hash" in names  # read to authenticate in Python
    assert sequence_matrix == set()
    assert executable == INGRESS_FUNCTIONS
    assert len(ingress_helpers - INGRESS_FUNCTIONS) == INGRESS_HELPERS  # none executable
    assert tuple(schema) == (True, False)
    # TEMPORARY is PostgreSQL's default for PUBLIC, not a grant of ours.
    assert tuple(database) == (True, False, True)


def test_role_attributes_and_memberships(admin_engine: Engine, ingress_role: str) -> None:
    with admin_engine.connect() as connection:
        attributes = connection.execute(
            text(
                "SELECT rolcanlogin, rolinherit, rolsuper, rolcreatedb, rolcreaterole,"
                " rolreplication, rolbypassrls FROM pg_roles WHERE rolname = :role"
            ),
            {"role": ingress_role},
        ).one()
    assert tuple(attributes) == (True, False, False, False, False, False, False)


def test_entry_points_are_security_definer_with_a_pinned_search_path(
    admin_engine: Engine,
) -> None:
    with admin_engine.connect() as connection:
        found = connection.execute(
            text(
                "SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig,"
                " p.proowner = (SELECT relowner FROM pg_class WHERE oid = 'runs'::regclass),"
                " has_function_privilege('public', p.oid, 'EXECUTE')"
                " FROM pg_proc p WHERE p.proname LIKE 'ql3\\_ingress\\_%'"
            )
        ).all()
    assert len(found) == len(INGRESS_FUNCTIONS) + INGRESS_HELPERS
    assert {signature for signature, *_ in found} >= INGRESS_FUNCTIONS
    for signature, definer, config, owned_by_schema_owner, public_may_execute in found:
        assert definer is (signature in DEFINER_FUNCTIONS), signature
        assert config == ["search_path=pg_catalog, public, pg_temp"], signature
        assert owned_by_schema_owner, signature
        assert not public_may_execute, signature


# --- direct access as the role ------------------------------------------------------------------


@pytest.mark.parametrize("table", WRITTEN_ONLY_THROUGH_FUNCTIONS)
@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO {table} DEFAULT VALUES",
        "UPDATE {table} SET {column} = {column} WHERE false",
        "DELETE FROM {table} WHERE false",
        "TRUNCATE {table}",
    ],
)
def test_direct_writes_are_refused(
    as_ingress: psycopg.Connection[tuple[object, ...]], table: str, statement: str
) -> None:
    column = "attempt_id" if table == "attempt_stop_reports" else "id"
    if table == "run_dispatch_leases":
        column = "version"
    with pytest.raises(errors.InsufficientPrivilege):
        as_ingress.execute(statement.format(table=table, column=column))


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT * FROM run_events",
        "SELECT * FROM attempt_stop_reports",
        "SELECT id FROM runs FOR UPDATE",
        "SELECT run_id FROM run_dispatch_leases FOR SHARE",
        "CREATE TABLE public.stash (x int)",
        "SELECT * FROM dispatch_gate FOR UPDATE",
        "SELECT ql3_ingress_apply_one('{}'::jsonb)",
        "SELECT ql3_ingress_claim_one('{}'::jsonb, NULL::runs, NULL::run_attempts)",
        "SELECT ql3_ingress_refuse('x')",
        "SELECT nextval(pg_get_serial_sequence('run_events', 'id'))",
    ],
)
def test_reads_and_calls_beyond_the_grant_are_refused(
    as_ingress: psycopg.Connection[tuple[object, ...]], statement: str
) -> None:
    with pytest.raises(errors.InsufficientPrivilege):
        as_ingress.execute(statement)


def test_the_granted_reads_work(as_ingress: psycopg.Connection[tuple[object, ...]]) -> None:
    for table in sorted(INGRESS_TABLES):
        assert as_ingress.execute(f"SELECT count(*) FROM {table}").fetchone() is not None


# --- grant_ingress: repair, refusals, password ----------------------------------------------------


@pytest.fixture
def spare_role(pg_database_url: str) -> Iterator[str]:
    role = unique_role()
    try:
        yield role
    finally:
        drop_role(pg_database_url, role)


def test_granting_again_repairs_a_role_that_drifted(admin_engine: Engine, spare_role: str) -> None:
    first = grant_ingress(admin_engine, spare_role)
    assert first.created
    with admin_engine.begin() as connection:
        for statement in (
            "GRANT INSERT, UPDATE ON runs TO {r}",
            "GRANT UPDATE (status) ON run_attempts TO {r}",
            "GRANT SELECT ON run_events TO {r}",
            "GRANT EXECUTE ON FUNCTION ql3_ingress_apply_one(jsonb) TO {r}",
            "GRANT EXECUTE ON FUNCTION ql3_ingress_claim_one(jsonb, runs, run_attempts) TO {r}",
            "GRANT UPDATE (open) ON dispatch_gate TO {r}",
            "REVOKE SELECT ON dispatch_gate FROM {r}",
            "REVOKE EXECUTE ON FUNCTION ql3_ingress_claim_lock(text, text, text[], integer)"
            " FROM {r}",
            "GRANT CREATE ON SCHEMA public TO {r}",
            "GRANT pg_read_all_data TO {r}",
            "ALTER ROLE {r} INHERIT CREATEDB NOLOGIN",
        ):
            connection.execute(text(statement.format(r=spare_role)))
    assert granted(admin_engine, spare_role) != expected_grants(database_of(admin_engine))
    again = grant_ingress(admin_engine, spare_role)
    assert not again.created
    assert granted(admin_engine, spare_role) == expected_grants(database_of(admin_engine))
    with admin_engine.connect() as connection:
        attributes = connection.execute(
            text("SELECT rolcanlogin, rolinherit, rolcreatedb FROM pg_roles WHERE rolname = :r"),
            {"r": spare_role},
        ).one()
    assert tuple(attributes) == (True, False, False)


def test_unfit_roles_are_refused_and_nothing_changes(admin_engine: Engine, spare_role: str) -> None:
    with admin_engine.connect() as connection:
        me = str(connection.execute(text("SELECT current_user")).scalar_one())
    with pytest.raises(IngressGrantRefused, match="running this command"):
        grant_ingress(admin_engine, me)
    for bad in ("Bad-Name", "", "x" * 64, "a b", 'q"uote'):
        with pytest.raises(IngressGrantRefused, match="lower-case identifier"):
            grant_ingress(admin_engine, bad)
    for reserved in ("pg_ingress", "public"):
        with pytest.raises(IngressGrantRefused, match="reserved"):
            grant_ingress(admin_engine, reserved)
    with admin_engine.begin() as connection:
        connection.execute(text(f"CREATE ROLE {spare_role} NOLOGIN"))
        connection.execute(text(f"CREATE SCHEMA {spare_role}_owned AUTHORIZATION {spare_role}"))
    before = granted(admin_engine, spare_role)
    try:
        with pytest.raises(IngressGrantRefused, match="owns database objects"):
            grant_ingress(admin_engine, spare_role, "a-good-password")
        assert granted(admin_engine, spare_role) == before
        with admin_engine.connect() as connection:
            login = connection.execute(
                text("SELECT rolcanlogin FROM pg_roles WHERE rolname = :r"), {"r": spare_role}
            ).scalar_one()
        assert login is False  # nothing written: the role was not touched
    finally:
        with admin_engine.begin() as connection:
            connection.execute(text(f"DROP SCHEMA {spare_role}_owned"))


def test_a_database_without_the_ingress_functions_is_refused(
    pg_server: PostgresServer, spare_role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    name = random_name("ql3_empty_")
    url = create_database(pg_server, name)
    try:
        engine = create_engine(url, poolclass=NullPool)
        try:
            with pytest.raises(IngressSchemaMissing, match="ql3 db upgrade"):
                grant_ingress(engine, spare_role)
        finally:
            engine.dispose()
        assert main(["db", "grant-ingress", spare_role, "--database-url", url]) == 1
        err = capsys.readouterr().err
        assert err == "ql3: no QL3 schema here: run `ql3 db upgrade` first\n"
    finally:
        drop_database(pg_server, name)
    with connect(pg_server.admin_url) as conn:
        assert (
            conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (spare_role,)).fetchone()
            is None
        )


def _verifies(verifier: str, password: str) -> bool:
    """Check a stored SCRAM-SHA-256 verifier against a password, as the server does."""
    method, rest = verifier.split("$", 1)
    head, keys = rest.split("$", 1)
    iterations, salt = head.split(":", 1)
    stored_key, server_key = keys.split(":", 1)
    salted = hashlib.pbkdf2_hmac(
        "sha256", password.encode(), base64.b64decode(salt), int(iterations)
    )
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    return (
        method == "SCRAM-SHA-256"
        and base64.b64decode(stored_key) == hashlib.sha256(client_key).digest()
        and base64.b64decode(server_key) == hmac.new(salted, b"Server Key", "sha256").digest()
    )


def test_the_password_is_stored_as_a_scram_verifier(admin_engine: Engine, spare_role: str) -> None:
    grant = grant_ingress(admin_engine, spare_role, "correct horse battery")
    assert grant.password_set
    with admin_engine.connect() as connection:
        stored = connection.execute(
            text("SELECT rolpassword FROM pg_authid WHERE rolname = :r"), {"r": spare_role}
        ).scalar_one()
    assert _verifies(stored, "correct horse battery")
    assert not _verifies(stored, "wrong horse battery")
    # Granting again without a password keeps it.
    grant_ingress(admin_engine, spare_role)
    with admin_engine.connect() as connection:
        assert (
            connection.execute(
                text("SELECT rolpassword FROM pg_authid WHERE rolname = :r"), {"r": spare_role}
            ).scalar_one()
            == stored
        )
    with pytest.raises(IngressGrantRefused):
        scram_verifier("naïve")


# --- the command line --------------------------------------------------------------------------


def test_ql3_db_grant_ingress(
    admin_engine: Engine,
    pg_database_url: str,
    spare_role: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("QL3_INGRESS_PASSWORD", raising=False)
    argv = ["db", "grant-ingress", spare_role, "--database-url", pg_database_url]
    assert main([*argv, "--password-env", "QL3_INGRESS_PASSWORD"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "QL3_INGRESS_PASSWORD" in err
    assert granted(admin_engine, spare_role) == set()  # nothing written

    monkeypatch.setenv("QL3_INGRESS_PASSWORD", "s3cret-pass")
    assert main([*argv, "--password-env", "QL3_INGRESS_PASSWORD"]) == 0
    out = capsys.readouterr().out
    assert f"ingress role {spare_role} created with a new password" in out
    assert "s3cret-pass" not in out
    assert granted(admin_engine, spare_role) == expected_grants(database_of(admin_engine))

    assert main(argv) == 0
    assert f"ingress role {spare_role} updated:" in capsys.readouterr().out

    assert main(["db", "grant-ingress", "Bad-Name", "--database-url", pg_database_url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lower-case identifier" in err and "Traceback" not in err
    assert main(["db", "grant-ingress", "x", "--database-url", "sqlite:////tmp/ql3.db"]) == 2
    assert "for PostgreSQL" in capsys.readouterr().err
