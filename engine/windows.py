"""Maintenance windows: when a runbook may change a node (pure; the clock is injected).

A window is either a weekday/time range with a time zone, as kured expresses it
(``{days: [mon, tue], start: "22:00", end: "04:00", timezone: Europe/Berlin}``: opens at ``start`` on
each listed day, closes at ``end``, the next day when ``end`` is not after ``start``), or a cron
schedule with a duration, as Rundeck does (``{cron: "0 2 * * sat", duration: 3h, timezone: UTC}``:
opens at each time the five-field cron expression names, for ``duration``). Several windows: open
when any is.

``state(windows, now)`` answers open or not, and the next opening (``None``: never within a year).
The clock is a parameter everywhere: ``system_clock`` is the wall clock; ``clock_from_env`` honours
``RUNBOOK_CLOCK="2026-12-07T21:59:30+00:00*60"`` (start there, run 60 times faster), which the lab
uses to compress hours into seconds. This module never sleeps and never reads a store.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from datetime import time as dtime
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

__all__ = ["Clock", "Window", "WindowState", "clock_from_env", "state", "system_clock"]

Clock = Callable[[], datetime]
Day = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
DAYS: tuple[Day, ...] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_HHMM = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")
_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
_CRON_NAMES = {**{d: i for i, d in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))},
               **{m: i + 1 for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug",
                                                  "sep", "oct", "nov", "dec"))}}
_CRON_BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))


def _cron_field(text: str, lo: int, hi: int) -> frozenset[int]:
    out: set[int] = set()
    for part in text.lower().split(","):
        step = 1
        if "/" in part:
            part, s = part.split("/", 1)
            if not s.isdigit() or int(s) < 1:
                raise ValueError(f"bad step {s!r}")
            step = int(s)
        if part == "*":
            a, b = lo, hi
        elif "-" in part:
            x, y = part.split("-", 1)
            a, b = _cron_value(x), _cron_value(y)
        else:
            a = _cron_value(part)
            b = hi if step > 1 else a
        if not lo <= a <= b <= hi:
            raise ValueError(f"{part!r} is outside {lo}-{hi}")
        out.update(range(a, b + 1, step))
    return frozenset(out)


def _cron_value(text: str) -> int:
    if text in _CRON_NAMES:
        return _CRON_NAMES[text]
    if not text.isdigit():
        raise ValueError(f"{text!r} is not a number")
    return int(text)


@dataclass(frozen=True)
class _Cron:
    minutes: frozenset[int]
    hours: frozenset[int]
    doms: frozenset[int]
    months: frozenset[int]
    dows: frozenset[int]  # 0 = Sunday
    dom_any: bool
    dow_any: bool

    @classmethod
    def parse(cls, text: str) -> _Cron:
        fields = text.split()
        if len(fields) != 5:
            raise ValueError(f"cron {text!r}: expected five fields (minute hour day-of-month month day-of-week)")
        try:
            sets = [_cron_field(f, lo, hi) for f, (lo, hi) in zip(fields, _CRON_BOUNDS, strict=True)]
        except ValueError as e:
            raise ValueError(f"cron {text!r}: {e}") from None
        dows = frozenset(d % 7 for d in sets[4])
        return cls(sets[0], sets[1], sets[2], sets[3], dows, fields[2] == "*", fields[4] == "*")

    def day_matches(self, d: date) -> bool:
        if d.month not in self.months:
            return False
        dom, dow = d.day in self.doms, (d.weekday() + 1) % 7 in self.dows
        if self.dom_any or self.dow_any:  # cron: both restricted means either may match
            return dom and dow
        return dom or dow


class Window(BaseModel):
    """One maintenance window: ``days``/``start``/``end`` or ``cron``/``duration``, in ``timezone``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    days: tuple[Day, ...] = DAYS
    start: str | None = None  # "22:00"
    end: str | None = None  # "04:00" (the next day when not after start)
    cron: str | None = None  # "0 2 * * sat"
    duration: str | None = None  # with cron: "3h", "90m", "1h30m"
    timezone: str = "UTC"

    @field_validator("start", "end")
    @classmethod
    def _hhmm(cls, v: str | None) -> str | None:
        if v is not None and not _HHMM.match(v):
            raise ValueError(f"{v!r}: expected HH:MM (24 h)")
        return v

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError) as e:
            raise ValueError(f"unknown time zone {v!r}") from e
        return v

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        if v is not None:
            _Cron.parse(v)
        return v

    @field_validator("duration")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is not None and (not v or not _DURATION.match(v) or _seconds(v) <= 0):
            raise ValueError(f"{v!r}: expected a duration like 3h, 90m, 1h30m")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> Window:
        if self.cron is not None:
            if self.duration is None:
                raise ValueError("a cron window needs its duration (how long it stays open)")
            if self.start is not None or self.end is not None or self.days != DAYS:
                raise ValueError("give either cron + duration or days + start + end, not both")
        elif self.start is None or self.end is None:
            raise ValueError("a window needs start and end (HH:MM), or cron and duration")
        return self

    def describe(self) -> str:
        if self.cron is not None:
            return f"cron {self.cron!r} for {self.duration} ({self.timezone})"
        days = "every day" if set(self.days) == set(DAYS) else ",".join(self.days)
        return f"{days} {self.start}-{self.end} ({self.timezone})"

    # -- evaluation ----------------------------------------------------------------------------

    def _openings_around(self, now: datetime) -> list[tuple[datetime, datetime]]:
        """Openings that may contain ``now`` (start <= now), newest last."""
        tz = ZoneInfo(self.timezone)
        local = now.astimezone(tz)
        out = []
        if self.cron is None:
            assert self.start is not None and self.end is not None
            for back in (1, 0):
                d = local.date() - timedelta(days=back)
                if DAYS[d.weekday()] in self.days:
                    s, e = _at(d, self.start, tz), _at(d, self.end, tz)
                    if e <= s:
                        e = _at(d + timedelta(days=1), self.end, tz)
                    out.append((s, e))
            return out
        cron, length = _Cron.parse(self.cron), timedelta(seconds=_seconds(self.duration or "0s"))
        t = local.replace(second=0, microsecond=0)
        earliest = local - length
        while t > earliest:
            if cron.day_matches(t.date()) and t.hour in cron.hours and t.minute in cron.minutes:
                out.append((t, t + length))
                break
            t -= timedelta(minutes=1)
        return out

    def is_open(self, now: datetime) -> bool:
        return any(s <= now < e for s, e in self._openings_around(now))

    def next_opening(self, now: datetime) -> datetime | None:
        """The first opening strictly after ``now`` (within a year)."""
        tz = ZoneInfo(self.timezone)
        local = now.astimezone(tz)
        for ahead in range(0, 367):
            d = local.date() + timedelta(days=ahead)
            if self.cron is None:
                assert self.start is not None
                if DAYS[d.weekday()] in self.days and (s := _at(d, self.start, tz)) > now:
                    return s
                continue
            cron = _Cron.parse(self.cron)
            if not cron.day_matches(d):
                continue
            for h in sorted(cron.hours):
                for m in sorted(cron.minutes):
                    s = datetime.combine(d, dtime(h, m), tzinfo=tz)
                    if s > now:
                        return s
        return None


