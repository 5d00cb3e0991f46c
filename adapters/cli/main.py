"""The ``ql3`` command line. Errors print one line on stderr: exit 2 for bad input or usage,
1 for not found or failure; never a traceback."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import click

from ql3.adapters.cli.lazy import LazyGroup
from ql3.application.admission import AdmissionRequest, UnknownRun
from ql3.application.budgets import DEFAULT_BATCH_SIZE, MAX_BATCH_SIZE, InvalidPageSize
from ql3.application.lookups import UnknownAttempt
from ql3.domain.errors import ConcurrencyConflict, DomainError
from ql3.domain.model import MAX_PRIORITY, MAX_TIMEOUT_MS, MIN_PRIORITY, RunStatus
from ql3.domain.policy import MAX_BACKOFF_MS, Backoff, RetryPolicy, Safety


class Failure(Exception):
    """A failure reported with exit status 1."""


def _fail_usage(message: str) -> NoReturn:
    raise click.UsageError(message)


SQLITE_URL_PREFIX = "sqlite:///"
# Commands that may create a missing SQLite database file (every other one needs it to exist).
CREATES_SQLITE_DATABASE = frozenset({"submit"})


def _command_name() -> str | None:
    context = click.get_current_context(silent=True)
    return context.command.name if context is not None else None


def _database_url(value: str | None) -> str:
    """A PostgreSQL URL (with the psycopg driver) or ``sqlite:///PATH`` (the Standalone store)."""
    url = value or os.environ.get("QL3_DATABASE_URL")
    if not url:
        _fail_usage("no database: pass --database-url or set QL3_DATABASE_URL")
    if url.startswith(SQLITE_URL_PREFIX):
        if _command_name() == "upgrade":
            _fail_usage("db upgrade is for PostgreSQL; the SQLite store creates its own schema")
        return url
    if not url.startswith(("postgresql+psycopg://", "postgresql://")):
        _fail_usage("the database URL must start with postgresql+psycopg:// or sqlite:///")
    return url.replace("postgresql://", "postgresql+psycopg://", 1)


def _sqlite_path(url: str) -> str:
    path = url[len(SQLITE_URL_PREFIX) :]
    if not path or path == ":memory:":
        _fail_usage("a sqlite:/// URL must name a database file")
    if not os.path.exists(path) and _command_name() not in CREATES_SQLITE_DATABASE:
        raise Failure(f"no database at {path}")
    return os.path.abspath(path)


