"""What a kubelet would start for the Deployment of ``deploy/kubernetes``: the rendered manifests and the
image's Containerfile -> one ``ContainerPlan`` per replica. Pure: no process, no API call, no file write.

The plan holds what a kubelet derives: the argv (the image's ENTRYPOINT, the container's ``args`` with
``$(VAR)`` expanded), the environment (the image's ``ENV``, the container's ``env`` with ``value``,
``fieldRef``, ``secretKeyRef`` and ``configMapKeyRef``, the service links and ``KUBERNETES_SERVICE_*``),
every volume's files with the modes and group the kubelet gives them (``defaultMode``, ``fsGroup``),
emptyDirs, the projected ServiceAccount token, the UID/GID, the read-only root, the probes.

Nothing is special-cased: every field of the Deployment is either in ``SUPPORTED`` (with how the lab
honours it) or an ``UnsupportedField`` error naming it, so the lab fails when the base grows something
no one has tried. ``cluster_mode`` carries the plan out.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from engine.lab.errors import LabError

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# The base image's own environment (python:3.12-slim); the installed package's bin folder replaces
# /usr/local/bin, where the image's `pip install .` puts the entry point.
BASE_IMAGE_ENV = {"PATH": "/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}

# field path ([] for any list item) -> how the lab honours it. Anything else is an error.
SUPPORTED: dict[str, str] = {
    "apiVersion": "apps/v1 only", "kind": "Deployment",
    "metadata.name": "the pods are named <name>-<hash>-<suffix>", "metadata.namespace": "the pods' namespace",
    "metadata.labels": "kept on the Deployment object",
    "spec.replicas": "one process per replica",
    "spec.selector.matchLabels": "must match the template's labels",
    "spec.template.metadata.labels": "the Pods' labels (the Service selects them)",
    "spec.template.spec.serviceAccountName": "the projected token is TokenRequest's for this ServiceAccount",
    "spec.template.spec.automountServiceAccountToken": "token, ca.crt and namespace at " + SA_DIR,
    "spec.template.spec.securityContext.runAsNonRoot": "refused when the UID is 0",
    "spec.template.spec.securityContext.runAsUser": "the process's UID (setpriv)",
    "spec.template.spec.securityContext.runAsGroup": "the process's GID (setpriv)",
    "spec.template.spec.securityContext.fsGroup": "supplementary group; volume files group-owned by it",
    "spec.template.spec.securityContext.seccompProfile.type": "RuntimeDefault only; NOT applied (no seccomp filter)",
    "spec.template.spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[].topologyKey":
        "kubernetes.io/hostname only: each replica on its own lab node",
    "spec.template.spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[]"
    ".labelSelector.matchLabels": "must select the replicas themselves",
    "spec.template.spec.volumes[].name": "", "spec.template.spec.volumes[].configMap.name": "files of the ConfigMap",
    "spec.template.spec.volumes[].configMap.defaultMode": "the files' mode",
    "spec.template.spec.volumes[].secret.secretName": "files of the Secret, read from the API server",
    "spec.template.spec.volumes[].secret.defaultMode": "the files' mode",
    "spec.template.spec.volumes[].secret.items[].key": "", "spec.template.spec.volumes[].secret.items[].path": "",
    "spec.template.spec.volumes[].configMap.items[].key": "", "spec.template.spec.volumes[].configMap.items[].path": "",
    "spec.template.spec.volumes[].emptyDir": "a tmpfs (no medium or sizeLimit)",
    "spec.template.spec.containers[].name": "one container only",
    "spec.template.spec.containers[].image": "the installed package stands for the image (deploy/Containerfile)",
    "spec.template.spec.containers[].imagePullPolicy": "nothing is pulled",
    "spec.template.spec.containers[].args": "after the image's ENTRYPOINT, $(VAR) expanded",
    "spec.template.spec.containers[].env[].name": "",
    "spec.template.spec.containers[].env[].value": "$(VAR) expanded",
    "spec.template.spec.containers[].env[].valueFrom.fieldRef.fieldPath":
        "metadata.name, metadata.namespace, status.podIP, spec.nodeName, spec.serviceAccountName",
    "spec.template.spec.containers[].env[].valueFrom.secretKeyRef.name": "read from the API server",
    "spec.template.spec.containers[].env[].valueFrom.secretKeyRef.key": "",
    "spec.template.spec.containers[].env[].valueFrom.secretKeyRef.optional": "",
    "spec.template.spec.containers[].env[].valueFrom.configMapKeyRef.name": "from the rendered ConfigMaps",
    "spec.template.spec.containers[].env[].valueFrom.configMapKeyRef.key": "",
    "spec.template.spec.containers[].env[].valueFrom.configMapKeyRef.optional": "",
    "spec.template.spec.containers[].ports[].name": "", "spec.template.spec.containers[].ports[].containerPort":
        "the pod IP's port the Service and the probes use",
    "spec.template.spec.containers[].readinessProbe.httpGet.path": "the Service sends only to ready pods",
    "spec.template.spec.containers[].readinessProbe.httpGet.port": "",
    "spec.template.spec.containers[].readinessProbe.periodSeconds": "",
    "spec.template.spec.containers[].livenessProbe.httpGet.path": "probed; failures are reported, NOT restarted",
    "spec.template.spec.containers[].livenessProbe.httpGet.port": "",
    "spec.template.spec.containers[].livenessProbe.periodSeconds": "",
    "spec.template.spec.containers[].livenessProbe.failureThreshold": "",
    "spec.template.spec.containers[].resources.requests.cpu": "NOT enforced (kept on the Pod)",
    "spec.template.spec.containers[].resources.requests.memory": "NOT enforced (kept on the Pod)",
    "spec.template.spec.containers[].resources.limits.memory": "NOT enforced (kept on the Pod)",
    "spec.template.spec.containers[].securityContext.allowPrivilegeEscalation": "false: no_new_privs",
    "spec.template.spec.containers[].securityContext.readOnlyRootFilesystem": "true: all read-only but volumes",
    "spec.template.spec.containers[].securityContext.capabilities.drop": "[ALL]: empty bounding set",
    "spec.template.spec.containers[].volumeMounts[].name": "",
    "spec.template.spec.containers[].volumeMounts[].mountPath": "bind-mounted there in the private mount namespace",
    "spec.template.spec.containers[].volumeMounts[].readOnly": "",
}
# kinds of the base -> how the lab honours them. Any other kind is an error.
KINDS: dict[str, str] = {
    "Namespace": "applied", "CustomResourceDefinition": "applied (waited for Established)",
    "ServiceAccount": "applied; the pods' token is TokenRequest's for it", "ClusterRole": "applied, enforced",
    "ClusterRoleBinding": "applied, enforced", "Role": "applied, enforced", "RoleBinding": "applied, enforced",
    "ConfigMap": "applied; mounted and read by the pods", "Deployment": "applied; its replicas run as processes",
    "Service": "applied; a TCP proxy on a loopback address stands for it",
    "PodDisruptionBudget": "applied where the API server serves its version (1.20 does not serve policy/v1)",
}
FIELD_REFS = ("metadata.name", "metadata.namespace", "status.podIP", "spec.nodeName", "spec.serviceAccountName")
_CONTAINERFILE_INSTRUCTIONS = {"FROM", "RUN", "WORKDIR", "COPY", "ENV", "USER", "ENTRYPOINT", "CMD"}


class UnsupportedField(LabError):
    """A manifest field (or value) the lab's emulation of a kubelet does not honour."""


