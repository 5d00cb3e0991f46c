"""Installs the PostgreSQL store's schema into the test session's template database.

``tests/conftest.py`` calls :func:`prepare_template` once per session; every per-module test
database is cloned from that template, so the schema (and the Alembic version) is already there.
"""

from __future__ import annotations

from ql3.adapters.postgres.migrate import upgrade


def prepare_template(url: str) -> None:
    upgrade(url)
