"""``ql3 demo``: a process dies mid-task, and the runtime retries only what was declared safe.

The story runs on the embedded default, with no configuration and no server: a Standalone
process (``ql3 standalone``, a real child process) on a SQLite database in a temporary folder.

1. Five runs are admitted with different retry policies.
2. The child process executes them with its in-process pool (task code from
   :mod:`ql3.adapters.cli.demo_tasks`).
3. While three of them are mid-task, the child is killed with SIGKILL.
4. It is started again. Its new session replaces the dead one (evidence that nothing of the dead
   process still runs); once the dead process's leases expire, startup recovery marks the three
   attempts lost and the lost-retry rules decide: the idempotent run gets attempt 2, the unsafe
   run and the run without a policy fail closed.
5. SIGTERM: the child drains and exits 0.

A live table shows the runs, their attempts and their leases while it happens; a summary says
which runs were retried, which failed closed and why.

With ``QL3_DATABASE_URL`` naming a PostgreSQL database the same story runs on the Cluster
profile: the schema is migrated, a node (``ql3 serve``) runs the cadence and the worker ingress,
and a worker process (``ql3 worker``) executes the runs; the worker is the process killed and
restarted, and the node's runtime recovery and lost retry settle what it left behind.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ql3.application.queries import AttemptView, RunQueries, RunView
from ql3.domain.model import AttemptStatus, JsonValue, RunStatus
from ql3.domain.policy import Backoff, RetryPolicy, Safety

DEMO_APP = "ql3.adapters.cli.demo_tasks:TASKS"
SHORT_ENV = "QL3_DEMO_SHORT"
POLL_S = 0.1


class DemoFailed(RuntimeError):
    """The story did not unfold as it must (a step timed out, the child failed)."""


@dataclass(frozen=True, slots=True)
class Timing:
    work_s: float  # how long the slow tasks take
    lease_ttl_s: float  # the child's lease TTL: a restart waits at most this for old leases
    backoff_ms: int  # the idempotent run's retry delay
    step_timeout_s: float


FULL = Timing(work_s=5.0, lease_ttl_s=2.0, backoff_ms=1_000, step_timeout_s=40.0)
SHORT = Timing(work_s=2.0, lease_ttl_s=1.0, backoff_ms=300, step_timeout_s=40.0)


@dataclass(frozen=True, slots=True)
class Scene:
    """One run of the story."""

    task: str
    policy: RetryPolicy | None
    input: JsonValue
    mid_task: bool  # still running when the process is killed


def story(timing: Timing) -> tuple[Scene, ...]:
    work = timing.work_s
    return (
        Scene(
            task="ping",
            policy=RetryPolicy(retry_on_lost=True, max_attempts=2, safety=Safety.IDEMPOTENT),
            input=None,
            mid_task=False,
        ),
        Scene(task="parse-upload", policy=None, input={"file": "orders.csv"}, mid_task=False),
        Scene(
            task="resize-image",
            policy=RetryPolicy(
                retry_on_lost=True,
                max_attempts=3,
                safety=Safety.IDEMPOTENT,
                backoff=Backoff(
                    initial_ms=timing.backoff_ms, cap_ms=max(timing.backoff_ms, 10_000)
                ),
            ),
            input={"seconds": work, "what": "thumbnail"},
            mid_task=True,
        ),
        Scene(
            task="charge-card",
            policy=RetryPolicy(retry_on_lost=True, max_attempts=3, safety=Safety.UNSAFE),
            input={"seconds": work, "what": "charge 42.00 EUR"},
            mid_task=True,
        ),
        Scene(
            task="send-report",
            policy=None,
            input={"seconds": work, "what": "weekly report"},
            mid_task=True,
        ),
    )


def postgres_url(environ: Mapping[str, str]) -> str | None:
    """``QL3_DATABASE_URL`` when it names a PostgreSQL database: the Cluster story runs there."""
    url = environ.get("QL3_DATABASE_URL", "")
    if url.startswith(("postgresql://", "postgresql+psycopg://")):
        return url
    return None


# --- rendering ---------------------------------------------------------------------------------

STATUS_STYLE = {
    RunStatus.SUCCEEDED: "green",
    RunStatus.FAILED: "red",
    RunStatus.RUNNING: "yellow",
    RunStatus.LOST: "magenta",
    RunStatus.RETRY_WAIT: "cyan",
}


def policy_text(policy: RetryPolicy | None) -> str:
    if policy is None:
        return "no policy"
    safety = policy.safety.value if policy.safety else "safety undeclared"
    retry = "retry-on-lost" if policy.retry_on_lost else "no retry-on-lost"
    return f"{safety}, {retry}, max {policy.max_attempts} attempts"


def attempt_text(view: AttemptView) -> str:
    attempt = view.attempt
    text = f"#{attempt.number} {attempt.status.value}"
    lease = view.lease
    if lease is not None:
        state = f"released: {lease.release_reason.value}" if lease.release_reason else "leased"
        text += f", lease gen {lease.generation} v{lease.version} {state}"
    if attempt.lost_evidence is not None:
        text += f", evidence {attempt.lost_evidence.value}"
    return text


def runs_table(scenes: tuple[Scene, ...], views: Mapping[str, RunView | None], title: str) -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("run")
    table.add_column("policy")
    table.add_column("status")
    table.add_column("attempts, with their lease (generation, version, state)")
    for scene in scenes:
        view = views.get(scene.task)
        if view is None:
            table.add_row(Text(scene.task), Text(policy_text(scene.policy)), Text("-"), Text(""))
            continue
        status = view.run.status
        table.add_row(
            Text(scene.task),
            Text(policy_text(scene.policy)),
            Text(status.value, style=STATUS_STYLE.get(status, "")),
            Text("\n".join(attempt_text(a) for a in view.attempts) or "-"),
        )
    return table


# --- the processes ------------------------------------------------------------------------------


class _Child:
    """A ``ql3`` child process, its output in a log file."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log_path = log
        self._log: IO[bytes] = log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ql3.adapters.cli.main", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # a Ctrl-C reaches the demo, which stops the child itself
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def failed(self) -> bool:
        return self.process.poll() not in (None, 0, -signal.SIGKILL)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self, timeout: float) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self._log.close()


