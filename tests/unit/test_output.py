"""Rendering plans for terminals, machines and tickets; run history with the digests to approve."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt

from engine import output, probes
from engine.loader import load_runbook
from engine.model import Plan
from engine.planning import plan_run, with_previews
from tests.fakes import FakeKube, FakeNodes, incident_host, incident_node

DATA = Path(__file__).parent / "data"
RUNBOOK = load_runbook(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=DATA / "playbooks")
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)
FSTAB_DIFF = """--- /etc/fstab
+++ /etc/fstab
@@ -1,2 +1,2 @@
 UUID=5b1f / ext4 errors=remount-ro 0 1
-/swapfile none swap sw 0 0
+# /swapfile none swap sw 0 0"""
RESTART = ("check mode: would change:\n"
           "Report the planned restart (check mode): would restart kubelet on omen2")


@pytest.fixture(scope="module")
def plan() -> Plan:
    kube, nodes = FakeKube([incident_node()]), FakeNodes({"omen2": incident_host()})
    params = {"node": "omen2", "workload": "container", "ready_timeout": 180}
    p = plan_run(RUNBOOK, params, probes.gather(RUNBOOK, params, "omen2", kube, nodes),
                 runbook_digest="d" * 64, now=NOW)
    return with_previews(p, {"relabel-container": "server dry-run accepted: label ...", "swap-off": FSTAB_DIFF,
                             "restart-kubelet": RESTART})


def test_preview_gists_say_what_a_playbook_step_will_change() -> None:
    assert output.preview_gist(FSTAB_DIFF) == "diff of /etc/fstab (-1 +1)"
    assert output.preview_gist(RESTART) == "would restart kubelet on omen2"
    assert output.preview_gist("server dry-run accepted: label a -> b") == "server dry-run accepted"
    assert output.preview_gist("") == ""


def test_text_lists_each_step_with_its_change_command_guards_verifications_and_preview(plan: Plan) -> None:
    text = output.plan_text(plan)
    assert "1. [~] relabel-container (kube): label nvidia.com/gpu.workload.config: vm-passthrough -> container" in text
    assert "2. [~] swap-off (ansible): run playbook swap-off.yml on omen2 as root -- diff of /etc/fstab (-1 +1)" in text
    assert "would restart kubelet on omen2" in text
    assert "command: kubectl label node omen2 nvidia.com/gpu.workload.config=container --overwrite" in text
    assert "guard: label nvidia.com/gpu.workload.config = container = yes" in text
    assert "then verify: node is Ready (within 180s)" in text
    assert "-/swapfile none swap sw 0 0" in text and "\x1b[" not in text


def test_text_is_coloured_only_when_asked(plan: Plan) -> None:
    coloured = output.plan_text(plan, color=True)
    assert "\x1b[33m[~]\x1b[0m" in coloured and "\x1b[31m-/swapfile" in coloured
    assert output.render_plans([plan], "text", color=False) == output.plan_text(plan)


def test_json_is_the_plan_model_and_round_trips(plan: Plan) -> None:
    doc = json.loads(output.render_plans([plan], "json"))
    assert doc["format"] == "runbook-plan/v1" and doc["digest"] == plan.digest
    assert Plan.model_validate(doc) == plan
    assert set(doc) >= {"runbook", "runbook_digest", "params", "node", "created_at", "expires_at", "state",
                        "preconditions", "steps", "depends_on", "baseline", "probe_errors", "digest"}
    two = json.loads(output.render_plans([plan, plan], "json"))
    assert list(two) == ["plans"] and len(two["plans"]) == 2


def _tokens(markdown: str) -> list[Any]:
    return MarkdownIt("commonmark").enable("table").parse(markdown)


def test_markdown_parses_into_a_step_table_diffs_and_a_step_order_diagram(plan: Plan) -> None:
    md = output.plan_markdown(plan)
    tokens = _tokens(md)
    fences = {t.info: t.content for t in tokens if t.type == "fence"}
    assert "-/swapfile none swap sw 0 0" in fences["diff"]
    assert "would restart kubelet on omen2" in fences["text"]
    assert "s_relabel_container --> s_swap_off" in fences["mermaid"]
    rows: list[list[str]] = []
    row: list[str] = []
    in_table = False
    for t in tokens:
        if t.type == "table_open":
            in_table, rows = True, []
        elif t.type == "table_close" and in_table:
            if rows and rows[0][:2] == ["#", "step"]:
                break
            in_table = False
        elif t.type == "tr_open":
            row = []
        elif t.type == "tr_close":
            rows.append(row)
        elif t.type == "inline" and in_table:
            row.append(t.content)
    assert rows[0] == ["#", "step", "action", "decision", "what happens", "command"]
    assert [r[1] for r in rows[1:]] == ["relabel-container", "swap-off", "restart-kubelet"]
    assert rows[1][4] == "label nvidia.com/gpu.workload.config: vm-passthrough -> container"
    assert rows[2][4].endswith("diff of /etc/fstab (-1 +1)")
    assert rows[3][4].endswith("would restart kubelet on omen2")


