"""Every parameter of ``runtime.submit()`` at its boundaries: a value inside its range is
admitted as given; one outside it raises a ``ql3.Error`` (never another exception) and nothing is
written. No value is taken for "not given"."""

from __future__ import annotations

import datetime as dt
import inspect
from typing import Any

import pytest

import ql3
from ql3 import Backoff, RetryPolicy, TaskRegistry
from ql3.domain.model import MAX_DELAY_MS, MAX_PRIORITY, MAX_TIMEOUT_MS, MIN_PRIORITY
from ql3.domain.policy import MAX_ATTEMPTS_LIMIT, MAX_BACKOFF_MS, MAX_BACKOFF_MULTIPLIER

tasks = TaskRegistry()


@tasks.task
def quick(payload: object) -> object:
    return payload


def _policy(**changes: Any) -> Any:
    """A policy built from ``changes``, or the error building it raised (itself a refusal)."""
    try:
        return RetryPolicy(**changes)
    except Exception as error:
        return error


def _backoff(**changes: Any) -> Any:
    try:
        return RetryPolicy(safety="idempotent", retry_on_lost=True, backoff=Backoff(**changes))
    except Exception as error:
        return error


ACCEPTED: dict[str, list[Any]] = {
    "task": [quick, "quick"],
    "input": [None, {"a": [1, "x"]}, "t" * 1000],
    "policy": [
        None,
        _policy(max_attempts=1),
        _policy(max_attempts=MAX_ATTEMPTS_LIMIT, safety="deduplicated", retry_on_error=True),
        _backoff(initial_ms=0, cap_ms=0),
        _backoff(initial_ms=MAX_BACKOFF_MS, cap_ms=MAX_BACKOFF_MS),
        _backoff(multiplier=1.0),
        _backoff(multiplier=MAX_BACKOFF_MULTIPLIER, jitter=1.0),
    ],
    "timeout": [None, 0.001, MAX_TIMEOUT_MS / 1000],
    "priority": [MIN_PRIORITY, 0, MAX_PRIORITY],
    "delay": [None, 0, dt.timedelta(0), MAX_DELAY_MS / 1000, dt.timedelta(days=3650)],
    "run_after": [None, dt.datetime(2020, 1, 1), dt.datetime(2030, 1, 1, tzinfo=dt.UTC)],
    "unique_key": [None, "k", "k" * 400],
    "transaction": [None],
}
REFUSED: dict[str, list[Any]] = {
    "task": ["", "missing", " quick", 7],
    "input": [{1, 2}, "a\x00b", {"k": float("nan")}],
    "policy": [
        "policy",
        _policy(max_attempts=0),
        _policy(max_attempts=MAX_ATTEMPTS_LIMIT + 1),
        _policy(max_attempts=1.5),
        _policy(max_attempts=True),
        _policy(safety="careful"),
        _policy(safety="unsafe", retry_on_error=True),
        _policy(retry_on_lost="yes"),
        _backoff(initial_ms=-1),
        _backoff(initial_ms=MAX_BACKOFF_MS + 1, cap_ms=MAX_BACKOFF_MS + 1),
        _backoff(initial_ms=1.5),
        _backoff(initial_ms=10, cap_ms=9),
        _backoff(multiplier=0.999),
        _backoff(multiplier=MAX_BACKOFF_MULTIPLIER + 1),
        _backoff(multiplier=float("nan")),
        _backoff(jitter=-0.1),
        _backoff(jitter=1.1),
        _backoff(jitter=float("nan")),
    ],
    "timeout": [0, -1, MAX_TIMEOUT_MS / 1000 + 1, float("nan"), float("inf"), True, "5"],
    "priority": [MIN_PRIORITY - 1, MAX_PRIORITY + 1, 1.5, True, None, "1"],
    "delay": [
        -0.001,
        MAX_DELAY_MS / 1000 + 1,
        dt.timedelta(days=3651),
        dt.timedelta(seconds=-1),
        float("nan"),
        float("inf"),
        True,
        "5",
    ],
    "run_after": ["2030-01-01", 0, dt.date(2030, 1, 1)],
    "unique_key": ["", "k" * 401, "a\x00b", 5],
    "transaction": [object()],
}


@pytest.fixture
def runtime() -> Any:
    return ql3.testing.in_memory(tasks)


def test_the_tables_name_every_parameter_of_submit() -> None:
    parameters = set(inspect.signature(ql3.Runtime.submit).parameters) - {"self"}
    assert set(ACCEPTED) == parameters
    assert set(REFUSED) == parameters


@pytest.mark.parametrize(
    ("name", "value"),
    [pytest.param(name, value, id=f"{name}-{i}") for name, values in ACCEPTED.items()
     for i, value in enumerate(values)],
)
def test_a_value_inside_its_range_is_admitted(runtime: Any, name: str, value: Any) -> None:
    assert not isinstance(value, Exception), value
    arguments: dict[str, Any] = {"task": quick, "input": {"n": 1}, name: value}
    run_id = runtime.submit(**arguments)
    info = runtime.get(run_id)
    assert [run.id for run in runtime.runs()] == [run_id]
    if name == "policy" and value is not None:
        assert info.policy == value


@pytest.mark.parametrize(
    ("name", "value"),
    [pytest.param(name, value, id=f"{name}-{i}") for name, values in REFUSED.items()
     for i, value in enumerate(values)],
)
def test_a_value_outside_its_range_is_refused_and_nothing_is_written(
    runtime: Any, name: str, value: Any
) -> None:
    if isinstance(value, Exception):  # the policy itself could not be built: a ql3.Error
        assert isinstance(value, ql3.Error), repr(value)
        return
    arguments: dict[str, Any] = {"task": quick, "input": {"n": 1}, name: value}
    with pytest.raises(ql3.Error):
        runtime.submit(**arguments)
    assert runtime.runs() == []


def test_the_errors_share_one_base_and_keep_their_builtin_kinds() -> None:
    assert issubclass(ql3.DomainError, ql3.Error)
    assert issubclass(ql3.UnknownRun, ql3.Error) and issubclass(ql3.UnknownRun, LookupError)
    assert issubclass(ql3.WaitTimeout, ql3.Error) and issubclass(ql3.WaitTimeout, TimeoutError)
    assert issubclass(ql3.UnsupportedTransaction, ql3.Error)
    assert issubclass(ql3.UnsupportedTransaction, TypeError)
    assert issubclass(ql3.InvalidDuration, ql3.Error)
    assert issubclass(ql3.InvalidDuration, ValueError)
    for name in ql3.__all__:
        value = getattr(ql3, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert issubclass(value, ql3.Error), name
