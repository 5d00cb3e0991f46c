"""Helpers of the trigger, workflow and admission tests: the Cluster container over any store
(memory or PostgreSQL), and a worker driven in-process through :class:`WorkerCommands`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from application.scheduler import CycleSummary
from application.worker_commands import Offer, WorkerCommands
from bootstrap import cluster
from domain.fence import LeaseFence
from domain.model import Run


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
    """One worker session that takes its offers and reports outcomes, in-process."""

    workers: WorkerCommands
    session_id: str
    secret: str
    fences: dict[str, LeaseFence] = field(default_factory=dict)
    offers: dict[str, Offer] = field(default_factory=dict)

    @classmethod
    def register(
        cls, workers: WorkerCommands, worker_id: str, tasks: list[str], capacity: int = 8
    ) -> WorkerDriver:
        grant = workers.register(worker_id, capacity, tasks)
        return cls(workers=workers, session_id=grant.session_id, secret=grant.secret)

    def heartbeat(self) -> list[Offer]:
        return self.workers.heartbeat(self.session_id, self.secret)

    def start_all(self) -> list[Offer]:
        """Accept every open offer and cross the start barrier; returns the offers taken."""
        taken = []
        for offer in self.heartbeat():
            token = f"token-{offer.attempt_id}-{offer.generation}".ljust(24, "t")
            self.workers.accept(
                self.session_id,
                self.secret,
                offer.attempt_id,
                offer.generation,
                offer.version,
                token,
            )
            fence = LeaseFence(
                attempt_id=offer.attempt_id,
                generation=offer.generation,
                version=offer.version,
                token=token,
            )
            self.workers.activate(self.session_id, self.secret, fence)
            self.workers.mark_running(self.session_id, self.secret, fence)
            self.fences[offer.run_id] = fence
            self.offers[offer.run_id] = offer
            taken.append(offer)
        return taken

    def finish(
        self, run_id: str, *, succeeded: bool = True, output: Any = None, error: str | None = None
    ) -> None:
        fence = self.fences.pop(run_id)
        self.workers.complete(
            self.session_id, self.secret, fence, succeeded=succeeded, output=output, error=error
        )
