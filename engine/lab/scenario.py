"""Lab scenarios: YAML -> typed, frozen ``Scenario``, with located errors (``FILE:LINE: where: message``).

A scenario describes the simulated cluster's initial state: nodes (zones, labels, GPUs, and each
node's host: swap, fstab, kubelet faults, units, CUDA jobs), generated fleets of ordinary GPU nodes,
the GPU Operator's and KubeVirt's configuration, the VirtualMachines, and the time compression.
The format is documented in docs/lab.md; the default is ``scenarios/incident-omen2.yaml``.

This module parses and derives (GPU model data, resource names, expanded node lists); it performs no
I/O beyond reading the scenario file and knows nothing of Kubernetes clients or node hosts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.errors import LoadError, Location
from engine.loader import compose_yaml

DEFAULT_SCENARIO = "incident-omen2"
API_VERSION = "runbook.lab/v1"
WORKLOADS = ("container", "vm-passthrough", "vm-vgpu")
_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?)?B?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes from ``34359738368``, ``"32Gi"``, ``"32G"`` or ``"32GiB"`` (binary multiples)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size (e.g. 32Gi, 512Mi, 1073741824)")
    number, unit = float(match.group(1)), (match.group(2) or "").upper().rstrip("I")
    return int(number * 1024 ** ("KMGTP".index(unit) + 1 if unit else 0))


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# --- GPUs ----------------------------------------------------------------------------------------
class GpuModel(_Model):
    """What a GPU model looks like to lspci, GFD and the sandbox device plugin."""

    name: str  # pci.ids device name, e.g. "GB202 [GeForce RTX 5090]"
    product: str  # GFD nvidia.com/gpu.product
    family: str  # GFD nvidia.com/gpu.family
    memory_mib: int
    subsystem: str = "NVIDIA Corporation Device [10de:0000]"
    audio: str | None = None  # vendor:device of the HDMI audio function, None for none
    audio_name: str = "Device"

    @property
    def resource_name(self) -> str:
        """The sandbox device plugin's resource: ``nvidia.com/`` + the pci.ids name, upper-cased,
        brackets dropped, spaces (and / .) turned into ``_``: ``nvidia.com/GB202_GEFORCE_RTX_5090``."""
        cleaned = self.name.replace("[", "").replace("]", "")
        return "nvidia.com/" + re.sub(r"[\s/.]+", "_", cleaned.strip()).upper()


BUILTIN_GPU_MODELS: dict[str, GpuModel] = {
    "10de:2b85": GpuModel(name="GB202 [GeForce RTX 5090]", product="NVIDIA-GeForce-RTX-5090",
                          family="blackwell", memory_mib=32607,
                          subsystem="NVIDIA Corporation Device [10de:2055]",
                          audio="10de:22e8", audio_name="Device"),
    "10de:2204": GpuModel(name="GA102 [GeForce RTX 3090]", product="NVIDIA-GeForce-RTX-3090",
                          family="ampere", memory_mib=24576,
                          subsystem="NVIDIA Corporation Device [10de:147d]",
                          audio="10de:1aef", audio_name="GA102 High Definition Audio Controller"),
}


class Gpu(_Model):
    """One GPU of a node: its model, PCI slot and the driver it is bound to when the scenario starts.

    In a node's ``gpus`` list a GPU without ``slot`` gets ``NN:00.0`` with NN its position + 1 in hex
    (``01:00.0``, ``02:00.0``, ...); slots are unique per node."""

    model: str = Field(pattern=r"^[0-9a-f]{4}:[0-9a-f]{4}$")  # PCI vendor:device
    slot: str = Field(default="01:00.0", pattern=r"^[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
    driver: Literal["nvidia", "vfio-pci", "none"] = "nvidia"


def default_slot(index: int) -> str:
    """The slot of the ``index``-th GPU of a node when the scenario names none."""
    return f"{index + 1:02x}:00.0"


def _fill_gpu_slots(data: Any) -> Any:
    """A node's raw data with a default slot for each GPU that has none (by position)."""
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        return data
    gpus = [dict(g, slot=default_slot(i)) if isinstance(g, dict) and "slot" not in g else g
            for i, g in enumerate(data["gpus"])]
    return {**data, "gpus": gpus}


