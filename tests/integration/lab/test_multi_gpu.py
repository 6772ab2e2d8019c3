"""A node with four GPUs (engine/lab/scenarios/multi-gpu.yaml) on a lab of its own, shared by the module.

gpu-quad is down for swap under vm-passthrough with mixed GPU bindings: 01:00.0 (RTX 5090, a CUDA job)
and 41:00.0 (RTX 3090, a CUDA job) on nvidia, 02:00.0 (RTX 5090) left on vfio-pci, c1:00.0 (RTX 4090)
without a driver.

* The flagship brings every GPU back on nvidia (its guarded bind step), verifies that each GPU is on
  nvidia and that allocatable nvidia.com/gpu equals the host's GPUs (4), and kills neither CUDA job
  (read from the host: the same pids; the shims' call log shows driverctl for the two GPUs only).
* gpu-workload-switch moves all four GPUs to vm-passthrough (each model's resource advertised) and
  back to container (all four on nvidia, nvidia.com/gpu = 4).
* The lab itself, recovered by hand without binding: once kubelet is back under container,
  vfio-manager's preStop leaves 02:00.0 without a driver and both CUDA jobs on the other GPUs live.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.lab.assets import find_assets
from engine.lab.hoststate import HostState
from engine.lab.manager import Lab
from engine.lab.nodehosts import node_host_prerequisite_problems
from tests.integration.lab.flagship_cli import LABEL, cuda_pids, host_lines, kube_node, node_status, ready, runbook
from tests.integration.lab.lab_helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

SCENARIO = Path(__file__).resolve().parents[3] / "engine" / "lab" / "scenarios" / "multi-gpu.yaml"
NODE = "gpu-quad"
SLOTS = ("01:00.0", "02:00.0", "41:00.0", "c1:00.0")
BUDGET = " --override-guard gpu-budget --reason 'lab: gpu-quad is the only GPU node'"


@pytest.fixture(scope="module")
def quad(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    problems = node_host_prerequisite_problems()
    if find_assets() is None:
        problems.append("no control-plane binaries (bash scripts/build-control-plane.sh)")
    problems += [f"no {tool} on PATH" for tool in ("kubectl", "ansible") if shutil.which(tool) is None]
    if problems:
        pytest.skip("; ".join(problems))
    lab = Lab(tmp_path_factory.mktemp("quad-lab"))
    lab.up(SCENARIO, timeout=240)
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture
def qsh(quad: Lab, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess[str]]:
    home = tmp_path_factory.mktemp("quad-home")
    env = {**os.environ, **quad.env(), "HOME": str(home), "ANSIBLE_HOME": str(home / "ansible"),
           "ANSIBLE_LOCAL_TEMP": str(home / "ansible-tmp"), "ANSIBLE_NOCOLOR": "1"}

    def run(command: str, check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{command!r} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    return run


def drivers(sh: Any) -> dict[str, str]:
    return {g["slot"]: g["driver"] for g in node_status(sh, NODE)["gpus"]}


def recovered(sh: Any, journal: Path) -> None:
    """gpu-quad recovered by the flagship (the first test does it; run again when it ran alone)."""
    if not ready(kube_node(sh, NODE)) or set(drivers(sh).values()) != {"nvidia"}:
        r = runbook(sh, f"run gpu-node-recovery --node {NODE} --yes", journal=journal)
        assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(1200)  # a lab of its own and one recovery; minutes on a loaded CI machine
def test_the_flagship_brings_every_gpu_of_a_four_gpu_node_back_on_nvidia_and_kills_no_cuda_job(
        quad: Lab, qsh: Any, tmp_path: Path) -> None:
    assert drivers(qsh) == {"01:00.0": "nvidia", "02:00.0": "vfio-pci", "41:00.0": "nvidia", "c1:00.0": "none"}
    pids_before = cuda_pids(qsh, NODE)
    assert len(pids_before) == 2
    host = HostState(quad.record()["nodes"][NODE]["state_dir"])
    calls_before = len(host.calls())

    r = runbook(qsh, f"run gpu-node-recovery --node {NODE} --yes -o json", journal=tmp_path / "journal.sqlite")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout)
    bind = next(o for o in result["outcomes"] if o["step"] == "bind-gpus")
    assert bind["status"] == "succeeded", bind

    node = kube_node(qsh, NODE)
    assert ready(node) and node["metadata"]["labels"][LABEL] == "container"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    assert drivers(qsh) == dict.fromkeys(SLOTS, "nvidia")
    status = node_status(qsh, NODE)
    assert (status["cuda_jobs_running"], status["cuda_jobs_killed"]) == (2, 0)
    assert cuda_pids(qsh, NODE) == pids_before  # the same two jobs, on their own GPUs
    binds = [c["argv"] for c in host.calls()[calls_before:] if c["cmd"] == "driverctl"]
    assert sorted(a[-2] for a in binds) == ["0000:02:00.0", "0000:c1:00.0"]  # only the GPUs off nvidia
    assert "GPUs on nvidia: 4 of 4" in result["report"]


@pytest.mark.timeout(1500)  # four runs of the switch on a loaded CI machine
def test_gpu_workload_switch_moves_all_four_gpus_to_passthrough_and_back(
        quad: Lab, qsh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    recovered(qsh, journal)
    to_vm = f"run gpu-workload-switch --node {NODE} -p workload=vm-passthrough --yes" + BUDGET

    # the job on the 3090 alone blocks the switch: vfio-manager takes every GPU
    assert runbook(qsh, f"lab job stop {NODE} --gpu 01:00.0").returncode == 0
    refused = runbook(qsh, to_vm, journal=journal)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "pid 41001 (train.py)" in " ".join(refused.stdout.split())
    assert drivers(qsh) == dict.fromkeys(SLOTS, "nvidia")

    assert runbook(qsh, f"lab job stop {NODE}").returncode == 0
    done = runbook(qsh, to_vm, journal=journal)
    assert done.returncode == 0, done.stdout + done.stderr
    assert drivers(qsh) == dict.fromkeys(SLOTS, "vfio-pci")
    alloc = kube_node(qsh, NODE)["status"]["allocatable"]
    assert (alloc["nvidia.com/GB202_GEFORCE_RTX_5090"], alloc["nvidia.com/GA102_GEFORCE_RTX_3090"],
            alloc["nvidia.com/AD102_GEFORCE_RTX_4090"], alloc.get("nvidia.com/gpu", "0")) == ("2", "1", "1", "0")

    back = runbook(qsh, f"run gpu-workload-switch --node {NODE} -p workload=container --yes" + BUDGET,
                   journal=journal)
    assert back.returncode == 0, back.stdout + back.stderr
    assert drivers(qsh) == dict.fromkeys(SLOTS, "nvidia")  # vfio-manager left them driverless; all rebound
    assert kube_node(qsh, NODE)["status"]["allocatable"]["nvidia.com/gpu"] == "4"
    assert runbook(qsh, f"lab job start {NODE} --gpu c1:00.0").returncode == 0  # each serves the host again
    assert node_status(qsh, NODE)["cuda_jobs_killed"] == 0


@pytest.mark.timeout(600)
def test_by_hand_a_gpu_leaving_vfio_pci_kills_no_cuda_job_on_the_nodes_other_gpus(quad: Lab, qsh: Any) -> None:
    quad.reset(timeout=120)
    pids_before = cuda_pids(qsh, NODE)
    assert len(pids_before) == 2
    assert qsh(f"kubectl label node {NODE} {LABEL}=container --overwrite").returncode == 0
    host_lines(qsh, NODE, "swapoff -a")  # kubelet's own restarts bring it back once swap is off
    wait_for(lambda: ready(kube_node(qsh, NODE)) and drivers(qsh)["02:00.0"] == "none", 120,
             "gpu-quad Ready with 02:00.0 unbound from vfio-pci")
    assert drivers(qsh) == {"01:00.0": "nvidia", "02:00.0": "none", "41:00.0": "nvidia", "c1:00.0": "none"}
    status = node_status(qsh, NODE)
    assert (status["cuda_jobs_running"], status["cuda_jobs_killed"]) == (2, 0)
    assert cuda_pids(qsh, NODE) == pids_before
    assert [g["cuda_jobs"] for g in status["gpus"]] == [1, 0, 1, 0]
    wait_for(lambda: kube_node(qsh, NODE)["status"]["allocatable"].get("nvidia.com/gpu") == "2", 60,
             "the two GPUs on nvidia advertised")
    no_gpu = runbook(qsh, f"lab job start {NODE} --gpu 02:00.0")
    assert no_gpu.returncode != 0 and "no GPU on the nvidia driver (02:00.0 none)" in no_gpu.stderr
