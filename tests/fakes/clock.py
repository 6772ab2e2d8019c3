"""Time for tests, and the scripted failures every fake connector shares.

``FakeClock``: ``now()`` (monotonic), ``wall()`` (epoch), ``sleep(dt)`` advances time and fires
scheduled changes (``clock.at(t, fn)``): unit tests never really sleep. ``wait_for``: the one poll
in real time, for what threads and processes do (servers, loops, the lab). ``raise_scripted``: a
fake's ``fail`` mapping (method name -> exception, or a list of exceptions/None consumed one call each).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._scheduled: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    __call__ = now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.t

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` when fake time reaches ``t`` (absolute)."""
        self._seq += 1
        self._scheduled.append((t, self._seq, fn))
        self._scheduled.sort(key=lambda x: (x[0], x[1]))
        self._fire()

    def after(self, dt: float, fn: Callable[[], None]) -> None:
        self.at(self.t + dt, fn)

    def next_event(self) -> float | None:
        return self._scheduled[0][0] if self._scheduled else None

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, t)
        self._fire()

    def until(self, done: Callable[[], bool], timeout: float) -> bool:
        """A watch on fake time: fire scheduled changes, in order, until ``done()`` holds (True) or
        ``timeout`` s have passed (False; time is then at the deadline)."""
        deadline = self.t + timeout
        while not done():
            nxt = self.next_event()
            if nxt is None or nxt > deadline:
                self.advance_to(deadline)
                return False
            self.advance_to(nxt)
        return True

    def sleep(self, dt: float) -> None:
        self.sleeps.append(dt)
        self.advance_to(self.t + max(0.0, dt))

    def _fire(self) -> None:
        while self._scheduled and self._scheduled[0][0] <= self.t:
            _, _, fn = self._scheduled.pop(0)
            fn()


def wait_for(probe: Callable[[], T], timeout: float = 10.0, what: str = "a condition", interval: float = 0.02) -> T:
    """Poll ``probe`` every ``interval`` s until it returns something truthy, and return that; after
    ``timeout`` s fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    value = probe()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(interval)
        value = probe()
    return value


def raise_scripted(fail: dict[str, Any], method: str) -> None:
    item = fail.get(method)
    if item is None:
        return
    if isinstance(item, list):
        if not item:
            return
        exc = item.pop(0)
        if exc is None:
            return
        raise exc
    raise item