# --- node hosts ------------------------------------------------------------------------------------
class SwapDevice(_Model):
    """One swap device (its key: the name /proc/swaps shows, e.g. /swapfile, /dev/sdb2, /dev/dm-1,
    /dev/zram0) and how the host turns it on (docs/lab.md, "Swap")."""

    size: int
    type: Literal["file", "partition"] = "file"
    used: int = 0
    uuid: str | None = None  # the names a fstab entry may use for it: UUID=, LABEL=, PARTUUID=
    label: str | None = None
    partuuid: str | None = None
    aliases: list[str] = []  # other paths of the device (LVM: /dev/mapper/vg0-swap, /dev/vg0/swap)
    in_fstab: bool = True  # listed (active) in the host's /etc/fstab when ``fstab`` is generated
    fstab_spec: str | None = None  # how that line names it (default: UUID=<uuid> if set, else the path)
    fstab_options: str = "sw"  # the line's options: nofail, noauto, pri=N, ...
    # not in fstab: true = a .swap unit file turns it on (/etc/systemd/system); false = turned on by
    # hand with swapon (systemd shows a transient unit, no unit file; it does not come back at boot)
    unit_file: bool = True
    # not in fstab: a systemd generator's unit, SourcePath this file (zram-generator:
    # /etc/systemd/zram-generator.conf); it comes back at boot whatever /etc/fstab says
    generator: str | None = None
    description: str | None = None  # systemd unit description (zram: "Compressed Swap on /dev/zram0")
    # swapoff of this device fails with this error (the fault the flagship cannot fix without a
    # reboot): "Cannot allocate memory" when the RAM cannot take its pages back
    swapoff_error: str | None = None

    def names(self, path: str) -> list[str]:
        """Every way a fstab entry can name this device."""
        tags = {"UUID": self.uuid, "LABEL": self.label, "PARTUUID": self.partuuid}
        return [path, *self.aliases, *(f"{k}={v}" for k, v in tags.items() if v)]

    def spec(self, path: str) -> str:
        """The device spec of its generated fstab line."""
        return self.fstab_spec or (f"UUID={self.uuid}" if self.uuid else path)

    @property
    def fstab_priority(self) -> int | None:
        """``pri=N`` of its fstab options (the kernel priority when fstab turned it on)."""
        for option in self.fstab_options.split(","):
            if option.startswith("pri=") and option[4:].lstrip("-").isdigit():
                return int(option[4:])
        return None

    @field_validator("size", "used", mode="before")
    @classmethod
    def _size(cls, value: Any) -> int:
        return parse_size(value)


class Swap(_Model):
    devices: dict[str, SwapDevice] = {}
    active: list[str] = []

    @model_validator(mode="after")
    def _known(self) -> Swap:
        unknown = [a for a in self.active if a not in self.devices]
        if unknown:
            raise ValueError(f"active swap {unknown[0]!r} is not among swap.devices")
        return self


class KubeletFault(_Model):
    """A kubelet failure other than swap: ``exit`` (crash loop, the lines each try) or
    ``no-heartbeat`` (kubelet runs, ``active``, but cannot post status: e.g. an expired certificate)."""

    mode: Literal["exit", "no-heartbeat"] = "exit"
    lines: list[str] = Field(min_length=1)  # klog messages after the "E0710 15:39:51.123456 pid " header
    until_unit_active: str | None = None  # the fault clears once this unit is active (containerd)


class Kubelet(_Model):
    fail_swap_on: bool = True
    restart_counter: int = 0
    stopped: bool = False  # someone ran systemctl stop kubelet
    fault: KubeletFault | None = None
    # its client certificate (in kubelet.conf) expired: it exits at start unless a bootstrap kubeconfig
    # lets it request a new one (engine.lab.kubelet_certs)
    client_cert_expired: bool = False


