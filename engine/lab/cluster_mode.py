"""Cluster mode on the lab: deploy/kubernetes applied to the lab's API server and its Deployment's replicas
run as processes on this machine, as a kubelet would start that container (``podspec`` says what).

``prepare`` (called by ``Lab.start_cluster_mode``) renders the base with ``kubectl kustomize`` through an
overlay in the lab folder that replaces only the example inventory and known_hosts (the base's own
``all.vars`` are kept: the SSH key and the pinned host keys reach Ansible through them), applies every
rendered object the server serves, creates the Secret the base asks for (``runbook-credentials``: the
lab's SSH key, a new sender token, the become password), places each replica on its own Ready lab node
(the base's anti-affinity) with its own loopback pod IP, and starts the supervisor
(``python -m engine.lab.cluster_mode CONFIG``), which:

* starts each replica in private mount and UTS namespaces (hostname = pod name): each volume at its
  ``mountPath`` (files staged with the kubelet's modes and fsGroup), emptyDirs as tmpfs, the token of a
  TokenRequest for the ServiceAccount at ``/var/run/secrets/kubernetes.io/serviceaccount``, /etc, /usr
  and /var overlaid (mount points and the image's passwd entry live in the overlays, never on this
  machine), every other mount read-only (readOnlyRootFilesystem), then ``setpriv`` to the manifest's
  UID/GID/fsGroup with no new privileges and no capabilities;
* registers a Pod per replica (bound to its node, Running with the process's start, Ready from the
  manifest's readiness probe) and deletes it (grace 0) when the process dies;
* is the Service: a TCP proxy on a loopback address at the Service's port, sending each connection to a
  ready replica's pod IP in turn (both replicas are ready: leader and follower serve alike);
* writes ``state.json`` (``runbook lab status``) and, on SIGTERM, stops the replicas and deletes the Pods.

Must not: listen beyond loopback, write outside the lab folder (mount points live in overlays), or stop
a process other than a replica it started (by PID and start time) and what runs in its mount namespace.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from engine.lab import podspec, procs
from engine.lab.errors import LabError
from engine.lab.podspec import ContainerPlan, Workload
from engine.lab.sim_pods import PROCESS_ANNOTATION  # the simulated kubelet leaves such pods to us

log = logging.getLogger(__name__)

SERVICE_DNS = "{name}.{namespace}.svc"
STATE_FILE = "state.json"
OVERLAID = ("etc", "usr", "var")
KEEP_WRITABLE = ("/proc", "/sys", "/dev")  # as a container runtime mounts them


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_base() -> Path:
    return repo_root() / "deploy" / "kubernetes"


def kubectl_run(kubeconfig: str, home: Path, *args: str, input: str | None = None) -> str:
    env = {**os.environ, "KUBECONFIG": kubeconfig, "HOME": str(home)}
    done = subprocess.run(["kubectl", *args], env=env, input=input, capture_output=True, text=True,
                          timeout=120, check=False)
    if done.returncode != 0:
        raise LabError(f"kubectl {' '.join(args[:3])} failed: {done.stderr.strip()[:800]}")
    return done.stdout


def render(kubeconfig: str, home: Path, path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(kubectl_run(kubeconfig, home, "kustomize", str(path))) if d]


def _mount_of(work: Workload, path: str) -> tuple[dict[str, Any], str]:
    """The volume mounted where ``path`` lies, and ``path`` relative to its mountPath."""
    for vm in work.container.get("volumeMounts", []):
        mount = vm["mountPath"].rstrip("/")
        if path.startswith(mount + "/"):
            volume = next(v for v in work.template["spec"]["volumes"] if v["name"] == vm["name"])
            return volume, path[len(mount) + 1:]
    raise LabError(f"{path} lies in no volume of the Deployment")


def _item_key(source: dict[str, Any], relative: str) -> str:
    for item in source.get("items") or []:
        if item["path"] == relative:
            return str(item["key"])
    return relative


def _env_of(work: Workload, name: str) -> dict[str, Any] | None:
    return next((e for e in work.container.get("env", []) if e["name"] == name), None)


def lab_inputs(work: Workload) -> dict[str, Any]:
    """Where the base expects the inventory, the known_hosts, the SSH key and the tokens, read from the
    base itself (env RUNBOOK_INVENTORY, the inventory's ssh variables, the secretKeyRefs)."""
    inventory_env = _env_of(work, "RUNBOOK_INVENTORY")
    if inventory_env is None:
        raise LabError("the Deployment sets no RUNBOOK_INVENTORY")
    volume, key = _mount_of(work, inventory_env["value"])
    inventory_cm = volume["configMap"]["name"]
    inventory = yaml.safe_load(work.config_maps[inventory_cm][key]) or {}
    base_vars = dict((inventory.get("all") or {}).get("vars") or {})
    key_file = base_vars.get("ansible_ssh_private_key_file")
    args = shlex.split(str(base_vars.get("ansible_ssh_common_args", "")))
    known = next((a.split("=", 1)[1] for a in args if a.startswith("UserKnownHostsFile=")), None)
    if not key_file or not known:
        raise LabError("the base's inventory sets no ansible_ssh_private_key_file or UserKnownHostsFile in "
                       "ansible_ssh_common_args: the SSH key and host keys would not reach Ansible")
    known_volume, known_key = _mount_of(work, known)
    key_volume, key_rel = _mount_of(work, key_file)
    secret = key_volume["secret"]["secretName"]
    refs = {}
    for var in ("RUNBOOK_WEBHOOK_TOKEN", "RUNBOOK_BECOME_PASSWORD"):
        ref = ((_env_of(work, var) or {}).get("valueFrom") or {}).get("secretKeyRef")
        if ref is None or ref["name"] != secret:
            raise LabError(f"the Deployment takes {var} from no key of Secret {secret}")
        refs[var] = ref["key"]
    return {"inventory_cm": inventory_cm, "inventory_key": key, "base_vars": base_vars,
            "known_hosts_cm": known_volume["configMap"]["name"], "known_hosts_key": known_key,
            "secret": secret, "ssh_key": _item_key(key_volume["secret"], key_rel),
            "webhook_key": refs["RUNBOOK_WEBHOOK_TOKEN"], "become_key": refs["RUNBOOK_BECOME_PASSWORD"]}


def write_overlay(folder: Path, base: Path, work: Workload, inputs: dict[str, Any],
                  lab_inventory: dict[str, Any], known_hosts: str) -> Path:
    """An overlay replacing the example inventory (hosts only: the base's ``all.vars`` stay) and
    known_hosts ConfigMaps with the lab's: what docs/cluster.md tells a user to do."""
    folder.mkdir(parents=True, exist_ok=True)
    hosts = {}
    for name, entry in ((lab_inventory.get("all") or {}).get("hosts") or {}).items():
        hosts[name] = {k: v for k, v in entry.items() if k != "ansible_become_password"}
    lab_vars = {k: v for k, v in ((lab_inventory.get("all") or {}).get("vars") or {}).items()
                if k not in ("ansible_ssh_private_key_file", "ansible_ssh_common_args")}
    inventory = {"all": {"vars": {**lab_vars, **inputs["base_vars"]}, "hosts": hosts}}
    (folder / "inventory.yaml").write_text("# the lab's node hosts; vars: the base's ssh settings\n"
                                           + yaml.safe_dump(inventory, sort_keys=False))
    (folder / "known_hosts").write_text(known_hosts)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(base, folder)],
        "generatorOptions": {"disableNameSuffixHash": True},
        "configMapGenerator": [
            {"name": inputs["inventory_cm"], "namespace": work.namespace, "behavior": "replace",
             "files": [f"{inputs['inventory_key']}=inventory.yaml"]},
            {"name": inputs["known_hosts_cm"], "namespace": work.namespace, "behavior": "replace",
             "files": [f"{inputs['known_hosts_key']}=known_hosts"]},
        ],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return folder


