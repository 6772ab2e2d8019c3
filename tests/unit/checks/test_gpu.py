"""Nodes with many GPUs: every GPU a fact (slot, model, driver; CUDA processes per GPU) and the checks
that read them all: ``gpu_driver: {driver, all: true}`` and ``allocatable: {resource, equals_host_gpus: true}``."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from engine import checks, probes
from engine.checks import HOST, NODE
from engine.execution import Executor
from engine.facts import CudaProcess, Facts, GpuDevice, HostFacts, ProbeError
from engine.hostfacts import parse_cuda_processes, parse_lspci
from engine.loader import load_runbook
from engine.model import Check, PlanState, RunResult, RunState, StepStatus
from engine.planning import plan_run
from engine.templating import facts_data
from tests.fakes import (
    FakeClock,
    FakeKube,
    FakeNodes,
    GpuHostLog,
    RecordingSink,
    incident_host,
    incident_node,
    install_gpu_host,
    make_host,
    make_node,
    quad_gpus,
)

CHECK = TypeAdapter(Check)
ALL_NVIDIA = {"gpu_driver": {"driver": "nvidia", "all": True}}
EQUALS = {"allocatable": {"resource": "nvidia.com/gpu", "equals_host_gpus": True}}


# What the lab's shims print on gpu-quad (the real tools' formats), for the parsers.
LSPCI_QUAD = """\
01:00.0 VGA compatible controller [0300]: NVIDIA Corporation GB202 [GeForce RTX 5090] [10de:2b85] (rev a1)
\tSubsystem: NVIDIA Corporation Device [10de:2055]
\tKernel driver in use: nvidia
\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia
01:00.1 Audio device [0403]: NVIDIA Corporation Device [10de:22e8] (rev a1)
\tKernel driver in use: snd_hda_intel
02:00.0 VGA compatible controller [0300]: NVIDIA Corporation GB202 [GeForce RTX 5090] [10de:2b85] (rev a1)
\tKernel driver in use: vfio-pci
\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia
41:00.0 3D controller [0302]: NVIDIA Corporation GA102 [GeForce RTX 3090] [10de:2204] (rev a1)
\tKernel driver in use: nvidia
c1:00.0 VGA compatible controller [0300]: NVIDIA Corporation AD102 [GeForce RTX 4090] [10de:2684] (rev a1)
\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia
c1:00.1 Audio device [0403]: NVIDIA Corporation AD102 High Definition Audio Controller [10de:22ba] (rev a1)
"""


def test_lspci_gives_every_gpu_with_its_slot_model_and_driver() -> None:
    assert parse_lspci(LSPCI_QUAD) == quad_gpus()


@pytest.mark.parametrize(("text", "processes"), [
    ("41000, python3, 00000000:01:00.0\n41001, train.py, 00000000:41:00.0\n",
     (CudaProcess(41000, "python3", "01:00.0"), CudaProcess(41001, "train.py", "41:00.0"))),
    ("7, /usr/bin/python3, 00000000:C1:00.0\n", (CudaProcess(7, "/usr/bin/python3", "c1:00.0"),)),
    ("7, python3, 00000001:02:00.0\n", (CudaProcess(7, "python3", "0001:02:00.0"),)),  # another PCI domain
    ("7, python3, [N/A]\n", (CudaProcess(7, "python3", ""),)),
    ("4242, python3\n", (CudaProcess(4242, "python3", ""),)),  # the older two-column query
    ("", ()),
])
def test_nvidia_smi_gives_each_cuda_process_the_slot_of_its_gpu(text: str, processes: tuple[CudaProcess, ...]) -> None:
    assert parse_cuda_processes(text) == processes


def test_templates_see_each_gpu_with_its_cuda_processes_and_the_gpu_count() -> None:
    host = quad().host
    assert host is not None
    data = facts_data(quad())["host"]
    assert data["gpu_count"] == 4
    assert [(g["slot"], g["driver"], g["cuda_processes"]) for g in data["gpus"]] == [
        ("01:00.0", "nvidia", [41000]), ("02:00.0", "vfio-pci", []), ("41:00.0", "nvidia", [41001]),
        ("c1:00.0", "none", [])]
    assert data["cuda_processes"][1] == {"pid": 41001, "name": "train.py", "gpu": "41:00.0", "cgroup": "",
                                         "pod_uid": ""}  # a host process: no pod
    # nvidia-smi's bus id and lspci -D's slot name the same GPU
    assert host.processes_on(GpuDevice("0000:41:00.0", "10de:2204")) == (host.cuda_processes[1],)


def quad(allocatable: str = "2", **host_changes: Any) -> Facts:
    """gpu-quad after kubelet came back: 02:00.0 on vfio-pci, c1:00.0 without a driver, 2 GPUs advertised."""
    changes = {"gpus": quad_gpus(), "cuda_processes": (CudaProcess(41000, "python3", "01:00.0"),
                                                       CudaProcess(41001, "train.py", "41:00.0")), **host_changes}
    host = replace(make_host("gpu-quad"), **changes)
    return Facts(node_name="gpu-quad", node=make_node("gpu-quad", allocatable={"nvidia.com/gpu": allocatable}),
                 host=host)


def evaluate(check: dict[str, Any], facts: Facts) -> checks.CheckResult:
    return checks.evaluate(CHECK.validate_python(check), facts)


def test_every_gpu_on_nvidia_fails_naming_each_gpu_that_is_not_by_slot_model_and_driver() -> None:
    r = evaluate(ALL_NVIDIA, quad())
    assert r.holds is False
    assert "02:00.0 NVIDIA Corporation GB202 [GeForce RTX 5090] (vfio-pci)" in r.observed
    assert "c1:00.0 NVIDIA Corporation AD102 [GeForce RTX 4090] (none)" in r.observed
    assert "01:00.0" not in r.observed and "41:00.0" not in r.observed


def test_every_gpu_on_nvidia_holds_once_all_four_are_and_plain_gpu_driver_still_reads_the_first() -> None:
    facts = quad(gpus=tuple(replace(g, driver="nvidia") for g in quad_gpus()))
    assert evaluate(ALL_NVIDIA, facts).holds is True
    assert evaluate({"gpu_driver": "nvidia"}, quad()).holds is True  # the first GPU only, as before
    assert evaluate({"gpu_driver": {"driver": "nvidia"}}, quad()).holds is True
    assert evaluate({"gpu_driver": {"driver": "vfio-pci", "all": True}}, quad()).holds is False


def test_every_gpu_on_a_driver_is_false_when_the_host_lists_no_gpu_and_unknown_without_host_facts() -> None:
    none = evaluate(ALL_NVIDIA, quad(gpus=()))
    assert none.holds is False and "no NVIDIA GPU" in none.observed
    blind = Facts(node_name="gpu-quad", node=make_node("gpu-quad"), errors=(ProbeError("host", "unreachable"),))
    assert evaluate(ALL_NVIDIA, blind).holds is None


def test_allocatable_equal_to_the_host_gpus_fails_with_both_numbers_and_the_missing_slots() -> None:
    r = evaluate(EQUALS, quad("2"))
    assert r.holds is False
    assert "allocatable nvidia.com/gpu 2" in r.observed and "4 NVIDIA GPUs" in r.observed
    assert "02:00.0 (vfio-pci)" in r.observed and "c1:00.0 (none)" in r.observed
    assert evaluate(EQUALS, quad("4")).holds is True
    assert evaluate(EQUALS, quad("5")).holds is False  # more than the host has is not "equal" either
    assert evaluate({"allocatable": {"resource": "nvidia.com/gpu", "min": 1}}, quad("1")).holds is True


def test_allocatable_equal_to_the_host_gpus_is_unknown_when_either_probe_failed() -> None:
    no_host = Facts(node_name="gpu-quad", node=make_node("gpu-quad", allocatable={"nvidia.com/gpu": "4"}),
                    errors=(ProbeError("host", "unreachable"),))
    no_node = Facts(node_name="gpu-quad", host=quad().host, errors=(ProbeError("node", "connection refused"),))
    assert evaluate(EQUALS, no_host).holds is None
    assert evaluate(EQUALS, no_node).holds is None


def test_the_gpu_checks_need_the_probes_they_read() -> None:
    assert checks.required_probes([CHECK.validate_python(EQUALS)]) == {NODE, HOST}
    assert checks.required_probes([CHECK.validate_python(ALL_NVIDIA)]) == {HOST}


@pytest.mark.parametrize("check", [ALL_NVIDIA, EQUALS, {"all": [ALL_NVIDIA, EQUALS]}])
def test_establish_predicts_every_gpu_on_the_driver_and_allocatable_equal_to_the_host_gpus(
        check: dict[str, Any]) -> None:
    c = CHECK.validate_python(check)
    assert checks.evaluate(c, quad()).holds is False
    assert checks.evaluate(c, checks.establish(c, quad())).holds is True


def test_gpu_checks_describe_themselves() -> None:
    assert checks.describe(CHECK.validate_python(ALL_NVIDIA)) == "every GPU's driver is nvidia"
    assert checks.describe(CHECK.validate_python({"gpu_driver": "nvidia"})) == "GPU driver is nvidia"
    assert checks.describe(CHECK.validate_python(EQUALS)) == \
        "allocatable nvidia.com/gpu equals the host's NVIDIA GPUs"


@pytest.mark.parametrize(("check", "message"), [
    ({"allocatable": {"resource": "nvidia.com/gpu", "min": 1, "equals_host_gpus": True}}, "not both"),
    ({"gpu_driver": {"driver": "nouveau", "all": True}}, "nvidia"),
    ({"gpu_driver": {"all": True}}, "driver"),
])
def test_bad_gpu_check_arguments_are_refused(check: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        CHECK.validate_python(check)
    assert message in str(info.value)


# -- the shipped flagship on a fake 4-GPU node (the lab's gpu-quad) ---------------------------------------
REPO = Path(__file__).resolve().parents[3]
FLAGSHIP = load_runbook(REPO / "runbooks" / "gpu-node-recovery.yaml", playbooks_dir=REPO / "playbooks")
PARAMS = {"node": "gpu-quad", "workload": "container", "ready_timeout": 120, "gpu_timeout": 180}
JOBS = (CudaProcess(41000, "python3", "01:00.0"), CudaProcess(41001, "train.py", "41:00.0"))


def recover_quad(stuck: frozenset[str] = frozenset(),
                 sink: RecordingSink | None = None) -> tuple[RunResult, GpuHostLog, FakeNodes, FakeKube]:
    """gpu-quad down for swap under vm-passthrough, 02:00.0 on vfio-pci and c1:00.0 without a driver
    (as quad_gpus), a CUDA job on 01:00.0 and 41:00.0; the shipped flagship, planned then run."""
    clock = FakeClock()
    kube = FakeKube([incident_node("gpu-quad")], clock=clock)
    nodes = FakeNodes({"gpu-quad": replace(incident_host("gpu-quad"), gpus=quad_gpus(), cuda_processes=JOBS)},
                      clock=clock)
    log = install_gpu_host(kube, nodes, "gpu-quad", auto_restart=False, stuck=stuck)
    facts = probes.gather(FLAGSHIP, PARAMS, "gpu-quad", kube, nodes, clock=clock.wall)
    plan = plan_run(FLAGSHIP, PARAMS, facts, runbook_digest="d" * 64, now=datetime(2026, 7, 10, tzinfo=UTC))
    assert plan.state is PlanState.READY, plan.blocked_reasons
    executor = Executor(kube, nodes, events=sink or RecordingSink(), playbooks_dir=REPO / "playbooks", clock=clock,
                        sleep=clock.sleep, wall=clock.wall, cancel=threading.Event())
    return executor.execute(plan, FLAGSHIP, PARAMS), log, nodes, kube


def host_of(nodes: FakeNodes) -> HostFacts:
    host = nodes.hosts["gpu-quad"]
    assert isinstance(host, HostFacts)
    return host


def test_the_flagship_binds_the_gpus_off_nvidia_before_kubelet_returns_and_verifies_all_four() -> None:
    sink = RecordingSink()
    result, log, nodes, kube = recover_quad(sink=sink)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert [(o.step, o.status) for o in result.outcomes] == [
        ("relabel-container", StepStatus.SUCCEEDED), ("swap-off", StepStatus.SUCCEEDED),
        ("bind-gpus", StepStatus.SUCCEEDED), ("restart-kubelet", StepStatus.SUCCEEDED)]
    assert log.effects == ["label=container", "swap-off.yml", "gpu-bind-driver.yml", "restart-kubelet.yml"]
    assert {g.driver for g in host_of(nodes).gpus} == {"nvidia"}
    assert host_of(nodes).cuda_processes == JOBS  # no job killed
    assert kube.nodes["gpu-quad"].allocatable["nvidia.com/gpu"] == "4"
    verified = {v["check"]: v["observed"] for v in result.outcomes[3].evidence["verify"]}
    assert verified["allocatable nvidia.com/gpu equals the host's NVIDIA GPUs"] == \
        "allocatable nvidia.com/gpu 4, the host lists 4 NVIDIA GPUs"
    assert "GPUs on nvidia: 4 of 4; allocatable nvidia.com/gpu: 4" in result.report
    # waited on the node's events (the host as restart-kubelet.yml left it), not by polling Ansible
    sources = {a["source"] for a in sink.of("verify.attempt")
               if a["check"] == "allocatable nvidia.com/gpu equals the host's NVIDIA GPUs"}
    assert sources == {"watch"}
    assert "GPU 02:00.0 (NVIDIA Corporation GB202 [GeForce RTX 5090]) driver: vfio-pci -> nvidia" in result.report


def test_a_gpu_that_stays_off_nvidia_fails_the_run_naming_its_slot_and_kubelet_is_not_restarted() -> None:
    result, log, nodes, _ = recover_quad(stuck=frozenset({"02:00.0"}))
    assert result.state is RunState.FAILED and result.exit_code == 1
    bind = next(o for o in result.outcomes if o.step == "bind-gpus")
    assert bind.status is StepStatus.TIMED_OUT and "02:00.0" in bind.reason  # waited its 60 s, then failed
    failed = [v for v in bind.evidence["verify"] if not v["holds"]]
    assert failed[0]["observed"] == "GPUs not on nvidia: 02:00.0 NVIDIA Corporation GB202 [GeForce RTX 5090] (vfio-pci)"
    assert "restart-kubelet.yml" not in log.effects  # never "recovered" with a GPU missing
    assert host_of(nodes).cuda_processes == JOBS
