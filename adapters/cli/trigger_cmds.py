"""``ql3 triggers ...`` (Runs admitted on a schedule) and ``ql3 workflows ...`` (a DAG of
steps: submit, list, show, cancel). Errors follow the command line's rules: one line on
stderr, exit 2 for bad input, 1 for not found or failure, nothing written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from ql3.application.triggers import TriggerDefinition, UnknownTrigger
from ql3.domain.model import JsonValue, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety, policy_to_document
from ql3.domain.triggers import DEFAULT_CATCH_UP_LIMIT, MAX_CATCH_UP_LIMIT, CatchUp, Trigger

database_option = click.option(
    "--database-url", "database_url", default=None, help="Defaults to $QL3_DATABASE_URL."
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


@contextmanager
def _container(database_url: str | None) -> Iterator[Any]:
    from ql3.adapters.cli.main import _cluster

    with _cluster(database_url) as container:
        yield container


def _emit(as_json: bool, document: object, text: str) -> None:
    click.echo(json.dumps(document, sort_keys=True, default=str) if as_json else text)


def _not_found(name: str) -> Exception:
    from ql3.adapters.cli.main import Failure

    return Failure(f"not found: trigger {name}")


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def trigger_document(trigger: Trigger) -> dict[str, JsonValue]:
    return {
        "id": trigger.id,
        "name": trigger.name,
        "task": trigger.task,
        "input": trigger.input,
        "policy": None if trigger.policy is None else _json(policy_to_document(trigger.policy)),
        "every_s": None if trigger.every_ms is None else trigger.every_ms / 1000,
        "cron": trigger.cron,
        "catch_up": trigger.catch_up.value,
        "catch_up_limit": trigger.catch_up_limit,
        "status": trigger.status.value,
        "next_fire_at_ms": trigger.next_fire_at_ms,
        "next_fire_at": _iso(trigger.next_fire_at_ms),
        "last_fired_at_ms": trigger.last_fired_at_ms,
        "created_at_ms": trigger.created_at_ms,
    }


def _json(value: object) -> JsonValue:
    loaded: JsonValue = json.loads(json.dumps(value))
    return loaded


def _schedule_text(trigger: Trigger) -> str:
    if trigger.cron is not None:
        return f"cron '{trigger.cron}'"
    assert trigger.every_ms is not None
    return f"every {trigger.every_ms / 1000:g}s"


def _line(trigger: Trigger) -> str:
    return (
        f"{trigger.name}  {trigger.status.value:<7} {_schedule_text(trigger)}"
        f"  catch-up {trigger.catch_up.value}  next {_iso(trigger.next_fire_at_ms)}"
        f"  task {trigger.task}"
    )


# --- ql3 triggers ---------------------------------------------------------------------------------


@click.group()
def triggers() -> None:
    """Triggers: Runs admitted on a schedule (an interval or a cron expression, UTC)."""


@triggers.command("add")
@click.argument("name")
@click.option("--task", required=True, help="The task each firing admits a run of.")
@click.option("--every", "every_s", type=float, default=None, help="Interval in seconds.")
@click.option("--cron", default=None, help="Five-field cron expression, UTC.")
@click.option("--input", "input_json", default="null", help="The runs' JSON input.")
@click.option("--safety", type=click.Choice([s.value for s in Safety]), default=None)
@click.option("--retry-on-lost", is_flag=True)
@click.option("--max-attempts", type=int, default=None)
@click.option("--backoff-initial", type=float, default=None, help="Seconds.")
@click.option(
    "--catch-up",
    type=click.Choice([c.value for c in CatchUp]),
    default=CatchUp.SKIP.value,
    show_default=True,
    help="What to do with firings missed while no scheduler ran.",
)
@click.option(
    "--catch-up-limit",
    type=click.IntRange(1, MAX_CATCH_UP_LIMIT),
    default=DEFAULT_CATCH_UP_LIMIT,
    show_default=True,
    help="With --catch-up all: at most this many missed firings (the latest).",
)
@database_option
@json_option
def add(
    name: str,
    task: str,
    every_s: float | None,
    cron: str | None,
    input_json: str,
    safety: str | None,
    retry_on_lost: bool,
    max_attempts: int | None,
    backoff_initial: float | None,
    catch_up: str,
    catch_up_limit: int,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Add trigger NAME: runs of TASK every N seconds or on a cron schedule."""
    if (every_s is None) == (cron is None):
        raise click.UsageError("give exactly one of --every SECONDS and --cron EXPR")
    if every_s is not None and not every_s > 0:
        raise click.UsageError("--every must be a positive number of seconds")
    try:
        payload = json.loads(input_json)
    except json.JSONDecodeError as error:
        raise click.UsageError(f"--input is not JSON: {error.msg}") from None
    definition = TriggerDefinition(
        name=name,
        task=task,
        input=payload,
        policy=_policy(safety, retry_on_lost, max_attempts, backoff_initial),
        every_ms=None if every_s is None else round(every_s * 1000),
        cron=cron,
        catch_up=CatchUp(catch_up),
        catch_up_limit=catch_up_limit,
    )
    with _container(database_url) as container:
        trigger = container.core.triggers().add(definition)
    _emit(as_json, trigger_document(trigger), f"added {_line(trigger)}")


