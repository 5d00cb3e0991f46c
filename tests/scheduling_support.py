"""Helpers of the trigger, workflow and admission tests: the Cluster container over any store
(memory or PostgreSQL), and a worker driven in-process through :class:`WorkerCommands`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ql3.application.scheduler import CycleSummary
from ql3.application.worker_commands import (
    BatchOutcome,
    ClaimAnswer,
    Completion,
    Grant,
    WorkerCommands,
)
from ql3.bootstrap import cluster
from ql3.domain.fence import LeaseFence
from ql3.domain.model import Run


@dataclass
class Runtime:
    """A Cluster container over ``store``; ``advance`` moves the store's clock."""

    store: Any
    container: cluster.ClusterContainer
    advance: Callable[[int], None]

    def cycle(self) -> CycleSummary:
        return self.container.coordinator().run_cycle()

    @property
    def triggers(self) -> Any:
        return self.container.core.triggers()

    @property
    def workflows(self) -> Any:
        return self.container.core.workflows()

    @property
    def workers(self) -> WorkerCommands:
        return self.container.core.worker_commands()

    def run(self, run_id: str) -> Run:
        with self.store.unit_of_work() as uow:
            run = uow.runs.get_run(run_id)
        assert run is not None, run_id
        return run

    def now_ms(self) -> int:
        with self.store.unit_of_work() as uow:
            return int(uow.now_ms())


def runtime(store: Any, advance: Callable[[int], None], **settings: Any) -> Runtime:
    container = cluster.build(store=store, **settings)
    return Runtime(store=store, container=container, advance=advance)


@dataclass
class WorkerDriver:
    """One worker session, in-process: it claims what its free slots allow (stating what it
    holds, as a worker does) and reports outcomes, each through :class:`WorkerCommands`."""

    workers: WorkerCommands
    session_id: str
    secret: str
    capacity: int
    fences: dict[str, LeaseFence] = field(default_factory=dict)
    grants: dict[str, Grant] = field(default_factory=dict)

    @classmethod
    def register(
        cls, workers: WorkerCommands, worker_id: str, tasks: list[str], capacity: int = 8
    ) -> WorkerDriver:
        grant = workers.register(worker_id, capacity, tasks)
        return cls(
            workers=workers, session_id=grant.session_id, secret=grant.secret, capacity=capacity
        )

    def claim(
        self, limit: int | None = None, completions: tuple[Completion, ...] = ()
    ) -> ClaimAnswer:
        """One claim of up to ``limit`` Attempts (the free slots by default); the worker states
        every Attempt it holds, so an answer is never lost on it."""
        free = self.capacity - len(self.fences)  # completions were taken out of fences
        answer = self.workers.claim(
            self.session_id,
            self.secret,
            limit=max(free, 0) if limit is None else limit,
            completions=completions,
            held=sorted(fence.attempt_id for fence in self.fences.values()),
        )
        assert answer.released == (), f"the store released held attempts: {answer.released}"
        for grant in answer.grants:
            assert grant.run_id not in self.fences, f"run {grant.run_id} granted twice"
            self.fences[grant.run_id] = grant.fence
            self.grants[grant.run_id] = grant
        return answer

    def claim_all(self) -> list[Grant]:
        """Claim (and so start) as many Attempts as there are free slots; returns the grants."""
        return list(self.claim().grants)

    def finish(
        self, run_id: str, *, succeeded: bool = True, output: Any = None, error: str | None = None
    ) -> None:
        fence = self.fences.pop(run_id)
        done = Completion(fence=fence, succeeded=succeeded, output=output, error=error)
        (result,) = self.workers.complete_many(self.session_id, self.secret, [done]).results
        assert result.outcome is (BatchOutcome.SUCCEEDED if succeeded else BatchOutcome.FAILED), (
            result
        )

    def completion(self, run_id: str, *, succeeded: bool = True, output: Any = None) -> Completion:
        """The completion of a held Run, to send with the next claim (forgotten here)."""
        return Completion(fence=self.fences.pop(run_id), succeeded=succeeded, output=output)
