"""Operators' commands (ADR 0010): ``ql3 runs quarantine|unquarantine``, ``ql3 doctor``,
``ql3 status`` and ``ql3 workers list``. Errors follow the command line's rules: one line on
stderr, exit 2 for bad input, 1 for not found or failure, nothing written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from ql3.adapters.cli.trigger_cmds import database_option, json_option
from ql3.application.operations import (
    Doctor,
    Quarantines,
    diagnose,
    failure_details,
    node_dict,
    quarantined_dict,
)
from ql3.application.ports import HARD_PAGE_CAP, OperationsView, SessionCapacity
from ql3.domain.model import JsonValue


@contextmanager
def _container(database_url: str | None) -> Iterator[Any]:
    from ql3.adapters.cli.main import _cluster

    with _cluster(database_url) as container:
        yield container


def _emit(as_json: bool, document: object, lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(document, sort_keys=True, default=str))
    else:
        for line in lines:
            click.echo(line)


def _iso(ms: int | None) -> str:
    from ql3.adapters.cli.main import _iso as iso

    return "-" if ms is None else iso(ms)


def _age(now_ms: int, ms: int | None) -> str:
    return "-" if ms is None else f"{max(0, now_ms - ms) / 1000:.1f}s"


# --- quarantine ----------------------------------------------------------------------------------


@click.command("quarantine")
@click.argument("run_id")
@click.option("--reason", required=True, help="Why the run is taken out of recovery and retry.")
@database_option
@json_option
def quarantine_command(run_id: str, reason: str, database_url: str | None, as_json: bool) -> None:
    """Take RUN_ID out of runtime recovery and lost retry, so that those steps proceed."""
    with _container(database_url) as container:
        run = Quarantines(container.store().unit_of_work).quarantine(run_id, reason)
    _emit(as_json, quarantined_dict(run), [f"quarantined: run {run.id} ({run.status.value})"])


@click.command("unquarantine")
@click.argument("run_id")
@click.option("--reason", default="", help="Why the run goes back to recovery and retry.")
@database_option
@json_option
def unquarantine_command(run_id: str, reason: str, database_url: str | None, as_json: bool) -> None:
    """Give RUN_ID back to runtime recovery and lost retry."""
    with _container(database_url) as container:
        run = Quarantines(container.store().unit_of_work).unquarantine(run_id, reason)
    document = {"run_id": run.id, "status": run.status.value, "quarantined": False}
    _emit(as_json, document, [f"unquarantined: run {run.id} ({run.status.value})"])


# --- doctor and status ---------------------------------------------------------------------------


@click.command("doctor")
@database_option
@json_option
def doctor_command(database_url: str | None, as_json: bool) -> None:
    """Say what keeps the runtime from making progress, and what to do about it. Exits 1 when
    something does."""
    from ql3.adapters.cli.main import Failure

    with _container(database_url) as container:
        view, findings = Doctor(container.store()).examine()
    problems = [f for f in findings if f.problem]
    document = {
        "healthy": not problems,
        "observed_at_ms": view.observed_at_ms,
        "findings": [f.as_dict() for f in findings],
    }
    lines = [f"{'PROBLEM' if f.problem else 'note'}: {f.what}\n  {f.advice}" for f in findings]
    failure = view.gate.failure
    if failure is not None:
        lines.insert(1, f"  failing since {_iso(failure.since_ms)}")
    _emit(as_json, document, lines or ["healthy: nothing keeps the runtime from progress"])
    if problems:
        raise Failure(f"{len(problems)} problem(s) found")


def _session_dict(found: SessionCapacity) -> dict[str, JsonValue]:
    s = found.session
    return {
        "worker_id": s.worker_id,
        "session_id": s.id,
        "state": s.status.value,
        "capacity": s.capacity,
        "in_flight": found.in_flight,
        "tasks": list(s.tasks),
        "registered_at_ms": s.registered_at_ms,
        "last_heartbeat_at_ms": s.last_heartbeat_at_ms,
    }


def _session_lines(view: OperationsView) -> list[str]:
    lines = [f"  {'worker':<24} {'state':<9} {'capacity':>8} {'in flight':>9}  last heartbeat"]
    for found in view.sessions:
        s = found.session
        lines.append(
            f"  {s.worker_id:<24} {s.status.value:<9} {s.capacity:>8} {found.in_flight:>9}"
            f"  {_age(view.observed_at_ms, s.last_heartbeat_at_ms)} ago"
        )
    return lines


def status_document(view: OperationsView) -> dict[str, JsonValue]:
    gate = view.gate
    return {
        "observed_at_ms": view.observed_at_ms,
        "nodes": [node_dict(n) for n in view.nodes],
        "gate": {
            "open": gate.open,
            "reason": gate.reason,
            "changed_at_ms": gate.changed_at_ms,
            "failure": None if gate.failure is None else failure_details(gate.failure),
        },
        "queues": [
            {"task": q.task, "queued": q.queued, "oldest_ms": q.oldest_ms} for q in view.queues
        ],
        "evidence_waiting": {"count": view.evidence.count, "oldest_ms": view.evidence.oldest_ms},
        "workers": [_session_dict(found) for found in view.sessions],
        "quarantined": {
            "count": view.quarantined_count,
            "runs": [quarantined_dict(run) for run in view.quarantined],
        },
        "healthy": not any(f.problem for f in diagnose(view)),
    }


@click.command("status")
@database_option
@json_option
def status_command(database_url: str | None, as_json: bool) -> None:
    """The dispatch gate, the failing step if any, queues, evidence waits, workers and
    quarantined runs, as the database has them now."""
    with _container(database_url) as container:
        view = container.store().operations_view(HARD_PAGE_CAP)
    now, gate = view.observed_at_ms, view.gate
    lines = [f"nodes        {len(view.nodes)}"]
    lines += [
        f"  {n.node_id:<32} last cycle {_age(now, n.last_cycle_at_ms)} ago,"
        f" {'ok' if n.ok else 'aborted at ' + (n.aborted_at or '?')}, {n.cycles} cycle(s)"
        + (" WARNING: anonymous workers allowed" if n.anonymous_workers else "")
        for n in view.nodes
    ]
    lines += [
        f"gate         {'open' if gate.open else 'CLOSED'} since {_iso(gate.changed_at_ms)}"
        + (f": {gate.reason}" if gate.reason and not gate.open else "")
    ]
    if gate.failure is not None:
        f = gate.failure
        lines.append(
            f"failing      {f.step} on run {f.run_id} (attempt {f.attempt_id}),"
            f" {f.cycles} cycle(s) since {_iso(f.since_ms)}: {f.error}"
        )
    lines.append(f"queued       {sum(q.queued for q in view.queues)}")
    lines += [f"  {q.task:<24} {q.queued:>6}  oldest {_age(now, q.oldest_ms)}" for q in view.queues]
    lines.append(
        f"evidence     {view.evidence.count} waiting, oldest {_age(now, view.evidence.oldest_ms)}"
    )
    lines.append(f"workers      {len(view.sessions)} open session(s)")
    lines += _session_lines(view) if view.sessions else []
    lines.append(f"quarantined  {view.quarantined_count}")
    lines += [
        f"  {run.id}  {run.status.value:<11} since {_iso(run.quarantine.since_ms)}:"
        f" {run.quarantine.reason}"
        for run in view.quarantined
        if run.quarantine is not None
    ]
    _emit(as_json, status_document(view), lines)


@click.group("workers")
def workers_group() -> None:
    """Worker sessions."""


@workers_group.command("list")
@database_option
@json_option
def workers_list(database_url: str | None, as_json: bool) -> None:
    """The open (active or draining) worker sessions with their capacity and work in flight."""
    with _container(database_url) as container:
        view = container.store().operations_view(HARD_PAGE_CAP)
    document = {"workers": [_session_dict(found) for found in view.sessions]}
    _emit(as_json, document, _session_lines(view) if view.sessions else ["no open sessions"])
