"""The web console in a real headless Chromium (Debian's chromium + chromium-driver, through Selenium
with the driver path given: no Selenium Manager, no browser download) against a real ``runbook serve``
(uvicorn on 127.0.0.1) backed by the fake run starter: log in, the runs list, a waiting run's fstab
diff and digest, approve and watch the page update live, a stale digest refused in the page, a
reader with no approve button whose forged POST is refused, a ``<script>`` label shown as text; the
plans page: a saved plan file uploaded and shown with its diff and digest, a changed one refused, and
a plan requested for a runbook + node, none of which starts a run.

Screenshots of the runs list, a waiting run and the plans page at 1280 px and 390 px go to a temporary folder (and to
``$RUNBOOK_SCREENSHOTS`` when set: ``docs/images/`` keeps the current ones).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import require
from tests.fakes import (
    APPROVER_TOKEN,
    FSTAB_DIFF,
    INCIDENT_NODES,
    READER_TOKEN,
    TOKEN,
    FakeRunStarter,
    StaticClusterView,
    alert,
    saved_plan,
    trigger_spec,
    webhook,
)

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
XSS = "<script>window.__xss=1</script>"


def sample_plan(run: Mapping[str, Any]) -> dict[str, Any]:
    """A gpu-node-recovery plan in ``Plan``'s JSON shape, as the real starter shows it."""
    node = run["params"]["node"]
    return {
        "format": "runbook-plan/v1", "runbook": run["runbook"], "version": "1", "node": node,
        "state": "ready", "params": dict(run["params"]),
        "digest": hashlib.sha256(f"plan-{run['id']}".encode()).hexdigest(),
        "preconditions": [{"id": "node-exists", "applies": True, "holds": True,
                           "observed": f"node {node} found", "evidence": {"ready": "Unknown"}}],
        "steps": [
            {"id": "disable-swap", "why": "kubelet refuses to start while swap is on", "kind": "change",
             "action": "ansible", "summary": "comment the swap line out of /etc/fstab, swapoff -a",
             "command": f"ansible-playbook -l {node} playbooks/disable-swap.yml",
             "guards": [{"check": "host.reachable", "holds": True, "observed": "ssh ok"}],
             "verify": [{"check": "host.swap_total_bytes == 0", "timeout_seconds": 60}],
             "preview": FSTAB_DIFF},
            {"id": "restart-kubelet", "why": "pick up the fixed configuration", "kind": "change",
             "action": "ansible", "summary": "systemctl restart kubelet",
             "command": f"ansible-playbook -l {node} playbooks/restart-kubelet.yml",
             "verify": [{"check": "node.ready == True", "timeout_seconds": 300}]},
        ],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, base: str, starter: FakeRunStarter, app: Any) -> None:
        self.base, self.starter, self.app = base, starter, app

    def page(self, alertname: str = "KubeNodeNotReady", **labels: str) -> str:
        """Deliver one alert; the id of the run it started."""
        before = {r["id"] for r in self.starter.runs()}
        r = httpx.post(f"{self.base}/hooks/alertmanager", json=webhook(alert(alertname=alertname, **labels)),
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert r.status_code == 202, r.text
        new = [x["id"] for x in self.starter.runs() if x["id"] not in before]
        assert len(new) == 1
        return new[0]

    def wait_state(self, run_id: str, state: str, timeout: float = 20.0) -> None:
        assert self.starter.wait_until(lambda s: s.run(run_id)["state"] == state, timeout), \
            f"{run_id} is {self.starter.run(run_id)['state']}, not {state}"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    import uvicorn

    from engine.serve.app import create_app
    from engine.serve.config import load_config
    from engine.serve.notify import Notifier

    port = free_port()
    env = {"RUNBOOK_WEBHOOK_TOKEN": TOKEN, "RUNBOOK_APPROVER_TOKEN_ALICE": APPROVER_TOKEN,
           "RUNBOOK_READER_TOKEN_GRAFANA": READER_TOKEN}
    config = load_config(None, env=env, overrides={"listen": f"127.0.0.1:{port}", "auth": {"reads": "token"},
                                                   "public_url": f"http://127.0.0.1:{port}"})
    starter = FakeRunStarter([
        trigger_spec(mode="approve", matchers=('node=~"omen.*"',),
                     params={"node": "{{ labels.node }}", "team": "{{ labels.team }}"}),
        trigger_spec("gpu-reset", mode="auto", alert="NodeGpuMissing", matchers=('node=~"omen.*"',)),
    ], plan=sample_plan, execute_delay=1.5)
    app = create_app(config, starter, cluster=StaticClusterView(INCIDENT_NODES),
                     notifier=Notifier(None), sweep_interval=0)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                       timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "runbook serve did not start"
        time.sleep(0.05)
    try:
        yield Server(f"http://127.0.0.1:{port}", starter, app)
    finally:
        uv.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    require(f"{' and '.join(missing)} missing (apt-get install chromium chromium-driver)" if missing else None)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        require("selenium is not installed (pip install -e '.[dev]')")
        raise
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--lang=en-US"):
        options.add_argument(arg)
    # Why the explicit driver path: Selenium Manager (which would download a driver) is never used.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-screenshots")


def wait_for(driver: Any, predicate: Any, timeout: float = 30.0, what: str = "") -> Any:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # Why stale is ignored: the live region is replaced on each update, under the element just found
    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
                         ).until(lambda d: predicate(d), message=what)


