"""``ql3 demo``: a scripted story of a worker dying mid-task, told through the real application
services of the Cluster profile on the in-memory store (which stands in for PostgreSQL; its
settable clock stands for the database clock)."""

from __future__ import annotations

from collections.abc import Callable

from adapters.memory import FakeClock, MemoryStore
from application.queries import AttemptView, RunQueries
from application.scheduler import CycleSummary
from application.worker_commands import Offer, WorkerCommands
from bootstrap import cluster
from domain.errors import FenceRejected
from domain.fence import LeaseFence
from domain.policy import Backoff, RetryPolicy, Safety

Echo = Callable[[str], None]

STORY = (
    (
        "resize-image",
        RetryPolicy(
            retry_on_lost=True,
            max_attempts=3,
            safety=Safety.IDEMPOTENT,
            backoff=Backoff(initial_ms=2_000),
        ),
    ),
    ("charge-card", RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.UNSAFE)),
    ("send-report", None),
    ("ping", RetryPolicy(retry_on_lost=True, max_attempts=2, safety=Safety.IDEMPOTENT)),
)


def _policy_text(policy: RetryPolicy | None) -> str:
    if policy is None:
        return "no policy"
    safety = policy.safety.value if policy.safety else "undeclared"
    retry = "retry-on-lost" if policy.retry_on_lost else "no retry"
    return f"{safety}, {retry}, max {policy.max_attempts}"


def _cycle_line(summary: CycleSummary) -> str:
    parts = []
    for step in summary.steps:
        interesting = {k: v for k, v in step.counts.items() if v and k != "has_more"}
        if interesting:
            parts.append(
                f"{step.name}(" + ", ".join(f"{k}={v}" for k, v in interesting.items()) + ")"
            )
    return "cycle: " + (", ".join(parts) if parts else "nothing to do")


class _Worker:
    """A remote worker speaking the fenced protocol through the real worker commands."""

    def __init__(self, commands: WorkerCommands, worker_id: str, tasks: list[str]) -> None:
        self.commands = commands
        grant = commands.register(worker_id, capacity=8, tasks=tasks)
        self.session_id, self.secret = grant.session_id, grant.secret
        self.held: dict[str, LeaseFence] = {}

    def take_offers(self) -> list[Offer]:
        offers = self.commands.heartbeat(self.session_id, self.secret)
        for offer in offers:
            token = f"token-{offer.attempt_id}-{offer.generation}-0123456789abcdef"
            self.commands.accept(
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
            self.commands.activate(self.session_id, self.secret, fence)
            self.held[offer.run_id] = fence
        return offers

    def finish(self, run_id: str, output: object) -> None:
        fence = self.held.pop(run_id)
        self.commands.complete(self.session_id, self.secret, fence, succeeded=True, output=output)  # type: ignore[arg-type]


def _attempt_text(view: AttemptView) -> str:
    text = f"#{view.attempt.number} {view.attempt.status.value}"
    lease = view.lease
    if lease is not None:
        reason = lease.release_reason.value if lease.release_reason else lease.status.value
        text += f" ({lease.generation}/{lease.version}/{reason})"
    return text


def run_demo(echo: Echo, lease_ttl_s: float = 30.0) -> dict[str, str]:
    """Tell the story; returns each task's final run status."""
    clock = FakeClock()
    container = cluster.build(store=MemoryStore(clock), lease_ttl_s=lease_ttl_s, cadence_s=1.0)
    admission = container.core.admission()
    commands = container.core.worker_commands()
    coordinator = container.coordinator()
    queries = RunQueries(container.store().unit_of_work)

    def cycle() -> CycleSummary:
        summary = coordinator.run_cycle()
        echo("  " + _cycle_line(summary))
        return summary

    echo("QL3 runtime demo: a worker dies mid-task; recovery fails closed until it has evidence,")
    echo("then retries only what was declared safe. Cluster services on the in-memory store.\n")
    runs = {}
    for task, policy in STORY:
        runs[task] = admission.submit(task, {"task": task}, policy)
        echo(f"  admitted {task:<13} [{_policy_text(policy)}]")

    echo("\n1. worker w-1 registers and takes every offer past the start barrier")
    worker = _Worker(commands, "w-1", [t for t, _ in STORY])
    cycle()
    worker.take_offers()
    worker.finish(runs["ping"], "pong")
    echo("  ping succeeded; resize-image, charge-card and send-report are running")

    echo(f"\n2. w-1 is killed. {lease_ttl_s:.0f}s later its leases have expired")
    clock.advance(round(lease_ttl_s * 1000) + 1_000)
    cycle()
    echo("  no evidence that w-1 stopped: nothing is lost, retried or failed (fail closed)")

    echo("\n3. w-1 restarts with the same worker id: its old session is replaced (evidence)")
    restarted = _Worker(commands, "w-1", [t for t, _ in STORY])
    cycle()
    clock.advance(2_000)
    cycle()
    offers = restarted.take_offers()
    for offer in offers:
        restarted.finish(offer.run_id, {"resized": True})
        echo(f"  {offer.task} attempt {offer.attempt_number} succeeded on the new session")

    echo("\n4. the old process's late completion is refused by the lease fence")
    stale = worker.held.get(runs["charge-card"])
    if stale is not None:
        try:
            commands.complete(worker.session_id, worker.secret, stale, succeeded=True)
        except Exception as refused:  # the fence or the closed session refuses it
            kind = "fence" if isinstance(refused, FenceRejected) else "session"
            echo(f"  refused ({kind}): {refused}")

    echo("\nSummary")
    echo(f"  {'task':<13} {'policy':<38} {'status':<10} attempts (status, lease gen/ver/reason)")
    final: dict[str, str] = {}
    for task, policy in STORY:
        view = queries.show(runs[task])
        assert view is not None
        final[task] = view.run.status.value
        history = "; ".join(_attempt_text(a) for a in view.attempts)
        echo(f"  {task:<13} {_policy_text(policy):<38} {view.run.status.value:<10} {history}")
        if view.run.error:
            echo(f"  {'':<13} why: {view.run.error}")
    container.store().close()
    return final