class CudaJob(_Model):
    """A CUDA process on the host driver. ``gpu``: the PCI slot of the GPU it runs on (default: the
    node's first GPU on ``nvidia``); it dies when that GPU leaves the ``nvidia`` driver."""

    name: str = "python3"
    used_memory_mib: int = 20480
    gpu: str | None = Field(default=None, pattern=r"^[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class Host(_Model):
    ssh: bool = True  # a real SSH node host (Ansible can reach it); False: the state folder only
    sudo: Literal["password", "nopasswd"] = "password"
    fstab: str | None = None  # None: generated from the swap devices with in_fstab
    swap: Swap = Swap()
    kubelet: Kubelet = Kubelet()
    units: dict[str, Literal["active", "inactive", "failed"]] = {"containerd": "active"}
    cuda_jobs: list[CudaJob] = []
    # each running pod asking for nvidia.com/gpu gets GPUs of this host and a CUDA process on each, in
    # its pod's cgroup (engine/lab/simulator_pod_gpus.py); off: GPU pods run no process on the host
    pod_cuda_jobs: bool = False


# --- nodes -----------------------------------------------------------------------------------------
PodStatus = Literal["Running", "Error", "Terminating", "Pending", "Completed"]


class Taint(_Model):
    key: str
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class Node(_Model):
    name: str = Field(pattern=_NAME)
    zone: str = "zone-a"
    roles: list[str] = []
    labels: dict[str, str] = {}
    taints: list[Taint] = []
    cpu: int = 16
    memory: str = "64Gi"
    max_pods: int = 110
    gpus: list[Gpu] = []
    host: Host = Host()
    operator_pods: dict[str, PodStatus] = {}  # initial status of operand pods (default Running)

    @model_validator(mode="before")
    @classmethod
    def _gpu_slots(cls, data: Any) -> Any:
        return _fill_gpu_slots(data)

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        parse_size(value)
        return value

    @property
    def workload(self) -> str | None:
        return self.labels.get("nvidia.com/gpu.workload.config")

    def cuda_job_gpu(self, job: CudaJob) -> str | None:
        """The slot of the GPU ``job`` runs on: its own, else the first GPU on ``nvidia`` (None: none)."""
        if job.gpu is not None:
            return job.gpu
        return next((g.slot for g in self.gpus if g.driver == "nvidia"), None)


class Generate(_Model):
    """Many ordinary GPU nodes for fleet benchmarks: ``{prefix}{index:03d}``; healthy with no SSH host
    unless ``ssh`` / ``host`` say otherwise (``host``: every generated node gets a copy, e.g. swap on)."""

    count: int = Field(ge=1, le=5000)
    prefix: str = Field(default="gpu-", pattern=r"^[a-z0-9][-a-z0-9]*$")
    start: int = 1
    zones: list[str] = ["zone-a", "zone-b", "zone-c"]
    gpus: list[Gpu] = [Gpu(model="10de:2204")]
    labels: dict[str, str] = {"nvidia.com/gpu.workload.config": "container"}
    cpu: int = 32
    memory: str = "128Gi"
    ssh: bool = False
    host: Host | None = None  # given: each node's host (its own ``ssh`` wins over the one above)

    @model_validator(mode="before")
    @classmethod
    def _gpu_slots(cls, data: Any) -> Any:
        return _fill_gpu_slots(data)

    def nodes(self) -> list[Node]:
        return [Node(name=f"{self.prefix}{i:03d}", zone=self.zones[(i - self.start) % len(self.zones)],
                     labels=dict(self.labels), cpu=self.cpu, memory=self.memory, gpus=list(self.gpus),
                     host=self.host.model_copy(deep=True) if self.host is not None else Host(ssh=self.ssh))
                for i in range(self.start, self.start + self.count)]


# --- cluster software ------------------------------------------------------------------------------
class GpuOperator(_Model):
    namespace: str = "gpu-operator"
    version: str = "v25.3.0"
    sandbox_workloads: bool = True
    default_workload: Literal["container", "vm-passthrough", "vm-vgpu"] = "container"
    driver_enabled: bool = False
    operand_pods: bool = True  # False: no pods, resources advertised as soon as kubelet runs (fleets)
    operands: list[str] = ["gpu-feature-discovery", "device-plugin", "operator-validator",
                           "sandbox-device-plugin", "sandbox-validator", "vfio-manager"]
    controller_node: str | None = None  # where gpu-operator and NFD master/gc run (default: a healthy worker)


class PermittedDevice(_Model):
    selector: str = Field(pattern=r"^[0-9a-f]{4}:[0-9a-f]{4}$")
    resource: str


class KubeVirt(_Model):
    namespace: str = "kubevirt"
    version: str = "v1.7.0"
    permitted_host_devices: list[PermittedDevice] = []


class Vm(_Model):
    name: str = Field(pattern=_NAME)
    namespace: str = Field(default="default", pattern=_NAME)
    running: bool = True
    paused: bool = False
    cpu: str = "2"
    memory: str = "4Gi"
    host_devices: list[str] = []  # resource names, e.g. nvidia.com/GB202_GEFORCE_RTX_5090
    unschedulable_days: int | None = None  # record "unschedulable since N days" (the incident's AGE)
    expect: Literal["Running", "Paused", "Stopped", "ErrorUnschedulable", "Starting"] | None = None

    @property
    def expected_status(self) -> str:
        if self.expect:
            return self.expect
        if not self.running:
            return "Stopped"
        return "Paused" if self.paused else ("ErrorUnschedulable" if self.host_devices else "Running")


class Timing(_Model):
    """The lab's compressed clock (seconds). Real values in comments."""

    heartbeat_seconds: float = Field(default=2.0, gt=0)  # Lease renewal (10 s)
    status_seconds: float = Field(default=20.0, gt=0)  # node status when nothing changed (5 min)
    kubelet_restart_seconds: float = Field(default=2.0, gt=0)  # RestartSec (10 s)
    kubelet_start_seconds: float = Field(default=1.0, ge=0)  # a started kubelet fails or is up after
    operand_start_seconds: float = Field(default=1.0, ge=0)  # operand pods run after kubelet is up
    gfd_relabel_seconds: float = Field(default=2.0, ge=0)  # GFD / NFD relabel period (60 s)
    tick_seconds: float = Field(default=0.2, gt=0, le=5)  # the simulator's loop period
    # monitoring (a lab started with --with-monitoring or `monitoring: true`)
    scrape_seconds: float = Field(default=1.0, gt=0)  # Prometheus scrape_interval (30 s)
    rule_evaluation_seconds: float = Field(default=1.0, gt=0)  # evaluation_interval (30 s)
    alert_for_seconds: float = Field(default=10.0, ge=0)  # the upstream rules' `for:` (15 m)
    alert_resend_seconds: float = Field(default=2.0, gt=0)  # Prometheus -> Alertmanager re-send (1 m)
    alert_group_wait_seconds: float = Field(default=1.0, ge=0)  # Alertmanager group_wait (30 s)
    alert_group_interval_seconds: float = Field(default=5.0, gt=0)  # group_interval (5 m)
    alert_repeat_interval_seconds: float = Field(default=15.0, gt=0)  # repeat_interval (4 h)


class Scenario(_Model):
    apiVersion: Literal["runbook.lab/v1"]
    kind: Literal["Scenario"] = "Scenario"
    name: str = Field(pattern=_NAME)
    description: str = ""
    timing: Timing = Timing()
    control_plane: dict[str, Any] = {}  # ControlPlaneSettings overrides, e.g. node_monitor_grace_period
    gpu_models: dict[str, GpuModel] = {}
    gpu_operator: GpuOperator = GpuOperator()
    kubevirt: KubeVirt = KubeVirt()
    nodes: list[Node] = Field(min_length=1)
    generate: list[Generate] = []
    vms: list[Vm] = []
    monitoring: bool = False  # also start Prometheus and Alertmanager (as `lab up --with-monitoring`)

    @property
    def all_nodes(self) -> list[Node]:
        return [*self.nodes, *(n for g in self.generate for n in g.nodes())]

    def gpu_model(self, vendor_device: str) -> GpuModel:
        return {**BUILTIN_GPU_MODELS, **self.gpu_models}[vendor_device]

    def node(self, name: str) -> Node:
        return next(n for n in self.all_nodes if n.name == name)


# --- loading ---------------------------------------------------------------------------------------
def _where(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + part
    return out


def _problems(e: ValidationError, data: Any, path: str, marks: Mapping[Any, tuple[int, int]],
              key_marks: Mapping[Any, tuple[int, int]]) -> list[tuple[Location, str]]:
    out = []
    for err in e.errors():
        loc: tuple[str | int, ...] = ()
        cur = data
        for part in err["loc"]:  # keep only the parts that exist in the data (drop union tags)
            if (isinstance(cur, Mapping) and part in cur) or (isinstance(cur, list) and isinstance(part, int)):
                cur = cur[part]  # type: ignore[index]
                loc = (*loc, part)
        probe = loc
        while probe not in key_marks and probe not in marks and probe:
            probe = probe[:-1]
        line = (key_marks.get(probe) or marks.get(probe) or (1, 1))[0]
        if err["type"] == "extra_forbidden":
            message = f"unknown field {err['loc'][-1]!r}"
        elif err["type"] == "missing":
            message = f"missing required field {err['loc'][-1]!r}"
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
        out.append((Location(path, line, None, _where(loc)), message))
    return out


def _semantic_problems(sc: Scenario, data: Any, path: str,
                       key_marks: Mapping[Any, tuple[int, int]]) -> list[tuple[Location, str]]:
    def at(*where: str | int) -> Location:
        probe = tuple(where)
        while probe not in key_marks and probe:
            probe = probe[:-1]
        return Location(path, key_marks.get(probe, (1, 1))[0], None, _where(tuple(where)))

    problems: list[tuple[Location, str]] = []
    seen: set[str] = set()
    for i, node in enumerate(sc.nodes):
        if node.name in seen:
            problems.append((at("nodes", i, "name"), f"duplicate node name {node.name!r}"))
        seen.add(node.name)
        problems += _gpu_problems(node, sc, lambda *where, i=i: at("nodes", i, *where))
        workload = node.workload
        if workload is not None and workload not in WORKLOADS:
            problems.append((at("nodes", i, "labels"), f"workload label {workload!r} is not one of "
                             f"{', '.join(WORKLOADS)}"))
        for path, dev in node.host.swap.devices.items():
            if dev.fstab_spec is not None and dev.fstab_spec not in dev.names(path):
                problems.append((at("nodes", i, "host", "swap", "devices", path, "fstab_spec"),
                                 f"{dev.fstab_spec!r} does not name {path} (its names: {', '.join(dev.names(path))})"))
            if dev.generator is not None and dev.in_fstab:
                problems.append((at("nodes", i, "host", "swap", "devices", path, "generator"),
                                 "a generator's swap unit is not in /etc/fstab: set in_fstab: false"))
            if re.search(r"\s", dev.fstab_options) or not dev.fstab_options:
                problems.append((at("nodes", i, "host", "swap", "devices", path, "fstab_options"),
                                 "fstab options are one comma-separated word (e.g. sw,pri=5 or nofail)"))
        fault = node.host.kubelet.fault
        if fault and fault.until_unit_active and fault.until_unit_active not in node.host.units:
            problems.append((at("nodes", i, "host", "kubelet", "fault", "until_unit_active"),
                             f"unit {fault.until_unit_active!r} is not among host.units"))
    for g, gen in enumerate(sc.generate):
        for node in gen.nodes():
            if node.name in seen:
                problems.append((at("generate", g, "prefix"), f"generated node {node.name!r} clashes "
                                 "with another node"))
                break
            seen.add(node.name)
    if sc.gpu_operator.controller_node and sc.gpu_operator.controller_node not in seen:
        problems.append((at("gpu_operator", "controller_node"),
                         f"no node named {sc.gpu_operator.controller_node!r}"))
    vm_names: set[tuple[str, str]] = set()
    for i, vm in enumerate(sc.vms):
        if (vm.namespace, vm.name) in vm_names:
            problems.append((at("vms", i, "name"), f"duplicate VM {vm.namespace}/{vm.name}"))
        vm_names.add((vm.namespace, vm.name))
    if not any(starts_ready(n) for n in sc.all_nodes):
        problems.append((at("nodes"), "every node starts NotReady: the node lifecycle controller then "
                         "stops tainting (master disruption mode); keep one healthy node"))
    return problems


def _gpu_problems(node: Node, sc: Scenario, at: Any) -> list[tuple[Location, str]]:
    """A node's GPUs: known models, one GPU per slot; each CUDA job on one of them, bound to nvidia."""
    problems: list[tuple[Location, str]] = []
    slots: dict[str, Gpu] = {}
    for j, gpu in enumerate(node.gpus):
        if gpu.model not in {**BUILTIN_GPU_MODELS, **sc.gpu_models}:
            problems.append((at("gpus", j, "model"), f"unknown GPU model {gpu.model!r}: add it under gpu_models"))
        if gpu.slot in slots:
            problems.append((at("gpus", j, "slot"), f"two GPUs in slot {gpu.slot}: give each GPU its own slot"))
        slots[gpu.slot] = gpu
    for j, job in enumerate(node.host.cuda_jobs):
        slot = node.cuda_job_gpu(job)
        if slot is None:
            problems.append((at("host", "cuda_jobs", j), "a CUDA job needs a GPU on the nvidia driver, and "
                             f"node {node.name!r} has none"))
        elif slot not in slots:
            problems.append((at("host", "cuda_jobs", j, "gpu"), f"node {node.name!r} has no GPU in slot "
                             f"{slot} (its GPUs: {', '.join(slots) or 'none'})"))
        elif slots[slot].driver != "nvidia":
            problems.append((at("host", "cuda_jobs", j, "gpu"), f"the GPU in slot {slot} is on "
                             f"{slots[slot].driver}: a CUDA job runs only on a GPU on the nvidia driver"))
    return problems


def starts_ready(node: Node) -> bool:
    """Whether the node's kubelet runs (and the node is Ready) in the scenario's initial state."""
    host = node.host
    fault = host.kubelet.fault
    fault_holds = fault is not None and not (
        fault.until_unit_active and host.units.get(fault.until_unit_active) == "active")
    swap_blocks = host.kubelet.fail_swap_on and bool(host.swap.active)
    return not (host.kubelet.stopped or swap_blocks or fault_holds or host.kubelet.client_cert_expired)


def parse_scenario(data: bytes, path: str) -> Scenario:
    """Bytes of a scenario file -> Scenario, or LoadError naming file, line and field of each problem."""
    value, marks, key_marks = compose_yaml(data, path)
    if not isinstance(value, dict):
        raise LoadError([(Location(path), "a scenario is a mapping (apiVersion, name, nodes, ...)")])
    try:
        scenario = Scenario.model_validate(value)
    except ValidationError as e:
        raise LoadError(_problems(e, value, path, marks, key_marks)) from None
    problems = _semantic_problems(scenario, value, path, key_marks)
    if problems:
        raise LoadError(problems)
    return scenario


def default_scenario_path() -> Path:
    return Path(str(resources.files("engine.lab") / "scenarios" / f"{DEFAULT_SCENARIO}.yaml"))


def load_scenario(path: Path | str | None = None) -> Scenario:
    """Load a scenario file (default: the packaged incident-omen2 scenario)."""
    file = Path(path) if path is not None else default_scenario_path()
    try:
        data = file.read_bytes()
    except OSError as e:
        raise LoadError([(Location(str(file)), f"cannot read scenario: {e.strerror}")]) from None
    return parse_scenario(data, str(file))