# ============================================================================ the image


@dataclass(frozen=True)
class Image:
    """What deploy/Containerfile builds, as far as starting the container goes."""

    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: Mapping[str, str]
    user: str | None
    workdir: str
    copies: tuple[tuple[str, str], ...]  # (source in the build context, absolute path in the image)
    users: Mapping[int, tuple[str, str]]  # uid -> (name, home), from `useradd` in RUN
    installs: tuple[str, ...]  # `pip install` arguments of RUN


def _logical_lines(text: str) -> Iterator[str]:
    buf = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield (buf + line).strip()
        buf = ""
    if buf.strip():
        yield buf.strip()


def _exec_form(value: str, where: str) -> tuple[str, ...]:
    import json

    try:
        parsed = json.loads(value)
    except ValueError:
        raise UnsupportedField(f"{where}: only the exec form [\"...\"] is supported") from None
    if not isinstance(parsed, list) or not all(isinstance(p, str) for p in parsed):
        raise UnsupportedField(f"{where}: only the exec form [\"...\"] is supported")
    return tuple(parsed)


def parse_containerfile(text: str, origin: str = "deploy/Containerfile") -> Image:
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: dict[str, str] = {}
    user: str | None = None
    workdir = "/"
    copies: list[tuple[str, str]] = []
    users: dict[int, tuple[str, str]] = {}
    installs: list[str] = []
    for line in _logical_lines(text):
        word, _, rest = line.partition(" ")
        word = word.upper()
        where = f"{origin}: {word} {rest[:40]}"
        if word not in _CONTAINERFILE_INSTRUCTIONS:
            raise UnsupportedField(f"{origin}: instruction {word} is not supported by the lab's emulation")
        if word == "ENTRYPOINT":
            entrypoint = _exec_form(rest, where)
        elif word == "CMD":
            cmd = _exec_form(rest, where)
        elif word == "ENV":
            for part in shlex.split(rest):
                key, eq, value = part.partition("=")
                if not eq:
                    raise UnsupportedField(f"{where}: only ENV KEY=VALUE is supported")
                env[key] = value
        elif word == "USER":
            user = rest.strip()
        elif word == "WORKDIR":
            workdir = str(PurePosixPath(workdir) / rest.strip())
        elif word == "COPY":
            parts = shlex.split(rest)
            if any(p.startswith("--") for p in parts) or len(parts) < 2:
                raise UnsupportedField(f"{where}: only COPY SRC... DEST is supported")
            *sources, dest = parts
            if dest.startswith("/"):  # into the image itself; relative: the build's context in WORKDIR
                copies += [(s, dest) for s in sources]
        elif word == "RUN":
            for command in re.split(r"&&|;", rest):
                argv = shlex.split(command)
                if argv[:1] == ["useradd"]:
                    users.update(_useradd(argv, where))
                if argv[:2] == ["pip", "install"]:
                    installs += [a for a in argv[2:] if not a.startswith("-")]
    if not entrypoint:
        raise UnsupportedField(f"{origin}: no ENTRYPOINT")
    return Image(entrypoint, cmd, env, user, workdir, tuple(copies), users, tuple(installs))


