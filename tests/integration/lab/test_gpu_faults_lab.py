"""The GPU failure catalogue on a lab of its own (engine/lab/scenarios/gpu-faults.yaml), shared by the
module: gpu-quad is Ready with four GPUs serving containers and host CUDA jobs on 01:00.0 and 41:00.0;
a GPU pod gets a GPU and a CUDA process on it whose cgroup names the pod.

Per fault: ``runbook lab inject`` puts it in, ``runbook diagnose`` names it (its cause id is the inject
word), the runbook fixes it without killing a CUDA job on any GPU not at fault (the host's job pids and
the shims' call log), its verification proves it, and a second run has nothing to do. A node with a
GPU fault plus swap gets both causes. A pending remap on a pod's GPU evicts that pod alone (the pod
its CUDA process's cgroup names), never while a host job holds the GPU. The full Xid 79 cycle (reboot
with approval, uncordon, the repeat that says "hardware: contact support") is the slow variant at the
end.
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
from engine.lab.controlplane import ControlPlane
from engine.lab.hoststate import HostState
from engine.lab.manager import Lab
from engine.lab.nodehosts import node_host_prerequisite_problems
from tests.integration.lab.flagship_cli import kube_node, ready, runbook
from tests.integration.lab.lab_helpers import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.lab]

SCENARIO = Path(__file__).resolve().parents[3] / "engine" / "lab" / "scenarios" / "gpu-faults.yaml"
NODE = "gpu-quad"
BUDGET = " --override-guard gpu-budget --reason 'lab: gpu-quad is the only GPU node'"


@pytest.fixture(scope="module")
def flab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    problems = node_host_prerequisite_problems()
    if find_assets() is None:
        problems.append("no control-plane binaries (bash scripts/build-control-plane.sh)")
    problems += [f"no {tool} on PATH" for tool in ("kubectl", "ansible") if shutil.which(tool) is None]
    if problems:
        pytest.skip("; ".join(problems))
    lab = Lab(tmp_path_factory.mktemp("gpu-faults-lab"))
    lab.up(SCENARIO, timeout=240)
    try:
        yield lab
    finally:
        lab.down()


@pytest.fixture
def fsh(flab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess[str]]:
    home = tmp_path_factory.mktemp("gpu-faults-home")
    env = {**os.environ, **flab.env(), "HOME": str(home), "ANSIBLE_HOME": str(home / "ansible"),
           "ANSIBLE_LOCAL_TEMP": str(home / "ansible-tmp"), "ANSIBLE_NOCOLOR": "1",
           "RUNBOOK_LAB_DIR": str(flab.dir)}

    def run(command: str, check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{command!r} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    return run


def host(flab: Lab) -> HostState:
    return HostState(flab.record()["nodes"][NODE]["state_dir"])


def jobs(flab: Lab) -> dict[int, str]:
    """The host's CUDA jobs: pid -> the GPU it runs on."""
    return {int(j["pid"]): str(j["gpu"]) for j in host(flab).read()["cuda_jobs"]}


def pod_jobs(flab: Lab) -> dict[str, str]:
    """The host's CUDA jobs of pods (their cgroups name the pod): pod -> the GPU it runs on."""
    return {str(j["pod"]): str(j["gpu"]) for j in host(flab).read()["cuda_jobs"] if j.get("pod_uid")}


GPU_PODS = "".join(f"""---
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: default}}
spec:
  nodeSelector: {{kubernetes.io/hostname: gpu-quad}}
  containers:
  - name: train
    image: nvcr.io/nvidia/cuda:12.4.0-base-ubuntu22.04
    command: [torchrun, train.py]
    resources: {{limits: {{nvidia.com/gpu: "1"}}}}
""" for name in ("gpu-pod-a", "gpu-pod-b"))


def allocatable(sh: Any) -> str:
    return str(kube_node(sh, NODE)["status"]["allocatable"].get("nvidia.com/gpu", "0"))


def wait_allocatable(sh: Any, want: str) -> None:
    wait_for(lambda: allocatable(sh) == want, 90, f"allocatable nvidia.com/gpu {want}")


