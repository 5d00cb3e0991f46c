"""What the pages draw (ADR 0020): the finished-per-bucket chart as SVG bars, and a trigger's
schedule in words with its next firings."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from ql3.application.console import FinishedBucket
from ql3.application.ports import CronCalendar
from ql3.application.triggers import schedule_of
from ql3.domain.triggers import Trigger

CHART_W, CHART_H, AXIS = 600, 120, 16


@dataclass(frozen=True, slots=True)
class Bar:
    x: float
    width: float
    # Heights of the stacked parts, bottom up: succeeded, failed, cancelled.
    parts: tuple[tuple[str, float, float], ...]
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    width: int
    height: int
    bars: tuple[Bar, ...]
    peak: int
    total: int
    unit: str
    first: str
    last: str


def _label(ms: int, unit: str) -> str:
    moment = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return moment.strftime("%H:%M") if unit == "minute" else moment.strftime("%d %H:00")


def bars(buckets: Sequence[FinishedBucket], unit: str) -> Chart:
    peak = max((b.total for b in buckets), default=0)
    slot = CHART_W / max(1, len(buckets))
    scale = (CHART_H - AXIS) / peak if peak else 0.0
    drawn = []
    for i, bucket in enumerate(buckets):
        base = float(CHART_H - AXIS)
        parts = []
        for name, value in (
            ("succeeded", bucket.succeeded),
            ("failed", bucket.failed),
            ("cancelled", bucket.cancelled),
        ):
            height = value * scale
            if height:
                base -= height
                parts.append((name, round(base, 2), round(height, 2)))
        label = (
            f"{_label(bucket.start_ms, unit)}: {bucket.succeeded} succeeded, "
            f"{bucket.failed} failed, {bucket.cancelled} cancelled"
        )
        drawn.append(Bar(round(i * slot, 2), round(max(1.0, slot - 1), 2), tuple(parts), label))
    return Chart(
        width=CHART_W,
        height=CHART_H,
        bars=tuple(drawn),
        peak=peak,
        total=sum(b.total for b in buckets),
        unit=unit,
        first=_label(buckets[0].start_ms, unit) if buckets else "",
        last=_label(buckets[-1].start_ms, unit) if buckets else "",
    )


def _every(ms: int) -> str:
    for size, name in ((86_400_000, "day"), (3_600_000, "hour"), (60_000, "minute")):
        if ms % size == 0:
            count = ms // size
            return f"every {name}" if count == 1 else f"every {count} {name}s"
    return f"every {ms / 1000:g} seconds"


def _cron_words(expression: str) -> str:
    fields = expression.split()
    if len(fields) != 5:
        return f"cron {expression} (UTC)"
    minute, hour, day, month, weekday = fields
    if minute.isdigit() and hour.isdigit():
        at = f"at {int(hour):02d}:{int(minute):02d} UTC"
        if (day, month, weekday) == ("*", "*", "*"):
            return f"every day {at}"
        if (day, month) == ("*", "*"):
            return f"{at} on weekday(s) {weekday} (cron {expression})"
        return f"{at} (cron {expression})"
    if minute.isdigit() and (hour, day, month, weekday) == ("*", "*", "*", "*"):
        return f"every hour at minute {int(minute)}"
    if minute.startswith("*/") and (hour, day, month, weekday) == ("*", "*", "*", "*"):
        return f"every {minute[2:]} minutes"
    return f"cron {expression} (UTC)"


def describe_trigger(
    trigger: Trigger, calendar: CronCalendar, count: int
) -> tuple[str, list[int]]:
    """The schedule in words, and the next ``count`` fire times from the next firing on."""
    words = _every(trigger.every_ms) if trigger.every_ms is not None else _cron_words(
        trigger.cron or ""
    )
    schedule = schedule_of(trigger, calendar)
    upcoming = [trigger.next_fire_at_ms]
    while len(upcoming) < count:
        upcoming.append(schedule.next_after(upcoming[-1]))
    return words, upcoming
