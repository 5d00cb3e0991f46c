"""Bulk jobs of the console (ADR 0020): each runs on a thread of the console's process, batch
after batch, whether or not the page that started it stays open; the page follows its progress.
The jobs, who started them and what they did, are kept in this process (the last
:data:`KEPT_JOBS`); each Run a job changed is audited in the store with the operator's name."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from ql3.application.bulk import BulkActions, BulkProgress, BulkRequest

log = logging.getLogger("ql3.console.audit")
KEPT_JOBS = 100
MAX_FAILED_BATCHES = 30


@dataclass
class BulkJob:
    id: str
    operator: str
    request: BulkRequest
    preview: int
    began_ms: int
    progress: BulkProgress = field(default_factory=BulkProgress)
    ended_ms: int | None = None


class BulkJobs:
    def __init__(self, bulk: BulkActions, now_ms: Callable[[], int]) -> None:
        self._bulk = bulk
        self._now_ms = now_ms
        self._jobs: dict[str, BulkJob] = {}
        self._lock = threading.Lock()

    def start(self, operator: str, request: BulkRequest, began_ms: int, preview: int) -> BulkJob:
        job = BulkJob(
            id=uuid.uuid4().hex,
            operator=operator,
            request=request,
            preview=preview,
            began_ms=began_ms,
        )
        with self._lock:
            self._jobs[job.id] = job
            while len(self._jobs) > KEPT_JOBS:
                self._jobs.pop(next(iter(self._jobs)))
        log.info(
            "%s started bulk %s of %d run(s) (job %s)",
            operator,
            request.action.value,
            preview,
            job.id,
        )
        threading.Thread(
            target=self._run, args=(job,), name=f"ql3-bulk-{job.id[:8]}", daemon=True
        ).start()
        return job

    def _run(self, job: BulkJob) -> None:
        progress = job.progress
        failures = 0
        while not progress.finished:
            try:
                self._bulk.run_batch(job.operator, job.request, job.began_ms, progress)
                failures = 0
            except Exception as error:  # the store is unreachable: wait, then the next batch
                failures += 1
                if failures >= MAX_FAILED_BATCHES:
                    progress.note(f"stopped after {failures} failed batches in a row")
                    progress.finished = True
                    break
                progress.note(f"a batch failed: {type(error).__name__}; trying again")
                time.sleep(1.0)
        job.ended_ms = self._now_ms()
        log.info(
            "bulk job %s of %s ended: %d done, %d skipped, %d failed",
            job.id,
            job.operator,
            progress.done,
            progress.skipped,
            progress.failed,
        )

    def get(self, job_id: str) -> BulkJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def all(self) -> list[BulkJob]:
        with self._lock:
            return list(reversed(self._jobs.values()))
