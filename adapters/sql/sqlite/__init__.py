"""The embedded SQLite store of the Standalone and Edge profiles."""

from adapters.sql.sqlite.store import SCHEMA_VERSION, SchemaMismatch, SqliteStore, SqliteUnitOfWork

__all__ = ["SCHEMA_VERSION", "SchemaMismatch", "SqliteStore", "SqliteUnitOfWork"]
