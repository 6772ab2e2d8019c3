"""The lab's exporters: kube-state-metrics, KubeVirt and DCGM-exporter series computed from the lab's state.

The simulator serves these on ``127.0.0.1:<metrics_port>`` (three paths, one per exporter, so that
Prometheus scrapes them as three jobs the way a cluster's Prometheus does):

* ``/metrics`` -- kube-state-metrics v2 (job ``kube-state-metrics``), from the real API objects the
  simulator watches: ``kube_node_status_condition{node,condition,status}``,
  ``kube_node_spec_unschedulable{node}``, ``kube_node_status_allocatable{node,resource,unit}``,
  ``kube_node_labels{node,label_*}`` (every label, as with ``--metric-labels-allowlist=nodes=[*]``),
  ``kube_node_spec_taint{node,key,value,effect}``, ``kube_pod_status_phase{namespace,pod,uid,phase}``;
* ``/kubevirt/metrics`` -- virt-controller's ``kubevirt_vmi_phase_count{node,phase,os,workload,flavor,
  instance_type,preference,guest_os_*}`` (phase lower-cased, ``<none>`` for unknown labels);
* ``/dcgm/metrics`` -- dcgm-exporter's ``DCGM_FI_DEV_FB_USED``, ``DCGM_FI_DEV_GPU_UTIL``, the last-Xid gauge
  ``DCGM_FI_DEV_XID_ERRORS``, ``DCGM_FI_DEV_(UN)CORRECTABLE_REMAPPED_ROWS``, ``DCGM_FI_DEV_ROW_REMAP_FAILURE``
  and ``DCGM_FI_DEV_ROW_REMAP_PENDING`` (from the host state's ``gpu_health``) per GPU
  (labels ``gpu,UUID,pci_bus_id,device,modelName,Hostname,DCGM_FI_DRIVER_VERSION``), only for GPUs
  bound to the nvidia driver (DCGM cannot see a GPU on vfio-pci), plus the lab's own
  ``runbook_lab_gpu_driver{Hostname,pci_bus_id,vendor_device,driver}`` (1 per GPU and bound driver;
  no real exporter has it, hence the prefix).

Names and labels follow the upstream exporters so that upstream rules (kubernetes-mixin) work
unmodified. This module computes series and serves them; it never writes to the API or a host.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.lab.ports import require_loopback

Obj = dict[str, Any]
DRIVER_VERSION = "570.133.07"  # what the lab's nvidia-smi shim reports
POD_PHASES = ("Pending", "Succeeded", "Failed", "Unknown", "Running")
_UNITS = {"cpu": "core", "memory": "byte", "ephemeral-storage": "byte", "pods": "integer"}
_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIX = {"": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
NONE = "<none>"


@dataclass(frozen=True)
class LabState:
    """What the exporters read at scrape time: API objects (from the simulator's watch caches) and
    each node's host state (GPU driver, CUDA jobs)."""

    nodes: list[Obj] = field(default_factory=list)
    pods: list[Obj] = field(default_factory=list)
    vmis: list[Obj] = field(default_factory=list)
    hosts: dict[str, Obj] = field(default_factory=dict)


def sanitize(name: str) -> str:
    """kube-state-metrics' label/resource name sanitising: every invalid character becomes ``_``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def quantity(text: str) -> float:
    """A Kubernetes quantity (``24``, ``500m``, ``64Gi``) as a float; ValueError when malformed."""
    match = _QUANTITY.match(str(text).strip())
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity: {text!r}")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


# -- kube-state-metrics --------------------------------------------------------------------------------
def kube_state_metrics(state: LabState) -> list[Metric]:
    condition = GaugeMetricFamily("kube_node_status_condition", "The condition of a cluster node.",
                                  labels=["node", "condition", "status"])
    unschedulable = GaugeMetricFamily("kube_node_spec_unschedulable",
                                      "Whether a node can schedule new pods.", labels=["node"])
    allocatable = GaugeMetricFamily("kube_node_status_allocatable",
                                    "The allocatable for different resources of a node that are available "
                                    "for scheduling.", labels=["node", "resource", "unit"])
    taint = GaugeMetricFamily("kube_node_spec_taint", "The taint of a cluster node.",
                              labels=["node", "key", "value", "effect"])
    phase = GaugeMetricFamily("kube_pod_status_phase", "The pods current phase.",
                              labels=["namespace", "pod", "uid", "phase"])
    out: list[Metric] = [condition, unschedulable, allocatable]
    for node in sorted(state.nodes, key=lambda n: n["metadata"]["name"]):
        name = node["metadata"]["name"]
        for c in node.get("status", {}).get("conditions", []):
            for status in ("true", "false", "unknown"):
                condition.add_metric([name, c["type"], status], 1.0 if str(c.get("status")).lower() == status else 0.0)
        unschedulable.add_metric([name], 1.0 if node.get("spec", {}).get("unschedulable") else 0.0)
        for resource, value in sorted(node.get("status", {}).get("allocatable", {}).items()):
            try:
                amount = quantity(value)
            except ValueError:
                continue
            allocatable.add_metric([name, sanitize(resource), _UNITS.get(resource, "integer")], amount)
        for t in node.get("spec", {}).get("taints") or []:
            taint.add_metric([name, t["key"], t.get("value", ""), t["effect"]], 1.0)
    out.append(_node_labels(state.nodes))
    out.append(taint)
    for pod in sorted(state.pods, key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"])):
        meta = pod["metadata"]
        current = pod.get("status", {}).get("phase") or "Pending"
        for p in POD_PHASES:
            phase.add_metric([meta.get("namespace", ""), meta["name"], meta.get("uid", ""), p],
                             1.0 if p == current else 0.0)
    out.append(phase)
    return out


def _node_labels(nodes: Iterable[Obj]) -> Metric:
    # one family, but each node has its own label names: build the samples by hand
    family = Metric("kube_node_labels", "Kubernetes labels converted to Prometheus labels.", "gauge")
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        labels = {"node": node["metadata"]["name"]}
        for key, value in sorted((node["metadata"].get("labels") or {}).items()):
            labels["label_" + sanitize(key)] = str(value)
        family.add_sample("kube_node_labels", labels, 1.0)
    return family


# -- KubeVirt ------------------------------------------------------------------------------------------
def kubevirt_metrics(state: LabState) -> list[Metric]:
    names = ["node", "phase", "os", "workload", "flavor", "instance_type", "preference",
             "guest_os_kernel_release", "guest_os_machine", "guest_os_name", "guest_os_version_id"]
    family = GaugeMetricFamily("kubevirt_vmi_phase_count",
                               "Sum of VMIs per phase and node. `phase` can be one of the following: "
                               "[`Pending`, `Scheduling`, `Scheduled`, `Running`, `Succeeded`, `Failed`, "
                               "`Unknown`].", labels=names)
    counts: dict[tuple[str, ...], int] = {}
    for vmi in state.vmis:
        status = vmi.get("status", {})
        notes = vmi["metadata"].get("annotations") or {}
        guest = status.get("guestOSInfo") or {}
        key: tuple[str, ...] = (str(status.get("nodeName", "")), str(status.get("phase", "")).lower(),
               notes.get("vm.kubevirt.io/os", NONE), notes.get("vm.kubevirt.io/workload", NONE),
               notes.get("vm.kubevirt.io/flavor", NONE), NONE, NONE,
               guest.get("kernelRelease") or NONE, guest.get("machine") or NONE,
               guest.get("name") or NONE, guest.get("versionId") or NONE)
        counts[key] = counts.get(key, 0) + 1
    for key, count in sorted(counts.items()):
        family.add_metric(list(key), float(count))
    return [family]


# -- DCGM exporter -------------------------------------------------------------------------------------
def gpu_uuid(device: Obj) -> str:
    """The UUID the lab's nvidia-smi shows for a GPU (stable, derived from slot and PCI id)."""
    digits = "".join(c for c in device["slot"] + device["vendor_device"] if c.isalnum()).ljust(32, "0")
    return f"GPU-{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:32]}"


def model_name(device: Obj) -> str:
    """``GB202 [GeForce RTX 5090]`` -> ``NVIDIA GeForce RTX 5090`` (what DCGM calls ``modelName``)."""
    name = str(device.get("name", ""))
    inner = name[name.find("[") + 1 : name.rfind("]")] if "[" in name else name
    return f"NVIDIA {inner}".strip()


def job_slot(job: dict[str, Any], first_nvidia: str | None) -> str | None:
    """The slot of the GPU a host CUDA job runs on (without one: the first GPU on nvidia)."""
    return str(job["gpu"]) if job.get("gpu") else first_nvidia


def dcgm_metrics(state: LabState) -> list[Metric]:
    names = ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION"]
    fb_used = GaugeMetricFamily("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", labels=names)
    util = GaugeMetricFamily("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", labels=names)
    # dcgm-exporter's health series (etc/default-counters.csv): the last Xid (a gauge, not a counter),
    # the remapped rows and the remap failure; the pending remap is DCGM's field 394 (not a default counter)
    xid = GaugeMetricFamily("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", labels=names)
    rows_corr = GaugeMetricFamily("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
                                  "Number of remapped rows for correctable errors.", labels=names)
    rows_unc = GaugeMetricFamily("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                                 "Number of remapped rows for uncorrectable errors.", labels=names)
    remap_failure = GaugeMetricFamily("DCGM_FI_DEV_ROW_REMAP_FAILURE",
                                      "Whether remapping of rows has failed.", labels=names)
    remap_pending = GaugeMetricFamily("DCGM_FI_DEV_ROW_REMAP_PENDING",
                                      "Whether remapping of rows is pending (a GPU reset applies it).", labels=names)
    driver = GaugeMetricFamily("runbook_lab_gpu_driver", "1 per GPU and the kernel driver it is bound to "
                               "(the lab's own series; vfio-pci GPUs are invisible to DCGM).",
                               labels=["Hostname", "pci_bus_id", "vendor_device", "driver"])
    for host_name, host in sorted(state.hosts.items()):
        gpus = [d for d in host.get("pci_devices", []) if d.get("display")]
        jobs = host.get("cuda_jobs", [])
        first = next((d["slot"] for d in sorted(gpus, key=lambda d: d["slot"]) if d.get("driver") == "nvidia"), None)
        index = 0
        for device in sorted(gpus, key=lambda d: d["slot"]):
            bus = f"00000000:{device['slot']}"
            driver.add_metric([host_name, bus, device["vendor_device"], str(device.get("driver", "none"))], 1.0)
            if device.get("driver") != "nvidia":
                continue
            labels = [str(index), gpu_uuid(device), bus, f"nvidia{index}", model_name(device), host_name,
                      DRIVER_VERSION]
            used = sum(int(j.get("used_memory_mib", 0)) for j in jobs if job_slot(j, first) == device["slot"])
            fb_used.add_metric(labels, float(used))
            util.add_metric(labels, 100.0 if used else 0.0)
            health = (host.get("gpu_health") or {}).get(device["slot"]) or {}
            xid.add_metric(labels, float(health.get("xid", 0)))
            rows_corr.add_metric(labels, float(health.get("rows_correctable", 0)))
            rows_unc.add_metric(labels, float(health.get("rows_uncorrectable", 0)))
            remap_failure.add_metric(labels, 1.0 if health.get("remap_failure") else 0.0)
            remap_pending.add_metric(labels, 1.0 if health.get("remap_pending") else 0.0)
            index += 1
    return [fb_used, util, xid, rows_corr, rows_unc, remap_failure, remap_pending, driver]


# -- serving -------------------------------------------------------------------------------------------
class _Exporter(Collector):
    def __init__(self, source: Callable[[], LabState], compute: Callable[[LabState], list[Metric]]) -> None:
        self.source, self.compute = source, compute

    def collect(self) -> Iterator[Metric]:
        yield from self.compute(self.source())


EXPORTERS: dict[str, Callable[[LabState], list[Metric]]] = {
    "/metrics": kube_state_metrics, "/kubevirt/metrics": kubevirt_metrics, "/dcgm/metrics": dcgm_metrics}


def wsgi_app(source: Callable[[], LabState]) -> Callable[..., Any]:
    """One WSGI app serving the three exporters at their paths (404 elsewhere)."""
    apps = {}
    for path, compute in EXPORTERS.items():
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Exporter(source, compute))
        apps[path] = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        target = apps.get(environ.get("PATH_INFO", ""))
        if target is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: /metrics, /kubevirt/metrics, /dcgm/metrics\n"]
        environ = {**environ, "PATH_INFO": "/metrics"}
        return target(environ, start_response)

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


def make_metrics_server(address: str, port: int, source: Callable[[], LabState]) -> WSGIServer:
    """A WSGI server on loopback ``address:port`` (call ``serve_forever`` in a thread)."""
    require_loopback(address)
    return make_server(address, port, wsgi_app(source), handler_class=_QuietHandler)
