"""Load ``MODULE:ATTR`` task mappings and call one task with its JSON input."""

from __future__ import annotations

import importlib
import inspect
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ql3.domain import step_input

# asyncio is imported when an ``async def`` task runs: a slot's child process loads this module
# at start-up, and most task mappings never need an event loop.

TaskMapping = Mapping[str, Callable[..., Any]]


class AppLoadError(Exception):
    """The ``MODULE:ATTR`` spec does not name a mapping of task names to callables."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskContext:
    """What a task may learn about the attempt running it.

    ``idempotency_key`` is the same for every attempt of one run, so a task can hand it to an
    external system that deduplicates requests. A workflow step that comes after other steps
    also learns its workflow, its step id and ``parents``: each parent step's output by step id,
    fixed when its run was admitted (the same for every attempt, ADR 0021); empty otherwise."""

    run_id: str
    attempt_number: int
    idempotency_key: str
    parents: Mapping[str, Any] = field(default_factory=dict)
    workflow_run_id: str | None = None
    step_id: str | None = None


def load_app(spec: str) -> dict[str, Callable[..., Any]]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AppLoadError(f"--app must be MODULE:ATTR, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AppLoadError(f"cannot import {module_name!r}: {exc}") from None
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise AppLoadError(f"{module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if callable(target) and not isinstance(target, Mapping):
        target = target()
    if not isinstance(target, Mapping) or not target:
        raise AppLoadError(f"{spec} must be a non-empty mapping of task names to callables")
    tasks: dict[str, Callable[..., Any]] = {}
    for name, fn in target.items():
        if not isinstance(name, str) or not name or not callable(fn):
            raise AppLoadError(f"{spec}: entry {name!r} is not a task name mapped to a callable")
        tasks[name] = fn
    return tasks


# Per task callable, whether it takes ``context``: read from its signature once.
_ACCEPTS_CONTEXT: dict[Callable[..., Any], bool] = {}
_ACCEPTS_CONTEXT_LIMIT = 1024


def _accepts_context(fn: Callable[..., Any]) -> bool:
    try:
        return _ACCEPTS_CONTEXT[fn]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable: never remembered
        return _reads_context(fn)
    if len(_ACCEPTS_CONTEXT) >= _ACCEPTS_CONTEXT_LIMIT:
        _ACCEPTS_CONTEXT.clear()
    accepts = _ACCEPTS_CONTEXT[fn] = _reads_context(fn)
    return accepts


def _reads_context(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if "context" in parameters:
        return parameters["context"].kind in (
            inspect.Parameter.KEYWORD_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        )
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def invoke_task(
    fn: Callable[..., Any],
    payload: Any,
    context: TaskContext,
    *,
    run: Callable[[Any], Any] | None = None,
) -> Any:
    """Call ``fn(payload)`` (with ``context=`` when it takes it) and check the result is JSON.
    An ``async def`` task runs to its end on an event loop: ``run`` (the awaitable's runner;
    :func:`run_awaitable` by default).

    A workflow step's input snapshot is unwrapped first: the task gets the step's own input,
    ``context`` its parents' outputs (:mod:`ql3.domain.step_input`).

    Any exception, including a result that is not JSON, propagates: the caller fails the
    attempt with it."""
    payload, step = step_input.split(payload)
    if step is not None:
        context = replace(
            context,
            parents=step["parents"],
            workflow_run_id=step.get("workflow_run_id"),
            step_id=step.get("step"),
        )
    result = fn(payload, context=context) if _accepts_context(fn) else fn(payload)
    if inspect.isawaitable(result):
        result = (run or run_awaitable)(result)
    json.dumps(result)
    return result


def is_async_task(fn: Callable[..., Any]) -> bool:
    """An ``async def`` task (or a callable object whose ``__call__`` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004  (a callable object's own method)
    )


def run_awaitable(awaitable: Any) -> Any:
    """Run ``awaitable`` on a new event loop; on a thread of its own when this thread already
    runs a loop (a task called inline from asyncio code)."""

    import asyncio

    async def body() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(body())
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = asyncio.run(body())
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, name="ql3-inline-task")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def describe_failure(error: BaseException, limit: int) -> str:
    """What a failed task reports as its error: the exception's type and message on the first
    line, then, after a blank line, its traceback (the innermost frames kept when it is long);
    at most ``limit`` characters."""
    import traceback

    head = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    head = head[:limit]
    frames = "".join(traceback.format_exception(error)).rstrip()
    room = limit - len(head) - 2
    if room < 200:
        return head
    if len(frames) > room:
        frames = "...\n" + frames[-(room - 4) :]
    return f"{head}\n\n{frames}"
