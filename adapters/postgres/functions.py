"""The one current text of every database function of the PostgreSQL store (ADR 0022).

``sql/functions.template.sql`` holds the functions (the worker ingress's fenced
``ql3_ingress_*`` functions and the trigger function ``ql3_notify_run_finished``) with
placeholders ``{{ NAME }}`` and ``{{ rule(argument, ...) }}``; :func:`render` fills them from the
domain's data and writes nothing by hand that the domain states:

- status sets (``{{ one_of(SET) }}``) are the sets of :mod:`ql3.domain.states`, spelled in their
  enum's order;
- each predicate that is a rule of the domain is rendered by one function here, named for it:
  :func:`claimable_run`, :func:`pristine_attempt`, :func:`lease_expired`,
  :func:`retries_on_error` (whose safety part is the schema's
  :func:`~ql3.adapters.sql.schema.retryable_safety`, as the CHECK on ``runs``);
- numbers and names are the application's constants (lock namespace, channel, batch size).

The rendered text is checked in as ``sql/functions.sql``, real SQL a reviewer reads, to be run
with the psql variable ``schema`` set to the schema that holds the tables (the functions pin
their ``search_path`` to it). A test renders it afresh and compares it with that file, and
compares every function of a migrated database with the file: a change to a guard here or in the
domain fails until the file is regenerated and a migration carries it. Regenerate with::

    python -m ql3.adapters.postgres.functions > adapters/postgres/sql/functions.sql

A migration never reads this file: it runs its own frozen copy (``migrations/versions``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from enum import Enum
from pathlib import Path

from ql3.adapters.postgres.ingress import MAX_CALL_ITEMS
from ql3.adapters.postgres.queries import (
    ADVISORY_LOCK_NAMESPACE,
    DISPATCH_CHANNEL,
    FINISHED_CHANNEL,
)
from ql3.adapters.sql import guards
from ql3.adapters.sql.schema import in_declared_order, retryable_safety
from ql3.domain.events import EventType
from ql3.domain.guards import CLAIMABLE_RUN, LEASE_EXPIRED, PRISTINE_ATTEMPT
from ql3.domain.model import RunStatus
from ql3.domain.sessions import MAX_CAPACITY
from ql3.domain.states import (
    CLAIMABLE_RUN_STATUSES,
    NON_TERMINAL_ATTEMPT_STATUSES,
    OPEN_SESSION_STATUSES,
    RECOVERABLE_RUN_STATUSES,
    RELEASABLE_ATTEMPT_STATUSES,
    RUN_EDGES,
    STARTED_ATTEMPT_STATUSES,
)

SQL = Path(__file__).resolve().parent / "sql"
TEMPLATE = SQL / "functions.template.sql"
RENDERED = SQL / "functions.sql"
SCHEMA_VARIABLE = ':"schema"'
"""Where the rendered text names the schema of the tables: a psql variable, bound by whoever
runs the text (a migration binds its own frozen copy's)."""

# A claim reads its candidates of each task a page at a time: as many as it may lock, and this
# many more for those other transactions hold.
CLAIM_PAGE_SLACK = 16

HANDED_BACK_RUN_STATUSES = frozenset(
    status for status in RECOVERABLE_RUN_STATUSES if RunStatus.QUEUED in RUN_EDGES[status]
)
"""Runs a worker's hand-back takes back to ``queued``: those whose Attempt may hold a lease
(:data:`~ql3.domain.states.RECOVERABLE_RUN_STATUSES`) with an edge into ``queued``."""

WORKER_EVENTS = (
    EventType.ATTEMPT_STARTED,
    EventType.ATTEMPT_RELEASED,
    EventType.ATTEMPT_SUCCEEDED,
    EventType.ATTEMPT_FAILED,
    EventType.ATTEMPT_LOST,
    EventType.EVIDENCE_RECORDED,
)
"""The changes a worker's ``ql3_ingress_apply`` item may be: a claim, a hand-back, a completion,
an abandon, and the record of an abandon report after its lease expired."""

SETS: dict[str, Iterable[Enum]] = {
    "CLAIMABLE_RUN_STATUSES": CLAIMABLE_RUN_STATUSES,
    "HANDED_BACK_RUN_STATUSES": HANDED_BACK_RUN_STATUSES,
    "RECOVERABLE_RUN_STATUSES": RECOVERABLE_RUN_STATUSES,
    "NON_TERMINAL_ATTEMPT_STATUSES": NON_TERMINAL_ATTEMPT_STATUSES,
    "RELEASABLE_ATTEMPT_STATUSES": RELEASABLE_ATTEMPT_STATUSES,
    "STARTED_ATTEMPT_STATUSES": STARTED_ATTEMPT_STATUSES,
    "OPEN_SESSION_STATUSES": OPEN_SESSION_STATUSES,
    "WORKER_EVENTS": WORKER_EVENTS,
}

CONSTANTS: dict[str, object] = {
    "ADVISORY_LOCK_NAMESPACE": ADVISORY_LOCK_NAMESPACE,
    "DISPATCH_CHANNEL": DISPATCH_CHANNEL,
    "FINISHED_CHANNEL": FINISHED_CHANNEL,
    "MAX_CALL_ITEMS": MAX_CALL_ITEMS,
    "CLAIM_PAGE_SLACK": CLAIM_PAGE_SLACK,
    "MAX_CAPACITY": MAX_CAPACITY,
}


def one_of(name: str) -> str:
    """The quoted members of the domain's status set (or event list) ``name``, for ``IN (...)``:
    a set in its enum's declared order, a list in its own."""
    members = SETS[name]
    ordered = list(members) if isinstance(members, tuple) else in_declared_order(members)
    return ", ".join(f"'{member.value}'" for member in ordered)


# --- the rules -----------------------------------------------------------------------------------


def claimable_run(run: str) -> str:
    """A Run a worker's claim may start (:data:`ql3.domain.guards.CLAIMABLE_RUN`)."""
    return guards.text(CLAIMABLE_RUN, {"run": run})


def pristine_attempt(attempt: str) -> str:
    """:data:`ql3.domain.guards.PRISTINE_ATTEMPT`: a claimed dispatch slot with no worker,
    session, offer, lease or start facts."""
    return guards.text(PRISTINE_ATTEMPT, {"attempt": attempt})


def lease_expired(lease: str) -> str:
    """:data:`ql3.domain.guards.LEASE_EXPIRED`: the lease's expiry has passed by the database's
    clock."""
    return guards.text(LEASE_EXPIRED, {"lease": lease}, now="statement_timestamp()")


def retries_on_error(run: str, attempt: str) -> str:
    """A failed ``attempt`` of ``run`` is retried (ADR 0013, :func:`ql3.domain.retry.decide_retry`
    for a task's error): the stored policy retries on error, its safety is one of
    :data:`ql3.domain.policy.RETRYABLE_SAFETY`, attempts are left, and the Attempt is the Run's
    latest."""
    return (
        f"{run}.has_policy AND coalesce({run}.retry_on_error, false)\n"
        f"                    AND {retryable_safety(f'{run}.safety')}\n"
        f"                    AND {run}.attempt_count < {run}.max_attempts\n"
        f"                    AND {attempt}.number = {run}.attempt_count"
    )


RULES: dict[str, Callable[..., str]] = {
    "one_of": one_of,
    "claimable_run": claimable_run,
    "pristine_attempt": pristine_attempt,
    "lease_expired": lease_expired,
    "retries_on_error": retries_on_error,
}

_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)(?:\(([^)]*)\))?\s*\}\}")

