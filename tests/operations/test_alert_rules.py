"""The shipped alert rules (``deploy/prometheus``) pass ``promtool check rules`` and their unit
tests (``promtool test rules``), and every metric they name is one a node exports. ``make
test`` installs promtool (Debian's ``prometheus`` package) when it is missing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from ql3.adapters.memory import FakeClock, MemoryStore
from ql3.application.admission import AdmissionRequest
from ql3.bootstrap import node

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: `make test` installs it (apt-get install prometheus)"
    return found


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], cwd=RULES, capture_output=True, text=True, timeout=120, check=False
    )


def test_the_rules_are_valid() -> None:
    done = _run("check", "rules", "alerts.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_unit_tests_pass() -> None:
    done = _run("test", "rules", "alerts_test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported_names() -> set[str]:
    """Every series name a node's registry declares, samples or not yet."""
    store = MemoryStore(FakeClock())
    container = node.build(store=store)
    container.cluster.core.admission().submit_many([AdmissionRequest(task="t")])
    container.cluster.coordinator().run_cycle()
    registry, _ = container.metrics_registry()
    names: set[str] = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def test_every_metric_the_rules_name_is_exported() -> None:
    named = set(re.findall(r"\bql3_[a-z_]+", (RULES / "alerts.yml").read_text()))
    assert named, "the rules name no metric"
    assert named <= _exported_names()


def test_the_dashboard_names_only_exported_metrics() -> None:
    named = set(re.findall(r"\bql3_[a-z_]+", (RULES.parent / "grafana" / "ql3.json").read_text()))
    assert named and named <= _exported_names()
