"""The Standalone and Edge runner in this process, on a SQLite file: Edge's zero cycles while
idle, its sleep until the next due time, the drain on stop and the database's exclusive lock."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ql3.adapters.standalone import AlreadyRunning, StandaloneRunner
from ql3.adapters.standalone.runner import MIN_CYCLE_GAP_S
from ql3.application.queries import RunQueries
from ql3.application.worker_commands import Grant
from ql3.bootstrap import edge, standalone
from ql3.domain.model import AttemptStatus, EvidenceKind, RunStatus, SessionStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety
from tests.standalone.support import REPO, wait_for
from tests.standalone.tasks import TASKS

SAFE = RetryPolicy(
    retry_on_lost=True,
    max_attempts=3,
    safety=Safety.IDEMPOTENT,
    backoff=Backoff(initial_ms=800, cap_ms=800),
)


class Serving:
    """A runner serving on a thread of this process."""

    def __init__(self, container: Any, runner: StandaloneRunner) -> None:
        self.container = container
        self.runner = runner
        self.lines: list[str] = []
        self.thread = threading.Thread(target=runner.serve, daemon=True)

    def status(self, run_id: str) -> RunStatus:
        view = RunQueries(self.container.store().unit_of_work).show(run_id)
        assert view is not None
        return view.run.status

    def settled(self, run_id: str) -> bool:
        return self.status(run_id).is_terminal

    def stop(self) -> None:
        self.runner.request_stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    started: list[Serving] = []

    def start(profile: Any, **settings: Any) -> Serving:
        settings.setdefault("database_path", str(tmp_path / "ql3.sqlite"))
        container = profile.build(**settings)
        lines: list[str] = []
        runner = container.runner(tasks=TASKS, emit=lines.append)
        serving = Serving(container, runner)
        serving.lines = lines
        runner.boot()
        serving.thread.start()
        started.append(serving)
        return serving

    yield start
    for serving in started:
        if serving.thread.is_alive():
            serving.stop()
        serving.container.store().close()


def _quiet(runner: StandaloneRunner, seconds: float) -> tuple[int, int]:
    """Cycles and wake-ups of the runner during ``seconds`` of idleness."""
    cycles, wakeups = runner.cycles, runner.wakeups
    time.sleep(seconds)
    return runner.cycles - cycles, runner.wakeups - wakeups


def test_an_idle_edge_process_makes_zero_cycles_until_a_submit_from_another_process(
    serve: Any, tmp_path: Path
) -> None:
    served = serve(edge, lease_ttl_s=2.0)
    wait_for(lambda: served.runner.cycles >= 1, 5, "the first cycle")
    time.sleep(0.2)
    assert _quiet(served.runner, 2.0) == (0, 0)

    database = tmp_path / "ql3.sqlite"
    submitted = subprocess.run(
        [sys.executable, "-m", "ql3.adapters.cli.main", "submit", "echo", "--input", '{"x": 1}',
         "--database-url", f"sqlite:///{database}", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    run_id = json.loads(submitted.stdout)["run_id"]
    wait_for(lambda: served.settled(run_id), 10, "the submitted run to finish")
    assert served.status(run_id) is RunStatus.SUCCEEDED
    assert served.runner.cycles >= 1
    # The cycle a finished task asks for (a workflow's next step) runs within MIN_CYCLE_GAP_S;
    # after it, nothing.
    time.sleep(MIN_CYCLE_GAP_S + 0.3)
    assert _quiet(served.runner, 1.0) == (0, 0)


def test_a_resident_standalone_process_keeps_its_cadence(serve: Any) -> None:
    served = serve(standalone, resident_cadence_s=0.2)
    cycles, _ = _quiet(served.runner, 1.0)
    assert cycles >= 3


def _claimed_by_a_vanished_process(tmp_path: Path) -> tuple[str, Grant]:
    """The "previous process" on the database: its session claimed and started an idempotent
    run (a lease of 1 s), then the process vanished. The run's id and its grant."""
    before = edge.build(database_path=str(tmp_path / "ql3.sqlite"), lease_ttl_s=1.0)
    try:
        commands = before.core.worker_commands()
        grant = commands.register("standalone", 2, ["hold"])
        run_id = before.core.admission().submit(
            "hold", {"dir": str(tmp_path), "name": "r", "first_s": 0, "later_s": 0}, SAFE
        )
        (claimed,) = commands.claim(grant.session_id, grant.secret, limit=1).grants
        assert claimed.run_id == run_id
        return run_id, claimed
    finally:
        before.store().close()


def test_edge_sleeps_until_the_leases_of_the_previous_process_expire_and_the_retry_is_due(
    serve: Any, tmp_path: Path
) -> None:
    run_id, _ = _claimed_by_a_vanished_process(tmp_path)

    started = time.monotonic()
    served = serve(edge, lease_ttl_s=1.0)
    wait_for(lambda: served.settled(run_id), 15, "the lost run to be retried and finish")
    elapsed = time.monotonic() - started
    view = RunQueries(served.container.store().unit_of_work).show(run_id)
    assert view is not None and view.run.status is RunStatus.SUCCEEDED
    first, second = view.attempts
    assert first.attempt.lost_evidence is EvidenceKind.SESSION_REPLACED
    assert second.attempt.status is AttemptStatus.SUCCEEDED
    # The lease had up to 1 s left and the backoff is 0.8 s: Edge woke for those due times
    # (and for its own task), not on a cadence.
    assert elapsed >= 0.8
    assert served.runner.wakeups <= 10, served.lines
    time.sleep(MIN_CYCLE_GAP_S + 0.3)
    assert _quiet(served.runner, 1.0) == (0, 0)


