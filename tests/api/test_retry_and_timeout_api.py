"""The Python API of retry on error and execution timeouts (ADR 0013): the task decorator takes
``retry_on_error=`` and ``timeout=``, submit takes ``timeout=``; the in-memory runtime retries a
failing task at its due time and fails a task that runs past its timeout (an async task is
cancelled there; a plain function, which cannot be stopped inline, fails once it returns)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from ql3 import InvalidAdmission, InvalidRetryPolicy, RetryPolicy, RunStatus, Safety
from ql3.application.tasks import TaskRegistry
from ql3.testing import InMemoryRuntime, in_memory

tasks = TaskRegistry()
calls: list[int] = []


@tasks.task(safety="idempotent", retry_on_error=True, max_attempts=3)
def flaky(payload: dict[str, int]) -> int:
    calls.append(1)
    if len(calls) <= payload["failures"]:
        raise RuntimeError(f"failure {len(calls)}")
    return len(calls)


@tasks.task(timeout=0.05)
async def slow_async(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "done"


@tasks.task(safety="deduplicated", retry_on_error=True, max_attempts=2, timeout=0.05)
def slow_sync(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


@tasks.task
def quick(payload: object) -> object:
    return payload


@pytest.fixture
def rt() -> Iterator[InMemoryRuntime]:
    calls.clear()
    runtime = in_memory(tasks)
    yield runtime
    runtime.close()


def test_a_failing_task_is_retried_at_its_due_time(rt: InMemoryRuntime) -> None:
    run_id = rt.submit(flaky, {"failures": 2})
    rt.run_due()
    assert rt.get(run_id).status is RunStatus.RETRY_WAIT
    rt.advance(seconds=1)  # the default backoff: 1 s, then 2 s
    rt.run_due()
    assert rt.get(run_id).status is RunStatus.RETRY_WAIT
    rt.advance(seconds=2)
    rt.run_due()
    info = rt.get(run_id)
    assert (info.status, info.output, info.attempts) == (RunStatus.SUCCEEDED, 3, 3)
    assert rt.events(run_id).count("attempt_failed") == 2


def test_exhausted_attempts_fail_the_run(rt: InMemoryRuntime) -> None:
    run_id = rt.submit(flaky, {"failures": 5})
    for seconds in (1, 2, 4):
        rt.run_due()
        rt.advance(seconds=seconds)
    info = rt.get(run_id)
    assert (info.status, info.attempts) == (RunStatus.FAILED, 3)
    assert info.error is not None and info.error.splitlines()[0] == "RuntimeError: failure 3"


def test_an_async_task_past_its_timeout_is_cancelled_and_fails(rt: InMemoryRuntime) -> None:
    run_id = rt.submit(slow_async, 30)
    rt.run_due()
    info = rt.get(run_id)
    assert (info.status, info.error) == (RunStatus.FAILED, "timed out after 0.05 s")


def test_a_sync_task_that_returns_after_its_timeout_fails_and_is_retried(
    rt: InMemoryRuntime,
) -> None:
    run_id = rt.submit(slow_sync, 0.2)
    rt.run_due()
    assert rt.get(run_id).status is RunStatus.RETRY_WAIT
    rt.advance(seconds=1)
    rt.run_due()
    info = rt.get(run_id)
    assert (info.status, info.attempts, info.error) == (
        RunStatus.FAILED,
        2,
        "timed out after 0.05 s",
    )


def test_submit_overrides_the_tasks_timeout(rt: InMemoryRuntime) -> None:
    run_id = rt.submit(slow_async, 0.01, timeout=30)
    assert rt.wait(run_id).output == "done"
    quick_id = rt.submit(quick, 1, timeout=0.5)
    with rt.store.unit_of_work() as uow:
        run = uow.runs.get_run(quick_id)
    assert run is not None and run.timeout_ms == 500


@pytest.mark.parametrize("timeout", [0, -1, True, "5", 10**9])
def test_bad_timeouts_are_refused(rt: InMemoryRuntime, timeout: object) -> None:
    with pytest.raises(InvalidAdmission):
        rt.submit(quick, 1, timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(InvalidAdmission):
        TaskRegistry().task(quick, timeout=timeout)  # type: ignore[arg-type]
    assert rt.runs() == []


def test_retry_on_error_needs_a_safe_declaration() -> None:
    registry = TaskRegistry()
    with pytest.raises(InvalidRetryPolicy, match="retry on error"):
        registry.task(quick, safety="unsafe", retry_on_error=True, max_attempts=3)
    with pytest.raises(InvalidRetryPolicy, match="retry on error"):
        registry.task(quick, retry_on_error=True)
    with pytest.raises(InvalidRetryPolicy):
        RetryPolicy(retry_on_error=True, max_attempts=2, safety=Safety.UNSAFE)