def inject(sh: Any, fault: str, gpu: str | None = None) -> str:
    r = runbook(sh, f"lab inject {fault} --node {NODE}" + (f" --gpu {gpu}" if gpu else ""))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def diagnose(sh: Any) -> dict[str, Any]:
    r = runbook(sh, f"diagnose --node {NODE} -o json")
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(json.loads(r.stdout))


def run_json(sh: Any, args: str, journal: Path, want_rc: int = 0) -> dict[str, Any]:
    r = runbook(sh, f"run {args} --node {NODE} --yes -o json" + BUDGET, journal=journal)
    assert r.returncode == want_rc, r.stdout + r.stderr
    return dict(json.loads(r.stdout))


def outcome(result: dict[str, Any], step: str) -> str:
    return str(next(o["status"] for o in result["outcomes"] if o["step"] == step))


def pod_phase(sh: Any, key: str) -> str:
    namespace, name = key.split("/")
    r = sh(f"kubectl get pod -n {namespace} {name} -o json")
    return str(json.loads(r.stdout)["status"].get("phase", "")) if r.returncode == 0 else "(gone)"


def mutating_calls(flab: Lab, since: int) -> list[tuple[str, list[str]]]:
    return [(c["cmd"], c["argv"]) for c in host(flab).calls()[since:]]


def plane(flab: Lab) -> ControlPlane:
    return ControlPlane.from_state(flab.record()["controlplane_dir"])


def api_changes(flab: Lab, mark: int) -> list[str]:
    """The engine's writes to the API server since ``mark`` (the audit log), but a run's own bookkeeping
    (its node Lease, its Events): what a second run must not do."""
    return [f"{e['verb']} {e['requestURI']}" for e in plane(flab).mutations(mark)
            if "/leases" not in e["requestURI"] and "/events" not in e["requestURI"]]


def assert_second_run_changes_nothing(flab: Lab, fsh: Any, args: str, journal: Path) -> None:
    """Done when: running it again changes nothing (no host call, no API write), every step skipped."""
    calls, mark = len(host(flab).calls()), plane(flab).audit_mark()
    again = run_json(fsh, args, journal)
    assert again["state"] == "succeeded" and all(o["status"] == "skipped" for o in again["outcomes"]), again
    assert mutating_calls(flab, calls) == []
    assert api_changes(flab, mark) == []


def test_inject_lists_every_fault_and_refuses_bad_input(flab: Lab, fsh: Any) -> None:
    listing = runbook(fsh, "lab inject --list")
    assert listing.returncode == 0, listing.stderr
    words = {ln.split()[0] for ln in listing.stdout.splitlines()}
    assert {"xid79", "xid48", "xid95", "row-remap-pending", "driver-mismatch", "device-plugin",
            "fabric-manager"} <= words
    bad = runbook(fsh, f"lab inject xid48 --node {NODE} --gpu 09:00.0")
    assert bad.returncode != 0 and "no GPU in slot 09:00.0 (its GPUs: 01:00.0, 02:00.0, 41:00.0, c1:00.0)" in bad.stderr
    assert "gpu_health" not in host(flab).read()  # nothing was injected


@pytest.mark.timeout(900)
def test_xid48_resets_only_its_gpu_and_every_other_gpus_job_lives(flab: Lab, fsh: Any, tmp_path: Path) -> None:
    before = jobs(flab)
    assert sorted(before.values()) == ["01:00.0", "41:00.0"]
    assert "GPU 02:00.0: Xid 48" in inject(fsh, "xid48", "02:00.0")
    wait_allocatable(fsh, "3")  # the device plugin marked it Unhealthy
    d = diagnose(fsh)
    assert (d["cause"], d["runbook"]) == ("xid48", "gpu-reset")
    assert d["fix"] == "runbook run gpu-reset --node gpu-quad -p gpu=02:00.0"
    assert d["evidence"]["per_gpu"]["02:00.0"]["xids"] == [48] and d["evidence"]["per_gpu"]["01:00.0"]["xids"] == []
    calls = len(host(flab).calls())

    journal = tmp_path / "j.sqlite"
    result = run_json(fsh, "gpu-reset -p gpu=02:00.0", journal)
    assert (outcome(result, "reset-gpu"), outcome(result, "restart-device-plugin")) == ("succeeded", "succeeded")
    assert jobs(flab) == before  # the jobs on 01:00.0 and 41:00.0 live
    resets = [argv for cmd, argv in mutating_calls(flab, calls) if cmd == "nvidia-smi" and "-r" in argv]
    assert resets == [["-r", "-i", "00000000:02:00.0"]]  # that GPU only, never a bare -r
    assert allocatable(fsh) == "4"
    assert diagnose(fsh)["cause"] == "healthy"

    assert_second_run_changes_nothing(flab, fsh, "gpu-reset -p gpu=02:00.0", journal)


