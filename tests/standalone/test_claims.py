"""The runner on the claim protocol (ADR 0007), in this process on a SQLite file: an admission
from another store is claimed at once through the wake channel, finished tasks complete through
the next claim, cycles do not follow every completion, and Attempts that never began are handed
back (a slot that failed to start, a claim answer that never arrived, a stop between the claim
and the start) and claimed again under the next lease generation."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ql3.adapters.sql.sqlite import SqliteStore
from ql3.adapters.standalone import StandaloneRunner
from ql3.adapters.standalone.pool import InProcessPool
from ql3.adapters.standalone.runner import MIN_CYCLE_GAP_S
from ql3.application.admission import Admission, AdmissionRequest
from ql3.application.identities import RandomIdentities
from ql3.application.queries import RunQueries, RunView
from ql3.application.worker_commands import ClaimAnswer, Completion, WorkerCommands
from ql3.bootstrap import standalone
from ql3.domain.model import AttemptStatus, LeaseStatus, ReleaseReason, RunStatus
from tests.standalone.support import wait_for
from tests.standalone.tasks import TASKS


class Recording:
    """The runner's worker commands, with a record of every claim and completion call.
    ``before_answer`` sees each claim answer before the runner does and may raise instead."""

    def __init__(self, inner: WorkerCommands) -> None:
        self._inner = inner
        self.claims: list[tuple[int, int, tuple[str, ...] | None, ClaimAnswer]] = []
        self.completed_alone: list[int] = []  # per complete_many call: after how many claims
        self.completed_alone_items = 0
        self.before_answer: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def claim(
        self,
        session_id: str,
        secret: str,
        *,
        limit: int,
        completions: Sequence[Completion] = (),
        held: Sequence[str] | None = None,
    ) -> ClaimAnswer:
        answer = self._inner.claim(
            session_id, secret, limit=limit, completions=completions, held=held
        )
        self.claims.append((limit, len(completions), None if held is None else tuple(held), answer))
        if self.before_answer is not None:
            self.before_answer(answer)
        return answer

    def complete_many(self, session_id: str, secret: str, completions: Any) -> Any:
        answer = self._inner.complete_many(session_id, secret, completions)
        self.completed_alone.append(len(self.claims))
        self.completed_alone_items += sum(1 for r in answer.results if r.ok)
        return answer

    @property
    def lease_ttl_ms(self) -> int:
        return self._inner.lease_ttl_ms


class Served:
    def __init__(self, container: Any, runner: StandaloneRunner, lines: list[str]) -> None:
        self.container = container
        self.runner = runner
        self.lines = lines
        self.thread = threading.Thread(target=runner.serve, daemon=True)

    def view(self, run_id: str) -> RunView:
        view = RunQueries(self.container.store().unit_of_work).show(run_id)
        assert view is not None
        return view

    def settled(self, *run_ids: str) -> bool:
        return all(self.view(run_id).run.status.is_terminal for run_id in run_ids)

    def succeeded(self) -> int:
        with self.container.store().unit_of_work() as uow:
            return len(uow.runs.list_runs(RunStatus.SUCCEEDED, 1_000))

    def stop(self) -> None:
        self.runner.request_stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()


@pytest.fixture
def database(tmp_path: Path) -> Path:
    return tmp_path / "ql3.sqlite"


@pytest.fixture
def serve(database: Path) -> Iterator[Any]:
    started: list[Served] = []

    def start(*, before_boot: Any = None, **settings: Any) -> tuple[Served, Recording]:
        settings.setdefault("database_path", str(database))
        container = standalone.build(**settings)
        if before_boot is not None:
            before_boot(container)
        commands = Recording(container.core.worker_commands())
        lines: list[str] = []
        runner = container.runner(tasks=TASKS, emit=lines.append, commands=commands)
        served = Served(container, runner, lines)
        runner.boot()
        served.thread.start()
        started.append(served)
        return served, commands

    yield start
    for served in started:
        if served.thread.is_alive():
            served.stop()
        served.container.store().close()


def _leases(served: Served, run_id: str) -> list[tuple[int, LeaseStatus, ReleaseReason | None]]:
    with served.container.store().unit_of_work() as uow:
        leases = uow.runs.leases_of(run_id)
    return sorted((lease.generation, lease.status, lease.release_reason) for lease in leases)


def _event_kinds(view: RunView) -> list[str]:
    return [kind for _, kind, _, _, _ in view.events]


def test_an_admission_through_another_store_is_claimed_at_once_not_on_the_cadence(
    serve: Any, database: Path
) -> None:
    served, commands = serve(resident_cadence_s=60.0)
    wait_for(lambda: served.runner.cycles >= 1, 5, "the first cycle")
    time.sleep(0.3)
    cycles = served.runner.cycles

    other = SqliteStore(database)  # as another process would: it pokes the wake channel
    try:
        admission = Admission(other.unit_of_work, RandomIdentities())
        run_id = admission.submit("echo", {"x": 1})
    finally:
        other.close()
    wait_for(lambda: served.settled(run_id), 10, "the run to finish")
    view = served.view(run_id)
    assert view.run.status is RunStatus.SUCCEEDED
    attempt = view.attempts[0].attempt
    assert attempt.started_at_ms is not None
    # The cadence is a minute: only the wake-up can have started it, well within a second.
    assert attempt.started_at_ms - view.run.created_at_ms < 1_000
    assert _event_kinds(view)[:2] == ["run_admitted", "attempt_started"]
    granted = [a for _, _, _, a in commands.claims if any(g.run_id == run_id for g in a.grants)]
    assert len(granted) == 1
    assert served.runner.cycles - cycles <= 3


def test_finished_tasks_complete_through_the_next_claim_and_cycles_do_not_follow_each_one(
    serve: Any,
) -> None:
    runs = 100
    ids: list[str] = []

    def admit(container: Any) -> None:
        requests = [AdmissionRequest(task="echo", input=n) for n in range(runs)]
        ids.extend(container.core.admission().submit_many(requests))

    served, commands = serve(before_boot=admit, capacity=4, resident_cadence_s=60.0)
    started = time.monotonic()  # the loop started just before
    wait_for(lambda: served.succeeded() == runs, 60, "every run to finish")
    elapsed = time.monotonic() - started
    assert {served.view(run_id).run.output for run_id in ids} == set(range(runs))

    claims = commands.claims
    granted = [g.run_id for _, _, _, answer in claims for g in answer.grants]
    assert sorted(granted) == sorted(ids)  # each run claimed once
    assert all(r.ok for _, _, _, answer in claims for r in answer.completed)
    completed = sum(len(answer.completed) for _, _, _, answer in claims)
    assert completed + commands.completed_alone_items == runs
    # Everything was queued before the boot: until a claim got fewer than it asked for (the
    # queue was empty then), every completion rode the next claim.
    short = next(i for i, (limit, _, _, a) in enumerate(claims) if len(a.grants) < limit)
    assert short >= len(claims) - 2
    assert all(after > short for after in commands.completed_alone)
    assert commands.completed_alone_items <= 4
    for limit, carried, held, answer in claims:
        assert 1 <= limit <= 4
        assert len(answer.grants) <= limit
        assert held is not None and len(held) <= 4 and carried <= len(held)
        assert answer.released == ()
    # Fewer calls than runs: a claim carries its completions and refills their slots.
    assert len(claims) < runs
    # Cycles follow finished tasks at most every MIN_CYCLE_GAP_S, not once per completion (the
    # resident cadence is a minute): the boot's cycle, then one per gap at most.
    assert served.runner.cycles <= 2 + elapsed / MIN_CYCLE_GAP_S


def test_a_grant_whose_slot_fails_to_start_is_handed_back_and_claimed_again(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_start = InProcessPool.start
    failures: list[str] = []

    def flaky(self: InProcessPool, execution: Any) -> None:
        if not failures:
            failures.append(execution.grant.attempt_id)
            raise RuntimeError("can't start new thread")
        real_start(self, execution)

    monkeypatch.setattr(InProcessPool, "start", flaky)
    served, _ = serve()
    run_id = served.container.core.admission().submit("echo", "again")
    wait_for(lambda: served.settled(run_id), 15, "the handed-back run to be claimed again")

    view = served.view(run_id)
    assert view.run.status is RunStatus.SUCCEEDED
    (attempt,) = view.attempts  # the same Attempt, pristine again, then claimed again
    assert attempt.attempt.id == failures[0]
    assert attempt.attempt.status is AttemptStatus.SUCCEEDED
    assert _leases(served, run_id) == [
        (1, LeaseStatus.RELEASED, ReleaseReason.HANDED_BACK),
        (2, LeaseStatus.RELEASED, ReleaseReason.COMPLETED),
    ]
    kinds = _event_kinds(view)
    assert kinds.index("attempt_started") < kinds.index("attempt_released")
    assert kinds.count("attempt_started") == 2
    assert any("handed back unstarted: slot failed to start" in line for line in served.lines)


def test_a_claim_answer_that_never_arrived_is_handed_back_by_the_next_claim(
    serve: Any,
) -> None:
    served, commands = serve()
    lost: list[ClaimAnswer] = []

    def lose_the_first_grant(answer: ClaimAnswer) -> None:
        if answer.grants and not lost:
            lost.append(answer)
            raise ConnectionError("the answer never arrived")

    commands.before_answer = lose_the_first_grant
    run_id = served.container.core.admission().submit("echo", "lost answer")
    wait_for(lambda: served.settled(run_id), 15, "the run to be handed back and claimed again")

    (answer,) = lost
    (grant,) = answer.grants
    released = [a for _, _, _, a in commands.claims if a.released]
    assert [a.released for a in released] == [(grant.attempt_id,)]
    # The claim that handed it back stated what the pool held: not this Attempt.
    assert all(
        held is not None and grant.attempt_id not in held
        for _, _, held, a in commands.claims
        if a is released[0]
    )
    view = served.view(run_id)
    assert view.run.status is RunStatus.SUCCEEDED
    assert view.attempts[0].attempt.id == grant.attempt_id
    assert _leases(served, run_id) == [
        (1, LeaseStatus.RELEASED, ReleaseReason.HANDED_BACK),
        (2, LeaseStatus.RELEASED, ReleaseReason.COMPLETED),
    ]
    assert "attempt_released" in _event_kinds(view)


def test_a_grant_that_arrives_while_the_process_stops_is_handed_back_unstarted(
    serve: Any, tmp_path: Path
) -> None:
    served, commands = serve(resident_cadence_s=60.0)

    def stop_before_the_start(answer: ClaimAnswer) -> None:
        if answer.grants:
            served.runner.request_stop()

    commands.before_answer = stop_before_the_start
    run_id = served.container.core.admission().submit(
        "hold", {"dir": str(tmp_path), "name": "never", "first_s": 0}
    )
    served.thread.join(timeout=30)
    assert not served.thread.is_alive()

    view = served.view(run_id)
    assert view.run.status is RunStatus.QUEUED  # for the next process, with no verdict
    (attempt,) = view.attempts
    assert attempt.attempt.status is AttemptStatus.CLAIMED and attempt.attempt.is_pristine
    assert _leases(served, run_id) == [(1, LeaseStatus.RELEASED, ReleaseReason.HANDED_BACK)]
    assert not (tmp_path / "never-1").exists()  # the task never began
    assert any("handed back unstarted: the process is stopping" in line for line in served.lines)
    assert served.lines[-1] == "stopped"


WORKFLOW = {
    "name": "two-steps",
    "steps": [
        {"id": "first", "task": "echo", "input": 1},
        {"id": "second", "task": "echo", "input": 2, "after": ["first"]},
    ],
}


def _workflow_done(served: Served, workflow_run_id: str) -> bool:
    return served.view(workflow_run_id).run.status.is_terminal


def test_edge_runs_a_workflow_step_after_step_with_no_cadence(serve: Any) -> None:
    # Edge has no resident cadence: the cycle a finished step asks for admits the next step,
    # and the commit that queues it wakes the loop.
    ids: list[str] = []
    served, _ = serve(
        before_boot=lambda c: ids.append(c.core.workflows().submit(WORKFLOW)),
        resident_cadence_s=None,
    )
    wait_for(lambda: _workflow_done(served, ids[0]), 10, "the workflow to finish")
    view = served.view(ids[0])
    assert view.run.status is RunStatus.SUCCEEDED
    assert [s.run.status for s in view.steps if s.run is not None] == [RunStatus.SUCCEEDED] * 2


def test_a_workflow_submitted_through_another_store_wakes_an_idle_edge_process(
    serve: Any, database: Path
) -> None:
    served, _ = serve(resident_cadence_s=None)
    wait_for(lambda: served.runner.cycles >= 1, 5, "the first cycle")
    time.sleep(MIN_CYCLE_GAP_S + 0.3)
    other = standalone.build(database_path=str(database))  # as another process would
    try:
        workflow_run_id = other.core.workflows().submit(WORKFLOW)
    finally:
        other.store().close()
    # No cadence, so only a poke of the wake channel can start it (in milliseconds).
    wait_for(lambda: _workflow_done(served, workflow_run_id), 5, "the workflow to finish")
    assert served.view(workflow_run_id).run.status is RunStatus.SUCCEEDED
