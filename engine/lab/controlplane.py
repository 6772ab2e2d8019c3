"""A real Kubernetes control plane on loopback: etcd + kube-apiserver + kube-controller-manager
(nodelifecycle, podgc, disruption, replicaset, csrsigning; the lab's adds daemonset, namespace and
garbagecollector: ``LAB_CONTROLLERS``) + kube-scheduler, v1.20.2, from the assets folder (see ``assets``).

No kubelet runs: nodes, leases and pod statuses are whatever the lab's simulator or a test writes.
Every port is chosen at run time (``ports``), so a test run and a running lab never collide. TLS uses
a CA and a serving certificate made with openssl; clients authenticate with bearer tokens (one per
user, so the audit log tells the engine's mutations from the simulator's and the controllers').
A JSON state file lets another process (``runbook lab down``) find and stop a running one.

Must not: bind anything but 127.0.0.1, stop a process other than by its recorded PID and start time,
or touch anything outside its ``state_dir``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from engine.lab import procs
from engine.lab.assets import find_assets
from engine.lab.errors import AssetsError, LabError
from engine.lab.ports import free_port

HOST = "127.0.0.1"
STATE_FILE = "controlplane.json"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
STOP_GRACE_SECONDS = 3.0
MUTATING_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
# disruption: PodDisruptionBudget status (without it every budget refuses every eviction);
# replicaset: evicted pods come back elsewhere (a drain guarded by a budget can then finish)
CONTROLLERS = ("nodelifecycle", "podgc", "disruption", "replicaset")
# The lab's cluster, as a real one: DaemonSet pods placed (through the scheduler) and kept on their
# nodes, deleted namespaces emptied and removed, dependents of a deleted owner deleted (a DaemonSet's
# pods, a VM's VMI). Not the bare control plane's default: its tests make pods whose owners do not exist.
LAB_CONTROLLERS = (*CONTROLLERS, "daemonset", "namespace", "garbagecollector")

ADMIN_USER = "admin"
SIMULATOR_USER = "lab-simulator"
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"
SCHEDULER_USER = "system:kube-scheduler"
NODE_BOOTSTRAP_GROUP = "system:bootstrappers:kubeadm:default-node-token"  # kubeadm's node-token group
# issue kubelet client certificates (TLS bootstrap); no csrapproving: an approval is a runbook's decision
SIGNING_CONTROLLERS = ("csrsigning",)


@dataclass(frozen=True)
class ControlPlaneSettings:
    """Tunables. Defaults are test-friendly: short node-lifecycle timings, immediate NoExecute tainting.

    Zone thresholds keep Kubernetes' defaults: with <= ``large_cluster_size_threshold`` nodes, once
    more than 2 nodes and >= ``unhealthy_zone_threshold`` of a zone are NotReady the controller stops
    tainting (and it always stops when *every* node is NotReady).
    """

    node_monitor_grace_period: str = "8s"
    node_monitor_period: str = "2s"
    node_startup_grace_period: str = "10s"
    node_eviction_rate: float = 10.0  # NoExecute taints per second and zone (Kubernetes: 0.1)
    secondary_node_eviction_rate: float = 0.01
    unhealthy_zone_threshold: float = 0.55
    large_cluster_size_threshold: int = 50
    default_unreachable_toleration_seconds: int = 300
    default_not_ready_toleration_seconds: int = 300
    audit_reads: bool = False  # True: get/list/watch are audited too (at Metadata level)
    # kube-apiserver --enable-bootstrap-token-auth, and kubeadm's binding of its node group to
    # system:node-bootstrapper (False: a cluster without the bootstrap-token authenticator)
    bootstrap_token_auth: bool = True
    controllers: tuple[str, ...] = CONTROLLERS  # the lab's: LAB_CONTROLLERS (csrsigning always runs)
    start_timeout: float = 120.0
    extra_apiserver_args: tuple[str, ...] = ()
    extra_controller_manager_args: tuple[str, ...] = ()
    extra_scheduler_args: tuple[str, ...] = ()


@dataclass
class _Component:
    name: str
    argv: list[str]
    ref: procs.ProcessRef | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)


class ControlPlane:
    """A running (or startable) control plane. Use as a context manager, or ``start()``/``stop()``.

    Attributes: ``url``, ``token`` (admin, group system:masters), ``kubeconfig`` (admin),
    ``simulator_token``/``simulator_kubeconfig`` (user ``lab-simulator``: audited at Metadata level only),
    ``state_dir``, ``audit_log``, ``ca_file``, ``ports``, ``settings``.
    """

    def __init__(self, state_dir: Path | str | None = None, *, assets: Path | str | None = None,
                 settings: ControlPlaneSettings | None = None, die_with_parent: bool = False,
                 **overrides: Any) -> None:
        self.settings = dataclasses.replace(settings or ControlPlaneSettings(), **overrides)
        self._owns_state_dir = state_dir is None
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="runbook-controlplane-")).resolve()
        self.assets = Path(assets).resolve() if assets else None
        self.die_with_parent = die_with_parent
        self.token = secrets.token_hex(16)
        self.simulator_token = secrets.token_hex(16)
        self.ports: dict[str, int] = {}
        self._components: dict[str, _Component] = {}

    # -- paths ---------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def simulator_kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig-simulator"

    @property
    def audit_log(self) -> Path:
        return self.state_dir / "audit.log"

    @property
    def ca_file(self) -> Path:
        return self.state_dir / "certs" / "ca.crt"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def url(self) -> str:
        return f"https://{HOST}:{self.ports['apiserver']}"

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> ControlPlane:
        """Start all four components and wait until the API server is ready and both controllers healthy."""
        if self._components:
            raise LabError(f"control plane in {self.state_dir} was already started")
        assets = self.assets or find_assets()
        if assets is None:
            raise AssetsError("no control-plane binaries: run scripts/build-control-plane.sh "
                              "(or set KUBEBUILDER_ASSETS / RUNBOOK_ASSETS)")
        self.assets = assets
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        for name in ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler"):
            self.ports[name] = free_port(HOST)
        self._write_credentials()
        self._components = {name: _Component(name, argv) for name, argv in self._argvs().items()}
        try:
            self._spawn("etcd")
            self._spawn("kube-apiserver")
            self._wait_apiserver_ready()
            if self.settings.bootstrap_token_auth:
                self._bind_node_bootstrappers()
            self._spawn("kube-controller-manager")
            self._spawn("kube-scheduler")
            self._wait_healthz("kube-controller-manager", self.ports["controller_manager"])
            self._wait_healthz("kube-scheduler", self.ports["scheduler"])
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, remove_state: bool = True) -> None:
        """Stop every component by PID (controllers first, etcd last); remove ``state_dir``."""
        for name in reversed(COMPONENTS):
            self._stop_component(name)
        if remove_state:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        else:
            self._save_state()

    def pids(self) -> dict[str, int]:
        """PID of every component that is running now."""
        return {n: c.ref.pid for n, c in self._components.items() if c.ref is not None and c.ref.alive()}

    def process_refs(self) -> dict[str, procs.ProcessRef]:
        return {n: c.ref for n, c in self._components.items() if c.ref is not None}

    def stop_apiserver(self) -> None:
        """Fault injection: kube-apiserver goes away (etcd and the controllers stay)."""
        self._stop_component("kube-apiserver")
        self._save_state()

    def start_apiserver(self) -> None:
        """Start kube-apiserver again with the same etcd, certificates, tokens and port."""
        self._spawn("kube-apiserver")
        self._wait_apiserver_ready()

    def restart_apiserver(self) -> None:
        self.stop_apiserver()
        self.start_apiserver()

    def stop_component(self, name: str) -> None:
        """Fault injection for any component (``etcd``, ``kube-scheduler``, ...)."""
        self._stop_component(name)
        self._save_state()

    def start_component(self, name: str) -> None:
        self._spawn(name)
        if name == "kube-apiserver":
            self._wait_apiserver_ready()
        elif name == "kube-controller-manager":
            self._wait_healthz(name, self.ports["controller_manager"])
        elif name == "kube-scheduler":
            self._wait_healthz(name, self.ports["scheduler"])

    # -- another process finds a running control plane ----------------------------------------
    @classmethod
    def from_state(cls, state_dir: Path | str) -> ControlPlane:
        """Attach to the control plane whose state file is in ``state_dir`` (started by another process)."""
        state_dir = Path(state_dir).resolve()
        try:
            data = json.loads((state_dir / STATE_FILE).read_text())
        except (OSError, ValueError) as e:
            raise LabError(f"no control-plane state in {state_dir}: {e}") from e
        saved: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in data["settings"].items()}
        plane = cls(state_dir, assets=data["assets"], settings=ControlPlaneSettings(**saved))
        plane.token = data["token"]
        plane.simulator_token = data["simulator_token"]
        plane.ports = dict(data["ports"])
        for name, comp in data["components"].items():
            ref = procs.ProcessRef.from_json(comp["process"]) if comp.get("process") else None
            plane._components[name] = _Component(name, list(comp["argv"]), ref)
        return plane

    def is_running(self) -> bool:
        return set(self.pids()) == set(COMPONENTS)

    # -- clients and the audit log ----------------------------------------------------------------
    def new_api_client(self, user: str = ADMIN_USER) -> Any:
        """An official-client ``kubernetes.client.ApiClient`` (own configuration, nothing global)."""
        from kubernetes import config  # the lab may import kubernetes; the engine core may not

        path = self.simulator_kubeconfig if user == SIMULATOR_USER else self.kubeconfig
        return config.new_client_from_config(config_file=str(path))

    def audit_mark(self) -> int:
        """A position in the audit log; pass it to ``audit_events(since=...)`` to see only what follows."""
        try:
            return self.audit_log.stat().st_size
        except FileNotFoundError:
            return 0

    def audit_events(self, since: int = 0) -> list[dict[str, Any]]:
        """Audit events (stage ResponseComplete or Panic) written after position ``since``."""
        try:
            with self.audit_log.open("rb") as f:
                f.seek(since)
                raw = f.read()
        except FileNotFoundError:
            return []
        events = []
        for line in raw.splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("stage") in ("ResponseComplete", "Panic"):
                    events.append(event)
        return events

    def mutations(self, since: int = 0, user: str | None = ADMIN_USER,
                  include_dry_run: bool = False) -> list[dict[str, Any]]:
        """Mutating requests (create/update/patch/delete) after ``since``, by ``user`` (None: anyone)."""
        found = []
        for event in self.audit_events(since):
            if event.get("verb") not in MUTATING_VERBS:
                continue
            if user is not None and event.get("user", {}).get("username") != user:
                continue
            if not include_dry_run and "dryRun=" in event.get("requestURI", ""):
                continue
            found.append(event)
        return found

    # -- service accounts (RBAC tested for real) ---------------------------------------------------
    def issue_token(self, namespace: str, service_account: str, *, expiration_seconds: int = 3600,
                    audiences: Sequence[str] = ()) -> str:
        """A bound token for ``namespace/service_account`` from the TokenRequest API (signed with the
        API server's service-account key; audience: the issuer, or ``audiences`` - e.g. ``runbook``
        for a console login, as ``kubectl create token NAME --audience runbook``). The ServiceAccount
        must exist."""
        spec: dict[str, Any] = {"expirationSeconds": int(expiration_seconds)}
        if audiences:
            spec["audiences"] = list(audiences)
        body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                           "spec": spec}).encode()
        url = f"{self.url}/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token"
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with urllib.request.urlopen(request, context=context, timeout=10) as response:
                return str(json.loads(response.read())["status"]["token"])
        except urllib.error.HTTPError as e:
            raise LabError(f"TokenRequest for {namespace}/{service_account} failed: HTTP {e.code} "
                           f"{e.read().decode(errors='replace')[:300]}") from e
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            raise LabError(f"TokenRequest for {namespace}/{service_account} failed: {e}") from e

    def service_account_kubeconfig(self, namespace: str, service_account: str, path: Path | str, *,
                                   expiration_seconds: int = 3600) -> Path:
        """Write a kubeconfig at ``path`` whose only credential is a TokenRequest token of the
        ServiceAccount (username ``system:serviceaccount:NAMESPACE:NAME``); returns ``path``."""
        token = self.issue_token(namespace, service_account, expiration_seconds=expiration_seconds)
        path = Path(path)
        path.write_text(self._kubeconfig_text(f"{namespace}-{service_account}", token))
        path.chmod(0o600)
        return path

    # -- internals ----------------------------------------------------------------------------
    def _write_credentials(self) -> None:
        certs = self.state_dir / "certs"
        for sub in ("", "controller-manager", "scheduler"):
            (certs / sub).mkdir(parents=True, exist_ok=True)
        _make_certificates(certs)
        tokens = [
            (self.token, ADMIN_USER), (self.simulator_token, SIMULATOR_USER),
            (secrets.token_hex(16), CONTROLLER_MANAGER_USER), (secrets.token_hex(16), SCHEDULER_USER),
        ]
        (self.state_dir / "tokens.csv").write_text(
            "".join(f'{token},{user},{user},"system:masters"\n' for token, user in tokens))
        (self.state_dir / "tokens.csv").chmod(0o600)
        files = {ADMIN_USER: self.kubeconfig, SIMULATOR_USER: self.simulator_kubeconfig,
                 CONTROLLER_MANAGER_USER: self.state_dir / "kubeconfig-controller-manager",
                 SCHEDULER_USER: self.state_dir / "kubeconfig-scheduler"}
        for token, user in tokens:
            files[user].write_text(self._kubeconfig_text(user, token))
            files[user].chmod(0o600)
        (self.state_dir / "audit-policy.yaml").write_text(_audit_policy(self.settings.audit_reads))

    def _kubeconfig_text(self, user: str, token: str) -> str:
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "runbook-lab",
            "clusters": [{"name": "runbook-lab",
                          "cluster": {"server": self.url, "certificate-authority-data": ca}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "runbook-lab", "context": {"cluster": "runbook-lab", "user": user}}],
        }, indent=2) + "\n"

    def _argvs(self) -> dict[str, list[str]]:
        s, d, p = self.settings, self.state_dir, self.ports
        assert self.assets is not None
        etcd_url = f"http://{HOST}:{p['etcd_client']}"
        peer_url = f"http://{HOST}:{p['etcd_peer']}"
        return {
            "etcd": [
                str(self.assets / "etcd"), f"--data-dir={d / 'etcd'}", "--name=lab",
                "--logger=zap", "--log-level=warn",
                f"--listen-client-urls={etcd_url}", f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=lab={peer_url}", "--listen-metrics-urls=",
            ],
            "kube-apiserver": [
                str(self.assets / "kube-apiserver"), f"--etcd-servers={etcd_url}",
                f"--bind-address={HOST}", f"--secure-port={p['apiserver']}", f"--advertise-address={HOST}",
                f"--tls-cert-file={d / 'certs/apiserver.crt'}",
                f"--tls-private-key-file={d / 'certs/apiserver.key'}",
                f"--token-auth-file={d / 'tokens.csv'}", "--authorization-mode=Node,RBAC",
                f"--service-account-key-file={d / 'certs/sa.pub'}",
                f"--service-account-signing-key-file={d / 'certs/sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--api-audiences=https://kubernetes.default.svc",  # TokenRequest's default audience
                "--service-cluster-ip-range=10.96.0.0/16",
                "--disable-admission-plugins=ServiceAccount", "--enable-priority-and-fairness=false",
                f"--default-unreachable-toleration-seconds={s.default_unreachable_toleration_seconds}",
                f"--default-not-ready-toleration-seconds={s.default_not_ready_toleration_seconds}",
                f"--audit-policy-file={d / 'audit-policy.yaml'}", f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json", "--audit-log-maxsize=200", "--audit-log-maxbackup=1",
                "--endpoint-reconciler-type=none",  # 127.0.0.1 is no valid endpoint: no reconciler noise
                "--profiling=false", *(["--enable-bootstrap-token-auth"] if s.bootstrap_token_auth else []),
                *s.extra_apiserver_args,
            ],
            "kube-controller-manager": [
                str(self.assets / "kube-controller-manager"),
                f"--kubeconfig={d / 'kubeconfig-controller-manager'}",
                f"--bind-address={HOST}", f"--secure-port={p['controller_manager']}", "--port=0",
                f"--cert-dir={d / 'certs/controller-manager'}", "--leader-elect=false",
                f"--controllers={','.join((*s.controllers, *SIGNING_CONTROLLERS))}",
                "--use-service-account-credentials=false",
                # csrsigning issues kubelet client certificates (a kubelet's TLS bootstrap) with the lab's CA
                f"--cluster-signing-cert-file={d / 'certs/ca.crt'}", f"--cluster-signing-key-file={d / 'certs/ca.key'}",
                f"--node-monitor-period={s.node_monitor_period}",
                f"--node-monitor-grace-period={s.node_monitor_grace_period}",
                f"--node-startup-grace-period={s.node_startup_grace_period}",
                f"--node-eviction-rate={s.node_eviction_rate}",
                f"--secondary-node-eviction-rate={s.secondary_node_eviction_rate}",
                f"--unhealthy-zone-threshold={s.unhealthy_zone_threshold}",
                f"--large-cluster-size-threshold={s.large_cluster_size_threshold}",
                "--profiling=false", *s.extra_controller_manager_args,
            ],
            "kube-scheduler": [
                str(self.assets / "kube-scheduler"), f"--kubeconfig={d / 'kubeconfig-scheduler'}",
                f"--bind-address={HOST}", f"--secure-port={p['scheduler']}", "--port=0",
                f"--cert-dir={d / 'certs/scheduler'}", "--leader-elect=false", "--profiling=false",
                *s.extra_scheduler_args,
            ],
        }

    def _spawn(self, name: str) -> None:
        comp = self._components[name]
        if comp.ref is not None and comp.ref.alive():
            raise LabError(f"{name} is already running (pid {comp.ref.pid})")
        log = (self.log_dir / f"{name}.log").open("ab")
        with log:
            comp.popen = subprocess.Popen(
                comp.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.state_dir, start_new_session=True, close_fds=True,
                preexec_fn=procs.die_with_parent if self.die_with_parent else None,
            )
        comp.ref = procs.ProcessRef.of(comp.popen.pid)
        self._save_state()

    def _stop_component(self, name: str) -> None:
        comp = self._components.get(name)
        if comp is None or comp.ref is None:
            return
        popen = comp.popen

        def reap(_pid: int) -> None:
            if popen is not None:
                popen.poll()

        # kube-apiserver's graceful shutdown outlasts 10 s with watches open: a short grace, then SIGKILL
        procs.stop_processes([comp.ref], timeout=STOP_GRACE_SECONDS,
                             reap=reap)
        if popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
        comp.popen = None

    def _save_state(self) -> None:
        if not self.state_dir.is_dir():
            return
        data = {
            "version": 1, "url": self.url if "apiserver" in self.ports else None,
            "kubeconfig": str(self.kubeconfig), "simulator_kubeconfig": str(self.simulator_kubeconfig),
            "token": self.token, "simulator_token": self.simulator_token, "ports": self.ports,
            "assets": str(self.assets), "audit_log": str(self.audit_log),
            "settings": dataclasses.asdict(self.settings),
            "components": {
                n: {"argv": c.argv, "process": c.ref.to_json() if c.ref else None}
                for n, c in self._components.items()
            },
        }
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.chmod(0o600)
        tmp.replace(self.state_dir / STATE_FILE)

    def _check_alive(self, name: str) -> None:
        comp = self._components[name]
        if comp.popen is not None:
            comp.popen.poll()
        if comp.ref is None or not comp.ref.alive():
            raise LabError(f"{name} exited during start-up; last lines of {self.log_dir / name}.log:\n"
                           + _tail(self.log_dir / f"{name}.log"))

    def _wait_apiserver_ready(self) -> None:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        paths = ["/readyz", "/api/v1/namespaces/default", "/api/v1/namespaces/kube-node-lease"]
        for _ in _until(self.settings.start_timeout, f"kube-apiserver at {self.url} to be ready"):
            self._check_alive("etcd")
            self._check_alive("kube-apiserver")
            if all(_get_ok(self.url + path, context, self.token) for path in paths):
                return

    def _bind_node_bootstrappers(self) -> None:
        """kubeadm's ClusterRoleBinding ``kubeadm:kubelet-bootstrap``: its node-token group may create
        CertificateSigningRequests (``system:node-bootstrapper``); nothing approves them by itself."""
        body = json.dumps({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "kubeadm:kubelet-bootstrap"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:node-bootstrapper"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": NODE_BOOTSTRAP_GROUP}],
        }).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        request = urllib.request.Request(f"{self.url}/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
                                         data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(self.ca_file)),
                                        timeout=10):
                pass
        except urllib.error.HTTPError as e:
            if e.code != 409:  # already there (a restarted API server keeps etcd)
                raise LabError(f"could not bind {NODE_BOOTSTRAP_GROUP}: HTTP {e.code}") from e

    def _wait_healthz(self, name: str, port: int) -> None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # its self-signed serving cert, on loopback only
        for _ in _until(self.settings.start_timeout, f"{name} /healthz"):
            self._check_alive(name)
            if _get_ok(f"https://{HOST}:{port}/healthz", context, None):
                return


def _until(timeout: float, what: str) -> Iterator[None]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        yield
        time.sleep(0.1)
    raise LabError(f"timed out after {timeout:.0f} s waiting for {what}")


def _get_ok(url: str, context: ssl.SSLContext, token: str | None) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, context=context, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise LabError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def _make_certificates(certs: Path) -> None:
    """A CA, the API server's serving certificate (127.0.0.1, localhost), service-account keys."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=runbook-lab-ca", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=certs)
    _openssl("req", *ec, "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=certs)
    (certs / "apiserver.ext").write_text(
        "subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "apiserver.crt", "-days", "3650", "-extfile", "apiserver.ext",
             cwd=certs)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=certs)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=certs)
    for key in ("ca.key", "apiserver.key", "sa.key"):
        (certs / key).chmod(0o600)


def _audit_policy(audit_reads: bool) -> str:
    """Engine (admin) mutations in full; lab/controller writes as metadata; reads only on request."""
    reads = "" if audit_reads else "  - level: None\n    verbs: [get, list, watch]\n"
    return (
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n"
        "  - level: None\n"
        '    nonResourceURLs: ["/healthz*", "/readyz*", "/livez*", "/version", "/openapi/*", "/metrics"]\n'
        f"{reads}"
        "  - level: Metadata\n"
        f"    users: [{SIMULATOR_USER}, '{CONTROLLER_MANAGER_USER}', '{SCHEDULER_USER}', 'system:apiserver']\n"
        "  - level: Metadata\n    verbs: [get, list, watch]\n"
        "  - level: Metadata\n"  # a bootstrap token's secret in a Secret or a TokenReview stays out of the log
        "    resources: [{group: '', resources: [secrets]},\n"
        "                {group: authentication.k8s.io, resources: [tokenreviews]}]\n"
        "  - level: RequestResponse\n"
    )
