"""`preview: facts`: the engine's models of swap-off.yml and gpu-bind-driver.yml (what a plan shows
without a check-mode run), the fstab rule they share with the playbook, when they decline, the
loader refusing the option where no model exists, and a plan of the flagship making no check-mode
run. Whether each model says what the playbook's check mode says on a real host:
tests/integration/test_playbook_previews.py."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from engine import playbook_previews as pp
from engine.errors import LoadError
from engine.facts import GpuDevice, HostFacts, SwapDevice
from engine.loader import load
from engine.params import prepare_run
from engine.runs import plan_targets
from tests.fakes import FakeKube, FakeNodes
from tests.fakes.incident import incident_host, incident_node

REPO = Path(__file__).resolve().parents[2]
FSTAB = ("# /etc/fstab\nUUID=1 / ext4 defaults 0 1\n/swapfile none swap sw 0 0\n"
         "LABEL=spare none swap noauto 0 0\n#/dev/sda3 none swap sw 0 0\n")
GPU = GpuDevice("01:00.0", "10de:2204", "GA102 [GeForce RTX 3090]", "nvidia")


def host(**kw: object) -> HostFacts:
    base = HostFacts(host="omen2", swap_devices=(SwapDevice("/swapfile", "file", 1 << 30),),
                     fstab=FSTAB, gpus=(GPU,), driverctl=True)
    return replace(base, **kw)  # type: ignore[arg-type]


def test_the_fstab_rule_is_the_playbooks_regexp_character_for_character() -> None:
    play = yaml.safe_load((REPO / "playbooks" / "swap-off.yml").read_text())[0]
    tasks = [t for block in play["tasks"] for t in block.get("block", [])]
    (replace_task,) = [t["ansible.builtin.replace"] for t in tasks if "ansible.builtin.replace" in t]
    assert replace_task["regexp"] == pp.SWAP_OFF_FSTAB_REGEXP
    assert replace_task["replace"] == pp.SWAP_OFF_FSTAB_REPLACE


def test_swap_off_says_the_devices_and_the_fstab_diff_and_leaves_noauto_and_comments() -> None:
    text = pp.swap_off(host(), {})
    assert text is not None
    lines = text.splitlines()
    assert lines[:3] == ["check mode: would change:",
                         "Report the swap devices to turn off (check mode): would swapoff /swapfile on omen2",
                         "Comment out active swap entries in fstab: 1 replacements made"]
    assert "-/swapfile none swap sw 0 0" in lines and "+# /swapfile none swap sw 0 0" in lines
    changed = [ln for ln in lines[3:] if ln[:1] in "+-" and not ln.startswith(("---", "+++"))]
    assert len(changed) == 2  # the noauto entry and the commented one are not touched


def test_swap_off_with_nothing_to_do_says_no_changes() -> None:
    clean = "UUID=1 / ext4 defaults 0 1\n# /swapfile none swap sw 0 0\n"
    assert pp.swap_off(host(swap_devices=(), fstab=clean), {}) == "check mode: no changes"


def test_swap_off_refuses_swap_it_cannot_keep_off_like_the_playbook() -> None:
    text = pp.swap_off(host(unhandled_swap_sources=("zram device /dev/zram0",)), {})
    assert text is not None and text.startswith("check mode: failed (nothing changed)")
    assert "zram device /dev/zram0" in text


@pytest.mark.parametrize("facts_vars", [
    (dict(fstab=None), {}),  # the probe could not read /etc/fstab
    ({}, {"swap_off_fstab": "/etc/other"}),  # a variable the model does not know
])
def test_swap_off_declines_when_it_cannot_say(facts_vars: tuple[dict[str, object], dict[str, object]]) -> None:
    changes, variables = facts_vars
    assert pp.swap_off(host(**changes), variables) is None
    assert pp.swap_off(host(), {"backup": False}) is not None  # backup changes no effect shown


def test_gpu_bind_driver_names_each_gpu_not_on_the_driver_with_its_domain() -> None:
    gpus = (GPU, replace(GPU, slot="41:00.0", driver="vfio-pci"), replace(GPU, slot="0001:c1:00.0", driver="none"))
    assert pp.gpu_bind_driver(host(gpus=gpus), {"driver": "nvidia"}) == (
        "check mode: would change:\nReport the planned binding (check mode): would bind 0000:41:00.0, "
        "0001:c1:00.0 to nvidia on omen2")
    assert pp.gpu_bind_driver(host(), {"driver": "nvidia"}) == "check mode: no changes"


def test_gpu_bind_driver_refuses_without_a_gpu_or_without_driverctl_and_declines_when_unprobed() -> None:
    no_gpu = pp.gpu_bind_driver(host(gpus=()), {})
    assert no_gpu is not None and no_gpu.startswith("check mode: failed") and "no NVIDIA display function" in no_gpu
    on_vfio = (replace(GPU, driver="vfio-pci"),)
    missing = pp.gpu_bind_driver(host(gpus=on_vfio, driverctl=False), {})
    assert missing is not None and "driverctl is not installed" in missing
    assert pp.gpu_bind_driver(host(gpus=(GPU,), driverctl=False), {}) == "check mode: no changes"
    assert pp.gpu_bind_driver(host(driverctl=None), {}) is None  # facts of an older probe
    assert pp.preview("restart-kubelet.yml", host(), {}) is None  # no model


def test_the_loader_refuses_preview_facts_on_a_playbook_without_a_model(tmp_path: Path) -> None:
    (tmp_path / "runbooks").mkdir()
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "example-touch-file.yml").write_text("- hosts: all\n  tasks: []\n")
    text = (REPO / "runbooks" / "example-label-and-file.yaml").read_text()
    assert "playbook: example-touch-file.yml" in text
    text = text.replace("playbook: example-touch-file.yml",
                        "playbook: example-touch-file.yml\n        preview: facts", 1)
    (tmp_path / "runbooks" / "example-label-and-file.yaml").write_text(text)
    with pytest.raises(LoadError) as e:
        load("example-label-and-file", tmp_path / "runbooks")
    assert "preview: facts" in str(e.value) and "'example-touch-file.yml' has none" in str(e.value)
    assert ".preview" in str(e.value)  # located at the option


def test_the_loader_refuses_preview_facts_on_a_playbook_of_the_same_name_that_is_not_the_shipped_one(
        tmp_path: Path) -> None:
    shutil.copytree(REPO / "playbooks", tmp_path / "playbooks")
    (tmp_path / "runbooks").mkdir()
    shutil.copy(REPO / "runbooks" / "gpu-node-recovery.yaml", tmp_path / "runbooks")
    load("gpu-node-recovery", tmp_path / "runbooks")  # a byte-for-byte copy is the shipped playbook
    own = tmp_path / "playbooks" / "swap-off.yml"
    own.write_text(own.read_text().replace("swap(?![ \\t]+", "swap(?![ \\t]*", 1))
    with pytest.raises(LoadError) as e:
        load("gpu-node-recovery", tmp_path / "runbooks")
    assert "preview: facts models the shipped swap-off.yml" in str(e.value) and str(own) in str(e.value)


def test_a_plan_of_the_flagship_makes_one_facts_run_and_no_check_mode_run() -> None:
    kube = FakeKube([incident_node()])
    facts = replace(incident_host(), fstab="UUID=1 / ext4 defaults 0 1\n/swapfile none swap sw 0 0\n", driverctl=True)
    nodes = FakeNodes({"omen2": facts})
    prepared = prepare_run(load("gpu-node-recovery", REPO / "runbooks"), {}, node="omen2")
    (plan,) = plan_targets([prepared], kube, nodes)
    assert [r for r in nodes.runs if r["check"]] == []  # no ansible-playbook --check
    assert len(nodes.gathers) == 1
    swap_off = plan.step("swap-off")
    assert swap_off.kind == "change"
    assert swap_off.preview == pp.swap_off(facts, {})
    assert "+# /swapfile none swap sw 0 0" in swap_off.preview
    assert plan.step("bind-gpus").kind == "no-op"  # on nvidia already: no preview needed


def test_without_the_fstab_fact_the_plan_falls_back_to_check_mode() -> None:
    kube = FakeKube([incident_node()])
    nodes = FakeNodes({"omen2": incident_host()})  # fstab unknown
    prepared = prepare_run(load("gpu-node-recovery", REPO / "runbooks"), {}, node="omen2")
    (plan,) = plan_targets([prepared], kube, nodes)
    assert [r["playbook"] for r in nodes.runs if r["check"]] == ["swap-off.yml"]
    assert plan.step("swap-off").preview.startswith("check mode")
