"""A bounded pool of worker threads that executes runs off the request path.

At most ``workers`` runs execute at once and at most ``queue_size`` more wait; ``try_reserve``
takes a place *before* a run is created, so a full pool refuses work instead of piling it up
(the journal still has every run that was accepted). ``enqueue`` says where a job went: 0, a worker
takes it now; N, it waits with N - 1 jobs ahead of it (first in, first out), which the webhook answer
reports as the run's ``queue_position``. On shutdown, queued jobs that have not
started are dropped (they stay ``pending`` in the journal and are queued again by the next
server's ``recover``); running jobs get ``grace`` seconds to finish. This module runs callables;
it knows nothing of runs or guards.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

log = logging.getLogger(__name__)


class WorkerPool:
    def __init__(self, workers: int, queue_size: int) -> None:
        self.workers = workers
        self.capacity = workers + queue_size
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="runbook-run")
        self._lock = threading.Lock()
        self._outstanding = 0  # reserved + queued + running
        self._running = 0
        self._waiting = 0  # submitted jobs no worker has taken yet
        self._closed = False
        self._idle = threading.Condition(self._lock)

    def try_reserve(self) -> bool:
        """Take a place for one job; False when the pool is full or closed."""
        with self._lock:
            if self._closed or self._outstanding >= self.capacity:
                return False
            self._outstanding += 1
            return True

    def release(self) -> None:
        """Give back a place taken by ``try_reserve`` that will not be used."""
        with self._lock:
            self._outstanding = max(0, self._outstanding - 1)
            self._idle.notify_all()

    def submit(self, job: Callable[[], None], *, reserved: bool = True) -> bool:
        """Run ``job`` in a worker. Without a prior reservation, one is taken (False if full)."""
        return self.enqueue(job, reserved=reserved) is not None

    def enqueue(self, job: Callable[[], None], *, reserved: bool = True) -> int | None:
        """``submit``, answering where the job went: 0 when a worker takes it at once, N >= 1 when it
        waits at place N (N - 1 jobs ahead of it); None when the pool is full or closed."""
        if not reserved and not self.try_reserve():
            return None
        with self._lock:
            if self._closed:
                self._outstanding = max(0, self._outstanding - 1)
                return None
            position = max(0, self._running + self._waiting + 1 - self.workers)
            self._waiting += 1

        def run() -> None:
            with self._lock:
                self._waiting -= 1
                self._running += 1
            try:
                job()
            except Exception:  # Why: one broken job must not kill the worker thread silently
                log.exception("a run job raised")
            finally:
                with self._lock:
                    self._running -= 1
                    self._outstanding -= 1
                    self._idle.notify_all()

        fut: Future[None] = self._pool.submit(run)
        del fut
        return position

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"workers": self.workers, "running": self._running,
                    "queued": max(0, self._outstanding - self._running), "capacity": self.capacity,
                    "waiting": self._waiting}

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is reserved, queued or running (tests). True when idle."""
        with self._lock:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout)

    def shutdown(self, grace: float) -> None:
        """Stop taking work, drop queued jobs, give running ones ``grace`` seconds."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._idle.wait_for(lambda: self._running == 0, grace)