def _useradd(argv: list[str], where: str) -> dict[int, tuple[str, str]]:
    uid, home = None, None
    args = iter(argv[1:])
    name = None
    for a in args:
        if a in ("--uid", "-u"):
            uid = int(next(args))
        elif a in ("--home-dir", "-d"):
            home = next(args)
        elif not a.startswith("-"):
            name = a
    if uid is None or name is None:
        raise UnsupportedField(f"{where}: useradd without --uid or a name")
    return {uid: (name, home or f"/home/{name}")}


# ============================================================================ the Deployment


@dataclass(frozen=True)
class VolumeFile:
    path: str  # relative to the mount
    data: bytes
    mode: int
    group: int | None  # fsGroup


@dataclass(frozen=True)
class Mount:
    """A volume at ``path``: ``files`` (ConfigMap, Secret, the token) or a tmpfs (``files is None``)."""

    name: str
    path: str
    read_only: bool
    files: tuple[VolumeFile, ...] | None
    group: int | None = None


@dataclass(frozen=True)
class Probe:
    path: str
    port: int
    period: float
    failure_threshold: int


@dataclass(frozen=True)
class ContainerPlan:
    pod: str
    node: str
    pod_ip: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    uid: int
    gid: int
    groups: tuple[int, ...]
    workdir: str
    read_only_root: bool
    no_new_privs: bool
    drop_all_capabilities: bool
    mounts: tuple[Mount, ...]
    image_copies: tuple[tuple[str, str], ...]
    passwd: str  # the image's /etc/passwd line for the UID
    readiness: Probe | None
    liveness: Probe | None
    ports: Mapping[str, int]
    not_enforced: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Workload:
    """The rendered base, split: the Deployment, its Service, the ConfigMaps, everything else."""

    deployment: Mapping[str, Any]
    service: Mapping[str, Any]
    config_maps: Mapping[str, Mapping[str, str]]
    objects: tuple[Mapping[str, Any], ...]

    @property
    def namespace(self) -> str:
        return str(self.deployment["metadata"].get("namespace") or "default")

    @property
    def name(self) -> str:
        return str(self.deployment["metadata"]["name"])

    @property
    def replicas(self) -> int:
        return int(self.deployment["spec"].get("replicas", 1))

    @property
    def template(self) -> Mapping[str, Any]:
        return self.deployment["spec"]["template"]

    @property
    def container(self) -> Mapping[str, Any]:
        return self.template["spec"]["containers"][0]

    @property
    def service_account(self) -> str:
        return str(self.template["spec"].get("serviceAccountName") or "default")

    def service_port(self) -> tuple[int, int]:
        """(the Service's port, the container port it targets)."""
        ports = self.service["spec"]["ports"]
        if len(ports) != 1:
            raise UnsupportedField(f"Service {self.service['metadata']['name']}: one port only")
        target = ports[0].get("targetPort", ports[0]["port"])
        return int(ports[0]["port"]), _container_port(self.container, target, "Service targetPort")


