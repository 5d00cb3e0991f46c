"""The wheel is what users get (ADR 0019): built with the sdist, installed into a fresh
virtualenv, it adds one name to the import namespace, ``ql3``; there ``ql3 --version`` and
``ql3 demo --short`` run, and an application with its own ``domain``, ``application``,
``adapters`` and ``bootstrap`` packages runs its tests on ``ql3.testing`` and executes runs on a
Standalone runtime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COLLIDER = Path(__file__).resolve().parent / "collider"


def _version() -> str:
    from importlib.metadata import version

    return version("ql3-runtime")


def _env() -> dict[str, str]:
    """The environment of a user's shell: nothing points into this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QL3_", "PYTHON", "VIRTUAL"))}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(REPO))
    )
    env["COLUMNS"] = "200"
    return env


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, the wheel built from the sdist (``python -m build``)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)], REPO)
    return out


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding the wheel (and pytest, for the application's tests)."""
    where = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", str(where)], where.parent)
    wheel = next(dist.glob("*.whl"))
    _run([str(where / "bin" / "python"), "-m", "pip", "install", "--quiet",
          "--disable-pip-version-check", str(wheel), "pytest"], where.parent, timeout=600)
    return where


def test_the_wheel_adds_only_ql3_to_the_import_namespace(dist: Path) -> None:
    wheel = next(dist.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"ql3", f"ql3_runtime-{_version()}.dist-info"}
    for layer in ("domain", "application", "adapters", "bootstrap"):
        assert f"ql3/{layer}/__init__.py" in names
    assert "ql3/adapters/postgres/migrations/env.py" in names or any(
        name.startswith("ql3/adapters/postgres/migrations/") for name in names
    )
    # The frozen text the baseline revision runs, and the functions' current text.
    assert "ql3/adapters/postgres/migrations/versions/r0001_baseline.sql" in names
    assert "ql3/adapters/postgres/sql/functions.sql" in names
    assert "ql3/adapters/postgres/sql/functions.template.sql" in names
    assert not any(name.startswith(("benchmarks/", "tests/")) for name in names)
    assert not any("__pycache__" in name for name in names)


def test_the_sdist_keeps_the_repository_layout(dist: Path) -> None:
    sdist = next(dist.glob("*.tar.gz"))
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for folder in ("domain", "application", "adapters", "bootstrap", "ql3", "tests", "docs/adr"):
        assert any(name.startswith(folder + "/") for name in names), folder
    assert "CHANGELOG.md" in names and "pyproject.toml" in names


def test_ql3_version_in_the_fresh_virtualenv(venv: Path, tmp_path: Path) -> None:
    done = _run([str(venv / "bin" / "ql3"), "--version"], tmp_path)
    assert done.stdout.strip() == f"ql3 {_version()}"
    code = "import ql3, sys; print(ql3.__version__, ql3.__file__)"
    done = _run([str(venv / "bin" / "python"), "-c", code], tmp_path)
    version, location = done.stdout.split()
    assert version == _version()
    assert Path(location).is_relative_to(venv)


def test_the_demo_runs_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    done = _run([str(venv / "bin" / "ql3"), "demo", "--short"], tmp_path, timeout=300)
    assert "Summary" in done.stdout and "Traceback" not in done.stderr


def test_an_application_with_its_own_layer_packages(venv: Path, tmp_path: Path) -> None:
    app = tmp_path / "collider"
    shutil.copytree(COLLIDER, app)
    python = str(venv / "bin" / "python")
    tests = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider"], app)
    assert "3 passed" in tests.stdout, tests.stdout
    done = _run([python, "main.py", str(tmp_path / "app.db")], app, timeout=120)
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs == [
        {"status": "succeeded", "output": {"order": n, "cents": (n + 1) * 250}} for n in range(3)
    ]