class _Profile:
    """Where the story runs: its container (for admission and reads), the process that executes
    the runs (the one killed), and what else must run beside it."""

    executor = ""
    restart_text = ""
    where = ""

    def __init__(self, timing: Timing, folder: Path) -> None:
        self.timing = timing
        self.folder = folder
        self.children: list[_Child] = []

    def container(self) -> Any:
        raise NotImplementedError

    def prepare(self) -> None:
        """Start what the executing process needs (nothing for Standalone)."""

    def executor_args(self) -> list[str]:
        raise NotImplementedError

    def start(self, args: list[str], log: str) -> _Child:
        child = _Child(args, self.folder / log)
        self.children.append(child)
        return child

    def start_executor(self) -> _Child:
        return self.start(self.executor_args(), "executor.log")

    def stop_helpers(self) -> None:
        """Stop what :meth:`prepare` started; raise ``DemoFailed`` unless it exits 0."""


class _StandaloneProfile(_Profile):
    executor = "ql3 standalone"
    restart_text = (
        "its session replaces the dead one (evidence that nothing of it still runs); once the "
        "dead process's leases expire, startup recovery marks their attempts lost and applies "
        "the lost-retry rules"
    )

    def __init__(self, timing: Timing, folder: Path) -> None:
        super().__init__(timing, folder)
        self.database = folder / "demo.sqlite"
        self.where = str(self.database)

    def container(self) -> Any:
        from ql3.bootstrap import standalone

        return standalone.build(database_path=str(self.database))

    def executor_args(self) -> list[str]:
        return [
            "standalone",
            "--app",
            DEMO_APP,
            "--db",
            str(self.database),
            "--lease-ttl",
            str(self.timing.lease_ttl_s),
            "--drain-timeout",
            "10",
        ]