def _paths(value: Any, prefix: str) -> Iterator[tuple[str, str]]:
    """(generic path with [] for list items, concrete path) of every leaf; {} is a leaf."""
    if isinstance(value, Mapping) and value:
        if prefix.endswith(("labels", "matchLabels")):
            yield prefix, prefix
            return
        for k, v in value.items():
            yield from ((g, c) for g, c in _paths(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, list) and value and prefix.endswith(("args", "drop")):
        yield prefix, prefix
    elif isinstance(value, list):
        for i, v in enumerate(value):
            for g, c in _paths(v, f"{prefix}[]"):
                yield g, c.replace(f"{prefix}[]", f"{prefix}[{i}]", 1)
    else:
        yield prefix, prefix


def split_rendered(objects: Sequence[Mapping[str, Any]]) -> Workload:
    """The rendered base -> ``Workload``; checks every field of the Deployment against ``SUPPORTED``."""
    for o in objects:
        if o.get("kind") not in KINDS:
            raise UnsupportedField(f"{o.get('kind')} {o.get('metadata', {}).get('name')}: kind {o.get('kind')} is not "
                                   "supported by the lab's emulation (engine/lab/podspec.py KINDS)")
    deployments = [o for o in objects if o.get("kind") == "Deployment"]
    if len(deployments) != 1:
        raise UnsupportedField(f"the base must hold one Deployment, not {len(deployments)}")
    deployment = deployments[0]
    name = deployment["metadata"]["name"]
    for generic, concrete in _paths(deployment, ""):
        if generic not in SUPPORTED:
            raise UnsupportedField(f"Deployment {name}: {concrete} is not supported by the lab's emulation "
                                   "of a kubelet (engine/lab/podspec.py SUPPORTED)")
    spec = deployment["spec"]
    if deployment.get("apiVersion") != "apps/v1":
        raise UnsupportedField(f"Deployment {name}: apiVersion {deployment.get('apiVersion')} (apps/v1 only)")
    pod = spec["template"]["spec"]
    if len(pod["containers"]) != 1:
        raise UnsupportedField(f"Deployment {name}: spec.template.spec.containers: one container only")
    labels = spec["template"]["metadata"]["labels"]
    if not _selects(spec["selector"]["matchLabels"], labels):
        raise UnsupportedField(f"Deployment {name}: spec.selector does not select the template's labels")
    seccomp = (pod.get("securityContext") or {}).get("seccompProfile", {}).get("type")
    if seccomp not in (None, "RuntimeDefault"):
        raise UnsupportedField(f"Deployment {name}: seccompProfile.type {seccomp} (RuntimeDefault only)")
    for term in (pod.get("affinity") or {}).get("podAntiAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", []):
        if term.get("topologyKey") != "kubernetes.io/hostname" or not _selects(
                term.get("labelSelector", {}).get("matchLabels", {}), labels):
            raise UnsupportedField(f"Deployment {name}: podAntiAffinity: only topologyKey kubernetes.io/hostname "
                                   "selecting the replicas themselves")
    drop = ((pod["containers"][0].get("securityContext") or {}).get("capabilities") or {}).get("drop")
    if drop not in (None, ["ALL"]):
        raise UnsupportedField(f"Deployment {name}: capabilities.drop {drop} (only [ALL])")
    services = [o for o in objects if o.get("kind") == "Service"
                and _selects(o.get("spec", {}).get("selector") or {"-": "-"}, labels)]
    if len(services) != 1:
        raise UnsupportedField(f"the base must hold one Service selecting the Deployment's pods, not {len(services)}")
    for key in services[0]["spec"]:
        if key not in ("selector", "ports"):
            raise UnsupportedField(f"Service {services[0]['metadata']['name']}: spec.{key} is not supported "
                                   "by the lab's emulation")
    config_maps = {o["metadata"]["name"]: dict(o.get("data") or {}) for o in objects if o.get("kind") == "ConfigMap"}
    return Workload(deployment, services[0], config_maps, tuple(objects))


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _container_port(container: Mapping[str, Any], port: Any, what: str) -> int:
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise UnsupportedField(f"{what} {port!r} names no port of container {container.get('name')}")


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ is $, others stay as written."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(one, text)


def service_links(name: str, ip: str, ports: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The Docker-link variables a kubelet sets for each Service of the namespace (enableServiceLinks)."""
    prefix = name.upper().replace("-", "_")
    out = {f"{prefix}_SERVICE_HOST": ip, f"{prefix}_SERVICE_PORT": str(ports[0]["port"])}
    for p in ports:
        proto = str(p.get("protocol", "TCP"))
        if p.get("name"):
            out[f"{prefix}_SERVICE_PORT_{str(p['name']).upper().replace('-', '_')}"] = str(p["port"])
        base = f"{prefix}_PORT_{p['port']}_{proto}"
        out.update({base: f"{proto.lower()}://{ip}:{p['port']}", f"{base}_PROTO": proto.lower(),
                    f"{base}_PORT": str(p["port"]), f"{base}_ADDR": ip})
    out[f"{prefix}_PORT"] = f"{str(ports[0].get('protocol', 'TCP')).lower()}://{ip}:{ports[0]['port']}"
    return out


def container_plan(work: Workload, image: Image, *, pod: str, node: str, pod_ip: str,
                   secrets: Mapping[str, Mapping[str, bytes]], token: str, ca: bytes,
                   api_host: str, api_port: int, service_ip: str, venv_bin: str) -> ContainerPlan:
    """What a kubelet starts for replica ``pod`` on ``node`` (``secrets``: name -> key -> bytes, as read
    from the API server; ``token``: TokenRequest's for the ServiceAccount)."""
    spec = work.template["spec"]
    c = work.container
    where = f"Deployment {work.name}"
    sc = spec.get("securityContext") or {}
    csc = c.get("securityContext") or {}
    uid = int(sc.get("runAsUser", _image_uid(image)))
    gid = int(sc.get("runAsGroup", uid))
    if sc.get("runAsNonRoot") and uid == 0:
        raise UnsupportedField(f"{where}: runAsNonRoot with UID 0: a kubelet refuses to start it")
    fs_group = sc.get("fsGroup")
    fields = {"metadata.name": pod, "metadata.namespace": work.namespace, "status.podIP": pod_ip,
              "spec.nodeName": node, "spec.serviceAccountName": work.service_account}

    def secret_value(ref: Mapping[str, Any]) -> str | None:
        data = secrets.get(ref["name"])
        if data is None or ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise LabError(f"{where}: Secret {ref['name']} has no key {ref['key']} "
                           "(a kubelet: CreateContainerConfigError)")
        return data[ref["key"]].decode()

    env: dict[str, str] = {**BASE_IMAGE_ENV, **image.env, "HOSTNAME": pod}
    env["PATH"] = env["PATH"].replace("/usr/local/bin", venv_bin, 1)
    # what a kubelet adds: the API server's Service, and the links of the namespace's Services
    env.update(KUBERNETES_SERVICE_HOST=api_host, KUBERNETES_SERVICE_PORT=str(api_port),
               KUBERNETES_SERVICE_PORT_HTTPS=str(api_port), KUBERNETES_PORT=f"tcp://{api_host}:{api_port}")
    env.update(service_links(work.service["metadata"]["name"], service_ip, work.service["spec"]["ports"]))
    defined: dict[str, str] = {}
    for var in c.get("env", []):
        value: str | None
        if "value" in var:
            value = expand(str(var["value"]), defined)
        else:
            source = var["valueFrom"]
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                if path not in fields:
                    raise UnsupportedField(f"{where}: env {var['name']}: fieldRef {path} (supported: "
                                           f"{', '.join(FIELD_REFS)})")
                value = fields[path]
            elif "secretKeyRef" in source:
                value = secret_value(source["secretKeyRef"])
            else:
                ref = source["configMapKeyRef"]
                value = work.config_maps.get(ref["name"], {}).get(ref["key"])
                if value is None and not ref.get("optional"):
                    raise LabError(f"{where}: ConfigMap {ref['name']} has no key {ref['key']}")
        if value is not None:
            defined[var["name"]] = value
    env.update(defined)
    args = [expand(str(a), defined) for a in c.get("args", image.cmd)]
    entry = list(image.entrypoint)
    if entry and "/" not in entry[0]:
        entry[0] = f"{venv_bin}/{entry[0]}"  # where the image's PATH finds it
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts: list[Mount] = []
    for vm in c.get("volumeMounts", []):
        volume = volumes.get(vm["name"])
        if volume is None:
            raise LabError(f"{where}: volumeMount {vm['name']} names no volume")
        mounts.append(_mount(volume, vm, work, secrets, fs_group, where))
    if spec.get("automountServiceAccountToken", True):
        files = [VolumeFile(name, data, 0o644, fs_group) for name, data in
                 (("token", token.encode()), ("ca.crt", ca), ("namespace", work.namespace.encode()))]
        mounts.append(Mount("kube-api-access", SA_DIR, True, tuple(files), fs_group))
    ports = {str(p.get("name", p["containerPort"])): int(p["containerPort"]) for p in c.get("ports", [])}
    name, home = image.users.get(uid, (f"uid{uid}", "/"))
    not_enforced = tuple(f"{k}: {v}" for k, v in SUPPORTED.items() if "NOT" in v)
    return ContainerPlan(
        pod=pod, node=node, pod_ip=pod_ip, argv=(*entry, *args), env=env, uid=uid, gid=gid,
        groups=tuple(sorted({gid, *([int(fs_group)] if fs_group is not None else [])})),
        workdir=image.workdir, read_only_root=bool(csc.get("readOnlyRootFilesystem")),
        no_new_privs=csc.get("allowPrivilegeEscalation") is False,
        drop_all_capabilities=(csc.get("capabilities") or {}).get("drop") == ["ALL"],
        mounts=tuple(mounts), image_copies=image.copies,
        passwd=f"{name}:x:{uid}:{gid}::{home}:/usr/sbin/nologin",
        readiness=_probe(c, "readinessProbe"), liveness=_probe(c, "livenessProbe"), ports=ports,
        not_enforced=not_enforced)


def _image_uid(image: Image) -> int:
    user = (image.user or "0").split(":")[0]
    if user.isdigit():
        return int(user)
    for uid, (name, _) in image.users.items():
        if name == user:
            return uid
    raise UnsupportedField(f"Containerfile USER {user}: no such user")


def _probe(container: Mapping[str, Any], key: str) -> Probe | None:
    probe = container.get(key)
    if not probe:
        return None
    get = probe["httpGet"]
    return Probe(str(get["path"]), _container_port(container, get["port"], key),
                 float(probe.get("periodSeconds", 10)), int(probe.get("failureThreshold", 3)))


def _mount(volume: Mapping[str, Any], vm: Mapping[str, Any], work: Workload,
           secrets: Mapping[str, Mapping[str, bytes]], fs_group: Any, where: str) -> Mount:
    read_only = bool(vm.get("readOnly"))
    group = int(fs_group) if fs_group is not None else None
    if "emptyDir" in volume:
        if volume["emptyDir"]:
            raise UnsupportedField(f"{where}: volume {volume['name']}: emptyDir {volume['emptyDir']} "
                                   "(only {} is supported)")
        return Mount(volume["name"], vm["mountPath"], read_only, None, group)
    if "configMap" in volume:
        source, data = volume["configMap"], {k: v.encode() for k, v in
                                             work.config_maps.get(volume["configMap"]["name"], {}).items()}
        if volume["configMap"]["name"] not in work.config_maps:
            raise LabError(f"{where}: volume {volume['name']}: no ConfigMap {volume['configMap']['name']}")
    else:
        source = volume["secret"]
        if source["secretName"] not in secrets:
            raise LabError(f"{where}: volume {volume['name']}: no Secret {source['secretName']} in the API server")
        data = dict(secrets[source["secretName"]])
    mode = int(source.get("defaultMode", 0o644))
    # a kubelet's SetVolumeOwnership: group fsGroup, and group read (read-only volume plugins) added
    if group is not None:
        mode |= 0o440
    items = source.get("items") or [{"key": k, "path": k} for k in sorted(data)]
    files = []
    for item in items:
        if item["key"] not in data:
            raise LabError(f"{where}: volume {volume['name']}: no key {item['key']}")
        files.append(VolumeFile(item["path"], data[item["key"]], mode, group))
    return Mount(volume["name"], vm["mountPath"], read_only, tuple(files), group)
