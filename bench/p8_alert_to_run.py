"""P8 alert to run (issue 18): from the moment omen2's kubelet starts failing to the run that the page
started waiting for approval, through the real paging loop of the lab with monitoring, and its parts.

Each run: the incident lab is reset and omen2 recovered by the CLI (untimed); a real ``runbook
serve`` (its own fresh journal, a sender token, the runbook's ``approve`` mode) listens behind a
recording proxy on 127.0.0.1; Prometheus and Alertmanager are started on the lab
(``Lab.start_monitoring``, what ``runbook lab up --with-monitoring`` does) paging the proxy. Once the
other NotReady nodes have paged and their runs are refused (the loop is steady), T0: omen2's swap is
turned on and its kubelet restarted over real SSH (``ansible -b``), so kubelet crash-loops as in the
incident. Then, timed from T0:

* the node lifecycle controller marks omen2 NotReady (its Ready condition's ``lastTransitionTime``;
  node monitor grace period);
* Prometheus scrapes the simulator's kube-state-metrics and its rule ``KubeNodeNotReady`` turns
  pending (the alert's ``activeAt``: scrape interval + evaluation interval);
* the rule's ``for:`` elapses (``activeAt`` + ``for``);
* Prometheus sends, Alertmanager waits ``group_wait`` and posts the webhook (received by the proxy);
* runbook answers the webhook with the run created (the proxy times the round trip: runbook's
  request path) and plans it in a worker (live facts, check-mode previews over SSH) until it is
  parked waiting for approval (the run's ``approval.waiting`` event).

``p8_alert_to_run_s`` is T0 -> waiting for approval; ``p8_runbook_webhook_ms`` is the webhook's
round trip through runbook (receipt -> run created and answered), whose target is 100 ms. Both are
medians over the runs; every part of every run is in ``detail``. Monitoring and the server are
stopped after each run; the lab is left with omen2 down again (the next benchmark resets it).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.common import ENGINE_ROOT, Context, Metric, loadavg, log, median, run_timed, runbook_cmd, summary, tool

NODE = "omen2"
TOKEN = "bench-p8-sender-token-0123456789"  # the Alertmanager sender (>= 16 bytes)
ALERT = "KubeNodeNotReady"
_FINAL = ("succeeded", "failed", "blocked", "cancelled", "waiting-approval")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _iso(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class Delivery:
    received: float
    answered: float
    status: int
    body: dict[str, Any]
    answer: dict[str, Any]


@dataclass
class Proxy:
    """Alertmanager -> this -> runbook serve: records when each webhook arrived and was answered."""

    target_port: int
    deliveries: list[Delivery] = field(default_factory=list)

    def start(self) -> str:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received = time.time()
                conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=60)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("authorization", "content-type", "user-agent")}
                headers["Host"] = f"127.0.0.1:{proxy.target_port}"
                conn.request("POST", self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                answered = time.time()
                conn.close()
                with contextlib.suppress(ValueError):
                    proxy.deliveries.append(Delivery(received, answered, resp.status, json.loads(body),
                                                     json.loads(data or b"{}")))
                self.send_response(resp.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, name="bench-p8-proxy", daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks/alertmanager"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def started(self, node: str) -> tuple[Delivery, str] | None:
        """The delivery whose answer started a run on ``node``, and the run id."""
        for d in list(self.deliveries):
            for dec in d.answer.get("decisions", []):
                if dec.get("outcome") == "started" and dec.get("node") == node and dec.get("run_id"):
                    return d, str(dec["run_id"])
        return None


class Serve:
    def __init__(self, ctx: Context, work: Path) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**ctx.lab_env(), "RUNBOOK_WEBHOOK_TOKEN": TOKEN, "RUNBOOK_JOURNAL": str(work / "serve.sqlite")}
        self.log = work / "serve.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(runbook_cmd("serve", "--listen", f"127.0.0.1:{self.port}"), env=env,
                                         cwd=ENGINE_ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(Exception):
                self.get("/healthz")
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"runbook serve did not start: {self.log.read_text()[-1500:]}")
            time.sleep(0.2)

    def get(self, path: str) -> Any:
        import httpx

        r = httpx.get(self.base + path, timeout=10)
        r.raise_for_status()
        return r.json() if "json" in r.headers.get("content-type", "") else r.text

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _kubectl_json(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run([tool("kubectl", path=env.get("PATH")), *args, "-o", "json"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return json.loads(out)


def _ready_condition(env: dict[str, str], node: str) -> dict[str, Any]:
    obj = _kubectl_json(env, "get", "node", node)
    return next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")


def _not_ready_nodes(env: dict[str, str]) -> set[str]:
    items = _kubectl_json(env, "get", "nodes")["items"]
    return {n["metadata"]["name"] for n in items
            if next((c["status"] for c in n["status"]["conditions"] if c["type"] == "Ready"), "") != "True"}


def _wait(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as e:  # a poll that fails is retried until the deadline
            last = e
        time.sleep(interval)
    why = f" (last error: {last})" if last else ""
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}{why}")


@contextlib.contextmanager
def _monitoring(ctx: Context, webhook: str) -> Iterator[Any]:
    from engine.lab.manager import Lab

    lab = Lab(ctx.lab_dir)
    lab.stop_monitoring()  # one left by an interrupted run pages another address
    lab.start_monitoring(alert_webhook=webhook, webhook_token=TOKEN)
    try:
        yield lab.monitoring()
    finally:
        lab.stop_monitoring()


def _alert(monitoring: Any, node: str) -> dict[str, Any] | None:
    return next((a for a in monitoring.alerts() if a["alertname"] == ALERT and a["node"] == node), None)


def one_run(ctx: Context, index: int) -> dict[str, Any]:
    lab = ctx.lab()
    env = ctx.lab_env()
    timing = lab.timing()
    reset_s = lab.reset()
    rec = run_timed([*runbook_cmd("run", "gpu-node-recovery", "--node", NODE, "--yes")], env=env,
                    log_path=ctx.log_path(f"p8-recover-{index}.log"))
    if rec.rc != 0:
        raise RuntimeError(f"recovering {NODE} before the measurement failed (rc {rec.rc}, "
                           f"log {ctx.log_path(f'p8-recover-{index}.log')})")
    _wait(lambda: _ready_condition(env, NODE)["status"] == "True", 120, f"{NODE} Ready after the recovery")
    with tempfile.TemporaryDirectory(prefix="bench-p8-") as tmp:
        work = Path(tmp)
        serve = Serve(ctx, work)
        proxy = Proxy(serve.port)
        try:
            webhook = proxy.start()
            with _monitoring(ctx, webhook) as monitoring:
                steady_s = _settle(env, serve, monitoring)
                if _alert(monitoring, NODE) is not None:
                    raise RuntimeError(f"{NODE} has an alert before its kubelet was broken")
                parts = _measure(ctx, env, serve, proxy, monitoring, index)
        finally:
            proxy.stop()
            serve.stop()
            (ctx.log_path(f"p8-serve-{index}.log")).write_bytes(serve.log.read_bytes())
    parts.update(reset_s=round(reset_s, 1), recover_s=round(rec.seconds, 1), steady_s=round(steady_s, 1),
                 loadavg=loadavg(), lab_timing={k: timing.get(k) for k in (
                     "scrape_seconds", "rule_evaluation_seconds", "alert_for_seconds", "alert_group_wait_seconds",
                     "alert_resend_seconds")})
    return parts


def _settle(env: dict[str, str], serve: Serve, monitoring: Any) -> float:
    """Until every other NotReady node has paged and its run ended (refused): the loop is steady."""
    start = time.monotonic()
    others = _not_ready_nodes(env) - {NODE}

    def steady() -> bool:
        firing = {a["node"] for a in monitoring.alerts() if a["alertname"] == ALERT and a["state"] == "firing"}
        runs = serve.get("/runs")
        paged = {n for r in runs for n in r.get("nodes", [])}
        return others <= firing and others <= paged and all(r["state"] in _FINAL for r in runs)

    _wait(steady, 300, f"the other NotReady nodes ({', '.join(sorted(others))}) to page and their runs to end")
    return time.monotonic() - start


def _break_kubelet(env: dict[str, str], index: int, ctx: Context) -> float:
    """omen2's swap on, kubelet restarted (it then fails on swap, as in the incident); returns T0."""
    from engine.lab.hoststate import HostState
    from engine.lab.manager import Lab

    record = Lab(ctx.lab_dir).record()
    devices = list(HostState(record["nodes"][NODE]["state_dir"]).read()["swap"]["devices"])
    cmd = [tool("ansible", path=env.get("PATH")), "-i", env["RUNBOOK_INVENTORY"], NODE, "-b", "-m", "shell", "-a",
           f"swapon {devices[0]} && systemctl restart kubelet"]
    t = run_timed(cmd, env=env, log_path=ctx.log_path(f"p8-break-{index}.log"))
    if t.rc != 0:
        raise RuntimeError(f"breaking {NODE}'s kubelet failed: {t.output[-1000:]}")
    return time.time()


