"""The Promela model of the lease protocol (``docs/model/protocol.pml``, ADR 0011).

Spin checks the model exhaustively at small bounds (each configuration of faults the model's
``init`` may choose, in one search): its
assertions (a fence the store accepts is not stale, a started Attempt is lost only while
nothing executes it, every status change is an edge of the model's diagrams) and its LTL
property ``[] INVARIANT && <> SETTLED`` (at most one leased lease per run, a run's task never
executes twice at once and an unsafe run's at most once; every run ends terminal), and that a
cycle opens the dispatch gate only when it did not close after that cycle's recovery began
(which fails when the gate's compare-and-set is taken out). A further test shows that the
model's states and edges are the domain's (``domain/states.py``), with what the model leaves
out named below."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ql3.domain.model import AttemptStatus, RunStatus
from ql3.domain.states import ATTEMPT_EDGES, RUN_EDGES

Status = Any  # a RunStatus or an AttemptStatus
Edge = tuple[Status, Status]

MODEL = Path(__file__).resolve().parents[2] / "docs" / "model" / "protocol.pml"


# What the model leaves out of the domain's diagrams, by name: states (with every edge of
# theirs) and single edges.
LEFT_OUT: dict[Any, str] = {
    RunStatus.DISPATCHING: "offered under the protocol of ADR 0005; no edge leads into it since "
    "ADR 0007, so no run of the model reaches it",
    (RunStatus.CREATED, RunStatus.RUNNING): "a workflow aggregate starts (ADR 0003); it has no "
    "Attempt and its steps are runs of their own",
    (RunStatus.CREATED, RunStatus.FAILED): "a workflow aggregate fails before it started",
    (RunStatus.LOST, RunStatus.LOST): "a lost run whose Attempt is still active: the protocol "
    "loses a run and its Attempt in one change, so the model never has one",
    AttemptStatus.STARTING: "activated under the protocol of ADR 0005; no edge leads into it "
    "since ADR 0007",
    (AttemptStatus.CLAIMED, AttemptStatus.LOST): "an offered, unstarted Attempt whose lease "
    "expired (ADR 0005); a claim now leases and starts in one change",
    (AttemptStatus.CLAIMED, AttemptStatus.CLAIMED): "an offered Attempt handed back (ADR 0005)",
}


@dataclass(frozen=True)
class Diagram:
    """One of the domain's state diagrams and how the model spells it."""

    statuses: type[Any]
    prefix: str  # of the model's state names (R_QUEUED, A_RUNNING, ...)
    macro: str  # the model's edge predicate
    edges: Mapping[Status, frozenset[Status]]
    modelled_edges: int


DIAGRAMS = {
    "run": Diagram(RunStatus, "R", "RUN_EDGE", RUN_EDGES, modelled_edges=15),
    "attempt": Diagram(AttemptStatus, "A", "ATTEMPT_EDGE", ATTEMPT_EDGES, modelled_edges=7),
}


@pytest.mark.parametrize("name", list(DIAGRAMS))
def test_the_model_has_the_domains_states_and_edges(name: str) -> None:
    diagram = DIAGRAMS[name]
    text = MODEL.read_text()
    left_out_states = {k for k in LEFT_OUT if isinstance(k, diagram.statuses)}
    left_out_edges = {
        k for k in LEFT_OUT if isinstance(k, tuple) and isinstance(k[0], diagram.statuses)
    }
    assert len(left_out_states) + len(left_out_edges) < len(LEFT_OUT)  # the other diagram's
    states = declared_states(text, diagram.prefix, diagram.statuses)
    assert states == set(diagram.statuses) - left_out_states
    edges = declared_edges(text, diagram.macro, diagram.prefix, diagram.statuses)
    assert edges == modelled(diagram.edges, left_out_states, left_out_edges)
    assert len(edges) == diagram.modelled_edges


def test_every_status_change_of_the_model_is_checked_against_its_edges() -> None:
    """Statuses change only through ``run_to`` and ``att_to`` (which assert the edge), except
    where a run is admitted and an Attempt created (from nothing, pristine)."""
    text = MODEL.read_text()
    run_writes = re.findall(r"rstat\[[^\]]*\] = (\w+)", text)
    assert run_writes.count("to") == 1  # inside run_to
    assert sorted(w for w in run_writes if w != "to") == ["R_CREATED", "R_QUEUED"]  # init
    attempt_writes = re.findall(r"\batt\[[^\]]*\] = (\w+)", text)
    assert attempt_writes.count("to") == 1  # inside att_to
    assert {w for w in attempt_writes if w != "to"} == {"A_CLAIMED"}  # created pristine