def test_a_lease_that_expires_while_startup_recovery_runs_gets_the_second_pass_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id, claimed = _claimed_by_a_vanished_process(tmp_path)
    container = edge.build(database_path=str(tmp_path / "ql3.sqlite"), lease_ttl_s=1.0)
    lines: list[str] = []
    runner = container.runner(tasks=TASKS, emit=lines.append)
    startup = runner._startup
    first_pass = startup.run

    def slow_boot() -> Any:
        # Startup recovery finds the lease live; the boot then takes until it has expired.
        report = first_pass()
        time.sleep(max(0.0, claimed.expires_at_ms / 1000 - time.time()) + 0.05)
        return report

    monkeypatch.setattr(startup, "run", slow_boot)
    served = Serving(container, runner)
    served.lines = lines
    runner.boot()
    assert "startup recovery: nothing to recover" in lines
    served.thread.start()
    try:
        wait_for(lambda: served.settled(run_id), 10, "the expired lease to be recovered")
        view = RunQueries(container.store().unit_of_work).show(run_id)
        assert view is not None and view.run.status is RunStatus.SUCCEEDED
        first, second = view.attempts
        assert first.attempt.lost_evidence is EvidenceKind.SESSION_REPLACED
        assert second.attempt.status is AttemptStatus.SUCCEEDED
    finally:
        served.stop()
        container.store().close()


def test_stopping_drains_then_abandons_what_still_runs_and_the_next_boot_settles_it(
    serve: Any, tmp_path: Path
) -> None:
    served = serve(standalone, drain_timeout_s=0.3, lease_ttl_s=3.0)
    admission = served.container.core.admission()
    quick = admission.submit("echo", "hi")
    slow = admission.submit(
        "hold", {"dir": str(tmp_path), "name": "slow", "first_s": 30, "later_s": 0}, SAFE
    )
    wait_for(lambda: served.settled(quick), 10, "the quick run")
    wait_for(lambda: (tmp_path / "slow-1").exists(), 10, "the slow task to start")
    session_id = served.runner.session_id
    served.stop()

    with served.container.store().unit_of_work() as uow:
        attempt = uow.runs.attempts_of(slow)[0]
        session = uow.sessions.get(session_id)
    assert attempt.status is AttemptStatus.LOST
    assert attempt.lost_evidence is EvidenceKind.WORKER_ABANDONED
    assert session is not None and session.status is SessionStatus.CLOSED
    assert any("abandoned" in line for line in served.lines)

    again = serve(standalone, drain_timeout_s=0.3, lease_ttl_s=3.0)
    wait_for(lambda: again.settled(slow), 10, "the abandoned run to be retried")
    assert again.status(slow) is RunStatus.SUCCEEDED


def test_a_second_process_on_the_same_database_is_refused(serve: Any, tmp_path: Path) -> None:
    serve(edge)
    container = edge.build(database_path=str(tmp_path / "ql3.sqlite"))
    try:
        with pytest.raises(AlreadyRunning, match="another process"):
            container.runner(tasks=TASKS).boot()
    finally:
        container.store().close()


def test_a_second_stop_request_abandons_running_tasks_at_once(
    serve: Any, tmp_path: Path
) -> None:
    served = serve(edge, drain_timeout_s=60.0)
    run_id = served.container.core.admission().submit(
        "hold", {"dir": str(tmp_path), "name": "slow", "first_s": 30, "later_s": 0}, SAFE
    )
    wait_for(lambda: (tmp_path / "slow-1").exists(), 10, "the slow task to start")
    started = time.monotonic()
    served.runner.request_stop()
    time.sleep(0.3)
    assert served.thread.is_alive()  # draining: waiting for the task
    served.runner.request_stop()
    served.thread.join(timeout=10)
    assert not served.thread.is_alive()
    assert time.monotonic() - started < 5
    with served.container.store().unit_of_work() as uow:
        assert uow.runs.attempts_of(run_id)[0].status is AttemptStatus.LOST


def test_an_idle_edge_process_wakes_for_a_delayed_run_submitted_from_another_process(
    serve: Any, tmp_path: Path
) -> None:
    served = serve(edge, lease_ttl_s=2.0)
    wait_for(lambda: served.runner.cycles >= 1, 5, "the first cycle")
    time.sleep(0.2)
    assert _quiet(served.runner, 1.0) == (0, 0)

    database = tmp_path / "ql3.sqlite"
    submitted = subprocess.run(
        [sys.executable, "-m", "ql3.adapters.cli.main", "submit", "echo", "--input", '{"x": 2}',
         "--delay", "1.5", "--database-url", f"sqlite:///{database}", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    run_id = json.loads(submitted.stdout)["run_id"]
    wait_for(lambda: served.settled(run_id), 15, "the delayed run to finish")
    view = RunQueries(served.container.store().unit_of_work).show(run_id)
    assert view is not None and view.run.status is RunStatus.SUCCEEDED
    [attempt] = view.attempts
    # Its Attempt 1 was made when the store's clock reached the due time, not before.
    assert attempt.attempt.created_at_ms >= view.run.created_at_ms + 1_500
    assert [kind for _seq, kind, _at, _attempt, _data in view.events][:2] == [
        "run_admitted", "attempt_created",
    ]
    # Woken by the submit (to learn the due time) and at the due time, not on a cadence.
    assert served.runner.wakeups <= 10, served.lines
    time.sleep(MIN_CYCLE_GAP_S + 0.3)
    assert _quiet(served.runner, 1.0) == (0, 0)
