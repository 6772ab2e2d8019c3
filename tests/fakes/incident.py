"""The omen2 incident on the fakes: its node and host as facts, and scripted host behaviour.

``incident_node``/``incident_host`` (swap on, kubelet refusing, the workload label on
vm-passthrough), ``healthy_node``/``healthy_host``; ``install_recovery_effects``: what swap-off and
restart-kubelet do on fake time; ``install_gpu_host``: the shipped flagship's playbooks on a fake
omen2, kubelet coming back by itself after swap-off or not, and vfio-manager killing the host's
CUDA jobs when kubelet comes back before the relabel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from engine.facts import HostFacts, NodeFacts, ServiceFacts
from tests.fakes.hosts import FakeNodes, make_host
from tests.fakes.kube import FakeKube, make_node

GPU_LABEL = "nvidia.com/gpu.workload.config"
SWAP_REFUSAL = ('E0710 15:39:51 run.go:72] "command failed" err="failed to run Kubelet: running with swap on is '
                'not supported, please disable swap or set --fail-swap-on flag to false"')


def incident_node(name: str = "omen2") -> NodeFacts:
    return make_node(name, ready=False, labels={GPU_LABEL: "vm-passthrough"},
                     allocatable={"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "0"})


def incident_host(name: str = "omen2", cuda: int = 0) -> HostFacts:
    return make_host(name, swap=True, fstab_swap=True, kubelet="activating", journal=SWAP_REFUSAL, cuda=cuda)


def healthy_node(name: str = "omen2") -> NodeFacts:
    return make_node(name, ready=True, labels={GPU_LABEL: "container"},
                     allocatable={"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1"})


def healthy_host(name: str = "omen2") -> HostFacts:
    return make_host(name, kubelet="active")


def install_recovery_effects(kube: FakeKube, nodes: FakeNodes, *, ready_after: float | None = 20.0,
                             gpu_after: float | None = 40.0) -> None:
    """swap-off.yml turns swap off; restart-kubelet.yml starts kubelet, and (on fake time) the node
    turns Ready ``ready_after`` s later and advertises its GPU ``gpu_after`` s later (None: never)."""

    def swap_off(fn: FakeNodes, node: str, _: Mapping[str, Any]) -> None:
        fn.update(node, swap_devices=(), fstab_active_swap=())

    def restart_kubelet(fn: FakeNodes, node: str, _: Mapping[str, Any]) -> None:
        h = fn.hosts[node]
        assert isinstance(h, HostFacts)
        if h.swap_active:
            return  # kubelet refuses again
        fn.update(node, services={"kubelet": ServiceFacts("kubelet", "active")})
        if ready_after is not None:
            fn.clock.after(ready_after, lambda: kube.set_ready(node, True))
        if gpu_after is not None:
            fn.clock.after(gpu_after, lambda: kube.set_allocatable(node, "nvidia.com/gpu", "1"))

    nodes.effects["swap-off.yml"] = swap_off
    nodes.effects["restart-kubelet.yml"] = restart_kubelet


# ------------------------------------------------------------------------------------------------
# The shipped flagship's host, with the behaviour its step order guards against
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class KubeletComeback:
    """One time kubelet came back on a fake GPU host: why, and the workload label at that moment."""

    cause: str  # "restart-kubelet.yml" or "auto-restart"
    label: str | None
    killed: tuple[int, ...]  # host CUDA pids vfio-manager killed then


@dataclasses.dataclass
class GpuHostLog:
    """What happened to a fake GPU host, seen from outside the engine, in order.

    ``effects``: ``label=<value>`` for each label PATCH (the API server's view), then the playbook
    names as they acted (the host's view); ``comebacks``: each time kubelet came back."""

    effects: list[str] = dataclasses.field(default_factory=list)
    comebacks: list[KubeletComeback] = dataclasses.field(default_factory=list)


def install_gpu_host(kube: FakeKube, nodes: FakeNodes, node: str = "omen2", *, auto_restart: bool,
                     ready_after: float = 5.0, gpu_after: float = 10.0,
                     stuck: frozenset[str] = frozenset()) -> GpuHostLog:
    """What the shipped gpu-node-recovery's playbooks do to a fake omen2, and what the GPU Operator does next.

    * ``swap-off.yml``: swap off, fstab's swap entry commented out. With ``auto_restart`` kubelet's
      own ``Restart=always`` brings it back at once (a real node's systemd; the lab's); without it
      kubelet stays down (``systemctl stop kubelet``) until ``restart-kubelet.yml``.
    * ``restart-kubelet.yml``: kubelet comes back unless swap is still on (it refuses again).
    * Whenever kubelet comes back while the node's workload label is not ``container``, vfio-manager
      rebinds every GPU to vfio-pci and kills every host CUDA job on them (the incident's danger); the
      node then never advertises nvidia.com/gpu. Otherwise a GPU left on vfio-pci loses its driver
      (vfio-manager's preStop; no job dies: none runs on it), the node turns Ready ``ready_after`` s
      later and advertises its GPUs on nvidia ``gpu_after`` s later (fake time; 0: at once).
    * ``gpu-bind-driver.yml``: binds every GPU that is not on nvidia to nvidia, except the slots in
      ``stuck`` (a GPU the driver does not take: the playbook reports no error, the GPU stays put).

    Returns the log, appended to as things happen (tests assert it, not only the run's outcome).
    """
    log = GpuHostLog()

    def label_patched(name: str, patch: Any) -> None:
        labels = ((patch.get("metadata") or {}).get("labels") or {}) if isinstance(patch, dict) else {}
        if name == node and GPU_LABEL in labels:
            log.effects.append(f"label={labels[GPU_LABEL]}")

    def come_back(fn: FakeNodes, cause: str) -> None:
        h = fn.hosts[node]
        assert isinstance(h, HostFacts)
        label = kube.nodes[node].labels.get(GPU_LABEL) if node in kube.nodes else None
        killed: tuple[int, ...] = ()
        changes: dict[str, Any] = {"services": {**h.services, "kubelet": ServiceFacts("kubelet", "active")}}
        if label != "container":
            killed = tuple(p.pid for p in h.cuda_processes)
            changes.update(cuda_processes=(), gpus=tuple(replace(g, driver="vfio-pci") for g in h.gpus))
        else:
            changes.update(gpus=tuple(replace(g, driver="none") if g.driver == "vfio-pci" else g for g in h.gpus))
        fn.update(node, **changes)
        log.comebacks.append(KubeletComeback(cause, label, killed))
        fn.clock.after(ready_after, lambda: kube.set_ready(node, True))

        def advertise() -> None:
            now = fn.hosts[node]
            assert isinstance(now, HostFacts)
            kube.set_allocatable(node, "nvidia.com/gpu", str(len(now.gpus) - len(now.gpus_not_on("nvidia"))))

        if not killed:
            fn.clock.after(gpu_after, advertise)

    def swap_off(fn: FakeNodes, host: str, _: Mapping[str, Any]) -> None:
        log.effects.append("swap-off.yml")
        fn.update(host, swap_devices=(), fstab_active_swap=())
        if auto_restart:
            come_back(fn, "auto-restart")

    def restart_kubelet(fn: FakeNodes, host: str, _: Mapping[str, Any]) -> None:
        log.effects.append("restart-kubelet.yml")
        h = fn.hosts[host]
        assert isinstance(h, HostFacts)
        if not h.swap_active:
            come_back(fn, "restart-kubelet.yml")

    def bind_gpus(fn: FakeNodes, host: str, evars: Mapping[str, Any]) -> None:
        log.effects.append("gpu-bind-driver.yml")
        h = fn.hosts[host]
        assert isinstance(h, HostFacts)
        driver = str(evars.get("driver", "nvidia"))
        fn.update(host, gpus=tuple(g if g.slot in stuck else replace(g, driver=driver) for g in h.gpus))

    kube.on_patch = label_patched
    nodes.effects["swap-off.yml"] = swap_off
    nodes.effects["restart-kubelet.yml"] = restart_kubelet
    nodes.effects["gpu-bind-driver.yml"] = bind_gpus
    return log