def test_spin_finds_no_error_and_searches_exhaustively(tmp_path: Path) -> None:
    report = verify({}, tmp_path)
    assert re.search(r"\berrors: 0\b", report), report
    assert "Full statespace search for:" in report, report
    assert re.search(r"never claim\s+\+ \(protocol\)", report), report
    for incomplete in ("Search not completed", "max search depth too small", "-DMEMLIM bound"):
        assert incomplete not in report, report
    assert states_stored(report) > 1_000_000


def test_the_gate_opens_unordered_without_its_compare_and_set(tmp_path: Path) -> None:
    """The search above asserts that a cycle opens the gate only when it did not close after
    that cycle's recovery began. With ``UNORDERED_GATE`` step 5 opens a closed gate as it did
    before the compare-and-set (ADR 0011), and spin finds the race: a replica whose recovery
    and lost-retry steps succeeded reopens the gate another replica's failed step closed."""
    report = verify({"UNORDERED_GATE": 1}, tmp_path)
    assert re.search(r"\berrors: 1\b", report), report
    assert "assertion violated (since==closes)" in report, report


# --- helpers ------------------------------------------------------------------------------------


def declared_states(text: str, prefix: str, enum: type[Status]) -> set[Status]:
    names = re.findall(rf"^#define {prefix}_([A-Z_]+) \d+$", text, re.MULTILINE)
    assert names, f"no {prefix}_ states in the model"
    return {enum[name] for name in names}


def macro_body(text: str, macro: str) -> str:
    """The text of a ``#define`` spread over continued lines."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"#define {macro}("))
    body = [lines[start]]
    while body[-1].endswith("\\"):
        body.append(lines[start + len(body)])
    return "\n".join(body)


def declared_edges(text: str, macro: str, prefix: str, enum: type[Status]) -> set[Edge]:
    edges: set[Edge] = set()
    body = macro_body(text, macro)
    for source, targets in re.findall(rf"f == {prefix}_(\w+) && \(([^)]*)\)", body):
        for target in re.findall(rf"t == {prefix}_(\w+)", targets):
            edges.add((enum[source], enum[target]))
    assert edges, f"{macro} declares no edge"
    return edges


def modelled(
    edges: Mapping[Status, frozenset[Status]], states: set[Status], abstracted: set[Edge]
) -> set[Edge]:
    """The domain's edges less those the model leaves out: every edge of a left-out state and
    each named edge (which must be an edge of the domain, of states the model has)."""
    domain = {(s, t) for s, targets in edges.items() for t in targets}
    assert abstracted <= domain, abstracted - domain
    assert not any(s in states or t in states for s, t in abstracted)
    return {(s, t) for s, t in domain if s not in states and t not in states} - abstracted


def verify(defines: dict[str, int], workdir: Path) -> str:
    """``spin -a`` with the configuration, pan compiled with gcc, its exhaustive search."""
    spin, gcc = shutil.which("spin"), shutil.which("gcc")
    assert spin, "spin is not installed (make test installs Debian's spin package)"
    assert gcc, "gcc is not installed"
    flags = [f"-D{key}={value}" for key, value in defines.items()]
    shutil.copy(MODEL, workdir / MODEL.name)
    run([spin, *flags, "-a", MODEL.name], workdir)
    run([gcc, "-O1", "-DCOLLAPSE", "-DMEMLIM=1024", "-o", "pan", "pan.c"], workdir)
    return run(["./pan", "-a", "-m100000"], workdir, check=False)


def run(command: list[str], workdir: Path, *, check: bool = True) -> str:
    done = subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, timeout=240, check=False
    )
    output = done.stdout + done.stderr
    if check:
        assert done.returncode == 0, output
    return output


def states_stored(report: str) -> int:
    match = re.search(r"^\s*(\d+) states, stored", report, re.MULTILINE)
    assert match, report
    return int(match.group(1))
