"""What every benchmark shares: the server, throwaway databases, argument types and output.

A benchmark talks to one PostgreSQL server, named by an *admin* URL (``QL3_BENCH_DATABASE_URL``,
else ``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``). It creates its own databases on
that server, migrates them with :func:`ql3.adapters.postgres.migrate.upgrade` and drops them when it
is done, also when it fails or is interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from sqlalchemy.engine import URL, make_url

ADMIN_URL_ENV = "QL3_BENCH_DATABASE_URL"
DEFAULT_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DRIVER = "postgresql+psycopg"
CONNECT_TIMEOUT_S = 5


class BenchmarkError(RuntimeError):
    """A benchmark could not run or its result failed verification; the message says why."""


# --- arguments ---------------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """Bad arguments end the program with one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def bounded_int(low: int, high: int) -> Any:
    def parse(text: str) -> int:
        value = positive_int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be within {low}..{high}, got {value}")
        return value

    parse.__name__ = f"integer {low}..{high}"
    return parse


# --- the server and its databases --------------------------------------------------------------


def admin_url() -> str:
    return os.environ.get(ADMIN_URL_ENV, "").strip() or DEFAULT_ADMIN_URL


def _parsed(url: str) -> URL:
    try:
        parsed = make_url(url)
    except Exception as error:  # sqlalchemy raises ArgumentError with its own wording
        raise BenchmarkError(f"not a database URL: {url!r} ({error})") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername=DRIVER)
    if not parsed.drivername.startswith("postgresql"):
        raise BenchmarkError(f"not a PostgreSQL URL: {parsed.drivername}")
    return parsed


def url_for(url: str, database: str) -> str:
    """The SQLAlchemy URL of ``database`` on the server of ``url``."""
    return _parsed(url).set(database=database).render_as_string(hide_password=False)


@dataclass(frozen=True)
class ServerAddress:
    host: str
    port: int
    user: str
    password: str | None


def server_address(url: str) -> ServerAddress:
    parsed = _parsed(url)
    return ServerAddress(
        host=parsed.host or "127.0.0.1",
        port=parsed.port or 5432,
        user=parsed.username or "postgres",
        password=parsed.password,
    )


def conninfo(url: str) -> str:
    """A libpq connection string for a SQLAlchemy URL."""
    parsed = _parsed(url)
    params: dict[str, Any] = {
        "host": parsed.host,
        "port": parsed.port,
        "user": parsed.username,
        "password": parsed.password,
        "dbname": parsed.database,
        "connect_timeout": CONNECT_TIMEOUT_S,
    }
    params.update({key: value for key, value in parsed.query.items() if isinstance(value, str)})
    return make_conninfo(**{key: value for key, value in params.items() if value is not None})


def connect(url: str, *, autocommit: bool = False) -> psycopg.Connection[tuple[Any, ...]]:
    try:
        return psycopg.connect(conninfo(url), autocommit=autocommit)
    except psycopg.OperationalError as error:
        reason = " ".join(str(error).split())
        raise BenchmarkError(f"cannot connect to {_safe(url)}: {reason}") from None


def _safe(url: str) -> str:
    return _parsed(url).render_as_string(hide_password=True)


def drop_database(admin: str, name: str) -> None:
    with connect(admin, autocommit=True) as conn:
        try:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        except psycopg.errors.SyntaxError:  # before PostgreSQL 13: cut the sessions by hand
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))


@contextmanager
def throwaway_database(admin: str, prefix: str) -> Iterator[tuple[str, str]]:
    """Create an empty database on the admin URL's server; yield (name, SQLAlchemy URL); drop it
    afterwards whatever happened."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    with connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield name, url_for(admin, name)
    finally:
        drop_database(admin, name)


@contextmanager
def migrated_database(admin: str, prefix: str) -> Iterator[str]:
    """A throwaway database migrated to the newest revision of the store's schema."""
    from ql3.adapters.postgres.migrate import upgrade

    with throwaway_database(admin, prefix) as (_, url):
        upgrade(url)
        yield url


# --- measurements ------------------------------------------------------------------------------


def peak_rss_mb() -> float:
    """The benchmark process's peak resident set size (``ru_maxrss`` is KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    divisor = 1024 * 1024 if sys.platform == "darwin" else 1024
    return round(peak / divisor, 1)


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of nothing")
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


class Stopwatch:
    def __init__(self) -> None:
        self._start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self._start


def say(message: str) -> None:
    """Progress for the human, on stderr: stdout carries the table and the JSON line."""
    print(message, file=sys.stderr, flush=True)


# --- output ------------------------------------------------------------------------------------


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def print_table(title: str, rows: Sequence[tuple[str, object, str]]) -> None:
    """A two-column table (metric, value) with a free-text note per row."""
    shown = [(name, _cell(value), note) for name, value, note in rows]
    width_name = max(len("metric"), *(len(name) for name, _, _ in shown))
    width_value = max(len("value"), *(len(value) for _, value, _ in shown))
    rule = f"{'-' * width_name}  {'-' * width_value}  {'-' * 40}"
    print(title)
    print(rule)
    print(f"{'metric':<{width_name}}  {'value':>{width_value}}  note")
    print(rule)
    for name, value, note in shown:
        print(f"{name:<{width_name}}  {value:>{width_value}}  {note}".rstrip())
    print(rule, flush=True)


def print_json(result: dict[str, Any]) -> None:
    """The machine-readable result: one JSON object on the last line of stdout."""
    print(json.dumps(result, sort_keys=False, separators=(",", ":")), flush=True)
