"""The embedded SQLite store of the Standalone and Edge profiles.

The store is imported when first named here, so that :mod:`ql3.adapters.sql.sqlite.submit` (``ql3
submit``) loads no SQLAlchemy (ADR 0009)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ql3.adapters.sql.sqlite.connection import SCHEMA_VERSION

if TYPE_CHECKING:
    from ql3.adapters.sql.sqlite.store import SchemaMismatch, SqliteStore, SqliteUnitOfWork

__all__ = ["SCHEMA_VERSION", "SchemaMismatch", "SqliteStore", "SqliteUnitOfWork"]


def __getattr__(name: str) -> Any:
    if name in ("SchemaMismatch", "SqliteStore", "SqliteUnitOfWork"):
        from ql3.adapters.sql.sqlite import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
