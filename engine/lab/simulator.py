"""The lab's simulator daemon: plays kubelets, NFD/GFD, the GPU Operator and KubeVirt for a scenario.

Started by ``lab up`` as ``python -m engine.lab.simulator LAB_JSON`` (a background process with its
PID in the lab folder, logging to ``simulator.log``). Each tick (and on every watch event) it:

1. advances each host's kubelet unit (``sim_kubelet.step`` under the host state's lock); a kubelet
   whose client certificate expired and that found a bootstrap kubeconfig requests a new certificate
   from the API server with that token, and comes up once it is issued (``kubelet_certs``);
2. for each node whose kubelet runs: renews its Lease, posts its status (with the device plugins'
   resources), force-deletes its terminating pods, starts its pending ones and posts fresh statuses
   after a kubelet restart or a host reboot (``sim_pods``);
3. reconciles NFD/GFD labels, the operator's deploy labels, and vfio-manager's effect on the host's
   GPU driver and CUDA jobs (``sim_gpu``), NotReady nodes included. The operand pods are DaemonSet
   pods: the real daemonset controller and scheduler place them by the deploy labels;
4. reconciles VirtualMachines: VMI, virt-launcher pod, VMI and VM status (``sim_kubevirt``).

With ``metrics_port`` in its configuration (a lab with monitoring) it also serves the exporters of
``sim_metrics`` on 127.0.0.1, computed at scrape time from its watch caches and host states.

It never marks a node NotReady or taints it, nor its pods not ready: the real node lifecycle
controller does, once the heartbeats stop. It never creates nor schedules a DaemonSet's pod: the real
daemonset controller and kube-scheduler do. Must not touch anything but
the lab's API server and the lab's host state folders.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.lab import (
    kubelet_certs,
    sim_faults,
    sim_gpu,
    sim_kubelet,
    sim_kubevirt,
    sim_metrics,
    sim_nodes,
    sim_pods,
    simulator_pod_gpus,
)
from engine.lab.hoststate import HostState
from engine.lab.scenario import Node, Scenario, load_scenario
from engine.lab.sim_kube import LEASES, NODES, PODS, VMIS, VMS, Informer, Kube, Obj, rfc3339

log = logging.getLogger("runbook.lab.simulator")
CREATE_GRACE = 5.0  # seconds an object we created may take to show up in the watch cache
BOOTSTRAP_POLL_SECONDS = 1.0  # a bootstrapping kubelet looks at its certificate request this often


@dataclass
class NodeRuntime:
    """What the simulator remembers about one node between ticks (nothing it cannot re-derive)."""

    spec: Node
    host: HostState
    address: str
    state: dict[str, Any] = field(default_factory=dict)
    mtime: int = -1
    last_lease: float = 0.0
    last_status: float = 0.0
    status_key: str = ""
    layers_dir: str | None = None  # the SSH host's overlay layers (its kubelet's files: kubelet_certs)
    bootstrap_key: str = ""  # the private key of the kubelet's pending certificate request
    bootstrap_polled: float = 0.0  # when the pending request was last looked at


class Simulator:
    def __init__(self, config: dict[str, Any]) -> None:
        self.scenario: Scenario = load_scenario(config["scenario"])
        self.kube = Kube(config["kubeconfig"])
        self.nodes: dict[str, NodeRuntime] = {}
        for node in self.scenario.all_nodes:
            entry = config["nodes"][node.name]
            self.nodes[node.name] = NodeRuntime(node, HostState(entry["state_dir"]), entry["address"],
                                                layers_dir=entry.get("layers_dir"))
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.informers = {res.plural: Informer(self.kube, res, self.wake) for res in (NODES, PODS, VMS, VMIS)}
        self.created: dict[tuple[str, ...], float] = {}
        self.gpu_names = sim_gpu.gpu_resource_names(self.scenario)
        self.last_trim = 0.0
        self.metrics_port = int(config.get("metrics_port") or 0)
        self.host_pids = {name: int(pid or 0) for name, pid in (config.get("host_pids") or {}).items()}
        # node -> pid -> the CUDA process of a pod this simulator started (simulator_pod_gpus)
        self.pod_processes: dict[str, dict[int, subprocess.Popen[bytes]]] = {}

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        for informer in self.informers.values():
            informer.start()
        for informer in self.informers.values():
            informer.synced.wait(timeout=30)
        log.info("simulating %d nodes, %d VMs", len(self.nodes), len(self.scenario.vms))
        server = None
        if self.metrics_port:
            server = sim_metrics.make_metrics_server("127.0.0.1", self.metrics_port, self.lab_state)
            threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
            log.info("exporters on http://127.0.0.1:%d (/metrics, /kubevirt/metrics, /dcgm/metrics)",
                     self.metrics_port)
        tick = self.scenario.timing.tick_seconds
        while not self.stopping.is_set():
            self.wake.wait(tick)
            self.wake.clear()
            try:
                self.tick(time.time())
            except Exception:
                log.exception("tick failed; retrying")
                self.stopping.wait(0.5)
        for informer in self.informers.values():
            informer.stop()
        if server is not None:
            server.shutdown()
        for name, processes in self.pod_processes.items():
            for popen in processes.values():
                simulator_pod_gpus.end_process(popen, self.nodes[name].host.folder)

    def lab_state(self) -> sim_metrics.LabState:
        """What the exporters read at scrape time (called from the metrics server's thread)."""
        return sim_metrics.LabState(
            nodes=self.informers["nodes"].snapshot(), pods=self.informers["pods"].snapshot(),
            vmis=self.informers["virtualmachineinstances"].snapshot(),
            hosts={name: rt.state for name, rt in self.nodes.items() if rt.state})

    def stop(self, *_: Any) -> None:
        self.stopping.set()
        self.wake.set()

    def tick(self, now: float) -> None:
        timing = self.scenario.timing
        pods_by_node: dict[str, list[Obj]] = {}
        for pod in self.informers["pods"].snapshot():
            pods_by_node.setdefault(pod["spec"].get("nodeName") or "", []).append(pod)
        for rt in self.nodes.values():
            self._kubelet_unit(rt, now)
            self._tls_bootstrap(rt, now)
            api_node = self.informers["nodes"].get(rt.spec.name)
            pods = pods_by_node.get(rt.spec.name, [])
            healthy = bool(rt.state.get("kubelet", {}).get("healthy"))
            up_for = now - float(rt.state.get("kubelet", {}).get("healthy_since", now))
            running = self._running_operands(rt, pods, healthy, up_for, now)
            if healthy:
                if api_node is None:
                    api_node = self._register(rt, now)
                self._heartbeat(rt, api_node, running, now, pods)
                if up_for >= timing.operand_start_seconds or not self.scenario.gpu_operator.operand_pods:
                    self._kubelet_pods(rt, pods, now)
                else:
                    self._kubelet_pods(rt, [p for p in pods if p["metadata"].get("deletionTimestamp")], now)
            if api_node is not None and rt.spec.gpus:
                self._gpu(rt, api_node, running, healthy)
            if rt.spec.host.pod_cuda_jobs or rt.spec.name in self.pod_processes:
                self._pod_gpus(rt, pods, healthy)
        self._kubevirt(now)
        if now - self.last_trim > 60:
            self.last_trim = now
            for rt in self.nodes.values():
                rt.host.trim_journal()
            self.created = {k: t for k, t in self.created.items() if now - t < 60}

    # -- kubelet -----------------------------------------------------------------------------------
    def _kubelet_unit(self, rt: NodeRuntime, now: float) -> None:
        mtime = rt.host.mtime_ns()
        if mtime != rt.mtime:
            rt.state, rt.mtime = rt.host.read(), mtime
        timing = self.scenario.timing
        if not sim_kubelet.due(rt.state, now, timing.kubelet_start_seconds):
            return
        entries: list[Obj] = []

        # what kubelet finds at start: a bootstrap kubeconfig on its host (read when a start is due)
        bootstrap = kubelet_certs.host_file(rt.layers_dir, kubelet_certs.BOOTSTRAP_CONF) is not None

        def change(state: dict[str, Any]) -> None:
            state["kubelet"]["bootstrap_kubeconfig"] = bootstrap
            entries.extend(sim_kubelet.step(state, now, timing.kubelet_start_seconds,
                                            timing.kubelet_restart_seconds))

        rt.host.update(change)
        rt.host.append_entries(entries)
        rt.state, rt.mtime = rt.host.read(), rt.host.mtime_ns()
        kubelet = rt.state["kubelet"]
        if any("command failed" in e["msg"] or "Main process exited" in e["msg"] for e in entries):
            log.debug("%s: kubelet exited (restart counter %s)", rt.spec.name,
                      rt.state["units"]["kubelet"].get("restarts"))
        elif kubelet.get("healthy"):
            log.info("%s: kubelet is up", rt.spec.name)

    def _tls_bootstrap(self, rt: NodeRuntime, now: float) -> None:
        """A running kubelet with an expired certificate and a bootstrap kubeconfig requests a new
        certificate with the bootstrap token (one CSR per start) and comes up once it is issued."""
        kubelet, unit = rt.state.get("kubelet", {}), rt.state.get("units", {}).get("kubelet", {})
        if not (kubelet.get("client_cert_expired") and kubelet.get("bootstrap_kubeconfig")
                and unit.get("active") == "active" and kubelet.get("evaluated_generation") == unit.get("generation")):
            return
        generation = unit.get("generation")
        pending = kubelet.get("bootstrap") or {}
        text = kubelet_certs.host_file(rt.layers_dir, kubelet_certs.BOOTSTRAP_CONF)
        creds = kubelet_certs.bootstrap_credentials(text) if text is not None else None
        issued: str | None = None
        error = ""
        try:
            if creds is None:
                error = "invalid bootstrap kubeconfig /etc/kubernetes/bootstrap-kubelet.conf"
            elif pending.get("generation") != generation or not rt.bootstrap_key:
                name, rt.bootstrap_key = kubelet_certs.request_certificate(*creds, rt.spec.name)
                log.info("%s: kubelet requested its client certificate (CSR %s)", rt.spec.name, name)
                rt.host.update(lambda s: s["kubelet"].update(bootstrap={"generation": generation, "csr": name}))
                rt.state, rt.mtime = rt.host.read(), rt.host.mtime_ns()
                return
            elif now - rt.bootstrap_polled < BOOTSTRAP_POLL_SECONDS:
                return
            else:
                rt.bootstrap_polled = now
                issued = kubelet_certs.issued_certificate(*creds, str(pending["csr"]))
        except kubelet_certs.BootstrapRefused as e:
            error = "Unauthorized" if e.status == 401 else str(e)
        except OSError as e:
            log.warning("%s: certificate request: %s (retrying)", rt.spec.name, e)
            return
        if error:
            log.info("%s: kubelet's certificate request refused: %s", rt.spec.name, error)
            entries: list[Obj] = []
            rt.host.update(lambda s: entries.extend(sim_kubelet.fail_bootstrap(
                s, now, error, self.scenario.timing.kubelet_restart_seconds)))
            rt.host.append_entries(entries)
        elif issued is not None:
            (rt.host.folder / kubelet_certs.ISSUED_FILE).write_text(issued + rt.bootstrap_key)
            rt.bootstrap_key = ""
            log.info("%s: kubelet got its client certificate (CSR %s)", rt.spec.name, pending["csr"])
            rt.host.update(lambda s: s["kubelet"].update(client_cert_expired=False, bootstrap=None))
        else:
            return
        rt.state, rt.mtime = rt.host.read(), rt.host.mtime_ns()

    def _register(self, rt: NodeRuntime, now: float) -> Obj:
        """A running kubelet whose Node is gone registers it again."""
        manifest = sim_nodes.node_manifest(rt.spec, rt.address, {}, now)
        created = self.kube.create(NODES, manifest, exist_ok=True) or self.kube.get(NODES, rt.spec.name) or manifest
        log.info("%s: registered the node", rt.spec.name)
        return created

    def _heartbeat(self, rt: NodeRuntime, api_node: Obj, running: set[str], now: float,
                   pods: list[Obj] | None = None) -> None:
        timing = self.scenario.timing
        name = rt.spec.name
        if now - rt.last_lease >= timing.heartbeat_seconds:
            body = sim_nodes.lease_body(name, now, api_node["metadata"].get("uid"))
            if self.kube.patch(LEASES, name, {"spec": body["spec"]}, sim_nodes.LEASE_NAMESPACE) is None:
                self.kube.create(LEASES, body, sim_nodes.LEASE_NAMESPACE, exist_ok=True)
            rt.last_lease = now
        extended = self._advertised(rt, api_node, running)
        previous = api_node.get("status", {})
        status = sim_nodes.ready_status(rt.spec, rt.address, extended, previous, now,
                                        str(rt.state.get("boot", {}).get("id", "")))
        sim_faults.withhold(status, rt.state, pods or [])  # GPUs the device plugin reports Unhealthy
        key = json.dumps([status["capacity"], status["allocatable"], [c["status"] for c in status["conditions"]],
                          status["nodeInfo"]["bootID"]], sort_keys=True)
        ready: Obj = next((c for c in previous.get("conditions", []) if c["type"] == "Ready"), {})
        if key != rt.status_key or ready.get("status") != "True" or now - rt.last_status >= timing.status_seconds:
            self.kube.patch(NODES, name, {"status": status}, sub="status")
            if key != rt.status_key:
                log.info("%s: status posted (Ready=True, %s)", name,
                         {k: v for k, v in status["allocatable"].items() if k.startswith("nvidia.com/")})
            rt.status_key, rt.last_status = key, now

    def _kubelet_pods(self, rt: NodeRuntime, pods: list[Obj], now: float) -> None:
        booted_at = rt.state.get("boot", {}).get("at")
        for pod in pods:
            if sim_faults.crashlooping(rt.state, pod) and not pod["metadata"].get("deletionTimestamp"):
                body = sim_faults.crashloop_status(pod, now)  # `runbook lab inject device-plugin`
                if body is not None:
                    self.kube.patch(PODS, pod["metadata"]["name"], {"status": body}, pod["metadata"]["namespace"],
                                    sub="status")
                continue
            action = sim_pods.kubelet_action(pod, float(booted_at) if booted_at else None)
            if action is None:
                continue
            meta = pod["metadata"]
            if action == "delete":
                self.kube.delete(PODS, meta["name"], meta["namespace"], grace=0)
                continue
            key = ("status", meta["namespace"], meta["name"], pod["metadata"].get("resourceVersion", ""))
            if key in self.created:
                continue
            self.created[key] = now
            if action == "restart":
                body = sim_pods.restarted_status(pod, rt.address, now)
                log.info("%s: pod %s/%s restarted after the host's boot", rt.spec.name, meta["namespace"], meta["name"])
            elif action == "ready":
                body = sim_pods.ready_again(pod, now)
            else:
                restarts = sum(cs.get("restartCount", 0) for cs in pod.get("status", {}).get("containerStatuses", []))
                was_error = any("terminated" in cs.get("state", {})
                                for cs in pod.get("status", {}).get("containerStatuses", []))
                status = "Completed" if action == "complete" else "Running"
                body = sim_pods.pod_status(pod, status, rt.address, now, restarts + (1 if was_error else 0))
            self.kube.patch(PODS, meta["name"], {"status": body}, meta["namespace"], sub="status")

    # -- NFD, GFD, GPU Operator ----------------------------------------------------------------------
    def _operand_pods(self, pods: list[Obj]) -> dict[str, list[Obj]]:
        out: dict[str, list[Obj]] = {}
        for pod in pods:
            if pod["metadata"].get("namespace") != self.scenario.gpu_operator.namespace:
                continue
            operand = pod["metadata"].get("labels", {}).get(sim_gpu.OPERAND_LABEL)
            if operand:
                out.setdefault(operand, []).append(pod)
        return out

    def _running_operands(self, rt: NodeRuntime, pods: list[Obj], healthy: bool, up_for: float,
                          now: float) -> set[str]:
        """Operands running on the node now, with how long: {"device-plugin", "gfd-labelled", ...}."""
        if not healthy:
            return set()
        op = self.scenario.gpu_operator
        if not op.operand_pods:
            if up_for < self.scenario.timing.operand_start_seconds:
                return set()
            workload = sim_gpu.workload_of(self._labels(rt), op)
            names = set(sim_gpu.desired_operands(workload, op))
            if up_for >= self.scenario.timing.operand_start_seconds + self.scenario.timing.gfd_relabel_seconds:
                names.add("gfd-labelled")
            return names
        running: set[str] = set()
        for operand, items in self._operand_pods(pods).items():
            for pod in items:
                since = sim_pods.running_since(pod)
                if since is None:
                    continue
                running.add(operand)
                if operand == "gpu-feature-discovery" and now - since >= self.scenario.timing.gfd_relabel_seconds:
                    running.add("gfd-labelled")
        return running

    def _labels(self, rt: NodeRuntime) -> dict[str, str]:
        node = self.informers["nodes"].get(rt.spec.name) or {}
        return dict(node.get("metadata", {}).get("labels") or {})

    def _advertised(self, rt: NodeRuntime, api_node: Obj, running: set[str]) -> dict[str, int]:
        if not rt.spec.gpus:
            return {}
        labels = api_node["metadata"].get("labels") or {}
        workload = sim_gpu.workload_of(labels, self.scenario.gpu_operator)
        return sim_gpu.advertised(rt.state, self.scenario, workload, running)

    def _gpu(self, rt: NodeRuntime, api_node: Obj, running: set[str], healthy: bool) -> None:
        op = self.scenario.gpu_operator
        name = rt.spec.name
        labels = dict(api_node["metadata"].get("labels") or {})
        patch: dict[str, str | None] = {}
        if healthy:  # nfd-worker runs: it (re)reports the PCI devices
            patch.update({k: v for k, v in sim_gpu.nfd_labels(rt.state).items() if labels.get(k) != v})
        labels.update({k: v for k, v in patch.items() if v is not None})
        patch.update(sim_gpu.label_changes(labels, rt.state, self.scenario, "gfd-labelled" in running))
        if patch:
            self.kube.patch(NODES, name, {"metadata": {"labels": patch}})
            log.info("%s: labels %s", name, patch)
            labels.update({k: v for k, v in patch.items() if v is not None})
            for key in [k for k, v in patch.items() if v is None]:
                labels.pop(key, None)
        workload = sim_gpu.workload_of(labels, op)
        if healthy:
            self._driver_effects(rt, workload, "vfio-manager" in running)

    def _create_once(self, key: tuple[str, ...], manifest: Obj, namespace: str, now: float) -> None:
        if now - self.created.get(key, 0.0) < CREATE_GRACE:
            return
        self.created[key] = now
        pod = self.kube.create(PODS, manifest, namespace)
        log.info("created pod %s/%s", namespace, (pod or {}).get("metadata", {}).get("name"))

    def _driver_effects(self, rt: NodeRuntime, workload: str, vfio_running: bool) -> None:
        probe = json.loads(json.dumps(rt.state))
        if not sim_gpu.driver_effects(probe, workload, vfio_running):
            return
        result: dict[str, list[sim_gpu.Rebind]] = {}

        def change(state: dict[str, Any]) -> None:
            result["changes"] = sim_gpu.driver_effects(state, workload, vfio_running)

        rt.host.update(change)
        rt.state, rt.mtime = rt.host.read(), rt.host.mtime_ns()
        changes = result.get("changes", [])
        log.info("%s: GPU drivers now %s; rebound %s; CUDA jobs killed: %s", rt.spec.name,
                 {d["slot"]: d["driver"] for d in sim_gpu.displays(rt.state)},
                 [f"{c.slot} {c.before}->{c.after}" for c in changes], [p for c in changes for p in c.killed])
        rt.host.append_entries([{"ts": time.time(), "unit": "kernel", "ident": "kernel", "pid": 0,
                                 "msg": f"NVRM: GPU 0000:{c.slot}: rebound to {c.after}, "
                                        f"{len(c.killed)} CUDA process(es) lost the device"}
                                for c in changes if c.killed])

    def _pod_gpus(self, rt: NodeRuntime, pods: list[Obj], healthy: bool) -> None:
        """The GPUs of the node's running GPU pods and their CUDA processes (simulator_pod_gpus)."""
        processes = self.pod_processes.setdefault(rt.spec.name, {})
        host_pid = self.host_pids.get(rt.spec.name, 0)
        if rt.spec.host.pod_cuda_jobs and healthy and host_pid:
            probe = json.loads(json.dumps(rt.state))
            start, left = simulator_pod_gpus.assign(probe, pods)
            if start or left or probe.get("pod_gpus") != rt.state.get("pod_gpus"):
                result: dict[str, Any] = {}

                def change(state: dict[str, Any]) -> None:
                    result["start"], result["left"] = simulator_pod_gpus.assign(state, pods)

                rt.host.update(change)
                if result["left"]:
                    log.info("%s: CUDA processes %s left with their pods", rt.spec.name, result["left"])
                for job in result["start"]:
                    try:
                        popen = simulator_pod_gpus.start_process(host_pid, rt.host.folder, job["pod_uid"])
                    except (OSError, subprocess.SubprocessError) as e:
                        log.warning("%s: cannot start the CUDA process of pod %s: %s", rt.spec.name, job["pod"], e)
                        continue
                    if rt.host.update(functools.partial(simulator_pod_gpus.add_job, job=job, pid=popen.pid)):
                        processes[popen.pid] = popen
                        log.info("%s: pod %s runs CUDA process %d on GPU %s", rt.spec.name, job["pod"], popen.pid,
                                 job["gpu"])
                    else:
                        simulator_pod_gpus.end_process(popen, rt.host.folder)
                rt.state, rt.mtime = rt.host.read(), rt.host.mtime_ns()
        if processes:  # a job that left cuda_jobs (its pod went, a fault or a reboot took it): its process ends
            live = {int(j["pid"]) for j in rt.state.get("cuda_jobs", [])}
            for pid in [p for p in processes if p not in live]:
                simulator_pod_gpus.end_process(processes.pop(pid), rt.host.folder)

    # -- KubeVirt ----------------------------------------------------------------------------------------
    def _kubevirt(self, now: float) -> None:
        kv = self.scenario.kubevirt
        vmis = {Informer.key(v): v for v in self.informers["virtualmachineinstances"].snapshot()}
        launchers: dict[str, list[Obj]] = {}
        for pod in self.informers["pods"].snapshot():
            uid = pod["metadata"].get("labels", {}).get("kubevirt.io/created-by")
            if uid:
                launchers.setdefault(uid, []).append(pod)
        for vm in self.informers["virtualmachines"].snapshot():
            meta = vm["metadata"]
            key = Informer.key(vm)
            vmi = vmis.get(key)
            if sim_kubevirt.should_run(vm) and vmi is None:
                self._create_vmi(vm, now)
            elif not sim_kubevirt.should_run(vm) and vmi is not None:
                if not vmi["metadata"].get("deletionTimestamp"):
                    self.kube.delete(VMIS, meta["name"], meta["namespace"], grace=0)
                for pod in launchers.get(vmi["metadata"]["uid"], []):
                    self.kube.delete(PODS, pod["metadata"]["name"], meta["namespace"])
                vmi = None
            if vmi is not None:
                vmi = self._reconcile_vmi(vm, vmi, launchers.get(vmi["metadata"]["uid"], []), kv, now)
            status = sim_kubevirt.vm_status(vm, vmi)
            if _differs(vm.get("status", {}), status):
                self.kube.patch(VMS, meta["name"], {"status": status}, meta["namespace"], sub="status")
                if vm.get("status", {}).get("printableStatus") != status["printableStatus"]:
                    log.info("vm %s: %s", key, status["printableStatus"])

    def _create_vmi(self, vm: Obj, now: float) -> None:
        meta = vm["metadata"]
        key = ("vmi", meta["namespace"], meta["name"])
        if now - self.created.get(key, 0.0) < CREATE_GRACE:
            return
        self.created[key] = now
        self.kube.create(VMIS, sim_kubevirt.vmi_manifest(vm), meta["namespace"], exist_ok=True)

    def _reconcile_vmi(self, vm: Obj, vmi: Obj, pods: list[Obj], kv: Any, now: float) -> Obj:
        meta = vmi["metadata"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        pod = live[0] if live else None
        if pod is not None and pod.get("status", {}).get("phase") in ("Failed", "Succeeded"):
            self.kube.delete(PODS, pod["metadata"]["name"], meta["namespace"])
            self.kube.delete(VMIS, meta["name"], meta["namespace"], grace=0)  # runStrategy Always: a new one
            return vmi
        if pod is None:
            self._create_once(("launcher", meta["uid"]), sim_kubevirt.launcher_pod(vmi, kv), meta["namespace"], now)
        annotations = vm["metadata"].get("annotations") or {}
        status = sim_kubevirt.vmi_status(pod, annotations.get(sim_kubevirt.PAUSED_ANNOTATION) == "true",
                                         annotations.get(sim_kubevirt.UNSCHEDULABLE_SINCE), rfc3339(now),
                                         vmi.get("status"))
        if _differs(vmi.get("status", {}), status):
            self.kube.patch(VMIS, meta["name"], {"status": status}, meta["namespace"], sub="status")
            vmi = {**vmi, "status": {**vmi.get("status", {}), **status}}
        return vmi


def _differs(current: Obj, desired: Obj) -> bool:
    return any(current.get(k) != v for k, v in desired.items())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m engine.lab.simulator LAB_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    config = json.loads(Path(args[0]).read_text())
    sim = Simulator(config)
    signal.signal(signal.SIGTERM, sim.stop)
    signal.signal(signal.SIGINT, sim.stop)
    sim.run()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