def _policy(
    safety: str | None,
    retry_on_lost: bool,
    max_attempts: int | None,
    backoff_initial: float | None,
) -> RetryPolicy | None:
    """The runs' retry policy, as ``ql3 submit`` builds it from the same options."""
    if not (safety or retry_on_lost or max_attempts is not None or backoff_initial is not None):
        return None
    if backoff_initial is not None and backoff_initial < 0:
        raise click.UsageError("--backoff-initial must be >= 0")
    initial_ms = round((backoff_initial if backoff_initial is not None else 1.0) * 1000)
    return RetryPolicy(
        retry_on_lost=retry_on_lost,
        max_attempts=max_attempts if max_attempts is not None else 1,
        safety=Safety(safety) if safety else None,
        backoff=Backoff(initial_ms=initial_ms, cap_ms=max(initial_ms, 300_000)),
    )


@triggers.command("list")
@click.option("--all", "include_deleted", is_flag=True, help="Deleted triggers too.")
@database_option
@json_option
def list_(include_deleted: bool, database_url: str | None, as_json: bool) -> None:
    """List triggers by name."""
    with _container(database_url) as container:
        found = container.core.triggers().list_triggers(include_deleted=include_deleted)
    _emit(
        as_json,
        {"triggers": [trigger_document(t) for t in found]},
        "\n".join(_line(t) for t in found) if found else "no triggers",
    )


def _change(action: str, name: str, database_url: str | None, as_json: bool) -> None:
    with _container(database_url) as container:
        service = container.core.triggers()
        try:
            trigger = getattr(service, action)(name)
        except UnknownTrigger:
            raise _not_found(name) from None
    past = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[action]
    _emit(as_json, trigger_document(trigger), f"{past} {_line(trigger)}")


@triggers.command("pause")
@click.argument("name")
@database_option
@json_option
def pause(name: str, database_url: str | None, as_json: bool) -> None:
    """Stop firing NAME; firings that fall in the pause are never caught up."""
    _change("pause", name, database_url, as_json)


@triggers.command("resume")
@click.argument("name")
@database_option
@json_option
def resume(name: str, database_url: str | None, as_json: bool) -> None:
    """Fire NAME again, from its first scheduled time after now."""
    _change("resume", name, database_url, as_json)


@triggers.command("delete")
@click.argument("name")
@database_option
@json_option
def delete(name: str, database_url: str | None, as_json: bool) -> None:
    """Delete NAME: it never fires again; the runs it admitted stay."""
    _change("delete", name, database_url, as_json)


# --- ql3 workflows --------------------------------------------------------------------------------


@click.group()
def workflows() -> None:
    """Workflows: a DAG of task steps, each a run of its own."""


@workflows.command("submit")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@database_option
@json_option
def submit(file: Path, database_url: str | None, as_json: bool) -> None:
    """Admit the workflow in FILE.json: {"name": ..., "steps": [{"id", "task", "input",
    "after": [step ids], "policy": {...}}]}. A step's task receives the outputs of the steps
    it comes after as context.parents (ADR 0021). A refused DAG writes nothing."""
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise click.UsageError(f"cannot read {file}: {error}") from None
    except json.JSONDecodeError as error:
        raise click.UsageError(f"{file} is not JSON: {error.msg} (line {error.lineno})") from None
    if not isinstance(document, dict):
        raise click.UsageError(f"{file} must hold a JSON object")
    from ql3.domain.workflows import workflow_from_document

    spec = workflow_from_document(document)  # refused before any database is opened
    with _container(database_url) as container:
        run_id = container.core.workflows().submit(spec)
    _emit(as_json, {"run_id": run_id, "steps": len(spec.steps)}, run_id)


def _workflow_service(container: Any) -> Any:
    return container.core.workflows()


def _unknown_workflow(workflow_id: str) -> Exception:
    from ql3.adapters.cli.main import Failure

    return Failure(f"not found: workflow {workflow_id}")