def test_markdown_cells_escape_pipes() -> None:
    assert output._cell("a | b\nc") == "a \\| b c"


class _Run:
    def __init__(self, state: str, digest: str, *, created: float = 1_000_000.0,
                 nodes: tuple[str, ...] = ("omen2",)) -> None:
        self.id, self.runbook, self.nodes, self.state, self.plan_digest = "r-1", "gpu-node-recovery", list(nodes), \
            state, digest
        self.created = created

    def summary(self) -> dict[str, Any]:
        return {"started": "2026-07-10T15:40:00Z", "finished": None, "exit_code": 1, "source": "cli",
                "approved_by": None, "params": {"node": self.nodes[0]}}


def test_runs_shows_runbook_node_phase_and_age_as_kubectl_get_rr_does() -> None:
    runs = [_Run("waiting-approval", "a" * 64, created=1_000_000.0 - 330), _Run("interrupted", ""),
            _Run("failed", "", created=1_000_000.0 - 3 * 86400 - 4 * 3600, nodes=("omen3", "omen4"))]
    lines = output.runs_text(runs, now=1_000_000.0).splitlines()  # type: ignore[arg-type]
    assert lines[0].split()[:5] == ["ID", "RUNBOOK", "NODE", "PHASE", "AGE"]
    assert [line.split()[1:5] for line in lines[1:]] == [
        ["gpu-node-recovery", "omen2", "WaitingApproval", "5m30s"],
        ["gpu-node-recovery", "omen2", "Interrupted", "0s"],
        ["gpu-node-recovery", "omen3", "Failed", "3d4h"]]
    wide = output.runs_text(runs, wide=True, now=1_000_000.0).splitlines()  # type: ignore[arg-type]
    assert "STATE" in wide[0].split() and "interrupted" in wide[2].split() and "omen3,omen4" in wide[3]


def test_ages_read_like_kubectl_ages() -> None:
    cases = {0: "0s", 119: "119s", 120: "2m", 150: "2m30s", 600: "10m", 3 * 3600 - 1: "179m", 3 * 3600: "3h",
             7 * 3600 + 60: "7h1m", 47 * 3600: "47h", 2 * 86400: "2d", 9 * 86400: "9d", 800 * 86400: "2y70d"}
    assert {s: output.age(s) for s in cases} == cases


def test_runs_waiting_for_approval_show_the_whole_digest_to_approve() -> None:
    digest = "a" * 64
    text = output.runs_text([_Run("waiting-approval", digest), _Run("succeeded", "b" * 64)])  # type: ignore[list-item]
    assert digest in text and "b" * 12 not in text
    assert "PLAN DIGEST (to approve)" in text.splitlines()[0]


SHIPPED_DIR = Path(__file__).resolve().parents[2]
SHIPPED = load_runbook(SHIPPED_DIR / "runbooks" / "gpu-node-recovery.yaml", playbooks_dir=SHIPPED_DIR / "playbooks")


def test_the_shipped_flagships_plan_reads_relabel_then_swap_off_then_a_guarded_restart_with_the_cuda_check() -> None:
    kube, nodes = FakeKube([incident_node()]), FakeNodes({"omen2": incident_host(cuda=1)})
    params = {"node": "omen2", "workload": "container", "ready_timeout": 120, "gpu_timeout": 180}
    plan = plan_run(SHIPPED, params, probes.gather(SHIPPED, params, "omen2", kube, nodes),
                    runbook_digest="d" * 64, now=NOW)
    lines = [ln.strip() for ln in output.plan_text(plan).splitlines()]
    assert [ln for ln in lines if ln[:3] in ("1. ", "2. ", "3. ", "4. ")] == [
        "1. [~] relabel-container (kube): label nvidia.com/gpu.workload.config: vm-passthrough -> container",
        "2. [~] swap-off (ansible): run playbook swap-off.yml on omen2 as root",
        "3. [=] bind-gpus (ansible): no-op: already done: all 1 GPU on nvidia",
        "4. [~] restart-kubelet (ansible): run playbook restart-kubelet.yml on omen2 as root",
    ]
    restart = lines[lines.index("4. [~] restart-kubelet (ansible): run playbook restart-kubelet.yml on omen2 as root"):]
    assert [ln for ln in restart if ln.startswith(("guard:", "then verify:"))] == [
        "guard: label nvidia.com/gpu.workload.config = container = yes "
        "(label nvidia.com/gpu.workload.config=container)",
        "guard: swap is off = yes (swap off)",
        "then verify: service kubelet is active (within 60s)",
        "then verify: node is Ready (within 120s)",
        "then verify: allocatable nvidia.com/gpu equals the host's NVIDIA GPUs (within 180s)",
        "then verify: label nvidia.com/gpu.workload.config = container (within 60s)",
        "then verify: every GPU's driver is nvidia (within 30s)",
        "then verify: no host CUDA process killed since the plan (within 30s)",
    ]
    assert [p["pid"] for p in plan.baseline["host"]["cuda_processes"]] == [1000]  # the job the check protects
