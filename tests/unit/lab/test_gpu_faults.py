"""``runbook lab inject``'s registry and the GPU faults as a real node shows them: each fault put into a
host state folder (engine/lab/gpu_faults.py), then read back through the shims (nvidia-smi, journalctl -k,
rmmod/modprobe, nv-fabricmanager) and the host-fact parsers, and the simulator's device-plugin rules
(engine/lab/sim_faults.py). Per-GPU: a fault of one GPU touches no other GPU's CUDA job."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from engine.facts import same_pci_slot
from engine.hostfacts import parse_kernel_xids, parse_remapped_rows
from engine.lab import gpu_faults, inject, sim_faults
from engine.lab.errors import LabError
from engine.lab.hoststate import HostState
from engine.lab.scenario import load_scenario
from engine.lab.sim_seed import fstab_text, host_state
from tests.unit.lab.test_shims import run  # the shims as programs on a state folder

MULTI = Path(__file__).resolve().parents[3] / "engine" / "lab" / "scenarios" / "multi-gpu.yaml"
OWN = {"xid79", "xid48", "xid95", "row-remap-pending", "driver-mismatch", "device-plugin", "fabric-manager"}
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mutating shims refuse non-root users, like the real tools")


class FakeLab:
    """What ``inject`` reads of a lab: its record (node -> state folder) and whether it runs."""

    def __init__(self, folders: dict[str, Path], running: bool = True) -> None:
        self.folders, self._running, self.dir = folders, running, Path("/nonexistent-lab")

    def record(self) -> dict[str, Any]:
        return {"nodes": {n: {"state_dir": str(p)} for n, p in self.folders.items()}}

    def running(self) -> bool:
        return self._running


@pytest.fixture
def quad(tmp_path: Path) -> HostState:
    """gpu-quad of the multi-GPU scenario, every GPU on nvidia: CUDA jobs on 01:00.0 and 41:00.0."""
    sc = load_scenario(MULTI)
    node = sc.node("gpu-quad")
    state, journal = host_state(node, sc, 1_752_161_991.0)
    for dev in state["pci_devices"]:
        if dev.get("display"):
            dev["driver"] = "nvidia"
    hs = HostState(tmp_path / "state")
    hs.initialise(state, journal)
    (tmp_path / "fstab").write_text(fstab_text(node))
    return hs


def put(hs: HostState, fault: str, gpu: str | None = None) -> str:
    return str(inject.inject(FakeLab({"gpu-quad": hs.folder}), fault, "gpu-quad", gpu)["did"])  # type: ignore[arg-type]


def jobs(hs: HostState) -> dict[int, str]:
    return {int(j["pid"]): str(j.get("gpu") or "01:00.0") for j in hs.read()["cuda_jobs"]}


# -- the registry -----------------------------------------------------------------------------------------


def test_the_registry_lists_every_gpu_fault_with_a_summary_and_whether_it_takes_a_gpu() -> None:
    known = inject.faults()
    assert set(known) >= OWN
    assert {n for n, f in known.items() if f.gpu} >= {"xid79", "xid48", "xid95", "row-remap-pending"}
    assert not any(known[n].gpu for n in ("driver-mismatch", "device-plugin", "fabric-manager"))
    assert all(f.summary and "\n" not in f.summary for f in known.values())
    assert list(known) == sorted(known)


def test_a_fault_registers_once_with_a_proper_name() -> None:
    with pytest.raises(ValueError, match="already registered"):
        inject.register_fault("xid48", "again")(lambda inj: "")
    with pytest.raises(ValueError, match="lower-case"):
        inject.register_fault("Bad Name", "x")


def test_bad_input_names_what_is_known_and_changes_nothing(quad: HostState) -> None:
    before = quad.state_path.read_bytes()
    lab = FakeLab({"gpu-quad": quad.folder})
    for args, said in [(("nope", "gpu-quad", None), "no fault named 'nope' (one of: "),
                       (("xid48", "gpu-x", None), "no node 'gpu-x' in this lab (its nodes: gpu-quad)"),
                       (("xid48", "gpu-quad", "09:00.0"), "gpu-quad: no GPU in slot 09:00.0 (its GPUs: 01:00.0, "),
                       (("driver-mismatch", "gpu-quad", "01:00.0"), "fault driver-mismatch acts on the whole node")]:
        with pytest.raises(LabError) as e:
            inject.inject(lab, *args)  # type: ignore[arg-type]
        assert said in str(e.value)
    with pytest.raises(LabError, match=r"not .fully. running"):
        inject.inject(FakeLab({"gpu-quad": quad.folder}, running=False), "xid48", "gpu-quad")  # type: ignore[arg-type]
    assert quad.state_path.read_bytes() == before


# -- each fault as the node shows it -------------------------------------------------------------------------


def test_xid48_kills_only_its_gpus_jobs_and_the_kernel_log_names_that_gpu(quad: HostState) -> None:
    assert jobs(quad) == {41000: "01:00.0", 41001: "41:00.0"}
    said = put(quad, "xid48", "41:00.0")
    assert "GPU 41:00.0: Xid 48" in said and "41001" in said
    assert jobs(quad) == {41000: "01:00.0"}  # the job on 01:00.0 lives
    kmsg = run(quad, "journalctl", "-k", "-o", "cat").stdout
    assert "NVRM: Xid (PCI:0000:41:00): 48, pid=41001, name=train.py, An uncorrectable double bit error" in kmsg
    assert [(x.slot, x.code) for x in parse_kernel_xids(kmsg)] == [("41:00.0", 48)]
    assert run(quad, "nvidia-smi", "-L").returncode == 0  # the GPU still answers


def test_xid79_makes_nvidia_smi_exit_15_naming_the_lost_gpu_while_the_others_answer(quad: HostState) -> None:
    put(quad, "xid79", "01:00.0")
    assert jobs(quad) == {41001: "41:00.0"}
    apps = run(quad, "nvidia-smi", "--query-compute-apps=pid,process_name,gpu_bus_id", "--format=csv,noheader")
    assert apps.returncode == 15
    assert apps.stdout.splitlines() == [
        "41001, train.py, 00000000:41:00.0",
        "Unable to determine the device handle for GPU00000000:01:00.0: GPU is lost.  Reboot the system to "
        "recover this GPU"]
    kmsg = run(quad, "journalctl", "-k", "-o", "cat").stdout
    assert "NVRM: Xid (PCI:0000:01:00): 79, pid=41000, name=python3, GPU has fallen off the bus." in kmsg


def test_a_pending_row_remap_shows_in_nvidia_smi_q_and_its_csv_query(quad: HostState) -> None:
    put(quad, "row-remap-pending", "c1:00.0")
    q = run(quad, "nvidia-smi", "-q", "-d", "ROW_REMAPPER").stdout
    block = q[q.index("GPU 00000000:C1:00.0"):]
    assert "Pending                           : Yes" in block.split("\n\n")[0]
    csv = run(quad, "nvidia-smi", "--query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure,"
              "remapped_rows.uncorrectable", "--format=csv,noheader").stdout
    assert [(r.slot, r.pending, r.uncorrectable) for r in parse_remapped_rows(csv)] == [
        ("01:00.0", False, 0), ("02:00.0", False, 0), ("41:00.0", False, 0), ("c1:00.0", True, 1)]
    assert jobs(quad) == {41000: "01:00.0", 41001: "41:00.0"}  # workloads keep running


@needs_root
def test_a_reset_without_i_resets_every_gpu_and_is_refused_while_a_process_holds_one(quad: HostState) -> None:
    put(quad, "xid48", "02:00.0")
    held = run(quad, "nvidia-smi", "-r")  # without -i: every GPU, two of them busy
    assert held.returncode == 255 and "GPU 00000000:01:00.0: In use by another client" in held.stdout
    quad.update(lambda s: next(d for d in s["pci_devices"] if d["slot"] == "02:00.0")
                .__setitem__("persistence_mode", "Enabled"))
    assert run(quad, "nvidia-smi", "-r", "-i", "00000000:02:00.0").returncode == 255  # persistence holds it
    assert run(quad, "nvidia-smi", "-pm", "0", "-i", "00000000:02:00.0").returncode == 0
    ok = run(quad, "nvidia-smi", "-r", "-i", "00000000:02:00.0")
    assert ok.returncode == 0 and "GPU 00000000:02:00.0 was successfully reset." in ok.stdout
    assert parse_kernel_xids(run(quad, "journalctl", "-k", "-o", "cat").stdout) == ()  # the reset clears it
    assert jobs(quad) == {41000: "01:00.0", 41001: "41:00.0"}
    assert [c["argv"] for c in quad.calls("nvidia-smi")] == [
        ["-r"], ["-r", "-i", "00000000:02:00.0"], ["-pm", "0", "-i", "00000000:02:00.0"],
        ["-r", "-i", "00000000:02:00.0"]]


@needs_root
def test_the_driver_mismatch_fails_nvml_until_the_modules_reload_and_rmmod_refuses_while_held(
        quad: HostState) -> None:
    put(quad, "driver-mismatch")
    smi = run(quad, "nvidia-smi")
    assert (smi.returncode, smi.stdout.splitlines()[0]) == (18, "Failed to initialize NVML: Driver/library version "
                                                                "mismatch")
    assert "NVRM: API mismatch: the client has the version 570.158.01" in run(quad, "journalctl", "-k").stdout
    held = run(quad, "usr__sbin__rmmod", "nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia")
    assert held.returncode == 1 and "Module nvidia is in use" in held.stderr  # the CUDA jobs hold it
    quad.update(lambda s: s.__setitem__("cuda_jobs", []))
    assert run(quad, "usr__sbin__rmmod", "nvidia_uvm", "nvidia_drm", "nvidia_modeset", "nvidia").returncode == 0
    assert run(quad, "nvidia-smi").returncode == 9
    assert run(quad, "usr__sbin__modprobe", "nvidia").returncode == 0
    again = run(quad, "nvidia-smi", "--query-gpu=pci.bus_id,driver_version", "--format=csv,noheader")
    assert again.returncode == 0 and again.stdout.splitlines()[0] == "00000000:01:00.0, 570.158.01"


def test_the_fabric_manager_fault_adds_nvswitches_a_failed_unit_and_refuses_cuda(quad: HostState) -> None:
    put(quad, "fabric-manager")
    lspci = run(quad, "lspci", "-nnk", "-d", "10de:").stdout
    assert lspci.count("Bridge [0680]: NVIDIA Corporation GH100 [H100 NVSwitch] [10de:22a3]") == 4
    assert run(quad, "systemctl", "is-active", "nvidia-fabricmanager").stdout.strip() == "failed"
    assert run(quad, "usr__bin__nv-fabricmanager", "--version").stdout == "Fabric Manager version is : 570.133.07\n"
    assert "cudaErrorSystemNotReady (802)" in str(sim_faults.cuda_start_problem(quad.read()))
    quad.update(lambda s: s["units"]["nvidia-fabricmanager"].__setitem__("active", "active"))
    assert sim_faults.cuda_start_problem(quad.read()) is None


# -- the simulator's device plugin ---------------------------------------------------------------------------


def _status(gpus: int) -> dict[str, Any]:
    return {"capacity": {sim_faults.GPU: str(gpus)}, "allocatable": {sim_faults.GPU: str(gpus)}}


def _plugin(name: str, started: str = "2026-12-03T10:00:00Z") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"runbook.lab/operand": "device-plugin"}},
            "spec": {"containers": [{"name": "device-plugin"}]},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": "device-plugin", "ready": True,
                                              "state": {"running": {"startedAt": started}}}]}}


def test_the_plugin_withholds_a_marked_gpu_until_it_is_reset_and_the_plugin_restarted(quad: HostState) -> None:
    put(quad, "xid48", "02:00.0")
    state = quad.read()
    old = [_plugin("dp-old")]
    status = _status(4)
    sim_faults.withhold(status, state, old)
    assert status == {"capacity": {sim_faults.GPU: "4"}, "allocatable": {sim_faults.GPU: "3"}}
    state["gpu_health"]["02:00.0"].pop("unhealthy")  # reset: the fault is gone, the old plugin still withholds
    status = _status(4)
    sim_faults.withhold(status, state, old)
    assert status["allocatable"][sim_faults.GPU] == "3"
    status = _status(4)
    sim_faults.withhold(status, state, [_plugin("dp-new", started="2099-01-01T00:00:00Z")])
    assert status["allocatable"][sim_faults.GPU] == "4"


def test_a_crash_looping_plugin_leaves_capacity_and_allocates_nothing(quad: HostState) -> None:
    quad.update(lambda s: s.__setitem__("device_plugin", {"crashloop_pod": "dp-old"}))
    status = {"capacity": {sim_faults.GPU: "0"}, "allocatable": {sim_faults.GPU: "0"}}
    sim_faults.withhold(status, quad.read(), [_plugin("dp-old")])
    assert status == {"capacity": {sim_faults.GPU: "4"}, "allocatable": {sim_faults.GPU: "0"}}
    body = sim_faults.crashloop_status(_plugin("dp-old"), 0.0)
    assert body is not None and body["containerStatuses"][0]["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert sim_faults.crashloop_status({**_plugin("dp-old"), "status": body}, 0.0) is None


def test_xid_lines_parse_per_gpu_and_a_reset_line_clears_only_its_gpu() -> None:
    text = "\n".join([gpu_faults.xid_line("02:00.0", 48), gpu_faults.xid_line("41:00.0", 95, 7, "x"),
                      "NVRM: GPU 0000:02:00.0: GPU reset occurred: GPU-0", gpu_faults.xid_line("c1:00.0", 79)])
    assert [(x.slot, x.code) for x in parse_kernel_xids(text)] == [("41:00.0", 95), ("c1:00.0", 79)]
    assert same_pci_slot(parse_kernel_xids("NVRM: Xid (PCI:0000:5a:00 GPU-I:05): 94, x")[0].slot, "5a:00.0")
    assert json.dumps(gpu_faults.XID_TEXT)  # plain data