class _ClusterProfile(_Profile):
    executor = "ql3 worker"
    restart_text = (
        "it registers with the same worker id, which replaces the dead session (evidence that "
        "nothing of it still runs); once the dead worker's leases expire, the node's runtime "
        "recovery marks their attempts lost and its lost retry applies the rules"
    )

    def __init__(self, timing: Timing, folder: Path, database_url: str) -> None:
        super().__init__(timing, folder)
        self.database_url = database_url
        self.where = "the PostgreSQL database of QL3_DATABASE_URL"
        self.worker_id = f"ql3-demo-{os.getpid()}"
        self.ingress = ""
        self.node: _Child | None = None

    def container(self) -> Any:
        from ql3.bootstrap import cluster

        return cluster.build(database_url=self.database_url)

    def prepare(self) -> None:
        from ql3.adapters.postgres.migrate import upgrade

        upgrade(self.database_url)
        ttl = str(self.timing.lease_ttl_s)
        node = self.start(
            [
                "serve",
                "--port",
                "0",
                "--cadence",
                "0.2",
                "--lease-ttl",
                ttl,
                "--database-url",
                self.database_url,
                "--log-level",
                "warning",
            ],
            "node.log",
        )
        self.node = node
        deadline = time.monotonic() + self.timing.step_timeout_s
        while not self.ingress:
            found = re.search(r"listening on (http://\S+)", node.log_path.read_text())
            if found:
                self.ingress = found.group(1)
            elif node.process.poll() is not None or time.monotonic() > deadline:
                raise DemoFailed(f"ql3 serve did not start (see {node.log_path})")
            else:
                time.sleep(POLL_S)

    def executor_args(self) -> list[str]:
        return [
            "worker",
            "--ingress",
            self.ingress,
            "--app",
            DEMO_APP,
            "--worker-id",
            self.worker_id,
            "--concurrency",
            "5",
            "--drain-timeout",
            "10",
            "--log-level",
            "warning",
        ]

    def stop_helpers(self) -> None:
        if self.node is not None and self.node.stop(timeout=30) != 0:
            raise DemoFailed(f"ql3 serve exited with {self.node.process.returncode}")


# --- the story ---------------------------------------------------------------------------------


class _Story:
    def __init__(self, console: Console, timing: Timing, profile: _Profile) -> None:
        self.console = console
        self.timing = timing
        self.profile = profile
        self.scenes = story(timing)
        self.container = profile.container()
        self.queries = RunQueries(self.container.store().unit_of_work)
        self.run_ids: dict[str, str] = {}
        self.caption = ""

    def views(self) -> dict[str, RunView | None]:
        return {task: self.queries.show(run_id) for task, run_id in self.run_ids.items()}

    def say(self, line: str) -> None:
        self.console.print(line, highlight=False)

    def wait(
        self, live: Live, until: Callable[[dict[str, RunView | None]], bool], what: str
    ) -> dict[str, RunView | None]:
        deadline = time.monotonic() + self.timing.step_timeout_s
        while True:
            views = self.views()
            live.update(runs_table(self.scenes, views, self.caption))
            if until(views):
                return views
            for child in self.profile.children:
                if child.failed():
                    raise DemoFailed(
                        f"a child process exited with {child.process.returncode} "
                        f"(see {child.log_path})"
                    )
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out waiting for {what}")
            time.sleep(POLL_S)

    def run(self) -> dict[str, str]:
        profile = self.profile
        executor = profile.executor
        profile.prepare()
        admission = self.container.core.admission()
        for scene in self.scenes:
            self.run_ids[scene.task] = admission.submit(scene.task, scene.input, scene.policy)
        self.say(f"1. admitted {len(self.scenes)} runs into {profile.where}")
        for scene in self.scenes:
            self.say(f"     {scene.task:<13} {policy_text(scene.policy)}")
        mid_task = [s.task for s in self.scenes if s.mid_task]

        with Live(
            runs_table(self.scenes, self.views(), ""),
            console=self.console,
            refresh_per_second=10,
            transient=True,  # the summary below shows the final table
        ) as live:
            first = profile.start_executor()
            self.caption = f"{executor} (pid {first.pid}) is executing the runs"
            self.say(f"2. started `{executor}` (pid {first.pid}): it executes the runs")

            def busy(views: dict[str, RunView | None]) -> bool:
                done = all(
                    (v := views.get(s.task)) is not None and v.run.status.is_terminal
                    for s in self.scenes
                    if not s.mid_task
                )
                return done and all(
                    _current_status(views.get(t)) is AttemptStatus.RUNNING for t in mid_task
                )

            self.wait(live, busy, "the slow tasks to run")
            time.sleep(min(0.5, self.timing.work_s / 4))
            first.kill()
            self.caption = f"pid {first.pid} was killed with SIGKILL mid-task"
            self.say(
                f"3. SIGKILL to pid {first.pid} while {', '.join(mid_task)} are mid-task: the "
                "database keeps every run, its attempt and its lease"
            )
            killed = self.wait(live, lambda views: True, "a look at the state")
            live.console.print(runs_table(self.scenes, killed, "Right after the SIGKILL"))
            time.sleep(0.5)

            second = profile.start_executor()
            self.caption = (
                f"{executor} restarted (pid {second.pid}); the old leases expire within "
                f"{self.timing.lease_ttl_s:g}s"
            )
            self.say(f"4. restarted `{executor}` (pid {second.pid}): {profile.restart_text}")

            def settled(views: dict[str, RunView | None]) -> bool:
                return all(v is not None and v.run.status.is_terminal for v in views.values())

            final = self.wait(live, settled, "every run to settle")
            self.caption = "every run settled"
            live.update(runs_table(self.scenes, final, self.caption))
            code = second.stop(timeout=30)
            if code != 0:
                raise DemoFailed(f"{executor} exited with {code} after SIGTERM")
            profile.stop_helpers()
            self.say(f"5. SIGTERM to pid {second.pid}: it drained and exited with status 0")
        self.summary(final)
        return {task: view.run.status.value for task, view in final.items() if view is not None}

    def summary(self, final: Mapping[str, RunView | None]) -> None:
        self.console.print()
        self.console.print(runs_table(self.scenes, final, "Summary"))
        retried, failed_closed, task_failed, unaffected = [], [], [], []
        for scene in self.scenes:
            view = final.get(scene.task)
            if view is None:
                continue
            attempts = view.attempts
            lost = [a for a in attempts if a.attempt.status is AttemptStatus.LOST]
            if lost and view.run.status is RunStatus.SUCCEEDED:
                evidence = lost[0].attempt.lost_evidence
                retried.append(
                    f"{scene.task}: attempt 1 lost with the killed process (evidence: "
                    f"{evidence.value if evidence else 'none'}); declared "
                    f"{policy_text(scene.policy)}, so attempt {attempts[-1].attempt.number} ran "
                    "and succeeded"
                )
            elif lost:
                failed_closed.append(
                    f"{scene.task}: {view.run.error} ({policy_text(scene.policy)})"
                )
            elif view.run.status is RunStatus.FAILED:
                first_line = (view.run.error or "").splitlines()[:1]
                task_failed.append(f"{scene.task}: {''.join(first_line)}")
            else:
                unaffected.append(f"{scene.task}: {view.run.status.value} before the crash")
        sections = (
            ("Retried, because their admission declared them safe to run again:", retried),
            ("Failed closed, never run a second time:", failed_closed),
            ("Failed by their own task code (no recovery involved):", task_failed),
            ("Finished before the crash:", unaffected),
        )
        for heading, lines in sections:
            if lines:
                self.say(heading)
                for line in lines:
                    self.say(f"  - {line}")


