"""The domain performs no I/O and reads no clock: checked on its source with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

DOMAIN = Path(__file__).resolve().parents[2] / "domain"
FORBIDDEN_MODULES = frozenset({
    "time", "datetime", "random", "os", "socket", "io", "logging", "threading", "asyncio",
    "sqlalchemy", "psycopg", "requests", "secrets", "subprocess", "uuid",
})
FORBIDDEN_CALLS = frozenset({"open", "print", "input", "exec", "eval", "__import__"})


def _violations(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        else:
            names = []
        for name in names:
            if name.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"line {node.lineno}: imports {name}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in FORBIDDEN_CALLS
        ):
            found.append(f"line {node.lineno}: calls {node.func.id}()")
    return found


def _modules() -> list[Path]:
    return sorted(DOMAIN.rglob("*.py"))


def test_the_domain_package_has_modules() -> None:
    names = {p.stem for p in _modules()}
    assert {"model", "policy", "events", "fence", "transitions", "recovery", "retry",
            "sessions"} <= names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_domain_module_does_no_io_and_reads_no_clock(path: Path) -> None:
    assert _violations(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    "source",
    ["import time", "from datetime import datetime", "import os.path", "open('x')",
     "print(1)", "from logging import getLogger", "import sqlalchemy.orm"],
)
def test_the_checker_catches_what_it_forbids(source: str) -> None:
    assert _violations(source) != []
