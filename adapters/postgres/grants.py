"""The worker ingress's database role: created or brought back to exactly its privileges.

:func:`grant_ingress` makes ``role`` a login role (``ql3 db grant-ingress``; or, for the default
role, a NOLOGIN one) that inherits nothing and has no attribute beyond LOGIN, takes it out of
every role it was a member of, revokes every privilege it holds in this database, then grants
exactly:

- ``CONNECT`` on the database and ``USAGE`` on the schema of the QL3 tables;
- ``SELECT`` on ``runs``, ``run_attempts``, ``run_dispatch_leases``, ``worker_sessions`` and
  ``dispatch_gate`` (what :class:`~ql3.adapters.postgres.ingress.PostgresIngressStore` reads: a
  session and the leases it holds, the Run, Attempt and lease a worker command decides on, and
  whether claims may grant);
- ``EXECUTE`` on the entry points of migrations ``0002_ingress`` and ``0005_ingress_claim``:
  the four fenced write functions (its only way to write), the claim's locks
  (``ql3_ingress_claim_lock``, ``SECURITY DEFINER``: row locks need a privilege the role does not
  have) and the batch read of Attempts under their advisory locks
  (``ql3_ingress_lock_attempts``, ``SECURITY INVOKER``: it can do nothing the role cannot).

Nothing on ``run_events`` or ``attempt_stop_reports``, no INSERT, UPDATE, DELETE, TRUNCATE,
REFERENCES or TRIGGER anywhere, no sequence, no other function of the schema. Privileges that
PostgreSQL gives PUBLIC by default still apply to every role (``TEMPORARY`` on the database, for
one); the functions pin their ``search_path`` with ``pg_temp`` last, so temporary objects cannot
stand in for theirs.

What this holds against a compromised ingress: it can perform only a worker's transitions, each
under the fence that transition requires (the lease of that generation, version and token hash,
held by the session whose secret hash it presents, and live, except that a hand-back gives an
expired lease up too and the worker's abandon report is recorded only once it expired), with
times of "now" and lease extensions of at most a day. A claim takes only the pristine Attempt of
a ``queued`` Run of a task the active session serves, while the dispatch gate is open and within
the session's capacity. It cannot admit, cancel, recover, retry, attest, delete or rewrite
history, and it cannot write a column a worker's transition does not change. The secret
and token hash columns are readable (the Python domain authenticates against them, as on the
runtime's own store), so such an ingress could act for any worker whose session and lease are
live; it sees those workers' secrets and tokens in flight anyway.

**The default role** (ADR 0024). ``ql3 db upgrade`` ends with :func:`grant_default_ingress`:
the NOLOGIN role :data:`DEFAULT_INGRESS_ROLE` with exactly these grants, granted to the role
that runs the upgrade (on PostgreSQL 16 and later with ``INHERIT FALSE``, so membership lends
nothing but the right to ``SET ROLE``). A node given no ``--ingress-database-url`` sets that
role on every connection of its ingress pool, so the ingress holds the same privileges at its
defaults as with a login role of its own.

The role and its grants are written in one transaction: a refusal changes nothing. A role that
is a superuser, is the current user or owns any object is refused: it could not be kept to these
privileges. A password is sent as a SCRAM-SHA-256 verifier computed here, so the server (and its
statement log) never sees it in clear; without one an existing role keeps its password.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, text

INGRESS_TABLES = (
    "runs",
    "run_attempts",
    "run_dispatch_leases",
    "worker_sessions",
    "dispatch_gate",
)
INGRESS_FUNCTIONS = (
    "ql3_ingress_register_sessions(jsonb)",
    "ql3_ingress_update_sessions(jsonb)",
    "ql3_ingress_apply(jsonb)",
    "ql3_ingress_renew(jsonb)",
    "ql3_ingress_claim_lock(text, text, text[], integer)",
    "ql3_ingress_lock_attempts(text[], boolean)",
)

DEFAULT_INGRESS_ROLE = "ql3_ingress_default"
ROLE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
SCRAM_ITERATIONS = 4096
_SYSTEM_SCHEMAS = (
    "nspname NOT IN ('pg_catalog', 'information_schema') AND nspname NOT LIKE 'pg\\_%'"
)


class IngressGrantRefused(ValueError):
    """The role cannot be made the ingress role."""


class IngressSchemaMissing(RuntimeError):
    """The database has no QL3 schema with the ingress functions: it needs ``ql3 db upgrade``."""


@dataclass(frozen=True, slots=True)
class IngressGrant:
    """What :func:`grant_ingress` did."""

    role: str
    created: bool
    password_set: bool
    database: str
    schema: str
    tables: tuple[str, ...]
    functions: tuple[str, ...]


def scram_verifier(
    password: str, *, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS
) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802 / 7677)."""
    if not password or not password.isascii() or not password.isprintable():
        raise IngressGrantRefused("a password must be non-empty printable ASCII")
    salt = salt if salt is not None else secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("ascii"), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(value: bytes) -> str:
        return base64.b64encode(value).decode("ascii")

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _ddl(connection: Connection, statement: str) -> None:
    """A utility statement built here (no bound parameters: colons are literal)."""
    connection.execute(text(statement.replace(":", "\\:")))


