"""Cron fire times through croniter, in UTC, as epoch milliseconds."""

from __future__ import annotations

import datetime as dt

import pytest

from ql3.adapters.cron import CroniterCalendar
from ql3.domain.errors import InvalidTrigger

NOON = int(dt.datetime(2026, 3, 2, 12, 0, tzinfo=dt.UTC).timestamp() * 1000)
MINUTE = 60_000


def test_fire_times_are_strictly_after_and_at_or_before() -> None:
    schedule = CroniterCalendar().schedule("*/15 * * * *")
    assert schedule.next_after(NOON) == NOON + 15 * MINUTE
    assert schedule.next_after(NOON - 1) == NOON
    assert schedule.latest_at_or_before(NOON) == NOON
    assert schedule.latest_at_or_before(NOON - 1) == NOON - 15 * MINUTE
    assert schedule.latest_at_or_before(NOON + 14 * MINUTE + 59_999) == NOON


def test_expressions_are_read_in_utc_with_aliases_and_spacing() -> None:
    calendar = CroniterCalendar()
    assert calendar.schedule("0 13 * * *").next_after(NOON) == NOON + 60 * MINUTE
    assert calendar.schedule("  0   13 * *  * ").next_after(NOON) == NOON + 60 * MINUTE
    assert calendar.schedule("@hourly").next_after(NOON) == NOON + 60 * MINUTE


@pytest.mark.parametrize(
    "expression",
    ["", "   ", "* * * *", "* * * * * *", "61 * * * *", "every minute", "0 0 30 2 *"],
)
def test_bad_expressions_are_refused(expression: str) -> None:
    with pytest.raises(InvalidTrigger):
        CroniterCalendar().schedule(expression)
