"""What every connection to a QL3 SQLite database shares, with or without SQLAlchemy: the schema
version the store keeps in ``PRAGMA user_version``, the settings of a new connection and the
host clock. The store (:mod:`ql3.adapters.sql.sqlite.store`) and the submit-only store
(:mod:`ql3.adapters.sql.sqlite.submit`) both take them from here."""

from __future__ import annotations

import time

# PRAGMA user_version of a database the store created. The baseline of ADR 0022 is version 5,
# numbered past the versions 1 to 4 it replaces so that a file of one of them is refused; each
# later change of the schema takes the next number and its own upgrade step, and a database of
# UPGRADABLE_VERSIONS is upgraded in place when it is opened. Any other value is refused.
SCHEMA_VERSION = 6
UPGRADABLE_VERSIONS = (5,)


def connection_pragmas(*, busy_timeout_ms: int, synchronous: str, wal: bool) -> list[str]:
    """The statements a new connection runs first (the driver opens no transaction by itself:
    the connection's user sends ``BEGIN``).

    ``temp_store = MEMORY`` keeps SQLite's temporary files in memory: the sub-journal of a
    savepoint (every batch of Changes is applied in one) would otherwise spill to a new file
    once it holds more than 64 KiB, a file created, written and deleted per transaction. It
    holds nothing that must outlive the transaction, so durability is as it was."""
    pragmas = [f"PRAGMA busy_timeout = {busy_timeout_ms}", "PRAGMA foreign_keys = ON"]
    if wal:
        pragmas.append("PRAGMA journal_mode = WAL")
    pragmas.append(f"PRAGMA synchronous = {synchronous}")
    pragmas.append("PRAGMA temp_store = MEMORY")
    return pragmas


def host_now_ms() -> int:
    """This host's clock in epoch milliseconds: the store's clock before its test offset."""
    return time.time_ns() // 1_000_000
