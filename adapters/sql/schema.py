"""The relational schema shared by the SQL stores (PostgreSQL for Cluster, SQLite for Standalone
and Edge).

Every status column is checked against the values of its domain enum, every invariant that one
row can express is a CHECK constraint, and every "at most one ... per ..." rule is a partial unique
index. PostgreSQL-only details (timestamptz, JSONB, the "C" collation of identifiers, storage
parameters, partial index predicates) sit behind ``with_variant`` or ``postgresql_*`` keywords so
that the same ``MetaData`` compiles on other dialects.

Indexes on ``runs``, ``run_attempts`` and ``run_dispatch_leases`` are partial on the non-terminal
statuses, so that the cost of every candidate query follows the live work, not the finished
history; ``ix_runs_finished`` alone lists the finished Runs, for a prune to read its page of
that history (ADR 0016). ``run_dispatch_leases.expires_at`` is deliberately not indexed: a
renewal changes only that column, and keeping it out of every index lets PostgreSQL renew with
HOT updates.
"""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    false,
    text,
    true,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import ColumnElement
from sqlalchemy.types import TypeDecorator, TypeEngine

from ql3.adapters.sql import guards
from ql3.adapters.sql.guards import in_declared_order
from ql3.domain.credentials import CredentialEventType
from ql3.domain.events import EventType
from ql3.domain.guards import HANDED_BACK
from ql3.domain.model import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    TERMINAL_RUN_STATUSES,
    AttemptStatus,
    CredentialStatus,
    EvidenceKind,
    LeaseStatus,
    ReleaseReason,
    RunOwner,
    RunStatus,
    SessionStatus,
)
from ql3.domain.policy import MAX_ATTEMPTS_LIMIT, RETRYABLE_SAFETY, Safety
from ql3.domain.states import (
    CLAIMABLE_RUN_STATUSES,
    NON_TERMINAL_ATTEMPT_STATUSES,
    NON_TERMINAL_RUN_STATUSES,
    OPEN_SESSION_STATUSES,
)
from ql3.domain.triggers import MAX_CATCH_UP_LIMIT, MIN_INTERVAL_MS, CatchUp, TriggerStatus
from ql3.domain.workflows import StepStatus

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
ONE_MILLISECOND = dt.timedelta(milliseconds=1)


def millis_to_datetime(value: int) -> dt.datetime:
    """Integer epoch milliseconds as an aware UTC datetime (exact: no float arithmetic)."""
    return EPOCH + dt.timedelta(milliseconds=value)


def datetime_to_millis(value: dt.datetime) -> int:
    """An aware datetime as integer epoch milliseconds, rounded down."""
    if value.tzinfo is None:
        raise ValueError("naive datetime: the store keeps only aware timestamps")
    return (value - EPOCH) // ONE_MILLISECOND


