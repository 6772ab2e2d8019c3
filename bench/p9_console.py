"""P9 the web console: the run page of a finished 3-step run (bytes transferred, first paint) and the
latency of a live update (journal event -> the page's DOM), in headless Chromium on the lab.

One real paged run gives all three. ``runbook serve`` (the real one, a fresh journal, an approver
credential) is paged for omen2 on a freshly reset incident lab; gpu-node-recovery waits for approval
(its trigger's ``approve`` mode). Headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
through Selenium with the driver path given) opens the run's page, a ``MutationObserver`` notes
``Date.now()`` and the number of timeline entries each time the live region changes, and the run is
approved through the JSON API (not the page: the page only follows). When the run is final:

* ``p9_live_update_ms``: for every journal event recorded after the approval, the time from the
  event's own timestamp (``events[].time``, written by the server that ran the step) to the first DOM
  update that shows it (the timeline has that many entries); the metric is the 95th percentile of
  those latencies (median and max in ``detail``). Same machine, same clock.
* ``p9_run_page_kb``: the finished run's page loaded afresh (browser cache disabled): the transferred
  bytes of the document and every resource it loads (Navigation and Resource Timing ``transferSize``:
  headers included), in KB (1000 bytes); median over the loads.
* ``p9_first_paint_ms``: ``first-contentful-paint`` of those loads (Paint Timing), median.

The server's watcher of a followed run reads it every 100 ms (``Console.poll``), so the latency is
bounded by that interval plus a render; the machine's load shows in it. The lab is reset afterwards.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import Context, Metric, loadavg, log, runbook_cmd, started_server, summary

SENDER = "bench-p9-sender-token-0123456789"
APPROVER = "bench-p9-approver-token-0123456789"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
PLAN_TIMEOUT = 300.0
RUN_TIMEOUT = 420.0

_OBSERVE = """
const live = document.getElementById("live");
window.__p9 = [];
const count = () => document.querySelectorAll("#timeline li").length;
window.__p9.push([Date.now(), count()]);
new MutationObserver(() => window.__p9.push([Date.now(), count()]))
  .observe(live, {childList: true, subtree: true});
"""

_TIMING = """
const nav = performance.getEntriesByType("navigation")[0];
const res = performance.getEntriesByType("resource");
const paint = Object.fromEntries(performance.getEntriesByType("paint").map(p => [p.name, p.startTime]));
return {document: nav ? nav.transferSize : null, resources: res.map(r => [r.name, r.transferSize]),
        fcp: paint["first-contentful-paint"] ?? null, fp: paint["first-paint"] ?? null,
        dom_content_loaded: nav ? nav.domContentLoadedEventEnd : null};
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _epoch_ms(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() * 1000.0


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(0.95 * len(ordered)) - 1))]


@contextlib.contextmanager
def _serve(ctx: Context, work: Path) -> Iterator[str]:
    port = _free_port()
    env = {**ctx.lab_env(), "RUNBOOK_WEBHOOK_TOKEN": SENDER, "RUNBOOK_APPROVER_TOKEN_BENCH": APPROVER,
           "RUNBOOK_JOURNAL": str(work / "serve.sqlite")}
    base = f"http://127.0.0.1:{port}"
    with started_server(runbook_cmd("serve", "--listen", f"127.0.0.1:{port}"), env=env, log=work / "serve.log",
                        ready_url=base + "/healthz"):
        yield base