@pytest.mark.timeout(900)
def test_a_pending_remap_evicts_only_its_gpus_pod_refuses_a_host_job_and_the_reset_applies_it(
        flab: Lab, fsh: Any, tmp_path: Path) -> None:
    # a host job on 02:00.0 first; then the device plugin gives each pod a GPU (01:00.0, 02:00.0) and
    # each pod's CUDA process runs in its pod's cgroup
    assert runbook(fsh, f"lab job start {NODE} --gpu 02:00.0").returncode == 0
    (tmp_path / "pods.yaml").write_text(GPU_PODS)
    assert fsh(f"kubectl apply -f {tmp_path / 'pods.yaml'}").returncode == 0
    try:
        placed = wait_for(lambda: pod_jobs(flab) if len(pod_jobs(flab)) == 2 else None, 90,
                          "both GPU pods running a CUDA process")
        assert sorted(placed.values()) == ["01:00.0", "02:00.0"], placed  # free GPUs, in slot order
        victim = next(p for p, g in placed.items() if g == "02:00.0")
        (keeper,) = set(placed) - {victim}  # shares 01:00.0 with the host's python3
        inject(fsh, "row-remap-pending", "02:00.0")
        d = diagnose(fsh)
        assert (d["cause"], d["fix"]) == ("row-remap-pending", "runbook run gpu-reset --node gpu-quad -p gpu=02:00.0")
        per_gpu = d["evidence"]["per_gpu"]
        assert len(per_gpu["02:00.0"]["pods"]) == 1 and per_gpu["c1:00.0"]["pods"] == []  # the pod on it

        # the host's job on that GPU refuses the reset, named (the pod's process is not); nothing changes
        journal = tmp_path / "j.sqlite"
        calls = len(host(flab).calls())
        refused = runbook(fsh, f"run gpu-reset --node {NODE} -p gpu=02:00.0 --yes" + BUDGET, journal=journal)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        held = " ".join(refused.stdout.split()).split("02:00.0 of gpu-quad is held by ", 1)[1]
        held = held.split(", not a pod's process", 1)[0]  # the precondition names the host's process alone
        assert "(python3)" in held and "torchrun" not in held, held
        assert mutating_calls(flab, calls) == [] and pod_phase(fsh, victim) == "Running"

        # the host's job finished (the pod's process restarts with its container): that pod alone is
        # evicted, its process leaves, that GPU alone is reset, every other GPU's job lives
        assert runbook(fsh, f"lab job stop {NODE} --gpu 02:00.0").returncode == 0
        wait_for(lambda: [g for g in jobs(flab).values() if g == "02:00.0"] == ["02:00.0"]
                 and pod_jobs(flab).get(victim) == "02:00.0", 30, "only the pod's process on 02:00.0")
        others = {p: g for p, g in jobs(flab).items() if g != "02:00.0"}
        calls = len(host(flab).calls())
        result = run_json(fsh, "gpu-reset -p gpu=02:00.0", journal)
        evict = next(o for o in result["outcomes"] if o["step"] == "evict-gpu-pods")
        assert evict["status"] == "succeeded" and evict["evidence"]["action"]["pods"] == [victim], evict
        assert outcome(result, "reset-gpu") == "succeeded"
        resets = [argv for cmd, argv in mutating_calls(flab, calls) if cmd == "nvidia-smi" and "-r" in argv]
        assert resets == [["-r", "-i", "00000000:02:00.0"]]  # that GPU only
        assert jobs(flab) == others and pod_jobs(flab) == {keeper: "01:00.0"}
        assert pod_phase(fsh, keeper) == "Running" and pod_phase(fsh, victim) == "(gone)"
        state = host(flab).read()["gpu_health"]["02:00.0"]
        assert "remap_pending" not in state and state["rows_remapped"] == 1 and allocatable(fsh) == "4"
        assert_second_run_changes_nothing(flab, fsh, "gpu-reset -p gpu=02:00.0", journal)
    finally:
        fsh("kubectl delete pod -n default gpu-pod-a gpu-pod-b --ignore-not-found --grace-period=0 --force")
    wait_for(lambda: not pod_jobs(flab), 60, "the pods' CUDA processes gone with them")


