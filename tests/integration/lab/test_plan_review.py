"""Plan review on the lab (issue 6): the plan of gpu-node-recovery on omen2 shows the label change, the
fstab diff and the kubelet restart and changes nothing; a saved plan applies when nothing moved, and is
refused (exit 5, with the difference) after a hand relabel, after expiry, after the runbook changed or
when the file was edited."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

from engine.lab.hoststate import HostState
from tests.integration.lab.flagship_cli import LABEL, RUNBOOKS, fstab, kube_node, node_status, ready, runbook

pytestmark = [pytest.mark.integration, pytest.mark.lab]

PLAN = "plan gpu-node-recovery --node omen2"


def snapshot(lab: Any, sh: Any) -> dict[str, Any]:
    """What a plan must not change: the node in the API, the host's state, its fstab, its command log."""
    node = kube_node(sh, "omen2")
    status = node_status(sh, "omen2")
    return {"labels": node["metadata"]["labels"], "taints": node["spec"].get("taints"),
            "unschedulable": node["spec"].get("unschedulable"),
            "host": {k: status[k] for k in ("ready", "workload", "gpu_driver", "cuda_jobs_running",
                                            "cuda_jobs_killed", "swap_active")},
            "fstab": fstab(sh, "omen2"),
            "calls": HostState(lab.lab.record()["nodes"]["omen2"]["state_dir"]).calls()}


def table_rows(tokens: list[Any], header: str) -> list[list[str]]:
    """The rows of the Markdown table whose first header cell is ``header``."""
    tables: list[list[list[str]]] = []
    for t in tokens:
        if t.type == "table_open":
            tables.append([])
        elif t.type == "tr_open" and tables:
            tables[-1].append([])
        elif t.type == "inline" and tables and tables[-1] and t.map is not None:
            tables[-1][-1].append(t.content)
    return next(tb for tb in tables if tb and tb[0] and tb[0][0] == header)


def test_the_plan_shows_the_four_steps_with_their_changes_and_changes_nothing(
        incident: Any, sh: Any, tmp_path: Path) -> None:
    before = snapshot(incident, sh)
    text = runbook(sh, PLAN)
    assert text.returncode == 0, text.stdout + text.stderr
    out = text.stdout
    assert "1. [~] relabel-container (kube): label nvidia.com/gpu.workload.config: vm-passthrough -> container" in out
    assert "2. [~] swap-off (ansible): run playbook swap-off.yml on omen2 as root -- diff of /etc/fstab (-1 +1)" in out
    assert "would swapoff /swapfile on omen2" in out  # swap-off's check mode, locally reported
    # restart-kubelet has `preview: false` (its check mode only said "would restart kubelet"):
    # omen2's one GPU is on nvidia: bind-gpus is already done
    assert "3. [=] bind-gpus (ansible): no-op: already done: all 1 GPU on nvidia" in out
    assert "4. [~] restart-kubelet (ansible): run playbook restart-kubelet.yml on omen2 as root" in out
    assert "command: kubectl label node omen2 nvidia.com/gpu.workload.config=container --overwrite" in out
    assert "playbooks/restart-kubelet.yml --limit omen2 -b" in out
    assert "server dry-run accepted" in out  # the label change went through the API server's dry run
    assert "guard: label nvidia.com/gpu.workload.config = container = yes" in out  # predicted from step 1
    assert "then verify: no host CUDA process killed since the plan (within 30s)" in out
    fstab_lines = [ln.strip() for ln in out.splitlines()]
    assert "-/swapfile                                 none      swap sw              0 0" in fstab_lines
    assert "+# /swapfile                                 none      swap sw              0 0" in fstab_lines

    saved = tmp_path / "plan.json"
    md = runbook(sh, f"{PLAN} -o markdown --out {saved}")
    assert md.returncode == 0, md.stdout + md.stderr
    tokens = MarkdownIt("commonmark").enable("table").parse(md.stdout)
    rows = table_rows(tokens, "#")
    assert rows[0] == ["#", "step", "action", "decision", "what happens", "command"]
    assert [(r[1], r[3]) for r in rows[1:]] == [("relabel-container", "change"), ("swap-off", "change"),
                                               ("bind-gpus", "no-op"), ("restart-kubelet", "change")]
    assert rows[1][4] == "label nvidia.com/gpu.workload.config: vm-passthrough -> container"
    assert rows[2][4].endswith("diff of /etc/fstab (-1 +1)")
    assert rows[4][4] == "run playbook restart-kubelet.yml on omen2 as root"
    fences = [t for t in tokens if t.type == "fence"]
    diff = next(t.content for t in fences if t.info == "diff")
    assert "--- /etc/fstab" in diff and "+# /swapfile" in diff
    assert any(t.info == "mermaid" and "s_swap_off --> s_bind_gpus" in t.content
               and "s_swap_off -. requires .-> s_restart_kubelet" in t.content for t in fences)

    plan = json.loads(saved.read_text())
    assert plan["format"] == "runbook-plan/v1" and plan["state"] == "ready" and len(plan["digest"]) == 64
    assert [s["kind"] for s in plan["steps"]] == ["change", "change", "no-op", "change"]
    assert plan["steps"][0]["changes"] == [{"path": f"node.labels[{LABEL}]", "before": "vm-passthrough",
                                            "after": "container"}]
    assert "+# /swapfile" in plan["steps"][1]["preview"]
    assert plan["steps"][3]["preview"] == ""  # no check-mode run for restart-kubelet
    assert plan["depends_on"][f"node.labels[{LABEL}]"] == "vm-passthrough"
    assert plan["depends_on"]["host.swap_active"] is True
    assert len(plan["depends_on"]["baseline.host.cuda_processes"]) == 1
    assert not any("journal" in k for k in plan["depends_on"])  # volatile readings are not dependencies

    assert snapshot(incident, sh) == before  # the API, the host's state, its fstab: untouched