class EpochMillis(TypeDecorator[int]):
    """Domain time (integer epoch milliseconds) stored as ``TIMESTAMP WITH TIME ZONE`` on
    PostgreSQL and as a plain ``BIGINT`` of milliseconds on dialects without a zoned timestamp.

    The conversion happens here, at the edge, for every bound value and every result.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(DateTime(timezone=True))
        return dialect.type_descriptor(BigInteger())

    def process_bind_param(self, value: int | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if dialect.name == "postgresql":
            return millis_to_datetime(int(value))
        return int(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> int | None:
        if value is None:
            return None
        if isinstance(value, dt.datetime):
            return datetime_to_millis(value)
        return int(value)

    @property
    def python_type(self) -> type[int]:
        return int


def identifier() -> TypeEngine[str]:
    """Identifiers compare and sort byte-wise ("C" collation) on PostgreSQL, as in Python."""
    return Text().with_variant(Text(collation="C"), "postgresql")


def sequence_key() -> TypeEngine[int]:
    """An identity key. On SQLite it must be declared ``INTEGER`` to alias the rowid, which is
    what numbers new rows there."""
    return BigInteger().with_variant(Integer(), "sqlite")


def json_document() -> TypeEngine[Any]:
    """A JSON value; SQL NULL stands for Python ``None``. JSONB on PostgreSQL."""
    return JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), "postgresql")


def _quoted(values: Iterable[str]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def _one_of(column: str, values: Iterable[str]) -> str:
    return f"{column} IN ({_quoted(values)})"


class _Allowed(ColumnElement[bool]):
    """A CHECK that ``column`` holds one of ``values`` (or is NULL, with ``or_null``): ``column
    IN (...)``, but on SQLite a chain of equalities. SQLite evaluates an IN list of three or
    more constants through a temporary index it builds again at every execution of a
    statement, and a CHECK is evaluated for every row a statement writes: the equalities cost
    a few comparisons instead (ADR 0006). Both spellings accept the same values."""

    inherit_cache = False
    type = Boolean()

    def __init__(self, column: str, values: Iterable[str], *, or_null: bool = False) -> None:
        self.column = column
        self.values = tuple(values)
        self.or_null = or_null


@compiles(_Allowed)
def _allowed_in_list(element: _Allowed, _compiler: Any, **_kw: Any) -> str:
    check = _one_of(element.column, element.values)
    return f"{element.column} IS NULL OR {check}" if element.or_null else check


@compiles(_Allowed, "sqlite")
def _allowed_equalities(element: _Allowed, _compiler: Any, **_kw: Any) -> str:
    column = element.column
    check = " OR ".join(f"{column} = '{value}'" for value in element.values)
    return f"{column} IS NULL OR {check}" if element.or_null else check


def _allowed(column: str, values: Iterable[str], *, or_null: bool = False) -> _Allowed:
    return _Allowed(column, values, or_null=or_null)


def _enum_values(enum_type: Any) -> list[str]:
    return [member.value for member in enum_type]




def _names(statuses: Iterable[enum.Enum]) -> list[str]:
    return [str(member.value) for member in in_declared_order(statuses)]


def retryable_safeties() -> list[str]:
    """The stored safeties a policy that retries on error may declare: the rule of
    :data:`ql3.domain.policy.RETRYABLE_SAFETY` (``idempotent``, ``deduplicated``; ADR 0013)."""
    return _names(RETRYABLE_SAFETY)


def retryable_safety(column: str) -> str:
    """SQL: the safety in ``column`` is one of :func:`retryable_safeties`. The worker ingress's
    functions (:mod:`ql3.adapters.postgres.functions`) render their retry rule with it; the CHECK
    of ``runs`` below states the same rule with :class:`_Allowed`."""
    return _one_of(column, retryable_safeties())


class _RetryOnErrorSafety(ColumnElement[bool]):
    """The CHECK that a Run whose policy retries on error has a retryable safety (NULL
    ``retry_on_error`` is false; a NULL safety is none of them), its safeties spelled as
    :class:`_Allowed` spells them on each dialect."""

    inherit_cache = False
    type = Boolean()


@compiles(_RetryOnErrorSafety)
def _retry_on_error_safety(element: _RetryOnErrorSafety, compiler: Any, **kw: Any) -> str:
    allowed = compiler.process(_allowed("safety", retryable_safeties()), **kw)
    return f"retry_on_error IS NOT TRUE OR (safety IS NOT NULL AND ({allowed}))"


_POLICY_COLUMNS_REQUIRED = (
    "retry_on_lost",
    "max_attempts",
    "backoff_initial_ms",
    "backoff_multiplier",
    "backoff_cap_ms",
    "backoff_jitter",
)
_POLICY_COLUMNS = (*_POLICY_COLUMNS_REQUIRED, "safety")

_POLICY_PRESENT = " AND ".join(f"{name} IS NOT NULL" for name in _POLICY_COLUMNS_REQUIRED)
_POLICY_ABSENT = " AND ".join(f"{name} IS NULL" for name in _POLICY_COLUMNS)

metadata = MetaData(naming_convention=NAMING_CONVENTION)

runs = Table(
    "runs",
    metadata,
    Column("id", identifier(), nullable=False),
    Column("task", Text(), nullable=False),
    Column("owner", Text(), nullable=False),
    Column("status", Text(), nullable=False),
    Column("input", json_document(), nullable=True),
    Column("output", json_document(), nullable=True),
    Column("error", Text(), nullable=True),
    Column("has_policy", Boolean(), nullable=False),
    Column("retry_on_lost", Boolean(), nullable=True),
    Column("max_attempts", Integer(), nullable=True),
    Column("safety", Text(), nullable=True),
    Column("backoff_initial_ms", BigInteger(), nullable=True),
    Column("backoff_multiplier", Double(), nullable=True),
    Column("backoff_cap_ms", BigInteger(), nullable=True),
    Column("backoff_jitter", Double(), nullable=True),
    Column("attempt_count", Integer(), nullable=False),
    Column("next_attempt_at", EpochMillis(), nullable=True),
    Column("parent_run_id", identifier(), nullable=True),
    Column("created_at", EpochMillis(), nullable=False),
    Column("updated_at", EpochMillis(), nullable=False),
    # An operator's quarantine (ADR 0010): set together, cleared together.
    Column("quarantined_at", EpochMillis(), nullable=True),
    Column("quarantine_reason", Text(), nullable=True),
    # ADR 0013: retries on a task's error, the execution timeout; ADR 0014: the priority;
    # ADR 0015: the unique key. NULL ``retry_on_error`` (a Run admitted before the column) is
    # false.
    Column("retry_on_error", Boolean(), nullable=True),
    Column("timeout_ms", BigInteger(), nullable=True),
    Column("priority", Integer(), nullable=False, server_default=text("0")),
    Column("unique_key", Text(), nullable=True),
    PrimaryKeyConstraint("id", name="pk_runs"),
    CheckConstraint(_allowed("owner", _enum_values(RunOwner)), name="owner"),
    CheckConstraint(_allowed("status", _enum_values(RunStatus)), name="status"),
    CheckConstraint(_allowed("safety", _enum_values(Safety), or_null=True), name="safety"),
    CheckConstraint("attempt_count >= 0", name="attempt_count"),
    CheckConstraint(f"max_attempts BETWEEN 1 AND {MAX_ATTEMPTS_LIMIT}", name="max_attempts"),
    CheckConstraint(
        "backoff_initial_ms >= 0 AND backoff_multiplier >= 1"
        " AND backoff_cap_ms >= backoff_initial_ms"
        " AND backoff_jitter >= 0 AND backoff_jitter <= 1",
        name="backoff",
    ),
    CheckConstraint(
        f"(has_policy AND {_POLICY_PRESENT}) OR (NOT has_policy AND {_POLICY_ABSENT})",
        name="policy_iff_has_policy",
    ),
    CheckConstraint("task <> ''", name="task_not_empty"),
    CheckConstraint("timeout_ms IS NULL OR timeout_ms >= 1", name="timeout_ms"),
    CheckConstraint(_RetryOnErrorSafety(), name="retry_on_error_safety"),
    CheckConstraint(
        f"priority BETWEEN {MIN_PRIORITY} AND {MAX_PRIORITY}", name="priority"
    ),
)

Index(
    "ix_runs_created_at",
    runs.c.created_at,
    runs.c.id,
)
Index(
    "ix_runs_lost",
    runs.c.updated_at,
    runs.c.id,
    postgresql_where=text("status = 'lost'"),
    sqlite_where=text("status = 'lost'"),
)
Index(
    "ix_runs_retry_wait",
    runs.c.next_attempt_at,
    runs.c.id,
    postgresql_where=text("status = 'retry_wait'"),
    sqlite_where=text("status = 'retry_wait'"),
)
# ADR 0015: while a Run is unfinished, no other Run holds its unique key; a finished Run frees
# it. The store's admission reads it through this index, and an insert that races another
# replica's is refused by it.
UNFINISHED_KEYED_RUN = (
    f"unique_key IS NOT NULL AND {_one_of('status', _names(NON_TERMINAL_RUN_STATUSES))}"
)
Index(
    "uq_runs_unique_key",
    runs.c.unique_key,
    unique=True,
    postgresql_where=text(UNFINISHED_KEYED_RUN),
    sqlite_where=text(UNFINISHED_KEYED_RUN),
)
Index(
    "ix_runs_created",
    runs.c.created_at,
    runs.c.id,
    postgresql_where=text("status = 'created'"),
    sqlite_where=text("status = 'created'"),
)
# Quarantined Runs are few and listed by ``ql3 status`` and the metrics on every scrape.
QUARANTINED_RUN = "quarantined_at IS NOT NULL"
Index(
    "ix_runs_quarantined",
    runs.c.quarantined_at,
    runs.c.id,
    postgresql_where=text(QUARANTINED_RUN),
    sqlite_where=text(QUARANTINED_RUN),
)
# A claim's candidates are the pristine Attempts of queued Runs of a task, the highest priority
# first, then the oldest Attempt (ADR 0014). An Attempt never changed since it was created was
# created with its Run's move into ``queued`` (admission, a first or a next Attempt), so its age
# is that Run's ``updated_at``, which nothing else changes while the Run is queued: this index
# lists them in claim order, and a claim reads the few first of each of its tasks, however deep
# the queue and however its priorities mix. An Attempt handed back keeps its age but its Run was
# updated since; ``ix_run_attempts_handed_back`` lists those.
_CLAIMABLE_RUN = _one_of("status", _names(CLAIMABLE_RUN_STATUSES))
Index(
    "ix_runs_claimable",
    runs.c.task,
    runs.c.priority.desc(),
    runs.c.updated_at,
    runs.c.id,
    postgresql_where=text(_CLAIMABLE_RUN),
    sqlite_where=text(_CLAIMABLE_RUN),
)

# A prune's pick (ADR 0016): the finished top-level Runs (no workflow step's), by their last
# change; a workflow's step Runs are pruned with it, found through its steps.
PRUNABLE_RUN = f"{_one_of('status', _names(TERMINAL_RUN_STATUSES))} AND parent_run_id IS NULL"
Index(
    "ix_runs_finished",
    runs.c.updated_at,
    runs.c.id,
    postgresql_where=text(PRUNABLE_RUN),
    sqlite_where=text(PRUNABLE_RUN),
)

# The operator console (ADR 0020): the runs list by status, newest or oldest first, and the
# count of a status (exact up to its cap) walk this index whatever the finished history holds;
# the workflows page lists the workflow aggregates, which are few, from the second. The first
# holds every Run, but is partial on a predicate true of each of them that only the console's
# statements name: a planner takes a partial index only for a statement whose predicate implies
# the index's, so no other statement's plan can change for it (SQLite, without statistics, would
# otherwise prefer it to ``ix_runs_finished`` for a prune).
CONSOLE_LISTED_RUN = "created_at IS NOT NULL"
Index(
    "ix_runs_status_created",
    runs.c.status,
    runs.c.created_at,
    runs.c.id,
    postgresql_where=text(CONSOLE_LISTED_RUN),
    sqlite_where=text(CONSOLE_LISTED_RUN),
)
WORKFLOW_RUN = "owner = 'workflow'"
Index(
    "ix_runs_workflows",
    runs.c.created_at,
    runs.c.id,
    postgresql_where=text(WORKFLOW_RUN),
    sqlite_where=text(WORKFLOW_RUN),
)

_ACTIVE_ATTEMPT = _one_of("status", _names(NON_TERMINAL_ATTEMPT_STATUSES))

run_attempts = Table(
    "run_attempts",
    metadata,
    Column("id", identifier(), nullable=False),
    Column("run_id", identifier(), ForeignKey("runs.id"), nullable=False),
    Column("number", Integer(), nullable=False),
    Column("status", Text(), nullable=False),
    Column("session_id", identifier(), nullable=True),
    Column("worker_id", identifier(), nullable=True),
    Column("lease_generation", Integer(), nullable=True),
    Column("lease_version", Integer(), nullable=True),
    Column("offered_at", EpochMillis(), nullable=True),
    Column("accepted_at", EpochMillis(), nullable=True),
    Column("started_at", EpochMillis(), nullable=True),
    Column("finished_at", EpochMillis(), nullable=True),
    Column("lost_evidence", Text(), nullable=True),
    Column("error", Text(), nullable=True),
    Column("created_at", EpochMillis(), nullable=False),
    Column("updated_at", EpochMillis(), nullable=False),
    PrimaryKeyConstraint("id", name="pk_run_attempts"),
    UniqueConstraint("run_id", "number", name="uq_run_attempts_run_id_number"),
    CheckConstraint("number >= 1", name="number"),
    CheckConstraint(_allowed("status", _enum_values(AttemptStatus)), name="status"),
    CheckConstraint(
        _allowed("lost_evidence", _enum_values(EvidenceKind), or_null=True),
        name="lost_evidence",
    ),
    CheckConstraint("lease_generation IS NULL OR lease_generation >= 1", name="lease_generation"),
    CheckConstraint("lease_version IS NULL OR lease_version >= 1", name="lease_version"),
)

Index(
    "uq_run_attempts_one_active_per_run",
    run_attempts.c.run_id,
    unique=True,
    postgresql_where=text(_ACTIVE_ATTEMPT),
    sqlite_where=text(_ACTIVE_ATTEMPT),
)
# Attempts handed back unstarted and not claimed again (``claimed`` with no session, changed
# since they were created): few at any time, by age. See ``ix_runs_claimable``.
HANDED_BACK_ATTEMPT = guards.text(HANDED_BACK, {"attempt": None})
Index(
    "ix_run_attempts_handed_back",
    run_attempts.c.created_at,
    run_attempts.c.run_id,
    postgresql_where=text(HANDED_BACK_ATTEMPT),
    sqlite_where=text(HANDED_BACK_ATTEMPT),
)

run_dispatch_leases = Table(
    "run_dispatch_leases",
    metadata,
    Column("run_id", identifier(), ForeignKey("runs.id"), nullable=False),
    Column("generation", Integer(), nullable=False),
    Column("attempt_id", identifier(), ForeignKey("run_attempts.id"), nullable=False),
    Column("version", Integer(), nullable=False),
    Column("status", Text(), nullable=False),
    Column("holder_session_id", identifier(), nullable=False),
    Column("token_hash", Text(), nullable=True),
    Column("expires_at", EpochMillis(), nullable=False),
    Column("granted_at", EpochMillis(), nullable=False),
    Column("release_reason", Text(), nullable=True),
    Column("released_at", EpochMillis(), nullable=True),
    PrimaryKeyConstraint("run_id", "generation", name="pk_run_dispatch_leases"),
    CheckConstraint("generation >= 1", name="generation"),
    CheckConstraint("version >= 1", name="version"),
    CheckConstraint(_allowed("status", _enum_values(LeaseStatus)), name="status"),
    CheckConstraint(
        _allowed("release_reason", _enum_values(ReleaseReason), or_null=True),
        name="release_reason",
    ),
    CheckConstraint(
        "(status = 'leased') = (release_reason IS NULL)", name="release_reason_iff_released"
    ),
    # Renewals rewrite only expires_at; the free space lets them stay on the page (HOT).
    postgresql_with={"fillfactor": "70"},
)

Index(
    "uq_run_dispatch_leases_one_leased_per_run",
    run_dispatch_leases.c.run_id,
    unique=True,
    postgresql_where=text("status = 'leased'"),
    sqlite_where=text("status = 'leased'"),
)
Index(
    "ix_run_dispatch_leases_held",
    run_dispatch_leases.c.holder_session_id,
    postgresql_where=text("status = 'leased'"),
    sqlite_where=text("status = 'leased'"),
)
# The foreign key to ``run_attempts``: deleting an Attempt (a prune, ADR 0016) looks its leases
# up by it. Renewals leave it alone, so they stay HOT.
Index("ix_run_dispatch_leases_attempt_id", run_dispatch_leases.c.attempt_id)

run_events = Table(
    "run_events",
    metadata,
    Column("id", sequence_key(), Identity(always=False), nullable=False),
    Column("run_id", identifier(), ForeignKey("runs.id"), nullable=False),
    Column("attempt_id", identifier(), nullable=True),
    Column("type", Text(), nullable=False),
    Column("at", EpochMillis(), nullable=False),
    Column("data", json_document(), nullable=False),
    PrimaryKeyConstraint("id", name="pk_run_events"),
    CheckConstraint(_allowed("type", _enum_values(EventType)), name="type"),
)

Index("ix_run_events_run_id", run_events.c.run_id, run_events.c.id)

worker_sessions = Table(
    "worker_sessions",
    metadata,
    Column("id", identifier(), nullable=False),
    Column("worker_id", identifier(), nullable=False),
    Column("status", Text(), nullable=False),
    Column("capacity", Integer(), nullable=False),
    Column("tasks", json_document(), nullable=False),
    Column("secret_hash", Text(), nullable=False),
    Column("registered_at", EpochMillis(), nullable=False),
    Column("last_heartbeat_at", EpochMillis(), nullable=False),
    Column("closed_at", EpochMillis(), nullable=True),
    PrimaryKeyConstraint("id", name="pk_worker_sessions"),
    CheckConstraint(_allowed("status", _enum_values(SessionStatus)), name="status"),
    CheckConstraint("capacity >= 1", name="capacity"),
)

_OPEN_SESSION = _one_of("status", _names(OPEN_SESSION_STATUSES))

Index(
    "uq_worker_sessions_one_open_per_worker",
    worker_sessions.c.worker_id,
    unique=True,
    postgresql_where=text(_OPEN_SESSION),
    sqlite_where=text(_OPEN_SESSION),
)
Index(
    "ix_worker_sessions_active",
    worker_sessions.c.id,
    postgresql_where=text("status = 'active'"),
    sqlite_where=text("status = 'active'"),
)

attempt_stop_reports = Table(
    "attempt_stop_reports",
    metadata,
    Column("id", sequence_key(), Identity(always=False), nullable=False),
    Column("attempt_id", identifier(), nullable=False),
    Column("kind", Text(), nullable=False),
    Column("reported_at", EpochMillis(), nullable=False),
    Column("detail", Text(), nullable=False),
    PrimaryKeyConstraint("id", name="pk_attempt_stop_reports"),
    CheckConstraint(_allowed("kind", _enum_values(EvidenceKind)), name="kind"),
)

Index(
    "ix_attempt_stop_reports_attempt_id",
    attempt_stop_reports.c.attempt_id,
    attempt_stop_reports.c.reported_at,
)

# --- the dispatch gate --------------------------------------------------------------------------
#
# One row shared by every replica of the store (ADR 0007): closed while the most recent runtime
# recovery or lost-retry step failed, and claims grant nothing while it is closed. The schema
# creates the row; nothing deletes it.

DISPATCH_GATE_ID = 1

dispatch_gate = Table(
    "dispatch_gate",
    metadata,
    Column("id", SmallInteger(), nullable=False),
    Column("open", Boolean(), nullable=False, server_default=true()),
    Column("reason", Text(), nullable=True),
    Column("changed_at", EpochMillis(), nullable=True),
    # The candidate the failing step is stuck on, cycle after cycle (ADR 0010).
    Column("failed_step", Text(), nullable=True),
    Column("failed_run_id", identifier(), nullable=True),
    Column("failed_attempt_id", identifier(), nullable=True),
    Column("failed_error", Text(), nullable=True),
    Column("failed_since", EpochMillis(), nullable=True),
    Column("failed_cycles", Integer(), nullable=True),
    PrimaryKeyConstraint("id", name="pk_dispatch_gate"),
    CheckConstraint(f"id = {DISPATCH_GATE_ID}", name="one_row"),
)

# --- scheduler nodes ----------------------------------------------------------------------------
#
# A task's limit on the Attempts running at once across the cluster (ADR 0014). A claim locks the
# rows of the limited tasks it would claim before it counts their leases; a task without a row
# has no limit.
task_limits = Table(
    "task_limits",
    metadata,
    Column("task", Text(), nullable=False),
    Column("max_running", Integer(), nullable=False),
    Column("updated_at", EpochMillis(), nullable=False),
    PrimaryKeyConstraint("task", name="pk_task_limits"),
    CheckConstraint("max_running >= 0", name="max_running"),
)

# One row per node id: when its last cycle ended and how (ADR 0010), written by the node after a
# cycle at most every few seconds (and whenever the outcome changes), never by the cycle itself.

scheduler_nodes = Table(
    "scheduler_nodes",
    metadata,
    Column("id", identifier(), nullable=False),
    Column("started_at", EpochMillis(), nullable=False),
    Column("last_cycle_at", EpochMillis(), nullable=False),
    Column("last_ok", Boolean(), nullable=False),
    Column("aborted_at", Text(), nullable=True),
    Column("cycles", BigInteger(), nullable=False),
    Column("anonymous_workers", Boolean(), nullable=False, server_default=false()),
    PrimaryKeyConstraint("id", name="pk_scheduler_nodes"),
    CheckConstraint("cycles >= 0", name="cycles"),
)

# --- triggers and workflows ----------------------------------------------------------------------
#
# Run templates (the policy of a trigger or a workflow step) are JSON documents
# (``ql3.domain.policy.policy_to_document``): they are copied onto each admitted Run's own columns.

triggers = Table(
    "triggers",
    metadata,
    Column("id", identifier(), nullable=False),
    Column("name", Text(), nullable=False),
    Column("task", Text(), nullable=False),
    Column("input", json_document(), nullable=True),
    Column("policy", json_document(), nullable=True),
    Column("every_ms", BigInteger(), nullable=True),
    Column("cron", Text(), nullable=True),
    Column("catch_up", Text(), nullable=False),
    Column("catch_up_limit", Integer(), nullable=False),
    Column("status", Text(), nullable=False),
    Column("next_fire_at", EpochMillis(), nullable=False),
    Column("last_fired_at", EpochMillis(), nullable=True),
    Column("version", Integer(), nullable=False),
    Column("created_at", EpochMillis(), nullable=False),
    Column("updated_at", EpochMillis(), nullable=False),
    PrimaryKeyConstraint("id", name="pk_triggers"),
    CheckConstraint(_allowed("status", _enum_values(TriggerStatus)), name="status"),
    CheckConstraint(_allowed("catch_up", _enum_values(CatchUp)), name="catch_up"),
    CheckConstraint(f"catch_up_limit BETWEEN 1 AND {MAX_CATCH_UP_LIMIT}", name="catch_up_limit"),
    CheckConstraint("(every_ms IS NULL) <> (cron IS NULL)", name="every_ms_or_cron"),
    CheckConstraint(f"every_ms IS NULL OR every_ms >= {MIN_INTERVAL_MS}", name="every_ms"),
    CheckConstraint("version >= 1", name="version"),
    CheckConstraint("name <> '' AND task <> ''", name="not_empty"),
)

_LIVE_TRIGGER = "status <> 'deleted'"

Index(
    "uq_triggers_live_name",
    triggers.c.name,
    unique=True,
    postgresql_where=text(_LIVE_TRIGGER),
    sqlite_where=text(_LIVE_TRIGGER),
)
Index(
    "ix_triggers_due",
    triggers.c.next_fire_at,
    triggers.c.id,
    postgresql_where=text("status = 'active'"),
    sqlite_where=text("status = 'active'"),
)

# One row per admitted firing. The primary key is the firing key: a scheduled time of a trigger
# is admitted at most once, whichever replica fires it.
trigger_firings = Table(
    "trigger_firings",
    metadata,
    Column("trigger_id", identifier(), ForeignKey("triggers.id"), nullable=False),
    Column("scheduled_at", EpochMillis(), nullable=False),
    Column("run_id", identifier(), ForeignKey("runs.id"), nullable=False),
    Column("fired_at", EpochMillis(), nullable=False),
    PrimaryKeyConstraint("trigger_id", "scheduled_at", name="pk_trigger_firings"),
    UniqueConstraint("run_id", name="uq_trigger_firings_run_id"),
)

_STEP_WITH_RUN = _one_of(
    "status",
    (StepStatus.ADMITTED.value, StepStatus.SUCCEEDED.value, StepStatus.FAILED.value),
)
_OPEN_STEP = _one_of("status", (StepStatus.PENDING.value, StepStatus.ADMITTED.value))

workflow_steps = Table(
    "workflow_steps",
    metadata,
    Column("workflow_run_id", identifier(), ForeignKey("runs.id"), nullable=False),
    Column("step_id", identifier(), nullable=False),
    Column("position", Integer(), nullable=False),
    Column("task", Text(), nullable=False),
    Column("input", json_document(), nullable=True),
    Column("after_steps", json_document(), nullable=False),
    Column("policy", json_document(), nullable=True),
    Column("status", Text(), nullable=False),
    Column("run_id", identifier(), ForeignKey("runs.id"), nullable=True),
    Column("updated_at", EpochMillis(), nullable=False),
    PrimaryKeyConstraint("workflow_run_id", "step_id", name="pk_workflow_steps"),
    UniqueConstraint(
        "workflow_run_id", "position", name="uq_workflow_steps_workflow_run_id_position"
    ),
    UniqueConstraint("run_id", name="uq_workflow_steps_run_id"),
    CheckConstraint(_allowed("status", _enum_values(StepStatus)), name="status"),
    CheckConstraint("position >= 0", name="position"),
    CheckConstraint(
        f"(status = 'pending' AND run_id IS NULL) OR ({_STEP_WITH_RUN} AND run_id IS NOT NULL)"
        " OR status = 'cancelled'",
        name="run_iff_admitted",
    ),
)

# The frontier's candidate query starts from the open steps: its cost follows the live work.
Index(
    "ix_workflow_steps_open",
    workflow_steps.c.workflow_run_id,
    workflow_steps.c.run_id,
    postgresql_where=text(_OPEN_STEP),
    sqlite_where=text(_OPEN_STEP),
)

# --- worker credentials (ADR 0008) --------------------------------------------------------------
#
# Who may register a worker session: only the SHA-256 hash of each secret is kept. The audit
# names the sessions registered with a credential (``used``), which is how a revocation finds
# the sessions to revoke with it.

worker_credentials = Table(
    "worker_credentials",
    metadata,
    Column("id", identifier(), nullable=False),
    Column("worker_pattern", Text(), nullable=False),
    Column("tasks", json_document(), nullable=True),
    Column("secret_hash", Text(), nullable=False),
    Column("status", Text(), nullable=False),
    Column("issued_at", EpochMillis(), nullable=False),
    Column("expires_at", EpochMillis(), nullable=True),
    Column("revoked_at", EpochMillis(), nullable=True),
    Column("rotates_id", identifier(), nullable=True),
    PrimaryKeyConstraint("id", name="pk_worker_credentials"),
    UniqueConstraint("secret_hash", name="uq_worker_credentials_secret_hash"),
    CheckConstraint(_allowed("status", _enum_values(CredentialStatus)), name="status"),
    CheckConstraint("(status = 'revoked') = (revoked_at IS NOT NULL)", name="revoked_at"),
)

worker_credential_events = Table(
    "worker_credential_events",
    metadata,
    Column("id", sequence_key(), Identity(always=False), nullable=False),
    Column("credential_id", identifier(), ForeignKey("worker_credentials.id"), nullable=False),
    Column("type", Text(), nullable=False),
    Column("at", EpochMillis(), nullable=False),
    Column("worker_id", identifier(), nullable=True),
    Column("session_id", identifier(), nullable=True),
    Column("detail", Text(), nullable=False),
    PrimaryKeyConstraint("id", name="pk_worker_credential_events"),
    CheckConstraint(_allowed("type", _enum_values(CredentialEventType)), name="type"),
)

Index(
    "ix_worker_credential_events_credential_id",
    worker_credential_events.c.credential_id,
    worker_credential_events.c.id,
)

ALL_TABLES = (
    runs,
    run_attempts,
    run_dispatch_leases,
    run_events,
    worker_sessions,
    attempt_stop_reports,
    triggers,
    trigger_firings,
    workflow_steps,
    dispatch_gate,
    worker_credentials,
    worker_credential_events,
    scheduler_nodes,
    task_limits,
)
