"""Cron fire times with croniter: the :class:`ql3.application.ports.CronCalendar` of every profile.

Expressions have the five standard fields (minute, hour, day of month, month, day of week) or are
one of croniter's ``@hourly``-style aliases, and are read in UTC. Times cross this edge as integer
epoch milliseconds; cron's own resolution is the minute.
"""

from __future__ import annotations

import datetime as dt
import math

from attrs import frozen
from croniter import CroniterBadCronError, CroniterBadDateError, CroniterError, croniter

from ql3.domain.errors import InvalidTrigger

_BAD = (CroniterBadCronError, CroniterBadDateError, CroniterError, ValueError, KeyError)


def _at(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def _ms(moment: dt.datetime) -> int:
    return math.floor(moment.timestamp() * 1000)


@frozen
class CronSchedule:
    """The fire times of one cron expression."""

    expression: str

    def next_after(self, t_ms: int) -> int:
        try:
            return _ms(croniter(self.expression, _at(t_ms)).get_next(dt.datetime))
        except _BAD as error:
            raise InvalidTrigger(f"cron {self.expression!r}: {error}") from None

    def latest_at_or_before(self, t_ms: int) -> int | None:
        # croniter's get_prev is strictly before its start: start one millisecond later.
        try:
            return _ms(croniter(self.expression, _at(t_ms + 1)).get_prev(dt.datetime))
        except _BAD:
            return None


class CroniterCalendar:
    """Validates expressions and hands out their schedules."""

    def schedule(self, expression: str) -> CronSchedule:
        text = " ".join(expression.split())
        if not text:
            raise InvalidTrigger("cron expression must not be empty")
        if not text.startswith("@") and len(text.split(" ")) != 5:
            raise InvalidTrigger(
                f"cron expression {expression!r} must have five fields"
                " (minute hour day-of-month month day-of-week)"
            )
        if not croniter.is_valid(text):
            raise InvalidTrigger(f"cron expression {expression!r} is not valid")
        schedule = CronSchedule(text)
        try:  # an expression that never fires (30 February) is refused up front
            croniter(text, _at(0)).get_next(dt.datetime)
        except _BAD:
            raise InvalidTrigger(f"cron expression {expression!r} never fires") from None
        return schedule
