"""Typed, frozen facts: what probes read from the cluster and from node hosts.

Facts are values. Connectors build them at their boundary (from API objects or from the
``runbook_facts`` dict the node-facts playbook returns); everything else only reads them.
Nothing here performs I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Taint:
    key: str
    effect: str
    value: str = ""


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str = ""
    message: str = ""
    # lastTransitionTime (epoch seconds; 0: unknown): how long the condition has had this status.
    # Not part of equality: facts compare by what the node is, not since when.
    since: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class NodeFacts:
    """One Kubernetes Node as the API shows it. ``exists=False`` for an unknown node."""

    name: str
    exists: bool = True
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    conditions: tuple[Condition, ...] = ()
    capacity: Mapping[str, str] = field(default_factory=dict)
    allocatable: Mapping[str, str] = field(default_factory=dict)
    unschedulable: bool = False
    resource_version: str = ""

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    @property
    def ready(self) -> bool:
        """True only when the Ready condition is True (Unknown and False are not ready)."""
        c = self.condition("Ready")
        return c is not None and c.status == "True"

    def with_labels(self, labels: Mapping[str, str]) -> NodeFacts:
        return replace(self, labels=MappingProxyType(dict(labels)))


@dataclass(frozen=True)
class SwapDevice:
    name: str
    type: str = "file"
    size_bytes: int = 0


@dataclass(frozen=True)
class ServiceFacts:
    name: str
    state: str  # systemctl is-active output: active | activating | inactive | failed | unknown
    journal_tail: str = ""


@dataclass(frozen=True)
class GpuDevice:
    slot: str  # PCI address, e.g. "01:00.0"
    vendor_device: str  # "10de:2b85"
    name: str = ""
    driver: str = "none"  # "nvidia" | "vfio-pci" | "none"


@dataclass(frozen=True)
class CudaProcess:
    pid: int
    name: str
    gpu: str = ""  # the PCI slot of its GPU, as lspci names it ("01:00.0"); "" when nvidia-smi did not say
    # The pod it belongs to: the UID its /proc/PID/cgroup names (kubelet puts a pod's containers under
    # kubepods...pod<UID>...); "" for a host process or when the cgroup file could not be read.
    pod_uid: str = ""
    cgroup: str = ""  # the process's cgroup path (the unified hierarchy's line); "" when unreadable


def same_pci_slot(a: str, b: str) -> bool:
    """Whether two PCI addresses name one device: ``01:00.0``, ``0000:01:00.0`` (lspci -D) and
    ``00000000:01:00.0`` (nvidia-smi) alike, hex digits in either case."""
    def full(address: str) -> str:
        parts = address.strip().lower().split(":")
        if len(parts) == 2:
            parts.insert(0, "0")
        try:
            return f"{int(parts[0], 16):04x}:" + ":".join(parts[1:])
        except ValueError:
            return address.strip().lower()

    return bool(a) and bool(b) and full(a) == full(b)


@dataclass(frozen=True)
class XidEvent:
    """An Xid the kernel logged for one GPU since the host booted and since that GPU's last reset."""

    slot: str  # lspci's form, "01:00.0"
    code: int
    line: str = ""


@dataclass(frozen=True)
class RowRemap:
    """``nvidia-smi --query-remapped-rows`` of one GPU: a pending remap needs a reset of that GPU."""

    slot: str
    pending: bool = False
    failure: bool = False
    uncorrectable: int = 0


@dataclass(frozen=True)
class GpuHealth:
    """What the NVIDIA driver and tools say about the GPUs (docs/catalogue.md reads these).

    ``smi_rc``: nvidia-smi's exit code (None: no nvidia-smi); ``smi_error``: its first line that is
    not a result when it failed (``Failed to initialize NVML: Driver/library version mismatch``, a
    lost GPU). ``driver_version``: the loaded driver's (nvidia-smi); ``fabric_manager_version``: the
    installed nv-fabricmanager's ("" when none); ``nvswitches``: NVSwitch devices on the PCI bus;
    ``persistence``: slot -> persistence mode on."""

    smi_rc: int | None = None
    smi_error: str = ""
    xids: tuple[XidEvent, ...] = ()
    remaps: tuple[RowRemap, ...] = ()
    lost: tuple[str, ...] = ()  # slots of GPUs nvidia-smi says are lost (fallen off the bus)
    driver_version: str = ""
    fabric_manager_version: str = ""
    fabric_manager_state: str = ""  # systemctl is-active nvidia-fabricmanager ("" when not read)
    nvswitches: int = 0
    persistence: Mapping[str, bool] = field(default_factory=dict)

    def xids_on(self, slot: str) -> tuple[XidEvent, ...]:
        return tuple(x for x in self.xids if same_pci_slot(x.slot, slot))


@dataclass(frozen=True)
class FileFacts:
    """A file on the host that a runbook asked about (``runbook_files``), e.g. for ``file`` checks."""

    path: str
    exists: bool
    content: str = ""  # text, at most the first 64 KiB
    sha256: str = ""


@dataclass(frozen=True)
class HostFacts:
    """What the read-only node-facts playbook found on one node host."""

    host: str
    swap_devices: tuple[SwapDevice, ...] = ()
    fstab_active_swap: tuple[str, ...] = ()  # active (uncommented) fstab lines of type swap
    fstab: str | None = None  # /etc/fstab's text as read (None: the probe could not read it)
    unhandled_swap_sources: tuple[str, ...] = ()  # zram devices, *.swap units: not ours to switch off
    services: Mapping[str, ServiceFacts] = field(default_factory=dict)
    gpus: tuple[GpuDevice, ...] = ()
    driverctl: bool | None = None  # driverctl(8) installed (None: not probed, an older playbook copy)
    cuda_processes: tuple[CudaProcess, ...] = ()
    files: Mapping[str, FileFacts] = field(default_factory=dict)  # path -> facts, for asked-for paths
    gpu_health: GpuHealth = field(default_factory=GpuHealth)
    boot_id: str = ""  # /proc/sys/kernel/random/boot_id: a new one at every boot ("" when unreadable)

    @property
    def swap_active(self) -> bool:
        return bool(self.swap_devices)

    @property
    def gpu_driver(self) -> str:
        """The driver of the first NVIDIA GPU, or "none" when there is no GPU or no driver bound."""
        return self.gpus[0].driver if self.gpus else "none"

    def gpus_not_on(self, driver: str) -> tuple[GpuDevice, ...]:
        """The GPUs bound to another driver than ``driver`` (or to none)."""
        return tuple(g for g in self.gpus if g.driver != driver)

    def processes_on(self, gpu: GpuDevice) -> tuple[CudaProcess, ...]:
        """The host CUDA processes on ``gpu`` (by PCI slot)."""
        return tuple(p for p in self.cuda_processes if same_pci_slot(p.gpu, gpu.slot))

    def service(self, name: str) -> ServiceFacts:
        return self.services.get(name) or ServiceFacts(name=name, state="unknown")


@dataclass(frozen=True)
class ProbeError:
    """A probe that could not answer. Checks over it fail closed."""

    probe: str  # "node", "host", "objects:<query>"
    message: str


@dataclass(frozen=True)
class Facts:
    """Everything known about one target (a node and its host) at one moment."""

    node_name: str
    node: NodeFacts | None = None
    host: HostFacts | None = None
    objects: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    errors: tuple[ProbeError, ...] = ()
    gathered_at: float = 0.0
    # Seconds since ``host`` was probed when it was reused (the closing facts of an Ansible run
    # moments ago) instead of gathered by this call; None when gathered now.
    host_age: float | None = None