HEADER = """\
-- The database functions of the PostgreSQL store: their one current text (ADR 0022).
--
-- Rendered by ql3.adapters.postgres.functions from functions.template.sql and the domain's
-- data; do not edit. Change the template or the domain, then regenerate:
--
--     python -m ql3.adapters.postgres.functions > adapters/postgres/sql/functions.sql
--
-- and carry the change in a new migration (a migration runs its own frozen copy of the text).
-- Run with psql's variable "schema" set to the schema of the tables (psql -v schema=public).

"""


def _fill(match: re.Match[str]) -> str:
    name, arguments = match.group(1), match.group(2)
    if arguments is None:
        if name not in CONSTANTS:
            raise KeyError(f"unknown placeholder {name!r} in {TEMPLATE.name}")
        return str(CONSTANTS[name])
    rule = RULES[name]
    return rule(*(argument.strip() for argument in arguments.split(",")))


_SIGNATURE = re.compile(r"^CREATE OR REPLACE FUNCTION (\w+\([^)]*\))$", re.MULTILINE)


def signatures(text: str) -> list[str]:
    """The functions a text defines, as ``name(arguments)``, in the order it defines them."""
    return _SIGNATURE.findall(text)


def render() -> str:
    """The text of ``sql/functions.sql``: the template with every placeholder filled, then
    EXECUTE revoked from PUBLIC on every function (the grants give it back to whom it is for)."""
    body = _PLACEHOLDER.sub(_fill, TEMPLATE.read_text(encoding="utf-8")).rstrip("\n") + "\n"
    revokes = "".join(f"REVOKE ALL ON FUNCTION {s} FROM PUBLIC;\n" for s in signatures(body))
    return HEADER + body + "\n" + revokes


def bind_schema(text: str, schema: str) -> str:
    """The text with the psql variable ``schema`` bound to ``schema`` (a quoted identifier)."""
    return text.replace(SCHEMA_VARIABLE, '"' + schema.replace('"', '""') + '"')


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
