"""A user's own Ansible inventory on the lab: an INI file with a host range, ``group_vars/all.yml`` and
``host_vars/<host>.yml``, one host named differently from its node (``k8s_node_name`` in its host_vars).
A plan and a run through it are the ones the lab's generated YAML inventory gives (issue 13, part 2), and
runbook reads the inventory once per command (an inventory script in the folder logs who reads it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.lab.hoststate import HostState
from tests.integration.lab.flagship_cli import LABEL, cuda_pids, kube_node, node_status, ready, runbook

pytestmark = [pytest.mark.integration, pytest.mark.lab]

RENAMED = {"omen2": "rtx5090-box"}  # node -> the inventory host that runs it (by k8s_node_name)
FLEET = "-l feature.node.kubernetes.io/pci-10de.present=true"


def ini_inventory(lab_inventory: Path, folder: Path) -> Path:
    """The lab's generated YAML inventory, rewritten as a team would keep it: INI hosts (the three
    gpu-3090-N as one range), connection settings in group_vars/all.yml, each host's address and
    become password in host_vars/<host>.yml, omen2 run by the host ``rtx5090-box``."""
    generated = yaml.safe_load(lab_inventory.read_text())["all"]
    hosts: dict[str, dict[str, Any]] = generated["hosts"]
    ranged = sorted(h for h in hosts if re.fullmatch(r"gpu-3090-\d", h))
    assert ranged == ["gpu-3090-1", "gpu-3090-2", "gpu-3090-3"] and set(hosts) == {*ranged, *RENAMED}, hosts
    folder.mkdir(mode=0o700)
    (folder / "hosts.ini").write_text(
        "# the lab's node hosts, as a user's own INI inventory\n"
        "[gpu]\n" + "".join(f"{host}\n" for host in RENAMED.values()) + "gpu-3090-[1:3]\n\n"
        "[gpu:vars]\nrunbook_example_group_var=1\n")
    (folder / "group_vars").mkdir()
    (folder / "group_vars" / "all.yml").write_text(yaml.safe_dump(generated["vars"]))
    (folder / "host_vars").mkdir(mode=0o700)
    for name, entry in hosts.items():
        host = RENAMED.get(name, name)
        host_vars = {k: v for k, v in entry.items() if k != "k8s_node_name"}
        if host != name:
            host_vars["k8s_node_name"] = name
        path = folder / "host_vars" / f"{host}.yml"
        path.touch(mode=0o600)  # it holds the become password, as the generated inventory does
        path.write_text(yaml.safe_dump(host_vars))
    # one more source, an executable script with no hosts: it logs which process reads the inventory
    script = folder / "zz-reads.sh"
    script.write_text("#!/bin/sh\n"
                      f"tr '\\0' ' ' < /proc/$PPID/cmdline >> '{reads_log(folder)}'\n"
                      f"echo >> '{reads_log(folder)}'\n"
                      "echo '{\"_meta\": {\"hostvars\": {}}}'\n")
    script.chmod(0o755)
    return folder


def reads_log(inventory: Path) -> Path:
    return inventory.parent / f"{inventory.name}-reads.log"  # outside: Ansible would try to parse it


def runbook_reads(inventory: Path) -> int:
    """How often runbook itself read the inventory (not counting ansible-playbook's own reads)."""
    log = reads_log(inventory)
    lines = log.read_text().splitlines() if log.exists() else []
    return sum("ansible.cli.inventory" in line for line in lines)


def comparable(plans: list[dict[str, Any]], inventory: Path) -> list[dict[str, Any]]:
    """What a plan decides, with the inventory's own names (its path, renamed hosts) taken out; the
    observations that move with time (journal lines, timestamps) left out."""
    def same(text: str) -> str:
        text = text.replace(str(inventory), "INVENTORY")
        for node, host in RENAMED.items():
            text = re.sub(rf"(?<![\w-]){re.escape(host)}(?![\w-])", node, text)
        return text

    out = []
    for p in sorted(plans, key=lambda p: p["node"]):
        out.append({
            "node": p["node"], "inventory_host": same(p["inventory_host"]), "state": p["state"],
            "params": p["params"], "approval": p["approval"],
            "preconditions": [(c["id"], c["applies"], c["holds"]) for c in p["preconditions"]],
            "steps": [(s["id"], s["kind"], s["action"], same(s["summary"]), same(s["reason"]), same(s["command"]),
                       s["changes"]) for s in p["steps"]],
            "depends_on": p["depends_on"],
        })
    return out


def plans_of(result: Any) -> list[dict[str, Any]]:
    doc = json.loads(result.stdout)
    return list(doc["plans"]) if isinstance(doc, dict) and "plans" in doc else [doc]


def test_a_fleet_plan_through_an_ini_inventory_with_a_range_and_host_vars_is_the_generated_yaml_ones(
        incident: Any, sh: Any, tmp_path: Path) -> None:
    generated = Path(incident.lab.record()["inventory"])
    ini = ini_inventory(generated, tmp_path / "inventory")
    journal = tmp_path / "journal.sqlite"

    through_yaml = runbook(sh, f"plan gpu-node-recovery {FLEET} -o json", journal=journal)
    through_ini = runbook(sh, f"plan gpu-node-recovery {FLEET} -o json -i {ini}", journal=journal)

    assert through_ini.returncode == through_yaml.returncode, through_ini.stdout + through_ini.stderr
    assert through_ini.returncode in (0, 3), through_ini.stdout + through_ini.stderr  # 3: two nodes blocked
    yaml_plans, ini_plans = plans_of(through_yaml), plans_of(through_ini)
    assert sorted(p["node"] for p in ini_plans) == ["gpu-3090-1", "gpu-3090-2", "gpu-3090-3", "omen2"]
    hosts = {p["node"]: p["inventory_host"] for p in ini_plans}
    assert hosts == {"omen2": "rtx5090-box", "gpu-3090-1": "gpu-3090-1", "gpu-3090-2": "gpu-3090-2",
                     "gpu-3090-3": "gpu-3090-3"}
    omen2 = next(p for p in ini_plans if p["node"] == "omen2")
    assert omen2["state"] == "ready"
    assert omen2["baseline"]["host"]["swap_active"] is True  # facts read over SSH through the INI inventory
    assert all("--limit rtx5090-box" in s["command"] for s in omen2["steps"] if s["action"] == "ansible")
    assert comparable(ini_plans, ini) == comparable(yaml_plans, generated)
    assert runbook_reads(ini) == 1  # one inventory read for the whole fleet's plan


@pytest.mark.timeout(1200)  # a full recovery on a loaded CI machine
def test_a_run_through_the_ini_inventory_recovers_omen2_run_by_a_host_of_another_name(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    ini = ini_inventory(Path(fresh_lab.lab.record()["inventory"]), tmp_path / "inventory")
    journal = tmp_path / "journal.sqlite"
    state_dir = fresh_lab.lab.record()["nodes"]["omen2"]["state_dir"]
    pids_before = cuda_pids(sh, "omen2")
    assert HostState(state_dir).calls("swapoff") == []

    r = runbook(sh, f"run gpu-node-recovery --node omen2 --yes -o json -i {ini}", journal=journal)

    assert r.returncode == 0, r.stdout + r.stderr
    assert runbook_reads(ini) == 1  # plan, previews, run and verification: one inventory read
    assert "ansible-playbook" in reads_log(ini).read_text()  # the log sees the playbooks' own reads too
    result = json.loads(r.stdout)
    assert result["state"] == "succeeded"
    outcomes = {o["step"]: o["status"] for o in result["outcomes"]}
    assert (outcomes["relabel-container"], outcomes["swap-off"]) == ("succeeded", "succeeded")
    # the lab's kubelet may come back by itself once swap is off: the step then holds already
    assert outcomes["restart-kubelet"] in ("succeeded", "skipped")
    node = kube_node(sh, "omen2")
    assert ready(node) and node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    assert node["metadata"]["labels"][LABEL] == "container"
    status = node_status(sh, "omen2")
    assert (status["swap_active"], status["kubelet"], status["cuda_jobs_killed"]) == (False, "active", 0)
    assert cuda_pids(sh, "omen2") == pids_before
    assert HostState(state_dir).calls("swapoff")  # the playbooks reached omen2's own host
    shown = json.loads(runbook(sh, f"runs show {result['run_id']} -o json", journal=journal).stdout)
    assert shown["plan"]["inventory_host"] == "rtx5090-box"  # the host named in the INI inventory
    assert "--limit rtx5090-box" in json.dumps(shown)
