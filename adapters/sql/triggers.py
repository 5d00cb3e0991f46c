"""Triggers on the shared SQL tables: row mapping, statements and the repository, for every SQL
store.

Statements are dialect-neutral SQLAlchemy Core. Row locks (``FOR UPDATE [SKIP LOCKED]``) are
rendered where the dialect has them and left out where a transaction already holds the whole
database (SQLite). Time predicates take the store's clock as a column expression (``now``), so
each store passes its own: PostgreSQL its ``statement_timestamp()``-based clock, SQLite the
milliseconds it read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Insert, Select, Update, insert, literal_column, select, true
from sqlalchemy import update as sql_update

from ql3.adapters.sql.rows import Row, Values
from ql3.adapters.sql.schema import trigger_firings, triggers
from ql3.adapters.sql.transaction import SqlTransaction
from ql3.domain.policy import RetryPolicy, policy_from_document, policy_to_document
from ql3.domain.triggers import CatchUp, Trigger, TriggerFiring, TriggerStatus

# Rendered inline, so that the partial indexes match generic plans too.
ACTIVE: ColumnElement[str] = literal_column(f"'{TriggerStatus.ACTIVE.value}'")
DELETED: ColumnElement[str] = literal_column(f"'{TriggerStatus.DELETED.value}'")


# --- row mapping --------------------------------------------------------------------------------


def policy_document(policy: RetryPolicy | None) -> Any:
    return None if policy is None else policy_to_document(policy)


def trigger_values(trigger: Trigger) -> Values:
    return {
        "id": trigger.id,
        "name": trigger.name,
        "task": trigger.task,
        "input": trigger.input,
        "policy": policy_document(trigger.policy),
        "every_ms": trigger.every_ms,
        "cron": trigger.cron,
        "catch_up": trigger.catch_up.value,
        "catch_up_limit": trigger.catch_up_limit,
        "status": trigger.status.value,
        "next_fire_at": trigger.next_fire_at_ms,
        "last_fired_at": trigger.last_fired_at_ms,
        "version": trigger.version,
        "created_at": trigger.created_at_ms,
        "updated_at": trigger.updated_at_ms,
    }


def trigger_from_row(row: Row) -> Trigger:
    every_ms = row["every_ms"]
    last_fired = row["last_fired_at"]
    return Trigger(
        id=row["id"],
        name=row["name"],
        task=row["task"],
        input=row["input"],
        policy=policy_from_document(row["policy"]),
        every_ms=None if every_ms is None else int(every_ms),
        cron=row["cron"],
        catch_up=CatchUp(row["catch_up"]),
        catch_up_limit=int(row["catch_up_limit"]),
        status=TriggerStatus(row["status"]),
        next_fire_at_ms=int(row["next_fire_at"]),
        last_fired_at_ms=None if last_fired is None else int(last_fired),
        version=int(row["version"]),
        created_at_ms=int(row["created_at"]),
        updated_at_ms=int(row["updated_at"]),
    )


def firing_values(firing: TriggerFiring) -> Values:
    return {
        "trigger_id": firing.trigger_id,
        "scheduled_at": firing.scheduled_at_ms,
        "run_id": firing.run_id,
        "fired_at": firing.fired_at_ms,
    }


def firing_from_row(row: Row) -> TriggerFiring:
    return TriggerFiring(
        trigger_id=row["trigger_id"],
        scheduled_at_ms=int(row["scheduled_at"]),
        run_id=row["run_id"],
        fired_at_ms=int(row["fired_at"]),
    )


# --- statements ---------------------------------------------------------------------------------


def insert_trigger(trigger: Trigger) -> Insert:
    return insert(triggers).values(trigger_values(trigger))


def update_trigger(before: Trigger, after: Trigger) -> Update:
    """Fenced on the version the transaction read."""
    t = triggers.c
    values = {k: v for k, v in trigger_values(after).items() if k != "id"}
    return sql_update(triggers).where(t.id == before.id, t.version == before.version).values(values)


def get_trigger(trigger_id: str) -> Select:
    return select(triggers).where(triggers.c.id == trigger_id)


def lock_trigger(trigger_id: str, *, skip_locked: bool) -> Select:
    return get_trigger(trigger_id).with_for_update(skip_locked=skip_locked)


def find_trigger(name: str, *, lock: bool) -> Select:
    t = triggers.c
    statement = select(triggers).where(t.name == name, t.status != DELETED)
    return statement.with_for_update() if lock else statement


def list_triggers(include_deleted: bool) -> Select:
    t = triggers.c
    statement = select(triggers)
    if not include_deleted:
        statement = statement.where(t.status != DELETED)
    return statement.order_by(t.name, t.id)


def insert_firing(firing: TriggerFiring) -> Insert:
    return insert(trigger_firings).values(firing_values(firing))


def firings_of(trigger_id: str, limit: int) -> Select:
    f = trigger_firings.c
    return (
        select(trigger_firings)
        .where(f.trigger_id == trigger_id)
        .order_by(f.scheduled_at.desc())
        .limit(limit)
    )


def due_triggers_query(limit: int, now: ColumnElement[int]) -> Select:
    """Active triggers whose next firing ``now`` reached, earliest first, ``limit + 1`` rows,
    as ``clock LEFT JOIN page ON true``: one row even for an empty page, carrying
    ``observed_at``."""
    t = triggers.c
    page = (
        select(t.id.label("trigger_id"), t.next_fire_at.label("next_fire_at"))
        .where(t.status == ACTIVE, t.next_fire_at <= now)
        .order_by(t.next_fire_at, t.id)
        .limit(limit + 1)
        .subquery("page")
    )
    clock = select(now.label("observed_at")).subquery("clock")
    return (
        select(clock.c.observed_at, *page.c)
        .select_from(clock.outerjoin(page, true()))
        .order_by(page.c.next_fire_at, page.c.trigger_id)
    )


# --- the repository -----------------------------------------------------------------------------


class SqlTriggerRepository:
    """:class:`ql3.application.ports.TriggerRepository` on any :class:`SqlTransaction`."""

    def __init__(self, tx: SqlTransaction) -> None:
        self._tx = tx

    def add(self, trigger: Trigger) -> None:
        statement = insert_trigger(trigger)
        self._tx.atomically(lambda: self._tx.write(statement, f"trigger {trigger.name!r}"))

    def get(self, trigger_id: str) -> Trigger | None:
        return self._one(get_trigger(trigger_id))

    def find(self, name: str, *, lock: bool = False) -> Trigger | None:
        return self._one(find_trigger(name, lock=lock))

    def lock(self, trigger_id: str, *, skip_locked: bool = False) -> Trigger | None:
        return self._one(lock_trigger(trigger_id, skip_locked=skip_locked))

    def update(self, before: Trigger, after: Trigger) -> None:
        if after.id != before.id:
            raise ValueError("a trigger update must name the same trigger before and after")
        statement = update_trigger(before, after)
        self._tx.atomically(lambda: self._tx.compare_and_set(statement, f"trigger {before.name!r}"))

    def list_triggers(self, *, include_deleted: bool = False) -> Sequence[Trigger]:
        result = self._tx.execute(list_triggers(include_deleted)).mappings()
        return tuple(trigger_from_row(row) for row in result)

    def record_firing(self, firing: TriggerFiring) -> None:
        statement = insert_firing(firing)
        what = f"firing of trigger {firing.trigger_id} at {firing.scheduled_at_ms}"
        self._tx.atomically(lambda: self._tx.write(statement, what))

    def firings_of(self, trigger_id: str, limit: int) -> Sequence[TriggerFiring]:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        result = self._tx.execute(firings_of(trigger_id, limit)).mappings()
        return tuple(firing_from_row(row) for row in result)

    def _one(self, statement: Select) -> Trigger | None:
        row = self._tx.execute(statement).mappings().first()
        return None if row is None else trigger_from_row(row)
