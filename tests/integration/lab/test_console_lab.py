"""The web console on the lab: a real ``runbook serve`` (subprocess, real journal, real planning over
SSH) pages an approve-mode run for omen2; headless Chromium logs in as alice, sees the run waiting
with the fstab diff and the digest, approves it in the page, and follows it live — no reload —
until it succeeded, then omen2 is Ready through the real API. And a plan requested on the plans page
for omen2 is the real plan (relabel, the fstab diff) and changes nothing: not the node in the API, not
the host, its fstab or its command log, not the journal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.lab.serve_helpers import APPROVERS, serving
from tests.integration.lab.test_plan_review import snapshot
from tests.integration.lab.test_serve_lab import PLAN_TIMEOUT, RUN_TIMEOUT, omen2_alert, omen2_recovered, started
from tests.integration.test_console_browser import browser, login, status_of, text_of, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab, pytest.mark.timeout(900)]
__all__ = ["browser"]  # the module-scoped headless Chromium fixture


def test_a_paged_run_is_approved_in_the_browser_and_followed_live_until_omen2_is_ready(
        fresh_lab: Any, sh: Any, browser: Any, tmp_path: Path) -> None:
    with serving(fresh_lab.env(), tmp_path) as server:
        run_id = started(server.alert(omen2_alert()))["run_id"]
        run = server.wait_state(run_id, ("waiting-approval",), PLAN_TIMEOUT)
        login(browser, server.url, APPROVERS["alice"])
        row = wait_for(browser, lambda d: d.find_elements("css selector", f"tr.run[data-run='{run_id}']"),
                       what="the waiting run in the list")[0]
        assert row.find_element("css selector", ".state").text == "waiting-approval"
        browser.get(f"{server.url}/ui/runs/{run_id}")
        assert text_of(browser, "#digest") == run["plan_digest"]
        diff = " ".join(e.text for e in browser.find_elements("css selector", "pre.diff .del, pre.diff .add"))
        assert "/etc/fstab" in text_of(browser, "#h-steps ~ ol") and "swap" in diff
        browser.find_element("css selector", "#approve").click()
        wait_for(browser, lambda d: d.find_elements("css selector", "#notice"), what="approval notice")
        browser.execute_script("window.__sameDocument = 'yes'")
        wait_for(browser, lambda d: status_of(d, "relabel-container") in ("running", "succeeded"),
                 timeout=RUN_TIMEOUT, what="first step under way, live")
        wait_for(browser, lambda d: text_of(d, "#state") == "succeeded", timeout=RUN_TIMEOUT,
                 what="run succeeded, live")
        assert browser.execute_script("return window.__sameDocument") == "yes"  # followed without a reload
        assert [status_of(browser, s) for s in ("relabel-container", "swap-off")] == ["succeeded"] * 2
        # restart-kubelet's skip_if: skipped when all it would verify already holds (kubelet came back)
        assert status_of(browser, "restart-kubelet") in ("succeeded", "skipped")
        assert "step.outcome" in text_of(browser, "#timeline")
        assert text_of(browser, "#approved-by") == "alice"
        assert server.run(run_id)["approved_by"] == "alice"
    omen2_recovered(fresh_lab, sh)


def test_a_plan_requested_in_the_browser_is_the_real_plan_and_changes_nothing_on_the_lab(
        incident: Any, sh: Any, browser: Any, tmp_path: Path) -> None:
    before = snapshot(incident, sh)
    with serving(incident.env(), tmp_path) as server:
        login(browser, server.url, APPROVERS["alice"])
        browser.get(f"{server.url}/ui/plans")
        browser.find_element("css selector", "#p-runbook option[value='gpu-node-recovery']").click()
        browser.find_element("css selector", "#p-node").send_keys("omen2")
        browser.find_element("css selector", "#make-plan").click()
        wait_for(browser, lambda d: d.find_elements("css selector", "#digest"), timeout=PLAN_TIMEOUT,
                 what="the plan of gpu-node-recovery on omen2")
        assert len(text_of(browser, "#digest")) == 64
        assert text_of(browser, "#plan-state") == "ready"
        assert "vm-passthrough → container" in text_of(browser, "#step-relabel-container")
        diff = [e.text for e in browser.find_elements("css selector", "#step-swap-off pre.diff .del, "
                                                                      "#step-swap-off pre.diff .add")]
        assert any(line.startswith("-/swapfile") for line in diff)
        assert any(line.startswith("+# /swapfile") for line in diff)
        assert server.runs() == []  # planning from the page records no run in the journal
    assert snapshot(incident, sh) == before  # the API, the host's state, its fstab, its command log
