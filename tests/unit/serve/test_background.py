"""The server's background loop: a pass at start (or not), then one every interval until stopped; a
pass that raises is logged and the loop goes on; an interval of 0 ends the loop; one thread a loop."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from engine.serve.background import BackgroundLoop
from tests.fakes import wait_for

log = logging.getLogger("tests.background")


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


class Counter:
    def __init__(self, fail_first: int = 0) -> None:
        self.passes = 0
        self.fail_first = fail_first
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.passes += 1
            n = self.passes
        if n <= self.fail_first:
            raise RuntimeError(f"pass {n} broke")


def test_a_loop_passes_at_start_then_every_interval_and_not_after_stop() -> None:
    step = Counter()
    loop = BackgroundLoop("test-bg-every", step, lambda: 0.01, at_start=True, log=log, what="test loop")
    loop.start()
    try:
        wait_for(lambda: step.passes >= 3, 10, "three passes")
    finally:
        loop.stop()
    stopped_at = step.passes
    assert not loop.running and not _threads("test-bg-every")
    time.sleep(0.05)
    assert step.passes == stopped_at  # nothing runs after stop returned


def test_a_loop_that_does_not_pass_at_start_waits_one_interval_first() -> None:
    step = Counter()
    loop = BackgroundLoop("test-bg-later", step, lambda: 60.0, at_start=False, log=log, what="test loop")
    loop.start()
    loop.stop()  # stops the wait at once: the interval never elapsed
    assert step.passes == 0


def test_a_pass_that_raises_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    step = Counter(fail_first=2)
    loop = BackgroundLoop("test-bg-raises", step, lambda: 0.01, at_start=True, log=log, what="test loop: pass")
    with caplog.at_level(logging.ERROR, logger="tests.background"):
        loop.start()
        try:
            wait_for(lambda: step.passes >= 4, 10, "passes after the failed ones")
        finally:
            loop.stop()
    failures = [r for r in caplog.records if r.getMessage() == "test loop: pass failed"]
    assert len(failures) == 2 and failures[0].exc_info is not None  # with the traceback, once a failed pass


def test_an_interval_of_zero_ends_the_loop_after_its_first_pass() -> None:
    step = Counter()
    loop = BackgroundLoop("test-bg-once", step, lambda: 0.0, at_start=True, log=log, what="test loop")
    loop.start()
    try:
        wait_for(lambda: step.passes == 1 and not _threads("test-bg-once"), 10,
                 "the thread to end by itself after one pass")
        assert step.passes == 1
    finally:
        loop.stop()


def test_the_interval_is_read_before_every_wait() -> None:
    step = Counter()
    interval = [0.01]
    loop = BackgroundLoop("test-bg-reread", step, lambda: interval[0], at_start=True, log=log, what="test loop")
    loop.start()
    try:
        wait_for(lambda: step.passes >= 2, 10, "two passes")
        interval[0] = 0.0  # the owner's setting changed: the loop ends at its next wait
        wait_for(lambda: not _threads("test-bg-reread"), 10, "the loop to end at the new interval of 0")
    finally:
        loop.stop()


def test_start_twice_is_one_thread_and_a_stopped_loop_starts_again() -> None:
    step = Counter()
    loop = BackgroundLoop("test-bg-restart", step, lambda: 60.0, at_start=True, log=log, what="test loop")
    loop.start()
    loop.start()
    try:
        wait_for(lambda: step.passes == 1, 10, "the pass at start")
        assert len(_threads("test-bg-restart")) == 1 and loop.running
    finally:
        loop.stop()
    loop.start()
    try:
        wait_for(lambda: step.passes == 2, 10, "the restarted loop's pass")
    finally:
        loop.stop()
    assert not _threads("test-bg-restart")