@pytest.mark.timeout(900)
def test_a_crash_looping_device_plugin_is_restarted_until_every_gpu_is_allocatable(
        flab: Lab, fsh: Any, tmp_path: Path) -> None:
    before = jobs(flab)
    inject(fsh, "device-plugin")
    wait_allocatable(fsh, "0")
    assert kube_node(fsh, NODE)["status"]["capacity"]["nvidia.com/gpu"] == "4"  # kubelet keeps the capacity
    d = diagnose(fsh)
    assert (d["cause"], d["runbook"], d["confidence"]) == ("device-plugin", "device-plugin-restart", "high")
    journal = tmp_path / "j.sqlite"
    result = run_json(fsh, "device-plugin-restart", journal)
    assert outcome(result, "restart-device-plugin") == "succeeded"
    assert allocatable(fsh) == "4" and jobs(flab) == before
    assert_second_run_changes_nothing(flab, fsh, "device-plugin-restart", journal)


@pytest.mark.timeout(900)
def test_a_driver_mismatch_escalates_while_jobs_hold_the_module_and_reloads_once_they_stopped(
        flab: Lab, fsh: Any, tmp_path: Path) -> None:
    before = jobs(flab)
    inject(fsh, "driver-mismatch")
    wait_allocatable(fsh, "0")
    d = diagnose(fsh)
    assert (d["cause"], d["runbook"]) == ("driver-mismatch", "gpu-driver-reload")
    journal = tmp_path / "j.sqlite"

    held = run_json(fsh, "gpu-driver-reload", journal, want_rc=1)  # its escalation waits in this journal
    assert outcome(held, "reload-modules") == "failed"
    shown = json.loads(runbook(fsh, f"runs show {held['run_id']} -o json", journal=journal).stdout)
    assert [(c["runbook"], c["why"]) for c in shown["children"]] == [("node-reboot", "escalated to")]
    assert jobs(flab) == before  # the module stayed: no job died
    assert [c["rc"] for c in host(flab).calls("rmmod")] == [1]

    assert runbook(fsh, f"lab job stop {NODE}").returncode == 0
    result = run_json(fsh, "gpu-driver-reload", tmp_path / "j2.sqlite")
    assert (outcome(result, "reload-modules"), outcome(result, "restart-device-plugin")) == ("succeeded", "succeeded")
    assert allocatable(fsh) == "4" and diagnose(fsh)["cause"] == "healthy"
    assert_second_run_changes_nothing(flab, fsh, "gpu-driver-reload", tmp_path / "j2.sqlite")
    for gpu in ("01:00.0", "41:00.0"):
        assert runbook(fsh, f"lab job start {NODE} --gpu {gpu}").returncode == 0


