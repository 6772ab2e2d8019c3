"""Maintenance windows (engine.windows, engine.run_windows): weekday/time ranges and cron schedules
in a time zone, the next opening, the ``window`` run guard and an automatic run's deferral."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from engine.model import Runbook
from engine.run_windows import deferral, window_verdict
from engine.windows import Window, clock_from_env, state

THU_17 = datetime(2026, 12, 3, 17, 0, tzinfo=UTC)  # a Thursday
NIGHTS = Window(days=("mon", "tue", "wed", "thu", "fri"), start="22:00", end="04:00", timezone="Europe/Berlin")
SAT_CRON = Window(cron="0 2 * * sat", duration="3h")


def test_a_night_window_crosses_midnight_in_its_time_zone() -> None:
    assert not NIGHTS.is_open(THU_17)
    assert NIGHTS.is_open(datetime(2026, 12, 3, 21, 0, tzinfo=UTC))  # 22:00 Berlin
    assert NIGHTS.is_open(datetime(2026, 12, 5, 2, 59, tzinfo=UTC))  # Saturday 03:59 Berlin: Friday's night
    assert not NIGHTS.is_open(datetime(2026, 12, 5, 3, 0, tzinfo=UTC))  # 04:00 Berlin: closed
    assert not NIGHTS.is_open(datetime(2026, 12, 5, 21, 0, tzinfo=UTC))  # Saturday night: not listed
    assert NIGHTS.next_opening(THU_17) == datetime(2026, 12, 3, 21, 0, tzinfo=UTC)


def test_a_cron_window_is_open_for_its_duration_from_each_firing() -> None:
    assert SAT_CRON.next_opening(THU_17) == datetime(2026, 12, 5, 2, 0, tzinfo=UTC)
    assert SAT_CRON.is_open(datetime(2026, 12, 5, 4, 59, tzinfo=UTC))
    assert not SAT_CRON.is_open(datetime(2026, 12, 5, 5, 0, tzinfo=UTC))
    every_15 = Window(cron="*/15 9-17 * * mon-fri", duration="5m", timezone="America/New_York")
    assert every_15.next_opening(THU_17) == datetime(2026, 12, 3, 17, 15, tzinfo=UTC)  # 12:15 New York


@pytest.mark.parametrize("bad", [
    {"start": "25:00", "end": "04:00"}, {"start": "22:00"}, {"cron": "0 2 * * sat"},
    {"cron": "0 2 * *", "duration": "1h"}, {"cron": "0 2 * * sat", "duration": "1h", "start": "01:00"},
    {"start": "22:00", "end": "04:00", "timezone": "Mars/Olympus"},
    {"days": ["sunday"], "start": "1:00", "end": "2:00"},
])
def test_a_malformed_window_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Window.model_validate(bad)


def _runbook(**extra: object) -> Runbook:
    return Runbook.model_validate({"apiVersion": "runbook/v1", "name": "rb", "version": "1",
                                   "params": {"node": {"type": "node", "required": True}},
                                   "steps": [{"id": "s", "action": {"check": {}}}], **extra})


def test_outside_its_window_a_person_needs_the_override_and_an_automatic_run_is_deferred_or_refused() -> None:
    rb = _runbook(windows=[{"start": "22:00", "end": "04:00"}])
    v = window_verdict(rb, THU_17, overrides={}, actor="ann", automatic=False)
    assert v is not None and v.blocks and "next opening 2026-12-03T22:00:00+00:00" in v.reason
    passed = window_verdict(rb, THU_17, overrides={"window": "the node is down anyway"}, actor="ann",
                            automatic=False)
    assert passed is not None and not passed.blocks and passed.overridden is not None
    auto = window_verdict(rb, THU_17, overrides={"window": "x"}, actor="serve", automatic=True)
    assert auto is not None and auto.blocks  # the server's runs never pass a guard
    found = deferral(rb, THU_17)
    assert found is not None and (found.action, found.until) == ("defer", datetime(2026, 12, 3, 22, tzinfo=UTC))
    refuse = deferral(_runbook(windows=[{"start": "22:00", "end": "04:00"}], outside_windows="refuse"), THU_17)
    assert refuse is not None and refuse.action == "refuse"
    assert deferral(rb, THU_17.replace(hour=23)) is None
    assert window_verdict(_runbook(), THU_17, overrides={}, actor="a", automatic=True) is None


def test_a_trigger_window_narrows_the_runbooks() -> None:
    rb = _runbook(windows=[{"start": "20:00", "end": "23:00"}])
    late = (Window(start="22:00", end="23:30"),)
    found = deferral(rb, THU_17.replace(hour=21), late)
    assert found is not None and found.until == THU_17.replace(hour=22)
    assert deferral(rb, THU_17.replace(hour=22, minute=30), late) is None


def test_the_lab_clock_starts_where_it_is_told_and_runs_faster() -> None:
    clock = clock_from_env({"RUNBOOK_CLOCK": "2026-12-03T21:59:00+00:00*3600"})
    first = clock()
    assert first - datetime(2026, 12, 3, 21, 59, tzinfo=UTC) < timedelta(minutes=30)
    assert state([NIGHTS], first + timedelta(minutes=1)).open
