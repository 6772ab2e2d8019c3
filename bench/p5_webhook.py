"""P5 webhook ingest: sustained requests per second and p99 latency of ``POST /hooks/alertmanager``
on loopback while every request is a duplicate (and so must start nothing).

The server is the real ``runbook serve`` against the lab (its ``JournalRunStarter``, a fresh journal,
a sender's Bearer token, reads open on loopback; every limit of issue 14 at its default), or
with ``--p5-fake`` ``bench.fake_serve`` (the same app over ``FakeRunStarter``).
One first page for omen2 starts one run (approve mode); once it waits for approval, the load
generator posts that same Alertmanager v4 payload (``tests.fakes.webhook``) over and over:
each is answered ``duplicate``. After each round the server must still list exactly one run, and
its ``/metrics`` must count the requests as duplicates.

Load generator: ``wrk`` (Debian's, ``apt-get install -y wrk``), 1 thread, 8 connections, each round
bounded in time (5 s; ``--quick`` 2 s); without wrk, a bounded Python client (httpx, 8 threads).
Both share the machine's 2 cores with the server.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    Context,
    Metric,
    base_env,
    loadavg,
    log,
    median,
    runbook_cmd,
    started_server,
    summary,
)

TOKEN = "bench-p5-sender-token-0123456789"  # the Alertmanager sender (>= 16 bytes)
CONNECTIONS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _payload() -> bytes:
    from tests.fakes import alert, webhook

    return json.dumps(webhook(alert("omen2", fingerprint="bench-p5-omen2"))).encode()


def _get(base: str, path: str) -> Any:
    import httpx

    r = httpx.get(base + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    r.raise_for_status()
    return r.json() if "json" in r.headers.get("content-type", "") else r.text


def _metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"not a wrk duration: {text}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk_round(url: str, body: bytes, seconds: float, work: Path) -> dict[str, Any]:
    script = work / "p5.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {TOKEN}"\n'
        f"wrk.body = [==[{body.decode()}]==]\n")
    cmd = ["wrk", "-t", "1", "-c", str(CONNECTIONS), "-d", f"{seconds:g}s", "--latency", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"^\s+99%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    p50 = _ms(re.search(r"^\s+50%\s+(\S+)", out, re.M).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": rps, "p99_ms": p99, "p50_ms": p50, "requests": total,
            "non_2xx": int(non2xx.group(1)) if non2xx else 0, "socket_errors": errors.group(1) if errors else "",
            "tool": "wrk"}


def python_round(url: str, body: bytes, seconds: float, max_requests: int = 200_000) -> dict[str, Any]:
    """Bounded in time and count: CONNECTIONS threads, one keep-alive httpx client each."""
    import httpx

    latencies: list[float] = []
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}

    def worker() -> None:
        mine: list[float] = []
        codes: dict[int, int] = {}
        with httpx.Client(timeout=10) as client:
            while time.perf_counter() < deadline and len(mine) < max_requests // CONNECTIONS:
                t = time.perf_counter()
                r = client.post(url, content=body, headers=headers)
                mine.append((time.perf_counter() - t) * 1000)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
        with lock:
            latencies.extend(mine)
            for k, v in codes.items():
                statuses[k] = statuses.get(k, 0) + v

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    p = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]) if latencies else (lambda q: 0.0)
    return {"rps": len(latencies) / elapsed, "p99_ms": p(0.99), "p50_ms": p(0.5), "requests": len(latencies),
            "non_2xx": sum(v for k, v in statuses.items() if not 200 <= k < 300), "tool": "python-httpx"}


@contextlib.contextmanager
def server(ctx: Context, fake: bool, work: Path) -> Any:
    port = _free_port()
    listen = f"127.0.0.1:{port}"
    if fake:
        env = base_env({"RUNBOOK_WEBHOOK_TOKEN": TOKEN})
        cmd = [sys.executable, "-m", "bench.fake_serve", listen]
    else:
        env = {**ctx.lab_env(), "RUNBOOK_WEBHOOK_TOKEN": TOKEN, "RUNBOOK_JOURNAL": str(work / "serve.sqlite")}
        cmd = runbook_cmd("serve", "--listen", listen)
    base = f"http://{listen}"
    with started_server(cmd, env=env, log=work / "serve.log", ready_url=base + "/healthz") as proc:
        yield base, proc


def run(ctx: Context, *, fake: bool = False) -> list[Metric]:
    import httpx

    seconds = 2.0 if ctx.quick else 5.0
    rounds = 1 if ctx.quick else max(5, ctx.runs)
    body = _payload()
    rps: list[float] = []
    p99: list[float] = []
    rounds_detail: list[dict[str, Any]] = []
    use_wrk = shutil.which("wrk") is not None
    with tempfile.TemporaryDirectory(prefix="bench-p5-") as tmp:
        work = Path(tmp)
        with server(ctx, fake, work) as (base, _proc):
            url = base + "/hooks/alertmanager"
            first = httpx.post(url, content=body, timeout=30, headers={"Authorization": f"Bearer {TOKEN}",
                                                                       "Content-Type": "application/json"})
            if first.status_code != 202:
                raise RuntimeError(f"the first page started nothing: {first.status_code} {first.text[:500]}")
            ok = False
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # let the one real run settle (planned, waiting approval)
                runs = _get(base, "/runs")
                if runs and runs[0].get("state") not in ("pending", "running"):
                    ok = True
                    break
                time.sleep(0.5)
            log(f"P5 first page started run {runs[0]['id'] if runs else '?'} -> {runs[0]['state'] if runs else '?'}")
            if not ok:
                raise RuntimeError(f"the first run did not settle: {runs}")
            for i in range(rounds):
                dup_before = _metric_sum(_get(base, "/metrics"), "runbook_serve_webhook_requests_total",
                                         outcome="duplicate")
                load = loadavg()
                r = wrk_round(url, body, seconds, work) if use_wrk else python_round(url, body, seconds)
                metrics_text = _get(base, "/metrics")
                dup = _metric_sum(metrics_text, "runbook_serve_webhook_requests_total", outcome="duplicate") \
                    - dup_before
                started = _metric_sum(metrics_text, "runbook_serve_runs_started_total")
                run_count = len(_get(base, "/runs"))
                r.update(duplicates_counted=int(dup), runs_listed=run_count, runs_started_total=int(started),
                         loadavg=load)
                rounds_detail.append(r)
                log(f"P5 round {i + 1}: {r['rps']:.0f} req/s, p99 {r['p99_ms']:.1f} ms, "
                    f"{r['requests']} requests, duplicates counted {int(dup)}, runs {run_count}")
                if run_count != 1 or started != 1 or r["non_2xx"]:
                    raise RuntimeError(f"duplicates must start nothing: {r}")
                rps.append(r["rps"])
                p99.append(r["p99_ms"])
    mode = "fake (bench.fake_serve: FakeRunStarter)" if fake else "real runbook serve against the lab"
    detail = {"server": mode, "round_seconds": seconds, "connections": CONNECTIONS,
              "tool": rounds_detail[0]["tool"] if rounds_detail else None, "rounds": rounds_detail}
    return [
        Metric("p5_webhook_rps", median(rps), len(rps), {"rps": summary(rps, 0), **detail}),
        Metric("p5_webhook_p99_ms", median(p99), len(p99), {"p99_ms": summary(p99, 2), "server": mode}),
    ]