@pytest.mark.timeout(900)
def test_the_fabric_manager_restarts_only_when_its_version_is_the_drivers(
        flab: Lab, fsh: Any, tmp_path: Path) -> None:
    before = jobs(flab)
    inject(fsh, "fabric-manager")
    refused_job = runbook(fsh, f"lab job start {NODE} --gpu 02:00.0")
    assert refused_job.returncode != 0 and "cudaErrorSystemNotReady (802)" in refused_job.stderr
    d = diagnose(fsh)
    assert (d["cause"], d["runbook"], d["confidence"]) == ("fabric-manager", "fabric-manager-restart", "high")
    journal = tmp_path / "j.sqlite"

    driver = host(flab).read()["nvidia"]["fabric_manager"]  # the loaded driver's (570.158.01 after a reload)
    host(flab).update(lambda s: s["nvidia"].__setitem__("fabric_manager", "570.86.15"))
    calls = len(host(flab).calls())
    refused = runbook(fsh, f"run fabric-manager-restart --node {NODE} --yes" + BUDGET, journal=journal)
    assert refused.returncode == 3, refused.stdout + refused.stderr
    said = " ".join(refused.stdout.split())
    assert f"nvidia-fabricmanager 570.86.15 does not match the loaded driver {driver}" in said
    assert mutating_calls(flab, calls) == []

    host(flab).update(lambda s: s["nvidia"].__setitem__("fabric_manager", driver))
    result = run_json(fsh, "fabric-manager-restart", journal)
    assert outcome(result, "restart-fabric-manager") == "succeeded"
    assert host(flab).read()["units"]["nvidia-fabricmanager"]["active"] == "active" and jobs(flab) == before
    assert_second_run_changes_nothing(flab, fsh, "fabric-manager-restart", journal)

    def no_nvswitch(state: dict[str, Any]) -> None:  # back to a plain node for the tests after this one
        state["nvidia"]["nvswitch"] = False
        state["pci_devices"] = [d for d in state["pci_devices"] if "NVSwitch" not in d.get("name", "")]

    host(flab).update(no_nvswitch)


@pytest.mark.timeout(900)
def test_xid79_cordons_evicts_records_and_escalates_to_an_approved_reboot(
        flab: Lab, fsh: Any, tmp_path: Path) -> None:
    before = jobs(flab)
    inject(fsh, "xid79", "02:00.0")
    d = diagnose(fsh)
    assert (d["cause"], d["runbook"], d["confidence"]) == ("xid79", "gpu-fallen-off-bus", "high")
    assert d["evidence"]["per_gpu"]["02:00.0"]["lost"] is True and d["evidence"]["nvidia_smi"]["exit_code"] == 15
    journal = tmp_path / "j.sqlite"
    result = run_json(fsh, "gpu-fallen-off-bus", journal, want_rc=1)
    assert [outcome(result, s) for s in ("cordon", "record-lost-gpu", "gpus-back")] == \
        ["succeeded", "succeeded", "timed-out"]  # the lost GPU does not come back: the run fails
    node = kube_node(fsh, NODE)
    assert node["spec"].get("unschedulable") is True
    assert node["metadata"]["annotations"]["runbook.io/gpu-fallen-off-bus"] == "02:00.0 Xid 79"
    shown = json.loads(runbook(fsh, f"runs show {result['run_id']} -o json", journal=journal).stdout)
    (child,) = [c for c in shown["children"] if c["why"] == "escalated to"]
    waiting = json.loads(runbook(fsh, f"runs show {child['run']} -o json", journal=journal).stdout)
    assert (child["runbook"], waiting["state"]) == ("node-reboot", "waiting-approval")
    assert host(flab).calls("shutdown") == [] and jobs(flab) == before  # nothing rebooted without a person
    boot = (Path(flab.record()["nodes"][NODE]["state_dir"]) / "boot_id").read_text().strip()
    assert node["metadata"]["annotations"]["runbook.io/gpu-fallen-off-bus-boot"] == boot

    # run again before anyone approved the reboot: the same loss (the record's boot), not a repeat
    again = run_json(fsh, "gpu-fallen-off-bus -p gpu_check_timeout=1", journal, want_rc=1)
    assert [outcome(again, s) for s in ("record-lost-gpu", "gpus-back")] == ["skipped", "timed-out"]
    said = " ".join(again["report"].split())
    assert "The reboot is still due" in said and "contact support" not in said


@pytest.mark.timeout(900)
def test_inject_containerd_is_diagnosed_as_containerd_and_its_runbook_brings_the_node_back_once(
        flab: Lab, fsh: Any, tmp_path: Path) -> None:
    before = jobs(flab)
    assert "containerd failed" in inject(fsh, "containerd")
    wait_for(lambda: not ready(kube_node(fsh, NODE)), 120, f"{NODE} NotReady")
    d = diagnose(fsh)
    assert "containerd" in {m["cause"] for m in d["matches"]}, d["matches"]  # the cause id is the inject word
    journal = tmp_path / "j.sqlite"
    calls = len(host(flab).calls())
    result = run_json(fsh, "containerd-recovery", journal)
    assert result["state"] == "succeeded", result
    assert ready(kube_node(fsh, NODE)) and jobs(flab) == before
    starts = [argv for cmd, argv in mutating_calls(flab, calls) if cmd == "systemctl" and "containerd" in argv]
    assert len(starts) == 1, starts  # containerd started once
    assert_second_run_changes_nothing(flab, fsh, "containerd-recovery", journal)