def served(kubeconfig: str, home: Path, objects: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The objects whose apiVersion/kind the server serves, and a note per one it does not."""
    versions = set(kubectl_run(kubeconfig, home, "api-versions").split())
    keep, notes = [], []
    for o in objects:
        if o["apiVersion"] in versions:
            keep.append(o)
        else:
            notes.append(f"{o['kind']} {o['metadata']['name']}: {o['apiVersion']} is not served by this API server")
    return keep, notes


def schedule(nodes: list[dict[str, Any]], replicas: int, anti_affinity: bool) -> list[str]:
    """Ready nodes without NoSchedule/NoExecute taints, one replica each (anti-affinity) or round robin."""
    fit = []
    for n in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
        taints = [t for t in (n.get("spec", {}).get("taints") or []) if t["effect"] in ("NoSchedule", "NoExecute")]
        gpus = any(k.startswith("nvidia.com/") for k in n.get("status", {}).get("capacity", {}))
        if ready and not taints:
            fit.append((gpus, n["metadata"]["name"]))  # nodes without GPUs first
    names = [name for _, name in sorted(fit)]
    if anti_affinity and len(names) < replicas:
        raise LabError(f"{replicas} replicas with required anti-affinity need {replicas} schedulable Ready "
                       f"nodes; the lab has {len(names)}: {names}")
    if not names:
        raise LabError("no schedulable Ready node for the replicas")
    return [names[i % len(names)] for i in range(replicas)]


# ============================================================================ the supervisor


def _stage(plan: ContainerPlan, folder: Path) -> dict[str, Path]:
    """Write each file volume with the kubelet's modes: owner root, group fsGroup. Returns mount -> folder."""
    out = {}
    for mount in plan.mounts:
        if mount.files is None:
            continue
        target = folder / "volumes" / mount.name
        target.mkdir(parents=True, exist_ok=True)
        os.chmod(target, 0o755 | (0o2000 if mount.group is not None else 0))
        if mount.group is not None:
            os.chown(target, 0, mount.group)
        for f in mount.files:
            path = target / f.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f.data)
            os.chown(path, 0, f.group if f.group is not None else 0)
            os.chmod(path, f.mode)
        out[mount.name] = target
    return out