@workflows.command("list")
@click.option(
    "--status",
    type=click.Choice([s.value for s in RunStatus]),
    default=None,
    help="Only the workflows in this status.",
)
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@database_option
@json_option
def list_workflows(status: str | None, limit: int, database_url: str | None, as_json: bool) -> None:
    """List workflows, the most recent first."""
    with _container(database_url) as container:
        found = _workflow_service(container).list_workflows(
            RunStatus(status) if status else None, limit
        )
    rows = [
        {
            "run_id": run.id,
            "name": run.task,
            "status": run.status.value,
            "steps": len(run.input["steps"]) if isinstance(run.input, dict) else None,
            "created_at": _iso(run.created_at_ms),
            "error": run.error,
        }
        for run in found
    ]
    text = "\n".join(
        f"{r['run_id']}  {r['status']:<9} {r['name']}  {r['steps']} steps  {r['created_at']}"
        + (f"  {r['error']}" if r["error"] else "")
        for r in rows
    )
    _emit(as_json, {"workflows": rows}, text or "no workflows")


def workflow_document(view: Any) -> dict[str, JsonValue]:
    run = view.run
    return {
        "run_id": run.id,
        "name": run.task,
        "status": run.status.value,
        "error": run.error,
        "output": run.output,
        "created_at": _iso(run.created_at_ms),
        "steps": [
            {
                "id": v.step.step_id,
                "task": v.step.task,
                "after": list(v.step.after),
                "status": v.step.status.value,
                "run_id": v.step.run_id,
                "run_status": v.run.status.value if v.run is not None else None,
                "attempts": v.run.attempt_count if v.run is not None else 0,
                "output": v.run.output if v.run is not None else None,
                "error": v.run.error if v.run is not None else None,
            }
            for v in view.steps
        ],
    }


def _tree(document: dict[str, Any]) -> str:
    """The steps as an indented tree: each under the first step it comes after (declaration
    order), the others it waits for named beside it."""
    steps = document["steps"]
    children: dict[str | None, list[dict[str, Any]]] = {}
    for step in steps:
        children.setdefault(step["after"][0] if step["after"] else None, []).append(step)
    lines = [
        f"workflow {document['run_id']}  {document['name']}  {document['status']}"
        + (f"  {document['error']}" if document["error"] else "")
    ]

    def walk(parent: str | None, depth: int) -> None:
        for step in children.get(parent, []):
            also = step["after"][1:]
            run = (
                f"run {step['run_id']} {step['run_status']}, {step['attempts']} attempt(s)"
                if step["run_id"]
                else "no run yet" if step["status"] == "pending" else "no run"
            )
            lines.append(
                f"{'  ' * depth}- {step['id']}  {step['status']:<9} task {step['task']}  {run}"
                + (f"  (also after {', '.join(also)})" if also else "")
                + (f"  error: {step['error']}" if step["error"] else "")
            )
            walk(step["id"], depth + 1)

    walk(None, 1)
    return "\n".join(lines)


@workflows.command("show")
@click.argument("workflow_id")
@database_option
@json_option
def show(workflow_id: str, database_url: str | None, as_json: bool) -> None:
    """Show a workflow: its status and each step's, as an indented tree."""
    from ql3.application.workflows import UnknownWorkflow

    with _container(database_url) as container:
        try:
            view = _workflow_service(container).get(workflow_id)
        except UnknownWorkflow:
            raise _unknown_workflow(workflow_id) from None
    document = workflow_document(view)
    _emit(as_json, document, _tree(document))


@workflows.command("cancel")
@click.argument("workflow_id")
@click.option(
    "--reason", default="cancelled by operator", show_default=True, help="Why (kept as error)."
)
@database_option
@json_option
def cancel(workflow_id: str, reason: str, database_url: str | None, as_json: bool) -> None:
    """Cancel a workflow now: every step not finished is cancelled with its run; a running
    step's task is stopped by its worker at its next call to the node (ADR 0017)."""
    from ql3.adapters.cli.main import Failure
    from ql3.application.workflows import UnknownWorkflow
    from ql3.domain.errors import InvalidTransition
    from ql3.domain.transitions import MAX_CANCEL_REASON_LENGTH

    if not reason.strip() or len(reason) > MAX_CANCEL_REASON_LENGTH or "\x00" in reason:
        raise click.UsageError(
            f"--reason must be 1..{MAX_CANCEL_REASON_LENGTH} characters, without NUL"
        )
    with _container(database_url) as container:
        try:
            was = _workflow_service(container).cancel(workflow_id, reason)
        except UnknownWorkflow:
            raise _unknown_workflow(workflow_id) from None
        except InvalidTransition as refused:
            raise Failure(
                f"workflow {workflow_id} is {refused.status}: a finished workflow cannot be "
                "cancelled; nothing changed"
            ) from None
    document = {"run_id": workflow_id, "status": RunStatus.CANCELLED.value, "was": was.value}
    _emit(as_json, document, f"cancelled workflow {workflow_id} (was {was.value})")