def _measure(ctx: Context, env: dict[str, str], serve: Serve, proxy: Proxy, monitoring: Any,
             index: int) -> dict[str, Any]:
    timing = ctx.lab().timing()
    seen: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:  # when Prometheus is first seen reporting the alert pending, then firing
        while not stop.wait(0.2):
            with contextlib.suppress(Exception):
                a = _alert(monitoring, NODE)
                if a is not None:
                    seen.setdefault(a["state"], time.time())
                    seen.setdefault("active_at", _iso(a["active_at"]))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        t0 = _break_kubelet(env, index, ctx)
        found = _wait(lambda: proxy.started(NODE), 240, f"a webhook starting a run on {NODE}", interval=0.2)
        delivery, run_id = found
        run = _wait(lambda: (r := serve.get(f"/runs/{run_id}"))["state"] in _FINAL and r, 300,
                    f"run {run_id} to be planned", interval=0.2)
    finally:
        stop.set()
        watcher.join(2)
    if run["state"] != "waiting-approval":
        raise RuntimeError(f"run {run_id} ended {run['state']} instead of waiting for approval: "
                           f"{run.get('outcome_reason')}")
    ready = _ready_condition(env, NODE)
    not_ready_at = _iso(ready["lastTransitionTime"])
    waiting_at = _iso(next(e["time"] for e in run["events"] if e["kind"] == "approval.waiting"))
    created_at = _iso(run["events"][0]["time"])
    active_at = seen.get("active_at")
    if active_at is None:
        raise RuntimeError(f"Prometheus never showed {ALERT}{{node={NODE}}} to the poller")
    firing_at = active_at + float(timing["alert_for_seconds"])
    scraped_at: float | None = None
    with contextlib.suppress(Exception):  # the split is extra detail: a failed query leaves it out
        scraped_at = _first_not_ready_sample(monitoring, t0)
    return {
        "run_id": run_id,
        "total_s": round(waiting_at - t0, 3),
        "node_not_ready_s": round(not_ready_at - t0, 3),  # node monitor grace (+ its period), 1 s resolution
        "scrape_and_evaluation_s": round(active_at - not_ready_at, 3),
        # split at the first scraped sample saying Ready is not true (NotReady has 1 s resolution)
        "scrape_s": round(scraped_at - not_ready_at, 3) if scraped_at else None,
        "evaluation_s": round(active_at - scraped_at, 3) if scraped_at else None,
        "rule_for_s": round(firing_at - active_at, 3),
        "firing_seen_by_poller_s": round(seen["firing"] - active_at, 3) if "firing" in seen else None,
        "alertmanager_s": round(delivery.received - firing_at, 3),  # next evaluation, send, group_wait
        "runbook_webhook_ms": round(1000 * (delivery.answered - delivery.received), 2),
        "run_created_after_receipt_ms": round(1000 * (created_at - delivery.received), 2),
        "runbook_plan_s": round(waiting_at - delivery.answered, 3),
        "runbook_share_s": round(waiting_at - delivery.received, 3),
        "webhook_status": delivery.status,
        "deliveries": len(proxy.deliveries),
        # every delivery of the run, the other nodes' first pages (answered while their runs plan in
        # the workers) and the re-sends (duplicates) included
        "all_webhooks_ms": summary([1000 * (d.answered - d.received) for d in proxy.deliveries], 2),
        "starting_webhooks_ms": summary([1000 * (d.answered - d.received) for d in proxy.deliveries
                                         if d.status == 202], 2),
    }