def _closed_to_others(uid: int, repo: Path) -> list[str]:
    """Top-level folders above the installed package (its interpreter, its source) that another UID
    cannot traverse (``/root`` holding a pyenv Python): overlaid traversable in the pod's namespace.
    An image has its Python in /usr/local; this machine's stands in for it wherever it lives."""
    out = []
    for path in {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), Path(sys.executable).resolve(),
                 repo.resolve()}:
        top = path.parts[1] if len(path.parts) > 1 else ""
        if top and top not in OVERLAID and top not in out and uid != 0 and not os.stat(f"/{top}").st_mode & 0o001:
            out.append(top)
    return sorted(out)


def _image_under_empty_dirs(plan: ContainerPlan, repo: Path) -> list[Path]:
    """Folders of the installed package (its source, its virtual environment, its interpreter) that
    an emptyDir's tmpfs would hide: a checkout or a virtual environment under /tmp, which the base
    mounts an emptyDir over. An image has them in its own layers; here they are bound back over the
    tmpfs (read-only), so the pod runs the same installed package wherever this machine keeps it."""
    image = sorted({Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(), repo.resolve()},
                   key=lambda p: len(p.parts))
    empty_dirs = [Path(m.path) for m in plan.mounts if m.files is None]
    out: list[Path] = []
    for path in image:
        if any(path.is_relative_to(kept) for kept in out):
            continue  # inside a folder already bound back
        if any(path.is_relative_to(d) for d in empty_dirs):
            out.append(path)
    return out


