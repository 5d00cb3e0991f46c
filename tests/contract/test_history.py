"""Pruning finished history on every store (ADR 0016): only finished Runs whose last change is
older than the cutoff go, with every row that records them; unfinished and recent Runs keep all
their rows; each batch takes at most its size; a dry run deletes nothing; a workflow goes whole
or not at all, a trigger's firing goes with its Run, and the Run the dispatch gate names stays."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from ql3.application.history import (
    HistoryPruning,
    InvalidBatchSize,
    InvalidDuration,
    PruneReport,
)
from ql3.application.ports import DispatchGate, PrunedRows, StepFailure
from ql3.application.triggers import TriggerDefinition
from ql3.domain.model import EvidenceKind, RunStatus
from ql3.domain.transitions import cancel
from ql3.domain.workflows import StepStatus
from tests.contract.builders import (
    TTL_MS,
    attempt_id_of,
    committed,
    finish,
    given_created,
    given_lost,
    given_queued,
    given_session,
    given_started,
    locked_run,
    report_stop,
)
from tests.scheduling_support import WorkerDriver, runtime

Advance = Callable[[int], None]
HOUR_MS = 3_600_000


def _rows(store: Any, run_id: str) -> tuple[Any, ...] | None:
    """Everything the store keeps of a Run, or None when the Run is gone (and so is every row
    of it: checked)."""
    with store.unit_of_work() as uow:
        run = uow.runs.get_run(run_id)
        attempts = tuple(uow.runs.attempts_of(run_id))
        leases = tuple(uow.runs.leases_of(run_id))
        events = tuple(uow.runs.events_of(run_id))
        reports = tuple(r for a in attempts for r in uow.evidence.reports_for(a.id))
        step = uow.workflows.step_of_run(run_id)
        steps = tuple(uow.workflows.steps_of(run_id))
    if run is None:
        assert (attempts, leases, events, reports, step, steps) == ((), (), (), (), None, ())
        return None
    return run, attempts, leases, events, reports, step, steps


def _snapshot(store: Any, run_ids: Sequence[str]) -> dict[str, Any]:
    return {run_id: _rows(store, run_id) for run_id in run_ids}


def _finished(store: Any, run_id: str, session_id: str, *, succeeded: bool = True) -> None:
    attempt_id = given_started(store, run_id, session_id)
    with committed(store) as uow:
        finish(uow, attempt_id, succeeded=succeeded)


def _cancelled(store: Any, run_id: str) -> None:
    given_queued(store, run_id)
    with committed(store) as uow:
        before = locked_run(uow, run_id)
        change = cancel(
            run=before.run,
            attempt=before.attempt,
            lease=before.lease,
            reason="not needed",
            now_ms=uow.now_ms(),
        )
        uow.runs.apply(before, change)


def _now(store: Any) -> int:
    with store.unit_of_work() as uow:
        return int(uow.now_ms())


def _prune(store: Any, older_than_ms: int = HOUR_MS, **options: Any) -> PruneReport:
    return HistoryPruning(store.unit_of_work).prune(older_than_ms, **options)


def test_only_finished_runs_older_than_the_cutoff_go_with_all_their_rows(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    _finished(store, "old1", "s1")
    _finished(store, "old2", "s1", succeeded=False)
    _cancelled(store, "old3")
    with committed(store) as uow:  # a stop report of a finished Attempt goes with it
        report_stop(uow, attempt_id_of("old1"), EvidenceKind.OPERATOR_ATTESTED)
    given_started(store, "running", "s1", ttl_ms=10 * HOUR_MS)
    given_queued(store, "queued")
    given_created(store, "created")
    given_lost(store, "lost", "s1")
    advance(2 * HOUR_MS)
    _finished(store, "recent", "s1")
    kept = ["running", "queued", "created", "lost", "recent"]
    before = _snapshot(store, kept)
    gone = _snapshot(store, ["old1", "old2", "old3"])
    earliest = _now(store)

    report = _prune(store)

    assert report.removed == PrunedRows(
        runs=3,
        attempts=3,
        leases=2,  # the cancelled Run was never claimed
        events=sum(len(rows[3]) for rows in gone.values()),
        stop_reports=1,
    )
    assert report.batches == 1 and not report.dry_run
    assert _snapshot(store, ["old1", "old2", "old3"]) == dict.fromkeys(gone)
    assert _snapshot(store, kept) == before
    # the store's clock when the prune began, minus the age
    assert earliest - HOUR_MS <= report.finished_before_ms <= _now(store) - HOUR_MS
    assert _prune(store).removed == PrunedRows()


def test_a_run_is_picked_only_when_its_last_change_is_strictly_before_the_cutoff(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    _finished(store, "r1", "s1")
    (run, *_) = _rows(store, "r1") or ()
    advance(HOUR_MS)
    with store.unit_of_work() as uow:
        assert uow.history.prunable(run.updated_at_ms, 10) == ()
        (picked,) = uow.history.prunable(run.updated_at_ms + 1, 10)
    assert (picked.run_id, picked.finished_at_ms) == ("r1", run.updated_at_ms)
    # a prune's cutoff is the store's clock minus the age: an age longer than the run's keeps it
    assert _prune(store, 2 * HOUR_MS).removed.runs == 0
    assert _prune(store, HOUR_MS // 2).removed.runs == 1


def test_each_batch_takes_at_most_its_size_oldest_first(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    for n in range(5):
        _finished(store, f"r{n}", "s1")
        advance(1_000)
    advance(HOUR_MS)
    with store.unit_of_work() as uow:
        picked = uow.history.prunable(uow.now_ms() - HOUR_MS, 2)
    assert [p.run_id for p in picked] == ["r0", "r1"]
    assert all(p.step_run_ids == () for p in picked)

    report = _prune(store, batch_size=2)

    assert report.batch_runs == (2, 2, 1)
    assert report.removed.runs == 5
    with store.unit_of_work() as uow:
        assert uow.runs.list_runs(None, 100) == ()


def test_a_pick_goes_on_after_the_mark_it_is_given(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    for n in range(3):
        _finished(store, f"r{n}", "s1")
        advance(1_000)
    with store.unit_of_work() as uow:
        cutoff = uow.now_ms()
        first = uow.history.prunable(cutoff, 1)
        rest = uow.history.prunable(cutoff, 5, first[-1].mark)
    assert [p.run_id for p in first] == ["r0"]
    assert [p.run_id for p in rest] == ["r1", "r2"]


def test_a_dry_run_counts_what_a_prune_removes_and_deletes_nothing(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    for n in range(3):
        _finished(store, f"r{n}", "s1")
    advance(2 * HOUR_MS)
    before = _snapshot(store, ["r0", "r1", "r2"])

    dry = _prune(store, dry_run=True, batch_size=2)

    assert dry.dry_run and dry.batch_runs == (2, 1)
    assert _snapshot(store, ["r0", "r1", "r2"]) == before
    real = _prune(store, batch_size=2)
    assert real.removed == dry.removed and real.removed.runs == 3
    assert dry.as_dict()["removed"] == real.removed.as_dict()


def test_a_rolled_back_delete_removes_nothing(store: Any, advance: Advance) -> None:
    given_session(store, "s1")
    _finished(store, "r1", "s1")
    advance(2 * HOUR_MS)
    before = _rows(store, "r1")
    with store.unit_of_work() as uow:
        picked = uow.history.prunable(uow.now_ms(), 10)
        assert uow.history.delete(picked).runs == 1
        assert uow.runs.get_run("r1") is None
    assert _rows(store, "r1") == before


def test_bad_ages_and_batch_sizes_are_refused(store: Any) -> None:
    pruning = HistoryPruning(store.unit_of_work)
    with pytest.raises(InvalidDuration):
        pruning.prune(-1)
    for size in (0, 10_001):
        with pytest.raises(InvalidBatchSize):
            pruning.prune(HOUR_MS, batch_size=size)
    with pytest.raises(InvalidBatchSize):
        HistoryPruning(store.unit_of_work, batch_size=0)


def test_the_run_the_dispatch_gate_names_stays_while_it_names_it(
    store: Any, advance: Advance
) -> None:
    given_session(store, "s1")
    _finished(store, "named", "s1")
    _finished(store, "other", "s1")
    advance(2 * HOUR_MS)
    with committed(store) as uow:
        now = uow.now_ms()
        failure = StepFailure(
            step="runtime_recovery",
            run_id="named",
            attempt_id=attempt_id_of("named"),
            error="boom",
            since_ms=now,
            cycles=1,
        )
        uow.gate.set(DispatchGate(open=False, reason="boom", changed_at_ms=now, failure=failure))
    assert _prune(store).removed.runs == 1
    assert _rows(store, "named") is not None
    with committed(store) as uow:
        uow.gate.set(DispatchGate(open=True, changed_at_ms=uow.now_ms()))
    assert _prune(store).removed.runs == 1
    assert _rows(store, "named") is None


# --- workflows and triggers ----------------------------------------------------------------------

PAIR = {
    "name": "pair",
    "steps": [{"id": "first", "task": "t"}, {"id": "second", "task": "t", "after": ["first"]}],
}


def _step_runs(rt: Any, workflow_id: str) -> dict[str, str]:
    return {
        view.step.step_id: view.step.run_id
        for view in rt.workflows.steps(workflow_id)
        if view.step.run_id is not None
    }


def test_a_finished_workflow_goes_whole_with_its_steps(store: Any, advance: Advance) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_MS / 1000)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=2)
    workflow_id = rt.workflows.submit(PAIR)
    for _ in range(2):
        assert rt.cycle().ok
        for grant in worker.claim_all():
            worker.finish(grant.run_id)
    assert rt.cycle().ok
    assert rt.run(workflow_id).status is RunStatus.SUCCEEDED
    steps = _step_runs(rt, workflow_id)
    ids = [workflow_id, steps["first"], steps["second"]]
    advance(2 * HOUR_MS)
    with store.unit_of_work() as uow:
        (picked,) = uow.history.prunable(uow.now_ms() - HOUR_MS, 10)
    assert picked.run_id == workflow_id
    assert sorted(picked.step_run_ids) == sorted(steps.values())

    # a batch of one takes the whole workflow: three Runs
    report = _prune(store, batch_size=1)

    assert report.batch_runs == (3,)
    assert (report.removed.runs, report.removed.workflow_steps) == (3, 2)
    assert _snapshot(store, ids) == dict.fromkeys(ids)


def test_a_workflow_with_a_step_still_running_keeps_every_run(
    store: Any, advance: Advance
) -> None:
    rt = runtime(store, advance, lease_ttl_s=10 * HOUR_MS / 1000)
    worker = WorkerDriver.register(rt.workers, "w1", ["t"], capacity=2)
    document = {
        "name": "fan",
        "steps": [{"id": "fails", "task": "t"}, {"id": "slow", "task": "t"}],
    }
    workflow_id = rt.workflows.submit(document)
    assert rt.cycle().ok
    grants = {
        _step_of(rt, workflow_id, g.run_id): g.run_id for g in worker.claim_all()
    }
    worker.finish(grants["fails"], succeeded=False, error="boom")
    assert rt.cycle().ok
    # the workflow failed; its running step runs on, its failed step is finished and old
    assert rt.run(workflow_id).status is RunStatus.FAILED
    steps = {v.step.step_id: v.step.status for v in rt.workflows.steps(workflow_id)}
    assert steps == {"fails": StepStatus.FAILED, "slow": StepStatus.ADMITTED}
    advance(2 * HOUR_MS)
    ids = [workflow_id, *grants.values()]
    before = _snapshot(store, ids)

    assert _prune(store).removed == PrunedRows()
    assert _snapshot(store, ids) == before

    worker.finish(grants["slow"])
    assert rt.cycle().ok  # the frontier records the outcome
    assert _prune(store).removed == PrunedRows(), "the last change is recent"
    advance(2 * HOUR_MS)
    report = _prune(store)
    assert (report.removed.runs, report.removed.workflow_steps) == (3, 2)
    assert _snapshot(store, ids) == dict.fromkeys(ids)


def _step_of(rt: Any, workflow_id: str, run_id: str) -> str:
    return next(s for s, r in _step_runs(rt, workflow_id).items() if r == run_id)


def test_a_triggers_firing_goes_with_its_run_and_the_trigger_stays(
    store: Any, advance: Advance
) -> None:
    rt = runtime(store, advance, lease_ttl_s=TTL_MS / 1000)
    worker = WorkerDriver.register(rt.workers, "w1", ["mail"], capacity=2)
    trigger = rt.triggers.add(TriggerDefinition(name="tick", task="mail", every_ms=60_000))
    advance(60_000)
    assert rt.cycle().step("trigger_schedule").counts["fired"] == 1
    (firing,) = rt.triggers.firings("tick")
    (grant,) = worker.claim_all()
    assert grant.run_id == firing.run_id
    worker.finish(grant.run_id)
    advance(2 * HOUR_MS)

    report = _prune(store)

    assert (report.removed.runs, report.removed.trigger_firings) == (1, 1)
    assert rt.triggers.firings("tick") == []
    assert rt.triggers.get("tick").id == trigger.id
    assert _rows(store, firing.run_id) is None