def by_css(driver: Any, css: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, css))


def text_of(driver: Any, css: str) -> str:
    """The text of the first element matching ``css`` (read again if the live region replaced it)."""
    return str(wait_for(driver, lambda d: [d.find_element("css selector", css).text], what=css)[0])


def status_of(driver: Any, step: str) -> str:
    return str(wait_for(driver, lambda d: [d.find_element("css selector", f"#step-{step}").get_attribute(
        "data-status")], what=step)[0])


def login(driver: Any, base: str, credential: str) -> None:
    driver.delete_all_cookies()
    driver.get(f"{base}/ui/login")
    by_css(driver, "#credential")[0].send_keys(credential)
    by_css(driver, "#login")[0].click()
    wait_for(driver, lambda d: d.current_url.rstrip("/").endswith("/ui"), what="runs list after login")


def screenshot(driver: Any, folder: Path, name: str, width: int) -> Path:
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": 900 if width > 600 else 844,
                            "deviceScaleFactor": 1, "mobile": width < 600})
    try:
        path = folder / f"{name}-{width}.png"
        shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(shot["data"]))  # the whole page, not only the first screen
        keep = os.environ.get("RUNBOOK_SCREENSHOTS")
        if keep:
            shutil.copy(path, Path(keep) / path.name)
        overflow = driver.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0, f"{name} at {width} px scrolls sideways by {overflow} px"
        return path
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_a_reader_must_log_in_before_the_runs_list_shows(server: Server, browser: Any) -> None:
    browser.delete_all_cookies()
    browser.get(f"{server.base}/ui/")
    assert "/ui/login" in browser.current_url
    by_css(browser, "#credential")[0].send_keys("not-a-credential")
    by_css(browser, "#login")[0].click()
    assert "unknown credential" in wait_for(browser, lambda d: by_css(d, "#error"), what="login refused")[0].text
    cookie = next((c for c in browser.get_cookies() if c["name"] == "runbook_session"), None)
    assert cookie is None
    login(browser, server.base, APPROVER_TOKEN)
    cookie = next(c for c in browser.get_cookies() if c["name"] == "runbook_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert "alice (approver)" in text_of(browser, "#viewer")


def test_the_runs_list_pins_a_waiting_run_above_newer_runs_and_shows_its_row(
        server: Server, browser: Any, shots: Path) -> None:
    waiting = server.page(node="omen2", team=XSS)
    server.wait_state(waiting, "waiting-approval")
    done = server.page("NodeGpuMissing", node="omen3")
    server.wait_state(done, "succeeded")
    login(browser, server.base, APPROVER_TOKEN)
    rows = by_css(browser, "tr.run")
    assert [r.get_attribute("data-run") for r in rows][:2] == [waiting, done]  # pinned over a newer run
    cells = [c.text for c in rows[0].find_elements("css selector", "td")]
    assert cells[0] == "gpu-node-recovery" and cells[1] == "omen2" and cells[2] == "waiting-approval"
    assert cells[3] == "Alertmanager (KubeNodeNotReady)" and cells[4] == "alertmanager"
    started = rows[0].find_element("css selector", "time")
    assert started.get_attribute("title").endswith("Z (UTC)") and "Z" not in started.text  # viewer's zone
    assert rows[1].find_element("css selector", ".state").text == "succeeded"
    by_css(browser, "#f-state option[value='succeeded']")[0].click()
    by_css(browser, ".filters button")[0].click()
    wait_for(browser, lambda d: "state=succeeded" in d.current_url)
    assert [r.get_attribute("data-run") for r in by_css(browser, "tr.run")] == [done]
    browser.get(f"{server.base}/ui/")
    screenshot(browser, shots, "runs", 1280)
    screenshot(browser, shots, "runs", 390)


def test_a_waiting_run_shows_its_fstab_diff_and_digest_and_a_label_script_as_text(
        server: Server, browser: Any, shots: Path) -> None:
    run_id = next(r["id"] for r in server.starter.runs() if r["state"] == "waiting-approval")
    login(browser, server.base, APPROVER_TOKEN)
    browser.get(f"{server.base}/ui/runs/{run_id}")
    assert text_of(browser, "#digest") == server.starter.run(run_id)["plan_digest"]
    added = [e.text for e in by_css(browser, "#step-disable-swap pre.diff .add")]
    removed = [e.text for e in by_css(browser, "#step-disable-swap pre.diff .del")]
    assert removed == ["-/swap.img none swap sw 0 0"] and added[0].startswith("+#/swap.img")
    command = text_of(browser, "#step-disable-swap .command")
    assert "ansible-playbook -l omen2 playbooks/disable-swap.yml" in command
    assert XSS in text_of(browser, "#params")
    assert browser.execute_script("return window.__xss === undefined")
    screenshot(browser, shots, "run-waiting", 1280)
    screenshot(browser, shots, "run-waiting", 390)


def test_approving_in_the_page_records_alice_and_the_page_follows_the_run_live_without_reload(
        server: Server, browser: Any) -> None:
    run_id = next(r["id"] for r in server.starter.runs() if r["state"] == "waiting-approval")
    login(browser, server.base, APPROVER_TOKEN)
    browser.get(f"{server.base}/ui/runs/{run_id}")
    by_css(browser, "#approve")[0].click()
    wait_for(browser, lambda d: by_css(d, "#notice"), what="approval notice")
    assert server.starter.run(run_id)["approved_by"] == "alice"
    browser.execute_script("window.__sameDocument = 'yes'")
    server.starter.record_event(run_id, "step.start", {"step": "disable-swap"})
    wait_for(browser, lambda d: status_of(d, "disable-swap") == "running", what="step running, live")
    server.starter.record_event(run_id, "step.outcome", {"step": "disable-swap", "status": "succeeded",
                                                          "started_at": time.time() - 2, "finished_at": time.time()})
    server.wait_state(run_id, "succeeded")
    wait_for(browser, lambda d: text_of(d, "#state") == "succeeded",
             what="state succeeded, live")
    assert browser.execute_script("return window.__sameDocument") == "yes"  # no reload happened
    assert status_of(browser, "disable-swap") == "succeeded"
    assert text_of(browser, "#approved-by") == "alice"
    assert not by_css(browser, "#approve")


def test_a_plan_that_changed_since_the_page_loaded_is_refused_in_the_page(server: Server, browser: Any) -> None:
    run_id = server.page(node="omen4", team="infra")
    server.wait_state(run_id, "waiting-approval")
    login(browser, server.base, APPROVER_TOKEN)
    browser.get(f"{server.base}/ui/runs/{run_id}")
    old = text_of(browser, "#digest")
    server.starter.replan(run_id, "c" * 64)
    # the live update shows the new digest but keeps the approve button on the plan that was loaded
    changed = wait_for(browser, lambda d: by_css(d, "#plan-changed"), what="the page says the plan changed")
    assert old in changed[0].text and "c" * 64 in changed[0].text
    assert by_css(browser, "#approve-form input[name=plan_digest]")[0].get_attribute("value") == old
    by_css(browser, "#approve")[0].click()
    error = wait_for(browser, lambda d: by_css(d, "#error"), what="refusal shown")[0].text
    assert "approval refused" in error and old in error
    assert server.starter.run(run_id)["approved_by"] is None


def test_a_reader_sees_no_approve_button_and_a_forged_approval_post_is_refused(server: Server, browser: Any) -> None:
    run_id = server.page(node="omen5", team="infra")
    server.wait_state(run_id, "waiting-approval")
    digest = server.starter.run(run_id)["plan_digest"]
    login(browser, server.base, READER_TOKEN)
    browser.get(f"{server.base}/ui/runs/{run_id}")
    assert "may only read" in wait_for(browser, lambda d: by_css(d, "#no-approve"))[0].text
    assert not by_css(browser, "#approve")
    forged = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        const csrf = document.querySelector("form[action='/ui/logout'] input[name=csrf]").value;
        fetch(location.pathname + "/decision", {method: "POST", body: new URLSearchParams(
              {csrf: csrf, action: "approve", plan_digest: arguments[0]})})
          .then(r => r.text().then(t => done([r.status, t])));
    """, digest)
    assert forged[0] == 403 and "grafana (reader) may not approve" in forged[1]
    assert server.starter.run(run_id)["approved_by"] is None


def test_a_run_is_rejected_with_a_reason_using_only_the_keyboard(server: Server, browser: Any) -> None:
    from selenium.webdriver.common.keys import Keys

    run_id = server.page(node="omen6", team="infra")
    server.wait_state(run_id, "waiting-approval")
    login(browser, server.base, APPROVER_TOKEN)
    browser.get(f"{server.base}/ui/runs/{run_id}")
    body = browser.find_element("css selector", "body")
    body.send_keys(Keys.TAB)  # the first stop is the skip link, then the header, ... the reason field
    for _ in range(30):
        active = browser.switch_to.active_element
        if active.get_attribute("id") == "reject-reason":
            break
        active.send_keys(Keys.TAB)
    else:
        raise AssertionError("the reject reason field is not reachable with Tab")
    label = browser.find_element("css selector", "label[for='reject-reason']").text
    assert "reject" in label.lower()
    active.send_keys("omen6 is being drained by hand")
    active.send_keys(Keys.TAB)
    assert browser.switch_to.active_element.get_attribute("id") == "reject"
    browser.switch_to.active_element.send_keys(Keys.ENTER)
    wait_for(browser, lambda d: d.find_elements("css selector", "#notice"), what="rejection notice")
    assert text_of(browser, "#state") == "cancelled"
    assert text_of(browser, "#rejected-by") == "alice: omen6 is being drained by hand"
    run = server.starter.run(run_id)
    assert (run["state"], run["rejected_by"]) == ("cancelled", "alice")


def test_a_saved_plan_file_uploaded_in_the_page_shows_its_diff_and_digest_and_a_changed_one_is_refused(
        server: Server, browser: Any, shots: Path, tmp_path: Path) -> None:
    plan = saved_plan("omen2")
    good = tmp_path / "omen2.plan.json"
    good.write_text(plan.model_dump_json(indent=2) + "\n")
    edited = json.loads(good.read_text())
    edited["steps"][0]["preview"] = edited["steps"][0]["preview"].replace("#/swap.img", "#/swap2.img")
    bad = tmp_path / "edited.plan.json"
    bad.write_text(json.dumps(edited))
    runs_before = server.starter.runs()
    login(browser, server.base, READER_TOKEN)
    browser.get(f"{server.base}/ui/plans")
    by_css(browser, "#p-file")[0].send_keys(str(good))
    by_css(browser, "#upload")[0].click()
    assert text_of(browser, "#digest") == plan.digest
    removed = [e.text for e in by_css(browser, "#step-swap-off pre.diff .del")]
    added = [e.text for e in by_css(browser, "#step-swap-off pre.diff .add")]
    assert removed == ["-/swap.img none swap sw 0 0"] and added[0].startswith("+#/swap.img")
    assert "omen2.plan.json, uploaded by grafana" in text_of(browser, "#plan-source")
    screenshot(browser, shots, "plans", 1280)
    screenshot(browser, shots, "plans", 390)
    browser.get(f"{server.base}/ui/plans")
    by_css(browser, "#p-file")[0].send_keys(str(bad))
    by_css(browser, "#upload")[0].click()
    error = wait_for(browser, lambda d: by_css(d, "#error"), what="refusal shown")[0].text
    assert error.startswith("edited.plan.json: digest:") and "changed after" in error
    assert not by_css(browser, "#plan") and not by_css(browser, "pre.diff")
    assert server.starter.runs() == runs_before  # showing a plan starts nothing


def test_a_plan_requested_in_the_page_for_a_runbook_and_node_is_shown_and_starts_no_run(
        server: Server, browser: Any) -> None:
    runs_before = server.starter.runs()
    login(browser, server.base, APPROVER_TOKEN)
    browser.get(f"{server.base}/ui/plans")
    by_css(browser, "#p-runbook option[value='gpu-node-recovery']")[0].click()
    by_css(browser, "#p-node")[0].send_keys("omen7")
    by_css(browser, "#make-plan")[0].click()
    digest = text_of(browser, "#digest")
    assert digest == sample_plan({"id": f"preview-{len(server.starter.previews)}",
                                  "runbook": "gpu-node-recovery", "params": {"node": "omen7"}})["digest"]
    assert "ansible-playbook -l omen7 playbooks/disable-swap.yml" in text_of(browser, "#step-disable-swap .command")
    assert [e.text for e in by_css(browser, "#step-disable-swap pre.diff .del")] == ["-/swap.img none swap sw 0 0"]
    assert server.starter.previews[-1] == ("gpu-node-recovery", {}, "omen7")
    assert server.starter.runs() == runs_before and not by_css(browser, "#approve")