def container_script(plan: ContainerPlan, folder: Path, repo: Path) -> str:
    """The shell run by ``unshare --mount --uts``: mounts as the pod's, then exec as the pod's UID."""
    q = shlex.quote
    staged = _stage(plan, folder)
    layers = folder / "layers"
    lines = ["set -e", f"hostname {q(plan.pod)}", "mount -t tmpfs -o mode=755 tmpfs /run"]
    kept = _image_under_empty_dirs(plan, repo)
    for i, path in enumerate(kept):  # held in this namespace's /run while a tmpfs covers their place
        lines += [f"mkdir -p /run/runbook-image/{i}", f"mount --rbind {q(str(path))} /run/runbook-image/{i}"]
    for d in (*OVERLAID, *_closed_to_others(plan.uid, repo)):
        for sub in (f"{d}-up", f"{d}-work"):
            (layers / sub).mkdir(parents=True, exist_ok=True)
        if d not in OVERLAID:  # only traversable (0711): the installed package's interpreter lies below
            os.chmod(layers / f"{d}-up", 0o711)
        lines.append(f"mount -t overlay overlay -o lowerdir=/{d},upperdir={q(str(layers / (d + '-up')))},"
                     f"workdir={q(str(layers / (d + '-work')))} /{d}")
    # the image's user, and /etc/hosts as a kubelet writes it (the pod's name on its IP)
    lines += [f"grep -q '^[^:]*:x:{plan.uid}:' /etc/passwd || echo {q(plan.passwd)} >> /etc/passwd",
              f"printf '127.0.0.1 localhost\\n%s %s\\n' {q(plan.pod_ip)} {q(plan.pod)} > /etc/hosts"]
    targets = [m.path for m in plan.mounts] + [dest for _, dest in plan.image_copies] + [plan.workdir]
    lines += [f"mkdir -p {q(t)}" for t in targets]
    if plan.read_only_root:
        # every mount of this namespace read-only (this namespace's flags only, never this machine's),
        # but /proc, /sys and /dev as a runtime gives them; the volumes are mounted over it next
        lines.append("for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do case $m in "
                     + "|".join(f"{k}|{k}/*" for k in KEEP_WRITABLE)
                     + ") ;; *) mount -o remount,bind,ro \"$m\" 2>/dev/null || true;; esac; done")
    for source, dest in plan.image_copies:
        lines += [f"mount --bind {q(str(repo / source))} {q(dest)}", f"mount -o remount,bind,ro {q(dest)}"]
    # file volumes first: an emptyDir over /tmp must not hide their staged sources (the lab folder)
    for mount in sorted(plan.mounts, key=lambda m: m.files is None):
        if mount.files is None:
            gid = f",gid={mount.group}" if mount.group is not None else ""
            mode = "2777" if mount.group is not None else "1777"
            lines.append(f"mount -t tmpfs -o mode={mode}{gid} tmpfs {q(mount.path)}")
        else:
            lines.append(f"mount --bind {q(str(staged[mount.name]))} {q(mount.path)}")
            lines.append(f"mount -o remount,bind,ro {q(mount.path)}")
    for i, path in enumerate(kept):
        lines += [f"mkdir -p {q(str(path))}", f"mount --rbind /run/runbook-image/{i} {q(str(path))}",
                  f"mount -o remount,bind,ro {q(str(path))}"]
    lines.append(f"cd {q(plan.workdir)}")
    groups = ",".join(str(g) for g in plan.groups)
    setpriv = ["setpriv", f"--reuid={plan.uid}", f"--regid={plan.gid}", f"--groups={groups}"]
    if plan.no_new_privs:
        setpriv.append("--no-new-privs")
    if plan.drop_all_capabilities:
        setpriv += ["--inh-caps=-all", "--bounding-set=-all"]
    lines.append("exec " + " ".join(q(a) for a in [*setpriv, "--", *plan.argv]))
    return "\n".join(lines) + "\n"