@contextlib.contextmanager
def _browser() -> Iterator[Any]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        raise RuntimeError(f"{' and '.join(missing)} missing (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--lang=en-US"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def live_latencies(events: list[dict[str, Any]], after_ms: float, updates: list[list[float]]) -> list[float]:
    """Per journal event recorded after ``after_ms``: ms from its time to the first DOM update whose
    timeline shows it (``updates``: [epoch ms, timeline entries] in order)."""
    out = []
    for index, event in enumerate(events):
        at = _epoch_ms(str(event.get("time") or ""))
        if at < after_ms:
            continue
        shown = next((t for t, n in updates if n >= index + 1 and t >= at - 1), None)
        if shown is not None:
            out.append(shown - at)
    return out


def run(ctx: Context) -> list[Metric]:
    import httpx

    from tests.fakes import alert, webhook

    loads = 1 if ctx.quick else max(5, ctx.runs)
    lab = ctx.lab()
    reset_s = lab.reset()
    log(f"P9 lab reset in {reset_s:.0f} s")
    sender = {"Authorization": f"Bearer {SENDER}"}
    approver = {"Authorization": f"Bearer {APPROVER}"}
    with tempfile.TemporaryDirectory(prefix="bench-p9-") as tmp, _serve(ctx, Path(tmp)) as base, \
            _browser() as driver:
        page = httpx.post(base + "/hooks/alertmanager", json=webhook(alert("omen2", fingerprint="bench-p9")),
                          headers=sender, timeout=30)
        if page.status_code != 202 or not page.json().get("runs"):
            raise RuntimeError(f"the page started no run: {page.status_code} {page.text[:300]}")
        run_id = page.json()["runs"][0]

        def current() -> dict[str, Any]:
            return dict(httpx.get(f"{base}/runs/{run_id}", headers=approver, timeout=10).json())

        run = _wait(lambda: (r := current())["state"] not in ("pending", "running") and r, PLAN_TIMEOUT,
                    "the plan (waiting-approval)")
        if run["state"] != "waiting-approval":
            raise RuntimeError(f"run {run_id} is {run['state']}, not waiting for approval: {run.get('outcome_reason')}")
        driver.get(f"{base}/ui/runs/{run_id}")
        driver.execute_script(_OBSERVE)
        approved_at = time.time() * 1000.0
        ok = httpx.post(f"{base}/runs/{run_id}/approve", json={"plan_digest": run["plan_digest"]},
                        headers=approver, timeout=30)
        if ok.status_code not in (200, 202):
            raise RuntimeError(f"approval refused: {ok.status_code} {ok.text[:300]}")
        final = _wait(lambda: (r := current())["state"] in ("succeeded", "failed", "blocked", "cancelled") and r,
                      RUN_TIMEOUT, "the run to end")
        time.sleep(1.0)  # the last update reaches the page
        updates = driver.execute_script("return window.__p9")
        events = [e for e in final.get("events") or [] if isinstance(e, dict)]
        latencies = live_latencies(events, approved_at, updates)
        # the incident's three changing steps (the flagship's bind-gpus is a no-op on one-GPU omen2)
        steps = [s.get("id") for s in (final.get("plan") or {}).get("steps") or [] if s.get("kind") == "change"]
        log(f"P9 run {run_id} {final['state']} ({len(steps)} changing steps); {len(latencies)} live updates")
        if final["state"] != "succeeded" or len(steps) != 3:
            raise RuntimeError(f"P9 measures the page of a succeeded 3-step run; run {run_id} is {final['state']} "
                               f"with steps {steps}: {final.get('outcome_reason')}")
        if not latencies:
            raise RuntimeError(f"no live update of run {run_id} reached the page: {updates[-5:]}")

        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setCacheDisabled", {"cacheDisabled": True})
        sizes: list[float] = []
        fcp: list[float] = []
        loads_detail = []
        for _ in range(loads):
            driver.get("about:blank")
            driver.get(f"{base}/ui/runs/{run_id}")
            timing = _wait(lambda: (t := driver.execute_script(_TIMING))["fcp"] is not None and t, 30,
                           "the first contentful paint", 0.1)
            total = (timing["document"] or 0) + sum(size or 0 for _, size in timing["resources"])
            sizes.append(total / 1000.0)
            fcp.append(float(timing["fcp"]))
            loads_detail.append({"bytes": total, "document_bytes": timing["document"],
                                 "resources": timing["resources"], "fcp_ms": timing["fcp"], "fp_ms": timing["fp"]})
    after = lab.reset()
    log(f"P9 lab reset again in {after:.0f} s")
    common = {"run": {"state": final["state"], "steps": steps, "events": len(events)}, "loadavg": loadavg(),
              "note": "real runbook serve on the incident lab, headless Chromium (Debian) through Selenium"}
    kb = sorted(sizes)[len(sizes) // 2] if sizes else None
    first = sorted(fcp)[len(fcp) // 2] if fcp else None
    return [
        Metric("p9_run_page_kb", kb, len(sizes), {"kb": summary(sizes, 1), "loads": loads_detail[:1], **common}),
        Metric("p9_first_paint_ms", first, len(fcp), {"first_contentful_paint_ms": summary(fcp, 1), **common}),
        Metric("p9_live_update_ms", _p95(latencies), len(latencies),
               {"statistic": "p95 over the run's journal events", "latency_ms": summary(latencies, 1),
                "poll_interval_ms": 100, **common}),
    ]
