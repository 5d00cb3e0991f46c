"""Schema migrations of the PostgreSQL store, driven from code (no ``alembic.ini``).

``upgrade(url)`` brings a database to the newest revision; ``current_revision(url)`` tells which
revision a database is at (``None`` before the first migration).

The revisions start at the baseline ``r0001_baseline`` (ADR 0022) and are append-only, each with
its own frozen text. A database at a revision these migrations do not know (one made before the
baseline, or by a newer QL3) is refused with :class:`UnknownRevision`, and nothing is written.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
DRIVER = "postgresql+psycopg"


def _driver_url(url: str) -> str:
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername=DRIVER)
    return parsed.render_as_string(hide_password=False)


def alembic_config(url: str | None = None) -> Config:
    """An Alembic configuration built in code: ``script_location`` is this package's
    ``migrations`` directory; ``url``, if given, becomes ``sqlalchemy.url``."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if url is not None:
        # configparser treats "%" as interpolation: escape it.
        config.set_main_option("sqlalchemy.url", _driver_url(url).replace("%", "%%"))
    return config


class UnknownRevision(RuntimeError):
    """The database is at a revision these migrations do not define."""


def head_revision() -> str:
    """The newest revision the migrations define."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS}")
    return str(head)


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: the newest), in one
    transaction; at the newest, then create or bring back the default ingress role
    (:func:`~ql3.adapters.postgres.grants.grant_default_ingress`, ADR 0024)."""
    engine = create_engine(_driver_url(url), poolclass=NullPool)
    try:
        with engine.begin() as connection:
            config = alembic_config()
            _refuse_unknown(connection, config)
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
        if revision == "head":
            from ql3.adapters.postgres.grants import grant_default_ingress

            grant_default_ingress(engine)
    finally:
        engine.dispose()


def _refuse_unknown(connection: Connection, config: Config) -> None:
    found = MigrationContext.configure(connection).get_current_revision()
    if found is None:
        return
    known = {script.revision for script in ScriptDirectory.from_config(config).walk_revisions()}
    if found not in known:
        raise UnknownRevision(
            f"the database is at revision {found}, which these migrations do not know: a "
            "database made before the baseline revision r0001_baseline must be recreated"
        )


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at, or ``None`` if it was never migrated."""
    engine = create_engine(_driver_url(url), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            revision = MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
    return None if revision is None else str(revision)