def _http_ok(host: str, port: int, path: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as r:
            return bool(200 <= r.status < 400)
    except (OSError, ValueError):
        return False


class Replica:
    def __init__(self, plan: ContainerPlan, popen: subprocess.Popen[bytes], pod: dict[str, Any]) -> None:
        self.plan = plan
        self.popen = popen
        self.ref = procs.ProcessRef.of(popen.pid)
        self.pod = pod
        self.ready = False
        self.started = time.time()
        self.gone = False
        self.mount_namespace: str | None = None
        self.uts_namespace: str | None = None
        self.next_probe = 0.0
        self.liveness_failures = 0
        self.pod_deleted = False


class Supervisor:
    def __init__(self, config: dict[str, Any]) -> None:
        from engine.lab.sim_kube import Kube

        self.config = config
        self.dir = Path(config["dir"])
        self.kube = Kube(config["kubeconfig"])
        self.replicas: list[Replica] = []
        self.stopping = threading.Event()
        self._turn = 0
        self._lock = threading.Lock()

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        from engine.lab.sim_kube import PODS

        c = self.config
        objects = json.loads((self.dir / "rendered.json").read_text())
        work = podspec.split_rendered(objects)
        image = podspec.parse_containerfile(Path(c["containerfile"]).read_text())
        secrets = {c["secret"]: self._secret(c["secret"], work.namespace)}
        for pod in c["pods"]:
            token = self._token(work.namespace, work.service_account)
            plan = podspec.container_plan(
                work, image, pod=pod["name"], node=pod["node"], pod_ip=pod["ip"], secrets=secrets, token=token,
                ca=Path(c["ca_file"]).read_bytes(), api_host=c["api_host"], api_port=c["api_port"],
                service_ip=c["service_ip"], venv_bin=c["venv_bin"])
            folder = self.dir / "pods" / pod["name"]
            folder.mkdir(parents=True, exist_ok=True)
            script = container_script(plan, folder, Path(c["repo"]))
            (folder / "start.sh").write_text(script)
            log = (folder / "container.log").open("ab")
            with log:
                popen = subprocess.Popen(
                    ["unshare", "--mount", "--uts", "--propagation", "private", "/bin/sh", "-c", script],
                    env=dict(plan.env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    cwd="/", start_new_session=True, close_fds=True)
            manifest = {"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": pod["name"], "namespace": work.namespace,
                                     "labels": dict(work.template["metadata"]["labels"]),
                                     "annotations": {PROCESS_ANNOTATION: str(popen.pid)}},
                        "spec": {**json.loads(json.dumps(work.template["spec"])), "nodeName": pod["node"]}}
            created = self.kube.create(PODS, manifest, work.namespace) or manifest
            replica = Replica(plan, popen, created)
            self.replicas.append(replica)
            self._status(replica, running=True, ready=False)
        self._save()

    def _secret(self, name: str, namespace: str) -> dict[str, bytes]:
        import base64

        from engine.lab.sim_kube import Resource

        obj = self.kube.get(Resource("", "v1", "secrets"), name, namespace)
        if obj is None:
            raise LabError(f"no Secret {namespace}/{name}")
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}

    def _token(self, namespace: str, service_account: str) -> str:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": 86400}}
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
        return str(self.kube.call("POST", path, body)["status"]["token"])

    def _status(self, replica: Replica, *, running: bool, ready: bool) -> None:
        from engine.lab import sim_pods
        from engine.lab.sim_kube import PODS

        pod = replica.pod
        body = sim_pods.pod_status(pod, "Running" if running else "Pending", self.config["node_ips"].get(
            replica.plan.node, replica.plan.pod_ip), replica.started)
        body.update(podIP=replica.plan.pod_ip, podIPs=[{"ip": replica.plan.pod_ip}], qosClass="Burstable")
        for cs in body["containerStatuses"]:
            cs["ready"] = ready
            cs["containerID"] = f"lab://{replica.ref.pid}"
        for cond in body["conditions"]:
            if cond["type"] in ("Ready", "ContainersReady"):
                cond["status"] = "True" if ready else "False"
        self.kube.patch(PODS, pod["metadata"]["name"], {"status": body}, pod["metadata"]["namespace"], sub="status")

    # -- run -------------------------------------------------------------------------------------
    def loop(self) -> None:

        while not self.stopping.is_set():
            now = time.monotonic()
            changed = False
            for r in self.replicas:
                if r.gone:
                    if not r.pod_deleted:  # a delete that failed (API slow or away) is retried until it took
                        r.pod_deleted = self._delete_pod(r)
                    continue
                r.popen.poll()
                if r.mount_namespace is None:
                    with contextlib.suppress(OSError):
                        ns = os.readlink(f"/proc/{r.ref.pid}/ns/mnt")
                        uts = os.readlink(f"/proc/{r.ref.pid}/ns/uts")
                        if ns != os.readlink("/proc/self/ns/mnt") and uts != os.readlink("/proc/self/ns/uts"):
                            r.mount_namespace, r.uts_namespace = ns, uts
                if not r.ref.alive():  # the container's process died: its Pod goes (no restart here)
                    r.gone, r.ready, changed = True, False, True
                    log.warning("replica %s (pid %s) exited: %s", r.plan.pod, r.ref.pid, r.popen.returncode)
                    r.pod_deleted = self._delete_pod(r)
                    self._kill_namespace(r)
                    continue
                if now >= r.next_probe and r.plan.readiness is not None:
                    probe = r.plan.readiness
                    ready = _http_ok(r.plan.pod_ip, probe.port, probe.path)
                    # the manifest's period once ready; every second until then (a start needs no 10 s wait)
                    r.next_probe = now + (probe.period if ready else 1.0)
                    if ready != r.ready:
                        r.ready, changed = ready, True
                        with contextlib.suppress(Exception):
                            self._status(r, running=True, ready=ready)
            if changed:
                self._save()
            self.stopping.wait(0.5)

    def _delete_pod(self, r: Replica) -> bool:
        """Delete the replica's Pod (grace 0: its process is gone); False when the API did not take it."""
        from engine.lab.sim_kube import PODS

        try:
            self.kube.delete(PODS, r.pod["metadata"]["name"], r.pod["metadata"]["namespace"], grace=0)
        except Exception as e:
            log.warning("could not delete Pod %s yet: %s", r.plan.pod, e)
            return False
        return True

    def _kill_namespace(self, r: Replica) -> None:
        """What a container runtime does when the container's first process ends: end the rest."""
        if r.mount_namespace and r.uts_namespace:
            refs = [procs.ProcessRef.of(p) for p in procs.pids_in_mount_namespace(r.mount_namespace, r.uts_namespace)]
            procs.stop_processes([x for x in refs if x.start_time != -1], timeout=5.0)

    def pick(self) -> Replica | None:
        with self._lock:
            ready = [r for r in self.replicas if r.ready and not r.gone]
            if not ready:
                return None
            self._turn += 1
            return ready[self._turn % len(ready)]

    def serve_service(self) -> socket.socket:
        c = self.config
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((c["service_ip"], c["service_port"]))
        listener.listen(64)

        def accept() -> None:
            while not self.stopping.is_set():
                try:
                    client, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=self._forward, args=(client,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return listener

    def _forward(self, client: socket.socket) -> None:
        replica = self.pick()
        if replica is None:
            client.close()  # no ready endpoint: refused, as kube-proxy rejects
            return
        try:
            upstream = socket.create_connection((replica.plan.pod_ip, self.config["target_port"]), timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)

        def pipe(a: socket.socket, b: socket.socket) -> None:
            try:
                while True:
                    data = a.recv(65536)
                    if not data:
                        break
                    b.sendall(data)
            except OSError:
                pass
            finally:
                with contextlib.suppress(OSError):
                    b.shutdown(socket.SHUT_WR)

        t = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
        t.start()
        pipe(client, upstream)
        t.join(timeout=600)
        client.close()
        upstream.close()

    def _save(self) -> None:
        c = self.config
        state = {"service_url": c["service_url"], "service_address": f"{c['service_ip']}:{c['service_port']}",
                 "supervisor_pid": os.getpid(),
                 "pods": [{"name": r.plan.pod, "pid": r.ref.pid, "start_time": r.ref.start_time,
                           "node": r.plan.node, "pod_ip": r.plan.pod_ip, "ready": r.ready,
                           "running": not r.gone, "mount_namespace": r.mount_namespace,
                           "uts_namespace": r.uts_namespace}
                          for r in self.replicas]}
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.dir / STATE_FILE)

    def stop(self) -> None:
        from engine.lab.sim_kube import PODS

        self.stopping.set()
        alive = [r for r in self.replicas if not r.gone]
        procs.stop_processes([r.ref for r in alive], timeout=20.0, reap=procs.reap_child)
        for r in alive:
            r.gone = True
            self._kill_namespace(r)
            with contextlib.suppress(Exception):
                self.kube.delete(PODS, r.pod["metadata"]["name"], r.pod["metadata"]["namespace"], grace=0)
        self._save()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = json.loads(Path(argv[0]).read_text())
    supervisor = Supervisor(config)
    signal.signal(signal.SIGTERM, lambda *_: supervisor.stopping.set())
    listener = supervisor.serve_service()
    try:
        supervisor.start()
        supervisor.loop()
    finally:
        listener.close()
        supervisor.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
