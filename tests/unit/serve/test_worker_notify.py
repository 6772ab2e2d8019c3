"""The bounded worker pool and the notification sender."""

from __future__ import annotations

import json
import threading
import time

import httpx

from engine.serve.delivery import RetryPolicy
from engine.serve.notify import Notification, Notifier
from engine.serve.worker import WorkerPool


def test_the_pool_runs_at_most_workers_at_once_and_refuses_beyond_its_queue() -> None:
    pool = WorkerPool(workers=2, queue_size=1)
    gate = threading.Event()
    running: list[int] = []
    peak = [0]
    lock = threading.Lock()

    def job() -> None:
        with lock:
            running.append(1)
            peak[0] = max(peak[0], len(running))
        gate.wait(5)
        with lock:
            running.pop()

    assert all(pool.try_reserve() for _ in range(3))
    assert not pool.try_reserve()  # 2 running + 1 queued
    for _ in range(3):
        pool.submit(job)
    gate.set()
    assert pool.wait_idle(5)
    assert peak[0] == 2
    assert pool.try_reserve()
    pool.release()
    pool.shutdown(grace=1)
    assert not pool.try_reserve()


def test_a_job_that_raises_does_not_kill_the_pool() -> None:
    pool = WorkerPool(workers=1, queue_size=0)
    done = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    assert pool.submit(boom, reserved=False)
    assert pool.wait_idle(5)
    assert pool.submit(done.set, reserved=False)
    assert done.wait(5)
    pool.shutdown(grace=1)


def test_notifications_are_slack_compatible_and_filtered_by_event() -> None:
    got: list[dict[str, object]] = []

    def receive(request: httpx.Request) -> httpx.Response:
        got.append(json.loads(request.content))
        return httpx.Response(200)

    n = Notifier("http://127.0.0.1:9/hook", events=["waiting-approval"], transport=httpx.MockTransport(receive))
    n.notify(Notification("started", "gpu-node-recovery", node="omen2", run_id="r-1", mode="auto"))
    n.notify(Notification("waiting-approval", "gpu-node-recovery", node="omen2", run_id="r-2", mode="approve",
                          warnings=["breaker: 4 of 8 nodes are unhealthy"], extra={"plan_digest": "d" * 64}))
    assert n.flush(5)
    (msg,) = got
    assert isinstance(msg["text"], str)
    assert "runbook approve r-2 --plan-digest " + "d" * 64 in msg["text"]
    assert "4 of 8 nodes" in msg["text"]
    assert msg["runbook_event"] == {
        "event": "waiting-approval", "run_id": "r-2", "runbook": "gpu-node-recovery", "node": "omen2",
        "mode": "approve", "reason": "", "warnings": ["breaker: 4 of 8 nodes are unhealthy"],
        "plan_digest": "d" * 64, "state": None, "report": "", "link": None}
    n.close()


def test_a_slow_or_failing_receiver_never_blocks_the_caller() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        entered.set()
        release.wait(15)  # a receiver that hangs far longer than the caller may wait
        return httpx.Response(500)

    # one attempt per request: retries are test_serve_delivery.py's subject
    n = Notifier("http://127.0.0.1:9/hook", transport=httpx.MockTransport(slow), max_queue=2,
                 retry=RetryPolicy(attempts=1))
    n.notify(Notification("failed", "rb", run_id="r-0"))
    assert entered.wait(5)  # the sender is now stuck in the receiver
    started = time.monotonic()
    for i in range(1, 10):
        n.notify(Notification("failed", "rb", run_id=f"r-{i}"))  # returns at once; overflow is dropped
    elapsed = time.monotonic() - started
    assert not release.is_set() and elapsed < 1.0, f"9 notify() calls took {elapsed:.2f} s"
    assert (n.sent, n.failed) == (0, 7)  # 2 queued behind the stuck one, 7 dropped
    release.set()
    assert n.flush(5)
    assert (n.sent, n.failed) == (0, 10)  # and the 3 attempted ones failed (HTTP 500), none lost silently
    n.close()