def _at(d: date, hhmm: str, tz: ZoneInfo) -> datetime:
    h, m = (int(x) for x in hhmm.split(":"))
    return datetime.combine(d, dtime(h, m), tzinfo=tz)


def _seconds(text: str) -> int:
    m = _DURATION.match(text)
    if not m:
        return 0
    d, h, mi, s = (int(x) if x else 0 for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


@dataclass(frozen=True)
class WindowState:
    open: bool
    next_opening: datetime | None
    windows: tuple[str, ...]

    def describe(self) -> str:
        if not self.windows:
            return "no maintenance window: any time"
        where = "; ".join(self.windows)
        if self.open:
            return f"inside a maintenance window ({where})"
        nxt = self.next_opening.astimezone(UTC).isoformat(timespec="seconds") if self.next_opening else "never"
        return f"outside its maintenance windows ({where}); next opening {nxt}"


def state(windows: Sequence[Window], now: datetime) -> WindowState:
    """Open when there are no windows or any is open; else the earliest next opening."""
    if not windows:
        return WindowState(True, None, ())
    names = tuple(w.describe() for w in windows)
    if any(w.is_open(now) for w in windows):
        return WindowState(True, None, names)
    openings = [o for w in windows if (o := w.next_opening(now)) is not None]
    return WindowState(False, min(openings) if openings else None, names)


def system_clock() -> datetime:
    return datetime.now(UTC)


def clock_from_env(env: Mapping[str, str] | None = None) -> Clock:
    """``RUNBOOK_CLOCK="ISO8601[*FACTOR]"``: a clock that starts at that instant (now, in this
    process) and runs FACTOR times faster (the lab's compressed time); unset: the wall clock."""
    spec = (os.environ if env is None else env).get("RUNBOOK_CLOCK", "").strip()
    if not spec:
        return system_clock
    at, _, factor = spec.partition("*")
    try:
        origin = datetime.fromisoformat(at)
        speed = float(factor) if factor else 1.0
    except ValueError as e:
        from engine.errors import UsageError

        raise UsageError(f"RUNBOOK_CLOCK={spec!r}: expected ISO8601[*FACTOR]") from e
    if origin.tzinfo is None:
        origin = origin.replace(tzinfo=UTC)
    real0 = time.monotonic()

    def clock() -> datetime:
        return origin + timedelta(seconds=(time.monotonic() - real0) * speed)

    return clock

