"""``Runtime.prune_finished``: the Python form of ``ql3 runs prune`` (ADR 0016), on the
in-memory runtime and on the Standalone runtime's SQLite file."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

import ql3
from ql3 import InvalidBatchSize, InvalidDuration, PruneReport
from ql3.testing import in_memory
from tests.api.tasks import TASKS, echo


def test_finished_runs_older_than_the_age_are_pruned_and_the_rest_stay() -> None:
    rt = in_memory(TASKS)
    try:
        old = [rt.submit(echo, n) for n in range(3)]
        rt.run_due()
        rt.advance(seconds=7_200)
        recent = rt.submit(echo, "recent")
        rt.run_due()
        waiting = rt.submit(echo, "waiting")

        dry = rt.prune_finished("1h", dry_run=True)
        assert (dry.dry_run, dry.removed.runs) == (True, 3)
        assert len(rt.runs()) == 5

        report = rt.prune_finished(datetime.timedelta(hours=1), batch_size=2)
        assert isinstance(report, PruneReport)

        assert (report.dry_run, report.removed.runs, report.batch_runs) == (False, 3, (2, 1))
        assert report.removed == dry.removed
        assert sorted(info.id for info in rt.runs()) == sorted([recent, waiting])
        for run_id in old:
            with pytest.raises(ql3.UnknownRun):
                rt.get(run_id)
    finally:
        rt.close()


def test_bad_ages_and_batch_sizes_are_refused() -> None:
    rt = in_memory(TASKS)
    try:
        for bad in ("soon", "5", "-1h", 3600):
            with pytest.raises(InvalidDuration):
                rt.prune_finished(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidBatchSize):
            rt.prune_finished("1h", batch_size=0)
    finally:
        rt.close()


def test_the_standalone_runtime_prunes_its_sqlite_file(tmp_path: Path) -> None:
    rt = ql3.standalone(str(tmp_path / "app.sqlite"), tasks=TASKS)
    try:
        run_id = rt.submit(echo, 1)
        assert rt.prune_finished("0s").removed.runs == 0  # queued: not finished
        assert rt.get(run_id).status is ql3.RunStatus.QUEUED
    finally:
        rt.close()
