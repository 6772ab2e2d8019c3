"""Real SSH "node hosts" on loopback: each an ``sshd`` in private mount and UTS namespaces.

A host sees overlays over /etc, /usr, /var and /root (its writes stay in its own layers on this
machine), fresh tmpfs over /run, /home and /tmp, its own hostname (also in its /etc/hosts), the
login user ``ops`` (with a password: locked accounts refuse keys) with sudo (password or NOPASSWD),
and the /etc/fstab it is given. It listens on port 22 of its own loopback address (a random
127.X.Y.0/24 per ``start_node_hosts`` call, so a test run and a running lab never collide).

Per-host state on THIS machine: ``NodeHost.state_dir``, bind-mounted read-write at
``/run/runbook-lab`` inside the host (shims and the lab simulator share it). ``proc_files`` maps a
path such as ``/proc/swaps`` to a file in the state folder that is bind-mounted over it (as LXCFS
does): rewrite such files in place (``open(path, "w")``), never by rename, or the host keeps
seeing the old inode.

Shims (``shims_dir``) replace commands at their REAL paths inside the host's own /usr, so nothing,
not even ``/usr/sbin/swapoff`` by absolute path, reaches this machine. Every file in ``shims_dir``
is installed executable into the host's overlay:

* ``usr__sbin__swapoff`` (``__`` stands for ``/``)  -> ``/usr/sbin/swapoff``
* ``usr/sbin/swapoff`` (a tree mirroring the root)  -> ``/usr/sbin/swapoff``
* ``swapoff`` (a plain name)                        -> wherever this machine has it among
  /usr/local/sbin, /usr/local/bin, /usr/sbin, /usr/bin (every such place), else ``/usr/bin/NAME``
* ``_helpers.py`` (a name starting with ``_``)       -> ``/usr/local/lib/runbook-lab/_helpers.py``

Only /usr, /etc, /var and /root targets are allowed (the overlaid trees).

The generated Ansible inventory (``NodeHostSet.inventory_path``, mode 0600, under the workdir) holds
everything Ansible needs, become passwords included: ``ansible -i INVENTORY HOST -b -m command
-a 'cat /etc/fstab'`` works with no other setup.

Must not: listen anywhere but 127.0.0.0/8, change anything of this machine outside the workdir,
or stop a process other than by PID (all processes of a host's mount namespace, found by PID).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import yaml

from engine.lab import procs
from engine.lab.errors import LabError
from engine.lab.ports import free_loopback_block, require_loopback

STATE_FILE = "nodehosts.json"
SSH_PORT = 22
LOGIN_USER = "ops"
STATE_MOUNT = "/run/runbook-lab"
HOST_FILES_MOUNT = "/run/runbook-host"
DEFAULT_FSTAB = "UUID=1111-2222 / ext4 errors=remount-ro 0 1\n/swapfile none swap sw 0 0\n"
OVERLAID = ("etc", "usr", "var", "root")
HELPER_DIR = "usr/local/lib/runbook-lab"
INIT_PID_FILE = "/run/runbook-init.pid"  # the host's init loop (shims/_reboot.py reads it)
REBOOT_FLAG = "/run/runbook-reboot"  # set by shims/_reboot.py: sshd ended because the host reboots
_PLAIN_SHIM_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin")

SudoMode = Literal["password", "nopasswd"]


@dataclass(frozen=True)
class NodeHostSpec:
    """What a node host is: name (also its hostname and inventory name), address, sudo flavour.

    ``address`` None: one is picked from the set's free loopback /24. ``become_password`` is the
    password of ``ops`` (random when None); with ``sudo="password"`` sudo asks for it.
    ``k8s_node_name`` (default: ``name``) is the Kubernetes Node it plays, an inventory hostvar.
    ``fstab`` overrides the set's /etc/fstab for this host.
    """

    name: str
    address: str | None = None
    sudo: SudoMode = "password"
    become_password: str | None = None
    k8s_node_name: str | None = None
    fstab: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-." for c in self.name):
            raise ValueError(f"invalid host name {self.name!r}")
        if self.sudo not in ("password", "nopasswd"):
            raise ValueError(f"sudo must be 'password' or 'nopasswd', not {self.sudo!r}")
        if self.address is not None:
            require_loopback(self.address)


@dataclass
class NodeHost:
    """One running (or stopped) node host. ``state_dir`` is on this machine; see the module docstring."""

    spec: NodeHostSpec
    address: str
    password: str
    host_dir: Path
    layers_dir: Path
    fstab: str
    proc_files: dict[str, str] = field(default_factory=dict)
    shims_dir: Path | None = None
    die_with_parent: bool = False
    port: int = SSH_PORT
    user: str = LOGIN_USER
    ref: procs.ProcessRef | None = None
    mount_namespace: str | None = None
    uts_namespace: str | None = None  # with the mount namespace: which processes are this host's
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _owner: NodeHostSet | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def k8s_node_name(self) -> str:
        return self.spec.k8s_node_name or self.spec.name

    @property
    def state_dir(self) -> Path:
        return self.host_dir / "state"

    @property
    def pid(self) -> int | None:
        return self.ref.pid if self.ref is not None and self.ref.alive() else None

    def is_running(self) -> bool:
        return self.pid is not None

    # -- lifecycle -------------------------------------------------------------------------------
    def launch(self) -> None:
        """Start the namespace and sshd; returns at once (``wait_ready`` waits for port 22)."""
        if self.is_running():
            raise LabError(f"host {self.name} is already running (pid {self.pid})")
        _install_shims(self.shims_dir, self.layers_dir / "usr-up", self.layers_dir)
        for target, name in self.proc_files.items():
            source = self.state_dir / name
            if not source.exists():
                source.write_bytes(_read_or_empty(target))
        with (self.host_dir / "sshd.log").open("ab") as log:
            self._popen = subprocess.Popen(
                ["unshare", "--mount", "--uts", "--propagation", "private", "/bin/sh", "-c", self._setup_script()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                close_fds=True, preexec_fn=procs.die_with_parent if self.die_with_parent else None,
            )
        self.ref = procs.ProcessRef.of(self._popen.pid)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._popen is not None:
                self._popen.poll()
            if self.ref is None or not self.ref.alive():
                status = self._popen.returncode if self._popen is not None else None
                how = (f"killed by signal {-status}" if status is not None and status < 0
                       else f"exit status {status}" if status is not None else "exit status unknown")
                raise LabError(f"node host {self.name} ({self.address}) exited during start-up ({how}); "
                               f"{self.host_dir / 'sshd.log'}:\n" + (_tail(self.host_dir / "sshd.log")
                                                                    or "(empty)"))
            if _accepts(self.address, self.port):
                with contextlib.suppress(OSError):
                    self.mount_namespace = os.readlink(f"/proc/{self.ref.pid}/ns/mnt")
                    self.uts_namespace = os.readlink(f"/proc/{self.ref.pid}/ns/uts")
                return
            if time.monotonic() > deadline:
                raise LabError(f"node host {self.name} did not listen on {self.address}:{self.port} "
                               f"within {timeout:.0f} s:\n" + _tail(self.host_dir / "sshd.log"))
            time.sleep(0.02)

    def start(self) -> None:
        """Start (again): the host keeps its /etc, /usr, /var, /root layers, like a rebooted machine."""
        self.launch()
        self.wait_ready()
        if self._owner is not None:
            self._owner.save_state()

    def stop(self, timeout: float = 10.0) -> None:
        """End sshd and every process of this host's namespace by PID; wait until the namespace is gone."""
        _stop_hosts([self], timeout)
        if self._owner is not None:
            self._owner.save_state()

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": dataclasses.asdict(self.spec), "address": self.address, "password": self.password,
            "host_dir": str(self.host_dir), "layers_dir": str(self.layers_dir), "fstab": self.fstab,
            "proc_files": self.proc_files, "shims_dir": str(self.shims_dir) if self.shims_dir else None,
            "process": self.ref.to_json() if self.ref else None, "mount_namespace": self.mount_namespace,
            "uts_namespace": self.uts_namespace,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeHost:
        return cls(
            spec=NodeHostSpec(**data["spec"]), address=data["address"], password=data["password"],
            host_dir=Path(data["host_dir"]), layers_dir=Path(data["layers_dir"]), fstab=data["fstab"],
            proc_files=dict(data["proc_files"]), shims_dir=Path(data["shims_dir"]) if data["shims_dir"] else None,
            ref=procs.ProcessRef.from_json(data["process"]) if data["process"] else None,
            mount_namespace=data["mount_namespace"], uts_namespace=data.get("uts_namespace"),
        )

    def namespace_pids(self) -> list[int]:
        return procs.pids_in_mount_namespace(self.mount_namespace, self.uts_namespace) if self.mount_namespace else []

    # -- looking inside ----------------------------------------------------------------------------
    def run(self, *argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` as root inside the host's namespaces (for tests and the simulator, not via SSH)."""
        if self.pid is None:
            raise LabError(f"host {self.name} is not running")
        return subprocess.run(["nsenter", f"--target={self.pid}", "--mount", "--uts", "--", *argv],
                              check=check, capture_output=True, text=True, input=input)

    def read_file(self, path: str) -> str:
        """A file as the host sees it (its /etc/fstab, say)."""
        return self.run("cat", path).stdout

    # -- internals -------------------------------------------------------------------------------
    def _setup_script(self) -> str:
        q = shlex.quote
        lines = [
            "set -e",
            "trap 'st=$?; [ $st -eq 0 ] || echo \"runbook-lab: host init exited (status $st)\"' EXIT",
            "mount -t tmpfs -o mode=755 tmpfs /run",
            f"mkdir -p /run/sshd {STATE_MOUNT} {HOST_FILES_MOUNT}",
            f"mount --bind {q(str(self.state_dir))} {STATE_MOUNT}",
            f"mount --bind {q(str(self.host_dir / 'ssh'))} {HOST_FILES_MOUNT}",
        ]
        for target, name in self.proc_files.items():
            lines.append(f"mount --bind {q(str(self.state_dir / name))} {q(target)}")
        for d in OVERLAID:
            up, work = self.layers_dir / f"{d}-up", self.layers_dir / f"{d}-work"
            lines.append(f"mount -t overlay overlay -o lowerdir=/{d},upperdir={up},workdir={work} /{d}")
        lines += [
            "mount -t tmpfs -o mode=755 tmpfs /home",
            "mount -t tmpfs -o mode=1777 tmpfs /tmp",
            f"hostname {q(self.name)}",
            f"mkdir -p /home/{LOGIN_USER}/.ssh",
            f"cp {HOST_FILES_MOUNT}/authorized_keys /home/{LOGIN_USER}/.ssh/authorized_keys",
            f"chown -R {LOGIN_USER}:{LOGIN_USER} /home/{LOGIN_USER}",
            f"chmod 700 /home/{LOGIN_USER} /home/{LOGIN_USER}/.ssh",
            # the host's init: sshd, and after a reboot (the lab's shutdown shim kills every other
            # process of the namespace and sets the flag) the boot, then sshd again; the namespace
            # and this PID stay (docs/lab.md, "Reboot")
            f"echo $$ > {INIT_PID_FILE}",
            "while :; do",
            f"  rm -f {REBOOT_FLAG}",
            f"  /usr/sbin/sshd -D -e -f {HOST_FILES_MOUNT}/sshd_config &",
            "  status=0; wait $! || status=$?",
            f"  [ -e {REBOOT_FLAG} ] || {{ echo \"runbook-lab: sshd exited (status $status)\"; exit 1; }}",
            f"  while [ \"$(cat {REBOOT_FLAG} 2>/dev/null)\" != down ]; do sleep 0.1 || true; done",
            "  echo \"runbook-lab: host rebooting (sshd gone)\"",
            f"  /usr/bin/python3 /{HELPER_DIR}/_reboot.py boot || true",
            "  echo \"runbook-lab: host booted (boot id $(cat /proc/sys/kernel/random/boot_id)), sshd starting\"",
            "done",
        ]
        return "\n".join(lines) + "\n"


class NodeHostSet:
    """Node hosts started together, with one client key, a known_hosts file and an Ansible inventory."""

    def __init__(self, workdir: Path, hosts: Sequence[NodeHost]) -> None:
        self.workdir = workdir
        self.hosts: dict[str, NodeHost] = {}
        for host in hosts:
            self.add(host)

    def add(self, host: NodeHost) -> None:
        host._owner = self
        self.hosts[host.name] = host

    @classmethod
    def from_state(cls, workdir: Path | str) -> NodeHostSet:
        """Attach to the hosts started (by another process) in ``workdir``, e.g. to stop them."""
        workdir = Path(workdir).resolve()
        try:
            data = json.loads((workdir / STATE_FILE).read_text())
        except (OSError, ValueError) as e:
            raise LabError(f"no node-host state in {workdir}: {e}") from e
        return cls(workdir, [NodeHost.from_json(h) for h in data["hosts"]])

    def save_state(self) -> None:
        """Write ``nodehosts.json`` (mode 0600: it holds the become passwords, as the inventory does)."""
        if self.workdir.is_dir():
            data = {"version": 1, "hosts": [h.to_json() for h in self]}
            _write_private(self.workdir / STATE_FILE, json.dumps(data, indent=2) + "\n")

    @property
    def inventory_path(self) -> Path:
        return self.workdir / "inventory.yml"

    @property
    def known_hosts_path(self) -> Path:
        return self.workdir / "known_hosts"

    @property
    def private_key_path(self) -> Path:
        return self.workdir / "id_ed25519"

    @property
    def ssh_common_args(self) -> str:
        return (f"-o UserKnownHostsFile={self.known_hosts_path} -o StrictHostKeyChecking=yes "
                "-o GlobalKnownHostsFile=/dev/null -o IdentitiesOnly=yes")

    def __getitem__(self, name: str) -> NodeHost:
        return self.hosts[name]

    def __iter__(self) -> Iterator[NodeHost]:
        return iter(self.hosts.values())

    def __len__(self) -> int:
        return len(self.hosts)

    def __contains__(self, name: object) -> bool:
        return name in self.hosts

    def __enter__(self) -> NodeHostSet:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def names(self) -> list[str]:
        return list(self.hosts)

    def pids(self) -> dict[str, int]:
        """The PID of every running host's init (its sshd's parent: the namespace's first process)."""
        return {h.name: h.pid for h in self if h.pid is not None}

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every host (by PID) and wait until all their namespaces are gone."""
        _stop_hosts(list(self), timeout)
        self.save_state()

    def ssh_argv(self, name: str, *command: str) -> list[str]:
        """``ssh`` argv that logs into host ``name`` as ``ops`` (strict host key checking)."""
        host = self.hosts[name]
        return ["ssh", "-i", str(self.private_key_path), *shlex.split(self.ssh_common_args),
                "-o", "BatchMode=yes", "-p", str(host.port), f"{host.user}@{host.address}", *command]

    def write_inventory(self) -> Path:
        hosts: dict[str, dict[str, object]] = {}
        for host in self:
            entry: dict[str, object] = {"ansible_host": host.address, "k8s_node_name": host.k8s_node_name}
            if host.spec.sudo == "password":
                entry["ansible_become_password"] = host.password
            hosts[host.name] = entry
        inventory = {"all": {
            "vars": {
                "ansible_user": LOGIN_USER, "ansible_port": SSH_PORT,
                "ansible_ssh_private_key_file": str(self.private_key_path),
                "ansible_ssh_common_args": self.ssh_common_args,
                "ansible_python_interpreter": "/usr/bin/python3",
                "ansible_become_method": "sudo",
            },
            "hosts": hosts,
        }}
        _write_private(self.inventory_path, "# generated by engine.lab.nodehosts: holds become passwords\n"
                       + yaml.safe_dump(inventory, sort_keys=False))
        return self.inventory_path


def start_node_hosts(specs: Iterable[NodeHostSpec | str], workdir: Path | str, *,
                     shims_dir: Path | str | None = None, fstab: str | None = None,
                     proc_files: Mapping[str, str] | None = None,
                     die_with_parent: bool = False, timeout: float = 60.0) -> NodeHostSet:
    """Start one node host per spec (plain names allowed) and write key, known_hosts and inventory.

    ``workdir`` must not lie under /run or /home (hidden inside the hosts). Raises LabError when a
    prerequisite is missing or a host does not come up (the hosts already started are stopped).
    """
    spec_list = [NodeHostSpec(s) if isinstance(s, str) else s for s in specs]
    names = [s.name for s in spec_list]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate host names in {names}")
    require_node_host_prerequisites()
    workdir = Path(workdir).resolve()
    if any(workdir.is_relative_to(p) for p in ("/run", "/home")):
        raise LabError(f"workdir {workdir} is hidden inside node hosts (/run and /home are tmpfs there)")
    workdir.mkdir(parents=True, exist_ok=True)
    shims = Path(shims_dir).resolve() if shims_dir else None
    if shims is not None and not shims.is_dir():
        raise LabError(f"shims_dir {shims} is not a folder")
    hostset = NodeHostSet(workdir, [])
    if not hostset.private_key_path.exists():
        _ssh_keygen(hostset.private_key_path, "runbook-lab")
    addresses = iter(_allocate_addresses(sum(1 for s in spec_list if s.address is None)))
    passwords = {s.name: s.become_password or secrets.token_urlsafe(12) for s in spec_list}
    hashes = _password_hashes(set(passwords.values()))
    for spec in spec_list:
        host = NodeHost(
            spec=spec, address=spec.address or next(addresses), password=passwords[spec.name],
            host_dir=workdir / "hosts" / spec.name, layers_dir=_layers_dir(workdir / "hosts" / spec.name),
            fstab=spec.fstab if spec.fstab is not None else (fstab if fstab is not None else DEFAULT_FSTAB),
            proc_files=dict(proc_files or {}), shims_dir=shims, die_with_parent=die_with_parent,
        )
        _prepare_host(host, hostset.private_key_path.with_suffix(".pub"), hashes[host.password])
        hostset.add(host)
    try:
        for host in hostset:
            host.launch()
        deadline = time.monotonic() + timeout
        for host in hostset:
            host.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        hostset.stop()
        raise
    _write_private(hostset.known_hosts_path, "".join(
        f"{h.address} {(h.host_dir / 'ssh' / 'ssh_host_ed25519_key.pub').read_text().split(' ')[0]} "
        f"{(h.host_dir / 'ssh' / 'ssh_host_ed25519_key.pub').read_text().split(' ')[1]}\n" for h in hostset))
    hostset.write_inventory()
    hostset.save_state()
    return hostset


def node_host_prerequisite_problems() -> list[str]:
    """What this machine lacks for node hosts (empty when nothing): root, unshare, sshd, sudo, ..."""
    problems = []
    if os.geteuid() != 0:
        problems.append("node hosts need root (mount namespaces and overlays)")
    for tool in ("unshare", "nsenter", "ssh-keygen", "ssh", "openssl", "mount"):
        if shutil.which(tool) is None:
            problems.append(f"missing command {tool}")
    for path in ("/usr/sbin/sshd", "/usr/bin/sudo", "/usr/bin/python3"):
        if not os.access(path, os.X_OK):
            problems.append(f"missing {path} (apt-get install openssh-server sudo python3)")
    for top in ("/bin", "/sbin", "/lib"):
        # shims live in the host's /usr overlay: a real /sbin outside /usr would let
        # /sbin/swapoff reach this machine's swap
        if os.path.exists(top) and not os.path.realpath(top).startswith("/usr/"):
            problems.append(f"{top} is not merged into /usr (a merged-/usr system is needed)")
    return problems


def require_node_host_prerequisites() -> None:
    problems = node_host_prerequisite_problems()
    if problems:
        raise LabError("cannot start node hosts: " + "; ".join(problems))


# -- preparation (on this machine, before the namespace exists) -------------------------------------
def _allocate_addresses(count: int) -> list[str]:
    addresses: list[str] = []
    while len(addresses) < count:
        addresses += free_loopback_block(min(254, count - len(addresses)))
    return addresses


def _layers_dir(host_dir: Path) -> Path:
    """Overlay layers must not lie inside a tree they overlay: move them to the temp folder if so."""
    if any(host_dir.is_relative_to(f"/{d}") for d in OVERLAID):
        digest = hashlib.sha256(str(host_dir).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"runbook-layers-{digest}"
    return host_dir / "layers"


def _prepare_host(host: NodeHost, client_pub: Path, password_hash: str) -> None:
    ssh = host.host_dir / "ssh"
    first_time = not ssh.is_dir()
    for path in (ssh, host.state_dir, *(host.layers_dir / f"{d}-{k}" for d in OVERLAID for k in ("up", "work"))):
        path.mkdir(parents=True, exist_ok=True)
    host.state_dir.chmod(0o777)  # shims write here as root; read-only tools (journalctl) as ops
    if not first_time:
        return
    _ssh_keygen(ssh / "ssh_host_ed25519_key", host.name)
    shutil.copyfile(client_pub, ssh / "authorized_keys")
    (ssh / "sshd_config").write_text("\n".join([
        f"ListenAddress {host.address}:{SSH_PORT}",
        f"HostKey {HOST_FILES_MOUNT}/ssh_host_ed25519_key",
        "PidFile none", "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        "PermitRootLogin no", f"AllowUsers {LOGIN_USER}", "AuthorizedKeysFile .ssh/authorized_keys",
        "UseDNS no", "MaxStartups 200:30:400", "MaxSessions 100",
        "Subsystem sftp /usr/lib/openssh/sftp-server", "",
    ]))
    etc = host.layers_dir / "etc-up"
    _write_like(etc, "fstab", host.fstab)
    _write_like(etc, "hostname", host.name + "\n")
    _write_like(etc, "hosts", _read_text("/etc/hosts") + f"127.0.0.1 {host.name}\n{host.address} {host.name}\n")
    _add_login_user(etc, password_hash)
    sudoers = f"{LOGIN_USER} ALL=(ALL) {'NOPASSWD' if host.spec.sudo == 'nopasswd' else 'PASSWD'}:ALL\n"
    _write_like(etc, "sudoers.d/runbook-ops", sudoers, mode=0o440)


def _add_login_user(etc_upper: Path, password_hash: str) -> None:
    """``ops`` in the host's passwd/group/shadow/gshadow (same UID as on this machine if it exists)."""
    passwd = [line for line in _read_text("/etc/passwd").splitlines() if line]
    uids = {int(f[2]) for f in (line.split(":") for line in passwd) if len(f) > 3}
    gids = {int(f[2]) for f in (line.split(":") for line in _read_text("/etc/group").splitlines()) if len(f) > 2}
    existing = [line.split(":") for line in passwd if line.startswith(f"{LOGIN_USER}:")]
    uid = int(existing[0][2]) if existing else next(n for n in range(1000, 60000) if n not in uids and n not in gids)

    def replaced(path: str, entry: str) -> str:
        kept = [line for line in _read_text(path).splitlines() if line and not line.startswith(f"{LOGIN_USER}:")]
        return "\n".join([*kept, entry]) + "\n"

    home = f"/home/{LOGIN_USER}"
    _write_like(etc_upper, "passwd", replaced("/etc/passwd", f"{LOGIN_USER}:x:{uid}:{uid}::{home}:/bin/bash"))
    _write_like(etc_upper, "group", replaced("/etc/group", f"{LOGIN_USER}:x:{uid}:"))
    _write_like(etc_upper, "shadow", replaced("/etc/shadow", f"{LOGIN_USER}:{password_hash}:19000:0:99999:7:::"))
    if os.path.exists("/etc/gshadow"):
        _write_like(etc_upper, "gshadow", replaced("/etc/gshadow", f"{LOGIN_USER}:!::"))


def _install_shims(shims_dir: Path | None, usr_upper: Path, layers_dir: Path) -> None:
    if shims_dir is None:
        return
    for source in sorted(p for p in shims_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        for target in _shim_targets(source.relative_to(shims_dir)):
            root, _, rest = target.partition("/")
            if root not in OVERLAID or not rest:
                raise LabError(f"shim {source} maps to /{target}: only /usr, /etc, /var and /root are allowed")
            upper = layers_dir / f"{root}-up"
            _mkdirs_like(upper, Path(rest).parent, Path("/") / root)
            destination = upper / rest
            shutil.copyfile(source, destination)
            destination.chmod(0o755)


def _shim_targets(relative: Path) -> list[str]:
    """Paths (without the leading /) a file of the shims folder is installed at; module docstring."""
    if len(relative.parts) > 1:
        return [relative.as_posix()]
    name = relative.name
    if "__" in name:
        return [name.replace("__", "/").lstrip("/")]
    if name.startswith("_"):
        return [f"{HELPER_DIR}/{name}"]
    found = [f"{d}/{name}" for d in _PLAIN_SHIM_DIRS if os.path.lexists(f"/{d}/{name}")]
    return found or [f"usr/bin/{name}"]


# -- stopping -------------------------------------------------------------------------------------
def _stop_hosts(hosts: list[NodeHost], timeout: float) -> None:
    namespaces = {(h.mount_namespace, h.uts_namespace) for h in hosts if h.mount_namespace}
    refs = [h.ref for h in hosts if h.ref is not None and h.ref.alive()]
    popens = {h.ref.pid: h._popen for h in hosts if h.ref is not None and h._popen is not None}

    def reap(pid: int) -> None:
        popen = popens.get(pid)
        if popen is not None:
            popen.poll()

    procs.stop_processes(refs, timeout=timeout / 2, reap=reap)
    deadline = time.monotonic() + timeout
    while namespaces:
        members = _namespace_members(namespaces)
        if not members:
            break
        for pid in members:
            procs.ProcessRef.of(pid).signal(9 if time.monotonic() > deadline - timeout / 2 else 15)
        if time.monotonic() > deadline:
            raise LabError(f"node host processes {members} did not end within {timeout:.0f} s")
        time.sleep(0.05)
    for host in hosts:
        if host._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                host._popen.wait(timeout=1)
        host._popen = None


def _namespace_members(namespaces: set[tuple[str, str | None]]) -> list[int]:
    return [pid for mnt, uts in namespaces for pid in procs.pids_in_mount_namespace(mnt, uts)]


# -- small helpers --------------------------------------------------------------------------------
def _ssh_keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)


def _password_hashes(passwords: set[str]) -> dict[str, str]:
    hashes = {}
    for password in passwords:
        result = subprocess.run(["openssl", "passwd", "-6", "-stdin"], input=password + "\n",
                                capture_output=True, text=True, check=True)
        hashes[password] = result.stdout.strip()
    return hashes


def _write_like(upper: Path, relative: str, content: str, mode: int | None = None) -> None:
    """Write ``upper/relative``, taking owner and mode from this machine's file (or dir) of that name."""
    lower_root = Path("/") / upper.name.removesuffix("-up")
    rel = Path(relative)
    _mkdirs_like(upper, rel.parent, lower_root)
    destination = upper / rel
    destination.write_text(content)
    lower = lower_root / rel
    if lower.exists():
        st = lower.stat()
        os.chown(destination, st.st_uid, st.st_gid)
        destination.chmod(mode if mode is not None else st.st_mode & 0o7777)
    else:
        destination.chmod(mode if mode is not None else 0o644)


def _mkdirs_like(upper: Path, relative_dir: Path, lower_root: Path) -> None:
    """Create ``relative_dir`` in an upper layer, each level with the lower directory's owner and mode."""
    current_upper, current_lower = upper, lower_root
    for part in relative_dir.parts:
        current_upper, current_lower = current_upper / part, current_lower / part
        if current_upper.is_dir():
            continue
        current_upper.mkdir()
        if current_lower.is_dir():
            st = current_lower.stat()
            os.chown(current_upper, st.st_uid, st.st_gid)
            current_upper.chmod(st.st_mode & 0o7777)
        else:
            current_upper.chmod(0o755)


def _write_private(path: Path, content: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(content)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def _read_or_empty(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _accepts(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((address, port)) == 0


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
