"""The server's background loops: one daemon thread a loop, doing a pass every few seconds until stopped.

The cluster view's refresher, the ``RunbookRemediation`` reconciler and the Node-condition watcher
are each a ``BackgroundLoop`` around their own pass. A pass that raises is logged (the owner's
logger, ``<what> failed``) and the loop goes on: one bad pass never ends a loop. The interval is
read before every wait, so an owner's setting changed while the loop runs takes effect at the next
wait; an interval of 0 or less ends the loop (after the first pass, for a loop that passes at start).

This module decides nothing about what a pass does; it only owns the thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

STOP_TIMEOUT = 5.0  # seconds ``stop`` waits for a pass in flight to finish (the thread is a daemon)


class BackgroundLoop:
    """``step`` on a daemon thread named ``name``: once at start when ``at_start``, then after every
    ``interval()`` seconds, until ``stop``. ``start`` on a running loop does nothing; a stopped loop
    may be started again."""

    def __init__(self, name: str, step: Callable[[], object], interval: Callable[[], float], *,
                 at_start: bool, log: logging.Logger, what: str) -> None:
        self.name = name
        self._step = step
        self._interval = interval
        self._at_start = at_start
        self._log = log
        self._what = what
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the loop to end and wait (at most ``STOP_TIMEOUT`` s) for a pass in flight."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=STOP_TIMEOUT)

    def _pass(self) -> None:
        try:
            self._step()
        except Exception:
            self._log.exception("%s failed", self._what)

    def _run(self) -> None:
        if self._at_start and not self._stop.is_set():
            self._pass()
        while True:
            interval = self._interval()
            if interval <= 0 or self._stop.wait(interval):
                return
            self._pass()