def _current_status(view: RunView | None) -> AttemptStatus | None:
    if view is None or not view.attempts:
        return None
    return view.attempts[-1].attempt.status


@contextmanager
def _folder(keep: str | None) -> Iterator[Path]:
    if keep:
        path = Path(keep)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="ql3-demo-") as name:
        yield Path(name)


def run_demo(
    console: Console | None = None,
    *,
    short: bool | None = None,
    folder: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Tell the story; returns each task's final run status. ``short`` (default: the
    ``QL3_DEMO_SHORT`` environment variable) makes the tasks and leases shorter; ``folder``
    keeps the database and the children's logs there instead of a temporary folder. With
    ``QL3_DATABASE_URL`` naming PostgreSQL the story runs on the Cluster profile: a node
    (``ql3 serve``) and a worker process (``ql3 worker``, the one killed) on that database."""
    environ = os.environ if environ is None else environ
    console = console or Console()
    if short is None:
        short = environ.get(SHORT_ENV, "").strip().lower() in {"1", "true", "yes"}
    timing = SHORT if short else FULL
    cluster_url = postgres_url(environ)
    kind = "Cluster: a node and a worker process" if cluster_url else "Standalone on SQLite"
    console.print(
        f"QL3 runtime demo ({kind}): a process dies mid-task; the runtime retries only the runs "
        "whose admission declared them safe, and fails the others closed.",
        highlight=False,
    )
    started = time.monotonic()
    with _folder(folder) as path:
        profile: _Profile = (
            _ClusterProfile(timing, path, cluster_url)
            if cluster_url
            else _StandaloneProfile(timing, path)
        )
        tale: _Story | None = None
        try:
            tale = _Story(console, timing, profile)
            final = tale.run()
        finally:
            for child in profile.children:
                child.close()
            if tale is not None:
                tale.container.store().close()
    console.print(f"Finished in {time.monotonic() - started:.1f}s.", highlight=False)
    return final


__all__ = ["DemoFailed", "postgres_url", "run_demo"]
