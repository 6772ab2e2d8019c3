"""``runbook lab``'s library: bring the lab up, describe it, change a host's CUDA jobs, reset it, tear it down.

A lab lives in one folder (default ``${XDG_STATE_HOME:-~/.local/state}/runbook/lab``, or
``$RUNBOOK_LAB_DIR``) holding ``lab.json`` (what runs: control plane, node hosts by PID and start time,
the simulator), the control plane's state, the node hosts' workdir and inventory, each node's host
state folder, and ``simulator.log``; with monitoring, ``monitoring/`` (Prometheus and Alertmanager,
see ``monitoring``). Every function returns values; the CLI (``labcli``) prints them.

Must not: stop a process other than by its recorded PID and start time, touch this machine's swap,
fstab or services, or listen anywhere but loopback.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from engine.lab import cluster_mode, kubelet_certs, podspec, procs, sim_faults, sim_gpu, sim_seed
from engine.lab.controlplane import LAB_CONTROLLERS, ControlPlane, ControlPlaneSettings
from engine.lab.errors import LabError
from engine.lab.hoststate import HostState
from engine.lab.monitoring import DEFAULT_WEBHOOK, Monitoring
from engine.lab.nodehosts import NodeHost, NodeHostSet, NodeHostSpec, start_node_hosts
from engine.lab.ports import free_loopback_block, free_port
from engine.lab.scenario import Scenario, load_scenario, starts_ready
from engine.lab.sim_kube import NODES, PODS, VMS, Kube

LAB_FILE = "lab.json"
SHIMS_DIR = Path(__file__).resolve().parent / "shims"
PROC_FILES = {"/proc/swaps": "proc_swaps", "/proc/sys/kernel/random/boot_id": "boot_id"}
UNREACHABLE = "node.kubernetes.io/unreachable"
Progress = Callable[[str], object]


def default_lab_dir() -> Path:
    if os.environ.get("RUNBOOK_LAB_DIR"):
        return Path(os.environ["RUNBOOK_LAB_DIR"]).expanduser().resolve()
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return (base / "runbook" / "lab").resolve()


def _quiet(_: str) -> None:
    return None


class Lab:
    """One lab folder. ``up`` is idempotent; ``down`` leaves nothing behind."""

    def __init__(self, lab_dir: Path | str | None = None) -> None:
        self.dir = Path(lab_dir).resolve() if lab_dir else default_lab_dir()

    # -- the record ---------------------------------------------------------------------------------
    @property
    def record_path(self) -> Path:
        return self.dir / LAB_FILE

    def record(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.record_path.read_text()))
        except (OSError, ValueError) as e:
            raise LabError(f"no lab in {self.dir} (run `runbook lab up`)") from e

    def _save(self, record: dict[str, Any]) -> None:
        tmp = self.record_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
        tmp.replace(self.record_path)

    def exists(self) -> bool:
        return self.record_path.exists()

    def running(self) -> bool:
        """Every process the lab started is alive."""
        if not self.exists():
            return False
        record = self.record()
        refs = [procs.ProcessRef.from_json(h["process"]) for h in record["hosts"].values()]
        refs.append(procs.ProcessRef.from_json(record["simulator"]))
        if record.get("monitoring") and not self.monitoring(record).running():
            return False
        if record.get("cluster_mode") and not procs.ProcessRef.from_json(record["cluster_mode"]["supervisor"]).alive():
            return False
        return all(r.alive() for r in refs) and ControlPlane.from_state(record["controlplane_dir"]).is_running()

    def monitoring(self, record: dict[str, Any] | None = None) -> Monitoring:
        """The lab's Prometheus + Alertmanager (``record['monitoring']`` empty when not started)."""
        record = record if record is not None else self.record()
        return Monitoring(self.dir / "monitoring", record.get("monitoring"))

    def scenario(self) -> Scenario:
        return load_scenario(self.record()["scenario"])

    def kube(self) -> Kube:
        """A client as the lab's own user (``lab-simulator``): the audit log keeps the engine's
        (admin) mutations apart from the lab's seeding and simulation."""
        record = self.record()
        return Kube(record.get("simulator_kubeconfig") or record["kubeconfig"])

    # -- up -----------------------------------------------------------------------------------------
    def up(self, scenario_path: Path | str | None = None, *, timeout: float = 180.0,
           progress: Progress = _quiet, with_monitoring: bool = False, alert_webhook: str | None = None,
           webhook_token: str | None = None, monitoring_rules: tuple[Path, ...] = (),
           with_cluster_mode: bool = False, cluster_base: Path | str | None = None) -> dict[str, Any]:
        """Start control plane, node hosts and simulator; wait until the scenario's state is reached.
        With monitoring (``with_monitoring`` or the scenario's ``monitoring: true``) also start
        Prometheus and Alertmanager (``start_monitoring``). With cluster mode, first run the base's
        Deployment as pods (``start_cluster_mode``): Alertmanager then pages its Service."""
        def monitoring_up() -> str:
            return self.start_monitoring(alert_webhook=alert_webhook, webhook_token=webhook_token,
                                         extra_rules=monitoring_rules)

        def cluster_mode_up() -> str:
            return self.start_cluster_mode(cluster_base, progress=progress)

        if self.exists():
            if self.running():
                wanted = str(Path(scenario_path).resolve()) if scenario_path else None
                if wanted and wanted != self.record()["scenario"]:
                    raise LabError(f"a lab with scenario {self.record()['scenario']} runs in {self.dir}: "
                                   "run `runbook lab down` first")
                progress(f"lab already running in {self.dir}")
                added: list[str] = []
                if with_cluster_mode and not self.record().get("cluster_mode"):
                    added.append(cluster_mode_up())
                    progress(added[-1])
                if (with_monitoring or self.scenario().monitoring) and not self.record().get("monitoring"):
                    added.append(monitoring_up())
                    progress(added[-1])
                return self.summary(started=added)
            progress("a previous lab is partly down: cleaning it up first")
            self.down()
        scenario_file = Path(scenario_path).resolve() if scenario_path else None
        scenario = load_scenario(scenario_file)
        if scenario_file is None:
            from engine.lab.scenario import default_scenario_path

            scenario_file = default_scenario_path()
        self.dir.mkdir(parents=True, exist_ok=True)
        started: list[str] = []
        record: dict[str, Any] = {"version": 1, "scenario": str(scenario_file), "hosts": {}, "nodes": {},
                                  "simulator": {"pid": 0, "start_time": -1},
                                  "controlplane_dir": str(self.dir / "controlplane")}
        try:
            with contextlib.suppress(ImportError):
                from engine.lab.assets import ensure_assets

                ensure_assets(progress)
            settings = ControlPlaneSettings(**{"controllers": LAB_CONTROLLERS, **scenario.control_plane})
            plane = ControlPlane(self.dir / "controlplane", settings=settings).start()
            record.update(kubeconfig=str(plane.kubeconfig), simulator_kubeconfig=str(plane.simulator_kubeconfig),
                          api_url=plane.url)
            self._save(record)
            started.append(f"control plane at {plane.url} (pids {sorted(plane.pids().values())})")
            progress(started[-1])
            self._start_hosts(scenario, record, progress, started)
            self._seed_kubelet_files(scenario, record)
            kube = self.kube()
            sim_seed.seed_cluster(kube, scenario, self._addresses(record), self._host_states(record))
            self._start_simulator(record)
            started.append(f"simulator (pid {record['simulator']['pid']}, log {self.dir / 'simulator.log'})")
            progress(started[-1])
            self._wait_for_scenario(kube, scenario, timeout, progress, self._addresses(record))
            kube.close()
            if with_cluster_mode:
                started.append(cluster_mode_up())
                progress(started[-1])
            if with_monitoring or scenario.monitoring:
                started.append(monitoring_up())
                progress(started[-1])
        except BaseException:
            progress("start-up failed: stopping what was started")
            with contextlib.suppress(Exception):
                self.down()
            raise
        return self.summary(started=started)

    def _start_hosts(self, scenario: Scenario, record: dict[str, Any], progress: Progress,
                     started: list[str]) -> None:
        password = secrets.token_urlsafe(12)
        record["become_password"] = password
        workdir = self.dir / "nodehosts"
        ssh_nodes = [n for n in scenario.all_nodes if n.host.ssh]
        specs = [NodeHostSpec(name=n.name, sudo=n.host.sudo, become_password=password,
                              fstab=sim_seed.fstab_text(n)) for n in ssh_nodes]
        for spec in specs:  # the state folders exist before the hosts bind-mount them
            (workdir / "hosts" / spec.name / "state").mkdir(parents=True, exist_ok=True)
        others = [n for n in scenario.all_nodes if not n.host.ssh]
        fake = free_loopback_block(min(len(others), 254)) if others else []
        for i, node in enumerate(others):
            folder = self.dir / "nodes" / node.name
            folder.mkdir(parents=True, exist_ok=True)
            record["nodes"][node.name] = {"state_dir": str(folder), "address": fake[i % len(fake)], "ssh": False}
        # initial state (proc_swaps included) before the hosts start: they bind-mount it
        for node in ssh_nodes:
            record["nodes"][node.name] = {"state_dir": str(workdir / "hosts" / node.name / "state"),
                                          "address": "", "ssh": True}
        self._initialise_hosts(scenario, record)
        hostset = start_node_hosts(specs, workdir, shims_dir=SHIMS_DIR, proc_files=PROC_FILES) if specs else None
        if hostset is not None:
            record["inventory"] = str(hostset.inventory_path)
            for host in hostset:
                record["nodes"][host.name]["address"] = host.address
                record["nodes"][host.name]["layers_dir"] = str(host.layers_dir)  # kubelet's files (kubelet_certs)
                record["hosts"][host.name] = {
                    "address": host.address, "password": host.password, "host_dir": str(host.host_dir),
                    "layers_dir": str(host.layers_dir), "fstab": host.fstab, "sudo": host.spec.sudo,
                    "process": host.ref.to_json() if host.ref else {"pid": 0, "start_time": -1},
                    "mount_namespace": host.mount_namespace, "uts_namespace": host.uts_namespace,
                    "workdir": str(workdir)}
            started.append(f"{len(hostset)} node hosts: " + ", ".join(f"{h.name}@{h.address}" for h in hostset)
                           + f" (inventory {hostset.inventory_path})")
            progress(started[-1])
        self._save(record)

    def _addresses(self, record: dict[str, Any]) -> dict[str, str]:
        return {name: entry["address"] for name, entry in record["nodes"].items()}

    def _host_states(self, record: dict[str, Any]) -> dict[str, dict[str, Any]]:
        return {name: HostState(entry["state_dir"]).read() for name, entry in record["nodes"].items()}

    def _initialise_hosts(self, scenario: Scenario, record: dict[str, Any]) -> None:
        now = time.time()
        for node in scenario.all_nodes:
            state, journal = sim_seed.host_state(node, scenario, now)
            HostState(record["nodes"][node.name]["state_dir"]).initialise(state, journal)

    def _start_simulator(self, record: dict[str, Any]) -> None:
        if not record.get("metrics_port"):  # the exporters' port stays the same across resets
            record["metrics_port"] = free_port("127.0.0.1")
        config = {"scenario": record["scenario"], "kubeconfig": record["simulator_kubeconfig"],
                  "nodes": record["nodes"], "metrics_port": record["metrics_port"],
                  # each SSH host's init (its namespaces): where the pods' CUDA processes run
                  "host_pids": {name: h.get("process", {}).get("pid", 0)
                                for name, h in record.get("hosts", {}).items()}}
        config_path = self.dir / "simulator.json"
        config_path.write_text(json.dumps(config, indent=2))
        with (self.dir / "simulator.log").open("ab") as log:
            popen = subprocess.Popen([sys.executable, "-m", "engine.lab.simulator", str(config_path)],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.dir, start_new_session=True, close_fds=True)
        ref = procs.ProcessRef.of(popen.pid)
        record["simulator"] = ref.to_json()
        (self.dir / "simulator.pid").write_text(f"{popen.pid}\n")
        self._save(record)

    def _stop_simulator(self, record: dict[str, Any]) -> None:
        ref = procs.ProcessRef.from_json(record["simulator"])
        procs.stop_processes([ref], timeout=10.0, reap=procs.reap_child)

    # -- monitoring -----------------------------------------------------------------------------------
    def start_monitoring(self, *, alert_webhook: str | None = None, webhook_token: str | None = None,
                         extra_rules: tuple[Path, ...] | list[Path] = ()) -> str:
        """Start Prometheus (scraping the simulator's exporters, with the lab's rules and
        ``extra_rules``) and Alertmanager (paging ``alert_webhook`` with ``webhook_token``, by default
        runbook serve's default address and ``$RUNBOOK_WEBHOOK_TOKEN`` or a new token)."""
        record = self.record()
        if record.get("monitoring"):
            raise LabError(f"the lab in {self.dir} already has monitoring")
        if not record.get("metrics_port"):  # a lab started before the exporters existed
            self._stop_simulator(record)
            self._start_simulator(record)
        hosts: dict[str, str] = {}
        cluster = record.get("cluster_mode")
        if cluster and not alert_webhook:
            # the in-cluster Alertmanager's way: the Service's DNS name (resolved by Alertmanager's own
            # /etc/hosts, as cluster DNS would) and the sender token the Secret holds
            alert_webhook = f"{cluster['service_dns_url']}/hooks/alertmanager"
            webhook_token = webhook_token or cluster["webhook_token"]
            hosts = {cluster["service_dns"]: cluster["service_ip"]}
        token = webhook_token or os.environ.get("RUNBOOK_WEBHOOK_TOKEN") or secrets.token_urlsafe(24)
        monitoring = self.monitoring(record)
        record["monitoring"] = monitoring.start(self.scenario().timing, record["metrics_port"],
                                                webhook_url=alert_webhook or DEFAULT_WEBHOOK, token=token,
                                                extra_rules=tuple(Path(r) for r in extra_rules), hosts=hosts)
        self._save(record)
        ends = monitoring.endpoints
        return (f"monitoring: Prometheus {ends.prometheus}, Alertmanager {ends.alertmanager} "
                f"(paging {record['monitoring']['webhook_url']}), exporters {ends.exporters}")

    def scrape_serve(self, name: str, address: str, *, token: str | None = None) -> None:
        """Have the lab's Prometheus scrape a ``runbook serve`` at ``address`` (job ``runbook-serve``)."""
        record = self.record()
        if not record.get("monitoring"):
            raise LabError(f"the lab in {self.dir} has no monitoring (runbook lab up --with-monitoring)")
        monitoring = self.monitoring(record)
        monitoring.add_scrape_target(name, address, token=token)
        record["monitoring"] = monitoring.record
        self._save(record)

    def stop_monitoring(self) -> list[str]:
        """Stop Prometheus and Alertmanager (by PID) and remove their folder; the lab runs on."""
        record = self.record()
        if not record.get("monitoring"):
            return []
        stopped = self.monitoring(record).stop()
        record.pop("monitoring")
        self._save(record)
        shutil.rmtree(self.dir / "monitoring", ignore_errors=True)
        return stopped

    # -- cluster mode ---------------------------------------------------------------------------------------
    def start_cluster_mode(self, base: Path | str | None = None, *, progress: Progress = _quiet,
                           timeout: float = 180.0) -> str:
        """Apply deploy/kubernetes (``base``) to the lab and run its Deployment's replicas as pods
        (``engine.lab.cluster_mode``); wait until every replica is ready behind the Service."""
        record = self.record()
        if record.get("cluster_mode"):
            raise LabError(f"the lab in {self.dir} already runs cluster mode")
        if not record.get("inventory"):
            raise LabError("cluster mode needs the lab's SSH node hosts")
        base_dir = Path(base).resolve() if base else cluster_mode.default_base()
        folder = self.dir / "cluster-mode"
        home = folder / "home"
        home.mkdir(parents=True, exist_ok=True)
        admin = record["kubeconfig"]
        progress(f"rendering {base_dir} with kustomize")
        work = podspec.split_rendered(cluster_mode.render(admin, home, base_dir))
        inputs = cluster_mode.lab_inputs(work)
        workdir = Path(next(iter(record["hosts"].values()))["workdir"])
        overlay = cluster_mode.write_overlay(folder / "overlay", base_dir, work, inputs,
                                             yaml.safe_load(Path(record["inventory"]).read_text()),
                                             (workdir / "known_hosts").read_text())
        objects = cluster_mode.render(admin, home, overlay)
        work = podspec.split_rendered(objects)
        applied, notes = cluster_mode.served(admin, home, objects)
        progress(f"applying {len(applied)} objects of the base" + (f" ({'; '.join(notes)})" if notes else ""))
        cluster_mode.kubectl_run(admin, home, "apply", "-f", "-", input=yaml.safe_dump_all(applied))
        for crd in (o for o in applied if o["kind"] == "CustomResourceDefinition"):
            cluster_mode.kubectl_run(admin, home, "wait", "--for=condition=Established",
                                     f"crd/{crd['metadata']['name']}", "--timeout=60s")
        token = secrets.token_urlsafe(24)
        data = {inputs["ssh_key"]: (workdir / "id_ed25519").read_bytes(), inputs["webhook_key"]: token.encode(),
                inputs["become_key"]: str(record.get("become_password", "")).encode()}
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": inputs["secret"], "namespace": work.namespace},
                  "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
        cluster_mode.kubectl_run(admin, home, "apply", "-f", "-", input=json.dumps(secret))
        kube = self.kube()
        try:
            api_nodes = kube.list(NODES)[0]
        finally:
            kube.close()
        anti = bool(work.template["spec"].get("affinity"))
        nodes = cluster_mode.schedule(api_nodes, work.replicas, anti)
        service_port, target_port = work.service_port()
        addresses = free_loopback_block(work.replicas + 1, port=service_port)
        if target_port != service_port:
            addresses = [addresses[0], *free_loopback_block(work.replicas, port=target_port)]
        template_hash = hashlib.sha256(json.dumps(work.template, sort_keys=True).encode()).hexdigest()[:10]
        pods = [{"name": f"{work.name}-{template_hash}-{secrets.token_hex(3)[:5]}", "node": node,
                 "ip": addresses[i + 1]} for i, node in enumerate(nodes)]
        dns = cluster_mode.SERVICE_DNS.format(name=work.service["metadata"]["name"], namespace=work.namespace)
        plane = ControlPlane.from_state(record["controlplane_dir"])
        config = {"dir": str(folder), "kubeconfig": record["simulator_kubeconfig"],
                  "containerfile": str(cluster_mode.repo_root() / "deploy" / "Containerfile"),
                  "repo": str(cluster_mode.repo_root()), "secret": inputs["secret"], "pods": pods,
                  "ca_file": str(plane.ca_file), "api_host": "127.0.0.1", "api_port": plane.ports["apiserver"],
                  "service_ip": addresses[0], "service_port": service_port, "target_port": target_port,
                  "service_url": f"http://{addresses[0]}:{service_port}",
                  "venv_bin": str(Path(sys.executable).parent), "node_ips": self._addresses(record)}
        (folder / "rendered.json").write_text(json.dumps(objects))
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        with (folder / "supervisor.log").open("ab") as log:
            popen = subprocess.Popen([sys.executable, "-m", "engine.lab.cluster_mode", str(folder / "config.json")],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=folder,
                                     start_new_session=True, close_fds=True)
        record["cluster_mode"] = {
            "supervisor": procs.ProcessRef.of(popen.pid).to_json(), "dir": str(folder),
            "service_url": config["service_url"], "service_ip": addresses[0], "service_dns": dns,
            "service_dns_url": f"http://{dns}:{service_port}", "webhook_token": token, "notes": notes,
            "namespace": work.namespace}
        self._save(record)
        progress(f"starting {len(pods)} replicas of Deployment {work.namespace}/{work.name} as pods")
        deadline = time.monotonic() + timeout

        def problem() -> str | None:
            popen.poll()
            if not procs.ProcessRef.from_json(record["cluster_mode"]["supervisor"]).alive():
                raise LabError("the cluster-mode supervisor exited: "
                               + (folder / "supervisor.log").read_text(errors="replace")[-1500:])
            state = self.cluster_mode_state()
            pods_now = state.get("pods", [])
            if len(pods_now) != len(pods):
                return "pods not started yet"
            for pod in pods_now:
                if not pod["running"]:
                    log_file = folder / "pods" / pod["name"] / "container.log"
                    raise LabError(f"replica {pod['name']} exited: "
                                   + log_file.read_text(errors="replace")[-1500:])
                if not pod["ready"]:
                    return f"{pod['name']} is not ready"
            return None

        _wait(problem, deadline, "the replicas to be ready")
        return (f"cluster mode: {len(pods)} replicas of {work.namespace}/{work.name} "
                f"({', '.join(p['name'] + '@' + p['node'] for p in pods)}), Service {dns} at {config['service_url']}")

    def cluster_mode_state(self) -> dict[str, Any]:
        """The supervisor's ``state.json`` (empty when cluster mode does not run)."""
        cluster = self.record().get("cluster_mode")
        if not cluster:
            return {}
        try:
            return dict(json.loads((Path(cluster["dir"]) / cluster_mode.STATE_FILE).read_text()))
        except (OSError, ValueError):
            return {}

    def stop_cluster_mode(self) -> list[str]:
        """Stop the replicas (their Pods are deleted) and the supervisor; the lab runs on."""
        record = self.record()
        stopped = self._stop_cluster_mode(record)
        record.pop("cluster_mode", None)
        self._save(record)
        return stopped

    def _stop_cluster_mode(self, record: dict[str, Any]) -> list[str]:
        cluster = record.get("cluster_mode")
        if not cluster:
            return []
        state = self.cluster_mode_state()
        ref = procs.ProcessRef.from_json(cluster["supervisor"])
        procs.stop_processes([ref], timeout=45.0, reap=procs.reap_child)
        stopped = [f"cluster-mode supervisor {ref.pid}"]
        for pod in state.get("pods", []):
            left = procs.ProcessRef(pod["pid"], pod["start_time"])
            members = [procs.ProcessRef.of(p) for p in procs.pids_in_mount_namespace(
                pod["mount_namespace"], pod.get("uts_namespace") or "unknown")] if pod.get("mount_namespace") else []
            procs.stop_processes([left, *members], timeout=10.0)
            stopped.append(f"pod {pod['name']} {pod['pid']}")
        return stopped

    # -- waiting for the scenario -------------------------------------------------------------------------
    def _wait_for_scenario(self, kube: Kube, scenario: Scenario, timeout: float, progress: Progress,
                           addresses: dict[str, str]) -> None:
        deadline = time.monotonic() + timeout
        progress("waiting for the node lifecycle controller to mark the dead nodes NotReady")
        _wait(lambda: _nodes_problem(kube, scenario), deadline, "the nodes' initial state")
        sim_seed.seed_controllers(kube, scenario, addresses)  # dead nodes tainted: no DaemonSet pod there
        sim_seed.seed_vms(kube, scenario)
        progress("waiting for the VirtualMachines' phases")
        _wait(lambda: _vms_problem(kube, scenario), deadline, "the VirtualMachines' initial phases")

    # -- env, status, jobs -----------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        record = self.record()
        out = {"KUBECONFIG": record["kubeconfig"], "KUBECACHEDIR": str(self.dir / "kube-cache"),
               "RUNBOOK_LAB_DIR": str(self.dir)}
        if record.get("inventory"):
            out["RUNBOOK_INVENTORY"] = record["inventory"]
        if record.get("become_password"):
            out["RUNBOOK_BECOME_PASSWORD"] = record["become_password"]
        if record.get("monitoring"):
            ends = self.monitoring(record).endpoints
            out["RUNBOOK_LAB_PROMETHEUS_URL"] = ends.prometheus
            out["RUNBOOK_LAB_ALERTMANAGER_URL"] = ends.alertmanager
            # runbook serve reads it: Alertmanager pages with this bearer token
            out["RUNBOOK_WEBHOOK_TOKEN"] = (self.dir / "monitoring" / "webhook-token").read_text()
        return out

    def summary(self, started: list[str]) -> dict[str, Any]:
        record = self.record()
        return {"lab_dir": str(self.dir), "kubeconfig": record["kubeconfig"], "inventory": record.get("inventory"),
                "scenario": record["scenario"], "started": started, "api_url": record.get("api_url")}

    def status(self) -> dict[str, Any]:
        record = self.record()
        scenario = self.scenario()
        kube = self.kube()
        try:
            api_nodes = {n["metadata"]["name"]: n for n in kube.list(NODES)[0]}
            vms = [] if not scenario.vms else kube.list(VMS)[0]
        finally:
            kube.close()
        nodes = []
        for node in scenario.all_nodes:
            api = api_nodes.get(node.name, {})
            host = HostState(record["nodes"][node.name]["state_dir"]).read()
            displays = sim_gpu.displays(host)
            conditions = {c["type"]: c for c in api.get("status", {}).get("conditions", [])}
            nodes.append({
                "name": node.name, "ready": conditions.get("Ready", {}).get("status") == "True",
                "workload": (api.get("metadata", {}).get("labels") or {}).get(sim_gpu.WORKLOAD_LABEL),
                "gpu_driver": displays[0]["driver"] if displays else "none",
                "gpus": [{"slot": d["slot"], "model": d["vendor_device"], "name": d.get("name", ""),
                          "driver": d.get("driver", "none"),
                          "cuda_jobs": sum(1 for j in host.get("cuda_jobs", [])
                                           if sim_gpu.job_gpu(host, j) == d["slot"])}
                         for d in sorted(displays, key=lambda d: str(d["slot"]))],
                "cuda_jobs_running": len(host.get("cuda_jobs", [])),
                "cuda_jobs_killed": int(host.get("cuda_jobs_killed", 0)),
                "kubelet": host["units"]["kubelet"]["active"], "swap_active": bool(host["swap"]["active"]),
                "taints": [f"{t['key']}:{t['effect']}" for t in api.get("spec", {}).get("taints", [])],
                "address": record["nodes"][node.name]["address"], "ssh": record["nodes"][node.name]["ssh"],
                "gpu_allocatable": {k: v for k, v in api.get("status", {}).get("allocatable", {}).items()
                                    if k.startswith("nvidia.com/")},
            })
        monitoring: dict[str, Any] | None = None
        if record.get("monitoring"):
            mon = self.monitoring(record)
            try:
                alerts: list[dict[str, Any]] | str = mon.alerts()
            except LabError as e:
                alerts = str(e)
            monitoring = {"prometheus": mon.endpoints.prometheus, "alertmanager": mon.endpoints.alertmanager,
                          "exporters": mon.endpoints.exporters, "webhook_url": record["monitoring"]["webhook_url"],
                          "alerts": alerts}
        cluster: dict[str, Any] | None = None
        if record.get("cluster_mode"):
            state = self.cluster_mode_state()
            cluster = {"service_url": record["cluster_mode"]["service_url"],
                       "service_dns": record["cluster_mode"]["service_dns"],
                       "pods": [{"name": p["name"], "pid": p["pid"], "node": p["node"], "pod_ip": p["pod_ip"],
                                 "ready": p["ready"]} for p in state.get("pods", []) if p["running"]],
                       "not_served": record["cluster_mode"].get("notes", [])}
        return {
            "lab_dir": str(self.dir), "kubeconfig": record["kubeconfig"], "inventory": record.get("inventory"),
            "scenario": record["scenario"], "running": self.running(), "monitoring": monitoring,
            "cluster_mode": cluster,
            "simulator": {"pid": record["simulator"]["pid"], "log": str(self.dir / "simulator.log")},
            "nodes": nodes,
            "vms": [{"namespace": vm["metadata"]["namespace"], "name": vm["metadata"]["name"],
                     "status": vm.get("status", {}).get("printableStatus", "")} for vm in vms],
        }

    def job(self, node: str, action: str, gpu: str | None = None) -> dict[str, Any]:
        """Start or stop the host CUDA job on ``node`` (on the GPU in slot ``gpu``; default: the first
        GPU on nvidia for start, every GPU for stop); returns the node's jobs afterwards."""
        record = self.record()
        if node not in record["nodes"]:
            raise LabError(f"no node {node!r} in this lab")
        if action not in ("start", "stop"):
            raise LabError(f"job action is start or stop, not {action!r}")
        host = HostState(record["nodes"][node]["state_dir"])

        def change(state: dict[str, Any]) -> None:
            displays = sim_gpu.displays(state)
            if gpu is not None and gpu not in {d["slot"] for d in displays}:
                slots = ", ".join(sorted(str(d["slot"]) for d in displays)) or "none"
                raise LabError(f"{node}: no GPU in slot {gpu} (its GPUs: {slots})")
            if action == "stop":
                state["cuda_jobs"] = [j for j in state.get("cuda_jobs", [])
                                      if gpu is not None and sim_gpu.job_gpu(state, j) != gpu]
                return
            problem = sim_faults.cuda_start_problem(state)  # an injected fault (`runbook lab inject`)
            if problem:
                raise LabError(f"{node}: a CUDA job cannot start: {problem}")
            nvidia = [d for d in displays if d.get("driver") == "nvidia" and gpu in (None, d["slot"])]
            if not nvidia:
                drivers = [f"{d['slot']} {d.get('driver')}" for d in displays if gpu in (None, d["slot"])]
                raise LabError(f"{node}: no GPU on the nvidia driver ({', '.join(drivers) or 'no GPU'}): "
                               "a CUDA job cannot start")
            slot = str(nvidia[0]["slot"])
            if not any(sim_gpu.job_gpu(state, j) == slot for j in state.get("cuda_jobs", [])):
                pid = int(state.get("next_pid", 3000))
                state["next_pid"] = pid + 1
                state["cuda_jobs"] = [*state.get("cuda_jobs", []),
                                      {"pid": pid + 40000, "name": "python3", "used_memory_mib": 21504, "gpu": slot}]

        host.update(change)
        state = host.read()
        return {"node": node, "cuda_jobs": state["cuda_jobs"], "cuda_jobs_killed": state["cuda_jobs_killed"]}

    # -- reset, down ---------------------------------------------------------------------------------
    def reset(self, *, timeout: float = 120.0, progress: Progress = _quiet) -> dict[str, Any]:
        """Back to the scenario's initial state without restarting the control plane or the hosts."""
        started = time.monotonic()
        record = self.record()
        if not self.running():
            raise LabError(f"the lab in {self.dir} is not (fully) running: `runbook lab down` then `up`")
        scenario = self.scenario()
        progress("stopping the simulator")
        self._stop_simulator(record)
        kube = self.kube()
        try:
            progress("removing the scenario's API objects and Leases")
            sim_seed.wipe_cluster(kube, scenario)
            progress("restoring the node hosts' files and state")
            self._initialise_hosts(scenario, record)
            for host in record["hosts"].values():
                self._write_host_file(host, "/etc/fstab", host["fstab"])
            self._seed_kubelet_files(scenario, record)
            progress("creating the scenario's nodes, pods and VirtualMachines")
            sim_seed.seed_cluster(kube, scenario, self._addresses(record), self._host_states(record))
            progress("starting the simulator")
            self._start_simulator(record)
            self._wait_for_scenario(kube, scenario, timeout, progress, self._addresses(record))
        finally:
            kube.close()
        return {"seconds": round(time.monotonic() - started, 1)}

    def write_host_file(self, node: str, path: str, content: str) -> None:
        """Replace a file of a node host (its /etc/fstab, say), as root inside the host: tests that give a
        node another swap setup between cases. Not recorded as a shim call (no command of the host ran)."""
        host = self.record()["hosts"].get(node)
        if host is None:
            raise LabError(f"no SSH node host named {node!r}")
        self._write_host_file(host, path, content)

    def _seed_kubelet_files(self, scenario: Scenario, record: dict[str, Any]) -> None:
        """kubeadm's kubelet.conf and client certificate on every SSH host (expired where the scenario
        says so); a bootstrap kubeconfig left by a run is removed."""
        certs = Path(record["controlplane_dir"]) / "certs"
        for name, host in record["hosts"].items():
            kubelet_certs.seed_host(int(host["process"]["pid"]), record["api_url"], certs / "ca.crt",
                                    certs / "ca.key", name,
                                    expired=scenario.node(name).host.kubelet.client_cert_expired)

    def _write_host_file(self, host: dict[str, Any], path: str, content: str) -> None:
        pid = host["process"]["pid"]
        result = subprocess.run(["nsenter", f"--target={pid}", "--mount", "--", "/bin/sh", "-c",
                                 f"cat > {path}"], input=content, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise LabError(f"could not restore {path} in host pid {pid}: {result.stderr.strip()}")

    def down(self) -> dict[str, Any]:
        """Stop the simulator, the node hosts and the control plane by PID; remove the lab folder."""
        if not self.exists():
            if self.dir.exists() and (self.dir / "controlplane" / "controlplane.json").exists():
                ControlPlane.from_state(self.dir / "controlplane").stop()
            shutil.rmtree(self.dir, ignore_errors=True)
            return {"stopped": [], "removed": str(self.dir)}
        record = self.record()
        stopped: list[str] = []
        if record.get("monitoring"):
            stopped += self.monitoring(record).stop()
        stopped += self._stop_cluster_mode(record)
        if record["simulator"].get("pid"):
            self._stop_simulator(record)
            stopped.append(f"simulator {record['simulator']['pid']}")
        hosts = [self._host_from_record(name, h) for name, h in record["hosts"].items()]
        if hosts:
            NodeHostSet(Path(next(iter(record["hosts"].values()))["workdir"]), hosts).stop()
            stopped += [f"node host {h.name} {h.ref.pid if h.ref else '?'}" for h in hosts]
        cp_dir = Path(record["controlplane_dir"])
        if (cp_dir / "controlplane.json").exists():
            plane = ControlPlane.from_state(cp_dir)
            stopped += [f"{name} {pid}" for name, pid in plane.pids().items()]
            plane.stop()
        for host in record["hosts"].values():
            if not Path(host["layers_dir"]).is_relative_to(self.dir):
                shutil.rmtree(host["layers_dir"], ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)
        return {"stopped": stopped, "removed": str(self.dir)}

    @staticmethod
    def _host_from_record(name: str, h: dict[str, Any]) -> NodeHost:
        return NodeHost(spec=NodeHostSpec(name=name, address=h["address"], sudo=h["sudo"]),
                        address=h["address"], password=h["password"], host_dir=Path(h["host_dir"]),
                        layers_dir=Path(h["layers_dir"]), fstab=h["fstab"],
                        ref=procs.ProcessRef.from_json(h["process"]), mount_namespace=h.get("mount_namespace"),
                        uts_namespace=h.get("uts_namespace"))


# -- the scenario's state, as checks that say what is missing -----------------------------------------
def _wait(problem: Callable[[], str | None], deadline: float, what: str) -> None:
    last: str | None = "not checked yet"
    while time.monotonic() < deadline:
        try:
            last = problem()
        except Exception as e:  # the API server may be starting
            last = f"{type(e).__name__}: {e}"
        if last is None:
            return
        time.sleep(0.3)
    raise LabError(f"timed out waiting for {what}: {last}")


def _nodes_problem(kube: Kube, scenario: Scenario) -> str | None:
    nodes = {n["metadata"]["name"]: n for n in kube.list(NODES)[0]}
    for node in scenario.all_nodes:
        api = nodes.get(node.name)
        if api is None:
            return f"node {node.name} does not exist"
        ready: dict[str, Any] = next(
            (c for c in api.get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})
        taints = {(t["key"], t["effect"]) for t in api.get("spec", {}).get("taints", [])}
        if starts_ready(node) and ready.get("status") != "True":
            return f"node {node.name} is not Ready yet"
        if not starts_ready(node) and (ready.get("status") == "True"
                                       or not {(UNREACHABLE, "NoExecute"), (UNREACHABLE, "NoSchedule")} <= taints):
            return f"node {node.name} is not NotReady with the unreachable taints yet"
    return None


def _vms_problem(kube: Kube, scenario: Scenario) -> str | None:
    vms = {(v["metadata"]["namespace"], v["metadata"]["name"]): v for v in kube.list(VMS)[0]}
    for vm in scenario.vms:
        status = vms.get((vm.namespace, vm.name), {}).get("status", {}).get("printableStatus")
        if status != vm.expected_status:
            return f"vm {vm.namespace}/{vm.name} is {status or 'without status'}, not {vm.expected_status}"
    return None


def operator_pod_statuses(kube: Kube, namespace: str = "gpu-operator") -> dict[str, str]:
    """Pod name -> the STATUS column ``kubectl get pods`` prints (Running, Error, Terminating, ...)."""
    out = {}
    for pod in kube.list(PODS, namespace)[0]:
        out[pod["metadata"]["name"]] = kubectl_status(pod)
    return out


def kubectl_status(pod: dict[str, Any]) -> str:
    """kubectl's STATUS column for a pod (the cases the lab produces)."""
    status = pod.get("status", {})
    reason = status.get("reason") or status.get("phase", "Pending")
    for cs in reversed(status.get("containerStatuses", [])):
        state = cs.get("state", {})
        if state.get("waiting", {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif state.get("terminated", {}).get("reason"):
            reason = state["terminated"]["reason"]
    if pod["metadata"].get("deletionTimestamp") and status.get("reason") != "NodeLost":
        reason = "Terminating"
    return str(reason)


# module-level conveniences (the CLI and tests call these)
def up(scenario: Path | str | None = None, lab_dir: Path | str | None = None, **kw: Any) -> dict[str, Any]:
    return Lab(lab_dir).up(scenario, **kw)


def env(lab_dir: Path | str | None = None) -> dict[str, str]:
    return Lab(lab_dir).env()


def status(lab_dir: Path | str | None = None) -> dict[str, Any]:
    return Lab(lab_dir).status()


def job(node: str, action: str, lab_dir: Path | str | None = None, gpu: str | None = None) -> dict[str, Any]:
    return Lab(lab_dir).job(node, action, gpu)


def reset(lab_dir: Path | str | None = None, **kw: Any) -> dict[str, Any]:
    return Lab(lab_dir).reset(**kw)


def down(lab_dir: Path | str | None = None) -> dict[str, Any]:
    return Lab(lab_dir).down()
