"""Tasks declared with their policy template; what a submit admits."""

from __future__ import annotations

import math

import pytest

from ql3 import (
    Backoff,
    InvalidAdmission,
    InvalidInput,
    RetryPolicy,
    Safety,
    TaskRegistry,
    UnknownTask,
)
from ql3.adapters.execution import load_app
from ql3.application.tasks import policy_template
from tests.api.tasks import TASKS, double_async, resize


def test_the_decorator_keeps_the_function_and_its_template() -> None:
    definition = TASKS.definition(resize)
    assert definition.name == "resize"
    assert definition.fn is resize
    assert definition.policy == RetryPolicy(
        retry_on_lost=True,
        max_attempts=3,
        safety=Safety.IDEMPOTENT,
        backoff=Backoff(initial_ms=1000),
    )
    assert TASKS.definition("double").fn is double_async
    assert TASKS.definition("echo").policy is None  # nothing declared: no policy, as today


def test_a_request_snapshots_the_template_or_the_override() -> None:
    assert TASKS.request(resize, {"id": 1}).policy == TASKS.definition("resize").policy
    override = RetryPolicy(max_attempts=2, safety=Safety.UNSAFE)
    request = TASKS.request("resize", {"id": 1}, policy=override)
    assert (request.task, request.input, request.policy) == ("resize", {"id": 1}, override)


def test_unknown_tasks_and_non_json_inputs_are_refused() -> None:
    with pytest.raises(UnknownTask, match="no task 'nope' is declared"):
        TASKS.request("nope")
    with pytest.raises(UnknownTask, match="is not a declared task"):
        TASKS.request(lambda payload: payload)
    with pytest.raises(InvalidInput, match="not JSON"):
        TASKS.request("echo", {"when": object()})
    with pytest.raises(InvalidInput, match="not JSON"):
        TASKS.request("echo", math.nan)


def test_declarations_are_checked_when_made() -> None:
    registry = TaskRegistry()
    registry.add(print, name="first")
    with pytest.raises(InvalidAdmission, match="declared twice"):
        registry.add(print, name="first")
    with pytest.raises(InvalidAdmission, match="safety must be one of"):
        registry.task(safety="sometimes")
    with pytest.raises(InvalidAdmission, match="either as policy= or as its parts"):
        registry.task(policy=RetryPolicy(), max_attempts=2)
    assert policy_template() is None
    assert policy_template(max_attempts=2) == RetryPolicy(max_attempts=2)


def test_a_registry_is_the_task_mapping_every_executor_loads() -> None:
    loaded = load_app("tests.api.tasks:TASKS")
    assert sorted(loaded) == ["charge", "double", "echo", "explode", "gather", "resize"]
    assert loaded["double"] is double_async
