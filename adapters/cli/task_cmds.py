"""``ql3 tasks limit|limits``: per-task limits on the Attempts running at once, cluster-wide
(ADR 0014). Errors follow the command line's rules: one line on stderr, exit 2 for bad input,
1 for not found or failure, nothing written."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click

from ql3.adapters.cli.trigger_cmds import database_option, json_option
from ql3.application.task_limits import TaskLimits
from ql3.domain.dispatch import MAX_TASK_LIMIT, TaskLimit
from ql3.domain.model import JsonValue


def limit_document(limit: TaskLimit) -> dict[str, JsonValue]:
    return {
        "task": limit.task,
        "max_running": limit.max_running,
        "updated_at_ms": limit.updated_at_ms,
        "updated_at": datetime.fromtimestamp(limit.updated_at_ms / 1000, tz=UTC).isoformat(
            timespec="milliseconds"
        ),
    }


def _emit(as_json: bool, document: object, lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(document, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)


@click.group()
def tasks() -> None:
    """Limits on the attempts of a task running at once, across the cluster."""


# A negative count reads as a bad count, not as an unknown option.
@tasks.command("limit", context_settings={"ignore_unknown_options": True})
@click.argument("task")
@click.argument("max_running", required=False, type=click.IntRange(0, MAX_TASK_LIMIT))
@click.option("--clear", is_flag=True, help="Remove the task's limit.")
@database_option
@json_option
def limit_command(
    task: str, max_running: int | None, clear: bool, database_url: str | None, as_json: bool
) -> None:
    """Let at most MAX_RUNNING attempts of TASK run at once (0 stops its claims), or --clear."""
    from ql3.adapters.cli.main import Failure, _fail_usage, _producer

    if clear == (max_running is not None):
        _fail_usage("give either MAX_RUNNING or --clear")
    if not task or task.strip() != task:
        _fail_usage(f"a task name has no padding, got {task!r}")
    with _producer(database_url) as producer:
        limits = TaskLimits(producer.store.unit_of_work)
        if max_running is not None:
            limit = limits.set(task, max_running)
            _emit(
                as_json,
                limit_document(limit),
                [f"{task}: at most {max_running} running at once"],
            )
            return
        if not limits.clear(task):
            raise Failure(f"not found: no limit on task {task}")
    _emit(as_json, {"task": task, "cleared": True}, [f"{task}: no limit"])


@tasks.command("limits")
@database_option
@json_option
def limits_command(database_url: str | None, as_json: bool) -> None:
    """List the task limits."""
    from ql3.adapters.cli.main import _producer

    with _producer(database_url) as producer:
        found = TaskLimits(producer.store.unit_of_work).all()
    lines = [f"{'TASK':<32} {'MAX_RUNNING':>11}  UPDATED_AT"]
    for limit in found:
        document = limit_document(limit)
        lines.append(f"{limit.task:<32} {limit.max_running:>11}  {document['updated_at']}")
    if not found:
        lines = ["no task limits"]
    _emit(as_json, {"limits": [limit_document(limit) for limit in found]}, lines)