def _quote(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _check_role_name(role: str) -> None:
    if not ROLE_NAME.fullmatch(role):
        raise IngressGrantRefused(
            f"role name {role!r} must be a lower-case identifier (letters, digits, _) "
            "of at most 63 characters"
        )
    if role.startswith("pg_") or role in ("public", "none"):
        raise IngressGrantRefused(f"role name {role!r} is reserved")


def _schema_of_tables(connection: Connection) -> str:
    schema = connection.execute(
        text(
            "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.oid = to_regclass('run_dispatch_leases')"
        )
    ).scalar()
    if schema is None:
        raise IngressSchemaMissing("no QL3 schema here: run `ql3 db upgrade` first")
    missing = [
        signature
        for signature in INGRESS_FUNCTIONS
        if connection.execute(
            text("SELECT to_regprocedure(:signature)"),
            {"signature": f"{_quote(schema)}.{signature}"},
        ).scalar()
        is None
    ]
    if missing:
        raise IngressSchemaMissing(
            f"the ingress functions are missing ({', '.join(missing)}): run `ql3 db upgrade`"
        )
    return str(schema)


def grant_ingress(
    engine: Engine, role: str, password: str | None = None, *, login: bool = True
) -> IngressGrant:
    """Create ``role`` or bring it back to exactly the ingress's privileges (see the module);
    with ``login=False`` a role nobody logs in as, taken by ``SET ROLE``.

    Run it as the owner of the QL3 schema with the right to create roles (or as a superuser).
    Raises :class:`IngressGrantRefused` when the role cannot be the ingress role and
    :class:`IngressSchemaMissing` when the schema is not migrated far enough."""
    _check_role_name(role)
    if password is not None and not login:
        raise IngressGrantRefused("a role without LOGIN takes no password")
    verifier = scram_verifier(password) if password is not None else None
    quoted = _quote(role)
    with engine.begin() as connection:
        database = str(connection.execute(text("SELECT current_database()")).scalar_one())
        schema = _schema_of_tables(connection)
        found = _find_role(connection, role)
        created = found is None
        if found is None:
            statement = (
                f"CREATE ROLE {quoted} {'LOGIN' if login else 'NOLOGIN'} NOINHERIT NOSUPERUSER"
                " NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"
            )
            if verifier is not None:
                statement += f" PASSWORD {_literal(verifier)}"
            _ddl(connection, statement)
        else:
            _refuse_unfit(connection, role, found)
            wrong = [
                flag
                for flag, present, wanted in (
                    ("LOGIN", found["rolcanlogin"], login),
                    ("INHERIT", found["rolinherit"], False),
                    ("CREATEDB", found["rolcreatedb"], False),
                    ("CREATEROLE", found["rolcreaterole"], False),
                    ("REPLICATION", found["rolreplication"], False),
                    ("BYPASSRLS", found["rolbypassrls"], False),
                )
                if bool(present) != wanted
            ]
            attributes = [
                flag if flag == "LOGIN" and login else f"NO{flag}" for flag in wrong
            ]
            if verifier is not None:
                attributes.append(f"PASSWORD {_literal(verifier)}")
            if attributes:
                _ddl(connection, f"ALTER ROLE {quoted} WITH {' '.join(attributes)}")
            memberships = connection.execute(
                text(
                    "SELECT g.rolname FROM pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid"
                    " WHERE m.member = :oid ORDER BY 1"
                ),
                {"oid": found["oid"]},
            ).scalars()
            for group in list(memberships):
                _ddl(connection, f"REVOKE {_quote(group)} FROM {quoted}")
        _revoke_everything(connection, quoted, database)
        _ddl(connection, f"GRANT CONNECT ON DATABASE {_quote(database)} TO {quoted}")
        _ddl(connection, f"GRANT USAGE ON SCHEMA {_quote(schema)} TO {quoted}")
        tables = ", ".join(f"{_quote(schema)}.{_quote(name)}" for name in INGRESS_TABLES)
        _ddl(connection, f"GRANT SELECT ON TABLE {tables} TO {quoted}")
        functions = ", ".join(f"{_quote(schema)}.{signature}" for signature in INGRESS_FUNCTIONS)
        _ddl(connection, f"GRANT EXECUTE ON FUNCTION {functions} TO {quoted}")
    return IngressGrant(
        role=role,
        created=created,
        password_set=verifier is not None,
        database=database,
        schema=schema,
        tables=INGRESS_TABLES,
        functions=INGRESS_FUNCTIONS,
    )


def grant_default_ingress(engine: Engine, role: str = DEFAULT_INGRESS_ROLE) -> IngressGrant:
    """The default ingress role (see the module): NOLOGIN, exactly the ingress's privileges, and
    granted to the role running this, which a node without an ingress URL connects as. Two
    upgrades at once (of two databases on one server) may race to create it: the loser tries
    again and finds it."""
    from sqlalchemy.exc import DBAPIError

    for attempt in range(3):
        try:
            grant = grant_ingress(engine, role, login=False)
            with engine.begin() as connection:
                _grant_membership(connection, role)
            return grant
        except DBAPIError as error:
            sqlstate = getattr(error.orig, "sqlstate", None)
            if sqlstate == "42501":  # insufficient_privilege
                first = str(error.orig).splitlines()[0] if error.orig else str(error)
                raise IngressGrantRefused(
                    f"the default ingress role {role} could not be made ({first}): run it as a"
                    " role that may create roles, or give every node --ingress-database-url"
                ) from None
            # duplicate_object, unique_violation (pg_authid), tuple concurrently updated (XX000)
            if sqlstate not in ("42710", "23505", "XX000") or attempt == 2:
                raise
    raise AssertionError("unreachable")


def _grant_membership(connection: Connection, role: str) -> None:
    """Let the role running this ``SET ROLE`` to ``role``; a superuser may anyway."""
    me = connection.execute(
        text("SELECT rolsuper, pg_has_role(current_user, :role, 'MEMBER') AS member"
             " FROM pg_roles WHERE rolname = current_user"),
        {"role": role},
    ).mappings().one()
    if me["rolsuper"] or me["member"]:
        return
    version = int(connection.execute(text("SHOW server_version_num")).scalar_one())
    clause = " WITH INHERIT FALSE, SET TRUE" if version >= 160000 else ""
    _ddl(connection, f"GRANT {_quote(role)} TO CURRENT_USER{clause}")


def _find_role(connection: Connection, role: str) -> Mapping[str, Any] | None:
    statement = text(
        "SELECT oid, rolsuper, rolinherit, rolcreaterole, rolcreatedb, rolcanlogin,"
        " rolreplication, rolbypassrls,"
        " rolname = current_user OR rolname = session_user AS is_me"
        " FROM pg_roles WHERE rolname = :role"
    )
    row = connection.execute(statement, {"role": role}).mappings().first()
    return dict(row) if row is not None else None


def _refuse_unfit(connection: Connection, role: str, found: Mapping[str, Any]) -> None:
    if found["is_me"]:
        raise IngressGrantRefused(f"role {role} is the role running this command")
    if found["rolsuper"]:
        raise IngressGrantRefused(f"role {role} is a superuser")
    owns = connection.execute(
        text(
            "SELECT 1 FROM pg_shdepend WHERE refclassid = 'pg_authid'::regclass"
            " AND refobjid = :oid AND deptype = 'o' LIMIT 1"
        ),
        {"oid": found["oid"]},
    ).first()
    if owns is not None:
        raise IngressGrantRefused(f"role {role} owns database objects")


def _revoke_everything(connection: Connection, quoted: str, database: str) -> None:
    _ddl(connection, f"REVOKE ALL ON DATABASE {_quote(database)} FROM {quoted}")
    schemas = connection.execute(
        text(f"SELECT nspname FROM pg_namespace WHERE {_SYSTEM_SCHEMAS} ORDER BY 1")
    ).scalars()
    for schema in list(schemas):
        name = _quote(schema)
        _ddl(connection, f"REVOKE ALL ON SCHEMA {name} FROM {quoted}")
        _ddl(connection, f"REVOKE ALL ON ALL TABLES IN SCHEMA {name} FROM {quoted}")
        _ddl(connection, f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {name} FROM {quoted}")
        _ddl(connection, f"REVOKE ALL ON ALL ROUTINES IN SCHEMA {name} FROM {quoted}")