def _first_not_ready_sample(monitoring: Any, since: float) -> float | None:
    """When Prometheus first scraped kube_node_status_condition{Ready, true} = 0 for the node after ``since``."""
    window = max(10, int(time.time() - since) + 10)
    series = monitoring.query(f'kube_node_status_condition{{node="{NODE}",condition="Ready",status="true"}}'
                              f"[{window}s]")
    samples = sorted((float(t), v) for s in series for t, v in s.get("values", []))
    return next((t for t, v in samples if t >= since and float(v) == 0), None)


def run(ctx: Context) -> list[Metric]:
    runs = 1 if ctx.quick else ctx.runs
    samples: list[dict[str, Any]] = []
    problems: list[str] = []
    for i in range(runs):
        try:
            parts = one_run(ctx, i)
        except RuntimeError as e:
            problems.append(f"run {i + 1}: {e}")
            log(f"P8 run {i + 1}: {e}")
            continue
        samples.append(parts)
        log(f"P8 run {i + 1}: {parts['total_s']:.1f} s to waiting for approval: NotReady "
            f"{parts['node_not_ready_s']:.1f} s, pending {parts['scrape_and_evaluation_s']:.1f} s, for "
            f"{parts['rule_for_s']:.1f} s, Alertmanager {parts['alertmanager_s']:.1f} s, runbook's webhook "
            f"{parts['runbook_webhook_ms']:.1f} ms, plan {parts['runbook_plan_s']:.1f} s (load {parts['loadavg'][:1]})")
    if not samples:
        raise RuntimeError("; ".join(problems) or "no run measured")

    def part(name: str, digits: int = 3) -> dict[str, Any]:
        return summary([s[name] for s in samples if s.get(name) is not None], digits)

    parts = {name: part(name) for name in (
        "node_not_ready_s", "scrape_and_evaluation_s", "scrape_s", "evaluation_s", "rule_for_s", "alertmanager_s",
        "runbook_webhook_ms",
        "run_created_after_receipt_ms", "runbook_plan_s", "runbook_share_s")}
    detail = {"node": NODE, "parts": parts, "runs_detail": samples, "problems": problems}
    totals = [s["total_s"] for s in samples]
    webhook = [s["runbook_webhook_ms"] for s in samples]
    return [
        Metric("p8_alert_to_run_s", median(totals), len(totals), {"total_s": summary(totals), **detail}),
        Metric("p8_runbook_webhook_ms", median(webhook), len(webhook),
               {"runbook_webhook_ms": summary(webhook, 2), "runbook_share_s": parts["runbook_share_s"],
                "what": "webhook receipt -> run created and the page answered (runbook's request path)"}),
    ]