database_option = click.option(
    "--database-url", "database_url", default=None, help="Defaults to $QL3_DATABASE_URL."
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


@contextmanager
def _cluster(database_url: str | None, **settings: Any) -> Iterator[Any]:
    """The container of the database's profile: Cluster for PostgreSQL, Standalone for a
    ``sqlite:///`` URL (it never loads the PostgreSQL adapter)."""
    url = _database_url(database_url)
    if url.startswith(SQLITE_URL_PREFIX):
        from ql3.bootstrap import standalone

        container: Any = standalone.build(database_path=_sqlite_path(url), **settings)
    else:
        from ql3.bootstrap import cluster

        container = cluster.build(database_url=url, **settings)
    try:
        yield container
    finally:
        container.store().close()


@contextmanager
def _producer(database_url: str | None) -> Iterator[Any]:
    """Admission and the run queries on the database's store, without a profile's container
    (quick to import: no dependency-injector, no web framework)."""
    from ql3.bootstrap import producer

    url = _database_url(database_url)
    if url.startswith(SQLITE_URL_PREFIX):
        store = producer.open_sqlite_store(_sqlite_path(url))
    else:
        store = producer.open_postgres_store(url, pool_size=1)
    built = producer.Producer(store)
    try:
        yield built
    finally:
        built.close()


@contextmanager
def _submit_store(database_url: str | None) -> Iterator[Any]:
    """A store that admits Runs and nothing else, on its driver alone: a submit imports no
    SQLAlchemy (ADR 0009). A SQLite file that is missing or of another schema version is opened
    by the Standalone store, which creates, upgrades or refuses it."""
    from ql3.bootstrap import producer

    url = _database_url(database_url)
    if url.startswith(SQLITE_URL_PREFIX):
        store = producer.open_sqlite_submit_store(_sqlite_path(url))
    else:
        store = producer.open_postgres_submit_store(url)
    try:
        yield store
    finally:
        store.close()


def _emit(as_json: bool, document: object, text: Callable[[], None]) -> None:
    if as_json:
        click.echo(json.dumps(document, sort_keys=True, default=str))
    else:
        text()


# The commands defined in modules of their own, imported only when named (or listed by --help),
# so that a submit loads none of what they need (ADR 0009).
@click.group(
    cls=LazyGroup,
    lazy={
        "serve": "ql3.adapters.cli.node_cmds:serve",
        "worker": "ql3.adapters.cli.node_cmds:worker",
        "standalone": "ql3.adapters.cli.standalone_cmds:standalone_command",
        "triggers": "ql3.adapters.cli.trigger_cmds:triggers",
        "workflows": "ql3.adapters.cli.trigger_cmds:workflows",
        "credentials": "ql3.adapters.cli.credential_cmds:credentials",
        "doctor": "ql3.adapters.cli.ops_cmds:doctor_command",
        "status": "ql3.adapters.cli.ops_cmds:status_command",
        "workers": "ql3.adapters.cli.ops_cmds:workers_group",
        "tasks": "ql3.adapters.cli.task_cmds:tasks",
        "console": "ql3.adapters.cli.console_cmds:console",
    },
)
@click.version_option(package_name="ql3-runtime", prog_name="ql3", message="%(prog)s %(version)s")
def cli() -> None:
    """QL3 runtime: durable execution with safe recovery of lost work."""


@cli.command()
@click.option("--short", is_flag=True, help="Shorter tasks and leases (also: QL3_DEMO_SHORT=1).")
@click.option("--keep", "folder", default=None, help="Keep the database and log in this folder.")
def demo(short: bool, folder: str | None) -> None:
    """Tell the recovery story: a process dies mid-task and is restarted."""
    from ql3.adapters.cli.demo import run_demo

    run_demo(short=short or None, folder=folder)


@cli.group(cls=LazyGroup, lazy={"grant-ingress": "ql3.adapters.cli.db_cmds:grant_ingress_command"})
def db() -> None:
    """Database administration."""


@db.command("upgrade")
@database_option
def db_upgrade(database_url: str | None) -> None:
    """Apply the schema migrations."""
    from ql3.adapters.postgres.grants import IngressGrantRefused
    from ql3.adapters.postgres.migrate import UnknownRevision, current_revision, upgrade

    url = _database_url(database_url)
    try:
        upgrade(url)
    except IngressGrantRefused as error:
        raise Failure(f"database at revision {current_revision(url)}, but {error}") from None
    except UnknownRevision as error:
        raise Failure(str(error)) from None
    click.echo(f"database at revision {current_revision(url)}")


@cli.command()
@click.argument("task")
@click.option("--input", "input_json", default="null", help="The run's JSON input.")
@click.option("--safety", type=click.Choice([s.value for s in Safety]), default=None)
@click.option("--retry-on-lost", is_flag=True)
@click.option(
    "--retry-on-error",
    is_flag=True,
    help="Retry when the task fails or times out (needs --safety idempotent or deduplicated).",
)
@click.option("--max-attempts", type=int, default=None)
@click.option("--backoff-initial", type=float, default=None, help="Seconds.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=None,
    help="Seconds an attempt may run before the worker stops it as a failure.",
)
@click.option(
    "--delay", type=float, default=None, help="Claimable this many seconds after admission."
)
@click.option(
    "--run-after",
    default=None,
    help="Claimable from this ISO 8601 time (without an offset: UTC).",
)
@click.option(
    "--unique-key",
    default=None,
    help="While an unfinished run holds this key, answer with it and write nothing.",
)
@click.option(
    "--priority",
    type=click.IntRange(MIN_PRIORITY, MAX_PRIORITY),
    default=0,
    show_default=True,
    help="Higher is claimed before the other queued runs of its task.",
)
@database_option
@json_option
def submit(
    task: str,
    input_json: str,
    safety: str | None,
    retry_on_lost: bool,
    retry_on_error: bool,
    max_attempts: int | None,
    backoff_initial: float | None,
    timeout_s: float | None,
    delay: float | None,
    run_after: str | None,
    unique_key: str | None,
    priority: int,
    database_url: str | None,
    as_json: bool,
) -> None:
    """Admit a run of TASK, at once or delayed (--delay or --run-after); with --unique-key, at
    most one unfinished run per key."""
    try:
        payload = json.loads(input_json)
    except json.JSONDecodeError as error:
        _fail_usage(f"--input is not JSON: {error.msg}")
    timeout_ms: int | None = None
    if timeout_s is not None:
        if not timeout_s > 0 or timeout_s * 1000 > MAX_TIMEOUT_MS:
            _fail_usage(f"--timeout must be within 0.001..{MAX_TIMEOUT_MS // 1000} seconds")
        timeout_ms = max(1, round(timeout_s * 1000))
    policy: RetryPolicy | None = None
    # Any policy option given, with whatever value, makes a policy: a value is never taken for
    # "not given", so a bad one is refused below rather than ignored.
    policy_given = (
        safety is not None
        or retry_on_lost
        or retry_on_error
        or max_attempts is not None
        or backoff_initial is not None
    )
    if policy_given:
        if backoff_initial is not None and not (
            math.isfinite(backoff_initial) and 0 <= backoff_initial * 1000 <= MAX_BACKOFF_MS
        ):
            _fail_usage(
                f"--backoff-initial must be a number of seconds within 0..{MAX_BACKOFF_MS // 1000}"
            )
        initial_ms = round((backoff_initial if backoff_initial is not None else 1.0) * 1000)
        policy = RetryPolicy(
            retry_on_lost=retry_on_lost,
            retry_on_error=retry_on_error,
            max_attempts=max_attempts if max_attempts is not None else 1,
            safety=Safety(safety) if safety else None,
            backoff=Backoff(initial_ms=initial_ms, cap_ms=max(initial_ms, 300_000)),
        )
    delay_ms, run_after_ms = _submit_timing(delay, run_after)
    if unique_key is not None:
        from ql3.domain.transitions import check_unique_key

        check_unique_key(unique_key)
    request = AdmissionRequest(
        task=task,
        input=payload,
        policy=policy,
        timeout_ms=timeout_ms,
        priority=priority,
        unique_key=unique_key,
        delay_ms=delay_ms,
        run_after_ms=run_after_ms,
    )
    from ql3.bootstrap.producer import submit as admit_on

    with _submit_store(database_url) as store:
        admitted = admit_on(store, [request])[0]
    run_id = admitted.run_id

    def text() -> None:
        click.echo(run_id)
        if admitted.existing:
            click.echo(f"existing run: an unfinished run holds unique key {unique_key}", err=True)

    _emit(as_json, {"run_id": run_id, "existing": admitted.existing}, text)


def _submit_timing(delay: float | None, run_after: str | None) -> tuple[int | None, int | None]:
    """The delay and the due time of ``ql3 submit`` in milliseconds (at most one of them);
    bad input is a usage error."""
    from ql3.application.admission import delay_ms, epoch_ms

    if delay is not None and run_after is not None:
        _fail_usage("give --delay or --run-after, not both")
    if delay is not None:
        if not math.isfinite(delay) or delay < 0:
            _fail_usage("--delay must be a finite number of seconds >= 0")
        return delay_ms(delay), None
    if run_after is not None:
        try:
            moment = dt.datetime.fromisoformat(run_after)
        except ValueError:
            _fail_usage(f"--run-after is not an ISO 8601 time: {run_after!r}")
        return None, epoch_ms(moment)
    return None, None


@cli.group(
    cls=LazyGroup,
    lazy={
        "quarantine": "ql3.adapters.cli.ops_cmds:quarantine_command",
        "unquarantine": "ql3.adapters.cli.ops_cmds:unquarantine_command",
    },
)
def runs() -> None:
    """Inspect runs; prune finished ones."""


@runs.command("list")
@click.option("--status", type=click.Choice([s.value for s in RunStatus]), default=None)
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@database_option
@json_option
def runs_list(status: str | None, limit: int, database_url: str | None, as_json: bool) -> None:
    """List runs, oldest first."""
    from ql3.application.queries import RunQueries

    with _cluster(database_url) as container:
        found = RunQueries(container.store().unit_of_work).list(
            RunStatus(status) if status else None, limit
        )
    rows = [
        {
            "id": r.id,
            "task": r.task,
            "status": r.status.value,
            "attempts": r.attempt_count,
            "quarantined": r.is_quarantined,
        }
        for r in found
    ]

    def text() -> None:
        for row in rows:
            mark = "  quarantined" if row["quarantined"] else ""
            click.echo(
                f"{row['id']}  {row['status']:<11} {row['attempts']:>3}  {row['task']}{mark}"
            )

    _emit(as_json, {"runs": rows}, text)


@runs.command("show")
@click.argument("run_id")
@database_option
@json_option
def runs_show(run_id: str, database_url: str | None, as_json: bool) -> None:
    """Show a run, its attempts with their leases, and its events."""
    from ql3.application.queries import RunQueries

    with _cluster(database_url) as container:
        view = RunQueries(container.store().unit_of_work).show(run_id)
    if view is None:
        raise UnknownRun(run_id)
    document = view.as_dict()

    def text() -> None:
        click.echo(f"run {view.run.id}  task {view.run.task}  status {view.run.status.value}")
        if view.run.error:
            click.echo(f"  error: {view.run.error}")
        if view.run.next_attempt_at_ms is not None:
            click.echo(f"  next attempt due at {_iso(view.run.next_attempt_at_ms)}")
        if view.run.unique_key is not None:
            click.echo(f"  unique key: {view.run.unique_key}")
        if view.run.quarantine:
            q = view.run.quarantine
            click.echo(f"  quarantined since {_iso(q.since_ms)}: {q.reason}")
        for a in view.attempts:
            lease = a.lease
            lease_text = (
                f"lease gen {lease.generation} v{lease.version} {lease.status.value}"
                + (f" ({lease.release_reason.value})" if lease.release_reason else "")
                if lease
                else "no lease"
            )
            click.echo(f"  attempt {a.attempt.number} {a.attempt.status.value:<9} {lease_text}")
            if a.awaiting_evidence_since_ms is not None:
                click.echo(
                    "    waiting for not-running evidence since "
                    f"{_iso(a.awaiting_evidence_since_ms)}"
                )
        for step in view.steps:
            run = step.run
            run_text = f"run {run.id} {run.status.value}" if run else "no run"
            click.echo(f"  step {step.step.step_id} {step.step.status.value:<9} {run_text}")
        for seq, kind, at, _attempt, _data in view.events:
            click.echo(f"  event {seq:>6} {_iso(at)} {kind}")

    _emit(as_json, document, text)


@runs.command("prune")
@click.option(
    "--finished-before",
    "finished_before",
    required=True,
    metavar="DURATION",
    help="Delete runs whose last change is older than this: 30d, 12h, 90m or 3600s.",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option(
    "--batch-size",
    type=click.IntRange(1, MAX_BATCH_SIZE),
    default=DEFAULT_BATCH_SIZE,
    show_default=True,
    help="Runs per transaction.",
)
@database_option
@json_option
def runs_prune(
    finished_before: str, dry_run: bool, batch_size: int, database_url: str | None, as_json: bool
) -> None:
    """Delete finished runs (succeeded, failed, cancelled) whose last change is older than
    DURATION, with their attempts, leases, events and every row that references them, in
    short transactions of at most --batch-size runs (ADR 0016). Made for cron."""
    from ql3.application.history import HistoryPruning, InvalidDuration, parse_duration

    try:
        older_than_ms = parse_duration(finished_before)
    except InvalidDuration as error:
        _fail_usage(f"--finished-before: {error}")
    with _cluster(database_url) as container:
        try:
            report = HistoryPruning(container.store().unit_of_work).prune(
                older_than_ms, dry_run=dry_run, batch_size=batch_size
            )
        except ConcurrencyConflict as error:
            # Only a writer that does not lock the Run first can get here; the batches before
            # this one are committed, and the next prune takes the rest.
            raise Failure(f"a batch was refused and rolled back, run it again: {error}") from None
    removed = report.removed

    def text() -> None:
        verb = "would prune" if dry_run else "pruned"
        click.echo(
            f"{verb} {removed.runs} run(s) finished before {_iso(report.finished_before_ms)}"
            f" in {report.batches} batch(es): {removed.attempts} attempt(s),"
            f" {removed.leases} lease(s), {removed.events} event(s),"
            f" {removed.stop_reports} stop report(s), {removed.trigger_firings} trigger"
            f" firing(s), {removed.workflow_steps} workflow step(s)"
        )

    _emit(as_json, report.as_dict(), text)


@runs.command("cancel")
@click.argument("run_id")
@click.option(
    "--reason",
    default="cancelled by operator",
    show_default=True,
    help="Why (kept as the run's error).",
)
@database_option
@json_option
def runs_cancel(run_id: str, reason: str, database_url: str | None, as_json: bool) -> None:
    """Cancel an unfinished run now; a running task is stopped by its worker at its next call
    to the node (ADR 0017)."""
    from ql3.domain.errors import InvalidTransition
    from ql3.domain.transitions import MAX_CANCEL_REASON_LENGTH

    if not reason.strip() or len(reason) > MAX_CANCEL_REASON_LENGTH or "\x00" in reason:
        _fail_usage(f"--reason must be 1..{MAX_CANCEL_REASON_LENGTH} characters, without NUL")
    with _producer(database_url) as producer:
        try:
            was = producer.admission.cancel(run_id, reason)
        except InvalidTransition as refused:
            raise Failure(
                f"run {run_id} is {refused.status}: a finished run cannot be "
                "cancelled; nothing changed"
            ) from None
    document = {"run_id": run_id, "status": RunStatus.CANCELLED.value, "was": was.value}
    _emit(
        as_json,
        document,
        lambda: click.echo(f"cancelled run {run_id} (was {was.value})"),
    )


def _iso(ms: int) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


@cli.group()
def scheduler() -> None:
    """The Cluster scheduler cadence."""


@scheduler.command("tick")
@database_option
@json_option
def scheduler_tick(database_url: str | None, as_json: bool) -> None:
    """Run one Cluster cadence cycle and print each step's counts."""
    with _cluster(database_url) as container:
        summary = container.coordinator().run_cycle()
    document = summary.as_dict()

    def text() -> None:
        for step in summary.steps:
            counts = ", ".join(f"{k}={v}" for k, v in step.counts.items())
            click.echo(
                f"{step.name:<24} {counts}" + (f"  ERROR {step.error}" if step.error else "")
            )

    _emit(as_json, document, text)
    if not summary.ok:
        raise Failure(f"cycle aborted at {summary.aborted_at}")


@cli.group()
def attempts() -> None:
    """Operator actions on attempts."""


@attempts.command("attest-stopped")
@click.argument("attempt_id")
@click.option("--reason", required=True, help="Why you know the attempt no longer runs.")
@database_option
def attempts_attest_stopped(attempt_id: str, reason: str, database_url: str | None) -> None:
    """Attest that ATTEMPT_ID no longer executes anywhere (not-running evidence)."""
    with _cluster(database_url) as container:
        container.core.worker_commands().attest_stopped(attempt_id, reason)
    click.echo(f"attested: attempt {attempt_id} is not running")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ql3`` console script."""
    try:
        cli.main(args=argv, prog_name="ql3", standalone_mode=False)
    except click.exceptions.Exit as done:
        return int(done.exit_code or 0)
    except click.Abort:
        click.echo("ql3: aborted", err=True)
        return 1
    except click.ClickException as error:
        click.echo(f"ql3: {error.format_message()}", err=True)
        return 2
    except (DomainError, InvalidPageSize, ValueError) as error:
        click.echo(f"ql3: {error}", err=True)
        return 2
    except (UnknownRun, UnknownAttempt) as error:
        click.echo(f"ql3: not found: {error}", err=True)
        return 1
    except Failure as error:
        click.echo(f"ql3: {error}", err=True)
        return 1
    except Exception as error:  # database unreachable and the like: one line, no traceback
        click.echo(
            f"ql3: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
            err=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    # ``python -m ql3.adapters.cli.main`` runs this file as ``__main__``, a second copy of the
    # module: hand over to the module under its own name, whose errors the commands raise.
    from ql3.adapters.cli import main as _named

    sys.exit(_named.main())