@pytest.mark.timeout(900)
def test_a_gpu_fault_plus_swap_gets_both_causes(flab: Lab, fsh: Any) -> None:
    if not diagnose(fsh)["evidence"]["per_gpu"]["02:00.0"]["lost"]:  # run alone: the Xid 79 test's fault
        inject(fsh, "xid79", "02:00.0")
    assert "swap on" in inject(fsh, "swap")  # the game-day word; kubelet restarted refuses swap
    wait_for(lambda: not ready(kube_node(fsh, NODE)), 120, f"{NODE} NotReady")
    d = diagnose(fsh)
    assert {m["cause"] for m in d["matches"]} >= {"swap", "xid79"}, d["matches"]  # the cause id is the word
    table = runbook(fsh, "diagnose --all")
    causes = {ln.split()[2] for ln in table.stdout.splitlines()[1:] if ln.split()[0] == NODE}
    assert {"swap", "xid79"} <= causes, table.stdout


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_xid79_full_cycle_reboot_uncordon_and_a_repeat_says_contact_support(
        flab: Lab, fsh: Any, tmp_path: Path) -> None:
    # Needs the operands as DaemonSet pods (issue 29, branch dsctl): until then node-reboot's drain of the
    # Ready gpu-quad refuses them as unmanaged pods and the approved reboot fails at its drain.
    flab.reset(timeout=240)
    journal = tmp_path / "j.sqlite"
    inject(fsh, "xid79", "02:00.0")
    first = run_json(fsh, "gpu-fallen-off-bus", journal, want_rc=1)
    shown = json.loads(runbook(fsh, f"runs show {first['run_id']} -o json", journal=journal).stdout)
    (child,) = [c for c in shown["children"] if c["why"] == "escalated to"]
    waiting = json.loads(runbook(fsh, f"runs show {child['run']} -o json", journal=journal).stdout)
    approve = f"approve {child['run']} --plan-digest {waiting['plan_digest']}"
    assert runbook(fsh, approve, journal=journal).returncode == 0
    resumed = runbook(fsh, f"resume {child['run']} --yes -o json" + BUDGET, journal=journal, timeout=1200)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    wait_allocatable(fsh, "4")
    assert kube_node(fsh, NODE)["spec"].get("unschedulable") is True  # node-reboot leaves it as it found it

    back = run_json(fsh, "gpu-fallen-off-bus", journal)
    # every GPU back at plan time: the check step is a no-op by its verify, re-checked live (not refused
    # because its "repeat" skip_if does not hold), then the node is uncordoned
    assert (outcome(back, "gpus-back"), outcome(back, "uncordon")) == ("skipped", "succeeded"), back
    gpus_back = next(o for o in back["outcomes"] if o["step"] == "gpus-back")
    assert gpus_back["reason"].startswith("already holds: nvidia-smi exit 0"), gpus_back
    assert not kube_node(fsh, NODE)["spec"].get("unschedulable")
    assert_second_run_changes_nothing(flab, fsh, "gpu-fallen-off-bus", journal)

    inject(fsh, "xid79", "41:00.0")  # the same node loses a GPU again: hardware
    repeat = run_json(fsh, "gpu-fallen-off-bus", journal)
    assert [outcome(repeat, s) for s in ("cordon", "record-lost-gpu", "gpus-back", "uncordon")] == \
        ["succeeded", "skipped", "skipped", "skipped"]  # within the window (168h) of the first loss's record
    assert "hardware: contact support" in repeat["report"] and "Xid (PCI:0000:41:00): 79" in repeat["report"]
    assert "02:00.0 Xid 79 at " in " ".join(repeat["report"].split())  # the record of the first loss, its time
    assert kube_node(fsh, NODE)["spec"].get("unschedulable") is True
    assert not [c for c in json.loads(runbook(fsh, f"runs show {repeat['run_id']} -o json",
                                                journal=journal).stdout)["children"]]  # no reboot this time