def test_apply_refuses_an_expired_plan_a_changed_runbook_and_an_edited_plan(
        incident: Any, sh: Any, tmp_path: Path) -> None:
    runbooks = tmp_path / "runbooks"
    shutil.copytree(RUNBOOKS, runbooks)
    before = snapshot(incident, sh)
    saved = tmp_path / "plan.json"
    assert runbook(sh, f"{PLAN} --runbooks-dir {runbooks} --expires 5m --out {saved}").returncode == 0

    edited = tmp_path / "edited.json"
    doc = json.loads(saved.read_text())
    doc["params"]["ready_timeout"] = 5
    edited.write_text(json.dumps(doc))
    r = runbook(sh, f"apply {edited} --yes --runbooks-dir {runbooks}")
    assert r.returncode == 5 and "the plan file was modified after it was made" in r.stderr, r.stderr

    with (runbooks / "gpu-node-recovery.yaml").open("a") as f:
        f.write("# a reviewer's edit after the plan was made\n")
    r = runbook(sh, f"apply {saved} --yes --runbooks-dir {runbooks}")
    assert r.returncode == 5, r.stdout + r.stderr
    assert "runbook gpu-node-recovery changed since the plan was made" in r.stderr

    expiring = tmp_path / "expiring.json"
    assert runbook(sh, f"{PLAN} --expires 1s --out {expiring}").returncode == 0
    time.sleep(1.1)
    r = runbook(sh, f"apply {expiring} --yes")
    assert r.returncode == 5 and "the plan expired at" in r.stderr, r.stderr
    assert snapshot(incident, sh) == before


def test_a_saved_plan_applies_cleanly_when_nothing_changed(fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    saved = tmp_path / "plan.json"
    assert runbook(sh, f"{PLAN} --out {saved}").returncode == 0
    digest = json.loads(saved.read_text())["digest"]
    r = runbook(sh, f"apply {saved} --yes -o json", journal=tmp_path / "journal.sqlite")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout)
    assert result["state"] == "succeeded" and result["plan_digest"] == digest
    node = kube_node(sh, "omen2")
    assert ready(node) and node["metadata"]["labels"][LABEL] == "container"


def test_apply_refuses_a_plan_when_omen2_was_relabelled_by_hand(fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    saved = tmp_path / "plan.json"
    assert runbook(sh, f"{PLAN} --out {saved}").returncode == 0
    assert sh(f"kubectl label node omen2 {LABEL}=container --overwrite").returncode == 0
    r = runbook(sh, f"apply {saved} --yes", journal=tmp_path / "journal.sqlite")
    assert r.returncode == 5, r.stdout + r.stderr
    assert f"node omen2 label {LABEL}: planned vm-passthrough, now container" in r.stderr
    assert node_status(sh, "omen2")["swap_active"] is True  # nothing was applied
