"""Host facts, each one unit: the lines it adds to the one ``raw`` facts probe and the parser of
their output, side by side (the pyinfra way: a fact is its command and its parser).

The node-facts probe (``playbooks/tasks/facts-probe.yml``) is ONE ``raw`` task, so gathering
every fact costs one SSH round trip: it is the header below followed by each registered fact's
``SCRIPT``, in registration order. Each probe inside prints one line ``NAME RC BASE64(STDOUT)``
(``emit NAME COMMAND...``), which ``decode_probes`` reads back. The committed task file is
generated from this module (``python -m engine.hostfacts > playbooks/tasks/facts-probe.yml``;
a unit test keeps them equal), so the playbook an operator runs by hand is the same probe.

``parse_host_facts`` is the parse boundary the Ansible connector calls: the ``runbook_facts`` stat
-> ``HostFacts``, each fact's ``parse`` filling its fields. ``host_data`` is the same facts as the
plain data templates see as ``facts.host``. Pure: no I/O, no Ansible; this module must not import
the connectors.
"""

from __future__ import annotations

import base64
import binascii
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from engine.errors import HostError
from engine.facts import (
    CudaProcess,
    FileFacts,
    GpuDevice,
    GpuHealth,
    HostFacts,
    RowRemap,
    ServiceFacts,
    SwapDevice,
    XidEvent,
    same_pci_slot,
)

FACTS_FORMAT_VERSION = 1

Probes = Mapping[str, tuple[int, str]]  # probe name -> (exit code, stdout)


class HostFact:
    """One host fact. ``SCRIPT``: bash lines of the raw probe (``emit NAME COMMAND ARGS...``; the
    output of the last ``emit`` is in ``$last_out``). ``parse``: the ``HostFacts`` fields it fills,
    from the decoded probe lines (and the stat, for the asked-for services and files). ``data``:
    those fields as plain data for templates (``facts.host.*``)."""

    NAME: ClassVar[str]
    SCRIPT: ClassVar[str]

    def parse(self, host: str, probes: Probes, stat: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def data(self, facts: HostFacts) -> dict[str, Any]:
        return {}


_FACTS: list[HostFact] = []

F = TypeVar("F", bound=type[HostFact])


def register_host_fact(cls: F) -> F:
    """Add a fact to the probe and the parser (a class decorator)."""
    if any(f.NAME == cls.NAME for f in _FACTS):
        raise ValueError(f"host fact {cls.NAME!r} is already registered")
    _FACTS.append(cls())
    return cls


def host_facts() -> tuple[HostFact, ...]:
    return tuple(_FACTS)


def out(probes: Probes, name: str, ok_rcs: tuple[int, ...] = (0,)) -> str | None:
    """A probe's output when it exited with one of ``ok_rcs``; None otherwise (127: not run)."""
    rc, text = probes.get(name, (127, ""))
    return text if rc in ok_rcs else None


# ============================================================================ swap and fstab


def _unescape_raw(value: str) -> str:
    r"""util-linux ``--raw`` output escapes unsafe characters as ``\xNN``."""
    return re.sub(r"\\x([0-9a-fA-F]{2})", lambda m: chr(int(m.group(1), 16)), value)


def parse_swapon(text: str) -> tuple[SwapDevice, ...]:
    """``swapon --show --noheadings --raw --bytes`` (NAME TYPE SIZE USED PRIO) -> devices."""
    devices = []
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        size = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else 0
        devices.append(SwapDevice(name=_unescape_raw(fields[0]),
                                  type=fields[1] if len(fields) > 1 else "file", size_bytes=size))
    return tuple(devices)


def parse_proc_swaps(text: str) -> tuple[SwapDevice, ...]:
    """``/proc/swaps`` (a header, then Filename Type Size(KiB) Used Priority) -> devices."""
    devices = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 3:
            continue
        # the kernel escapes spaces etc. in names as octal \040
        name = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[0])
        size = int(fields[2]) * 1024 if fields[2].isdigit() else 0
        devices.append(SwapDevice(name=name, type=fields[1], size_bytes=size))
    return tuple(devices)


def fstab_active_swap(text: str) -> tuple[str, ...]:
    """The active swap entries of an fstab: those that turn swap on at boot. Not comments, the third
    field (type) is ``swap``, and the options (fourth field) do not say ``noauto``.

    Lines that merely mention swap (a comment, ``/data/swapfiles-backup`` on ext4) are not
    entries of type swap. The same rule as the ``replace`` regexp in ``swap-off.yml``.
    """
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3 and not fields[0].startswith("#") and fields[2] == "swap" and \
                "noauto" not in (fields[3].split(",") if len(fields) > 3 else ()):
            entries.append(line.strip())
    return tuple(entries)


def parse_unit_properties(text: str) -> list[dict[str, str]]:
    """``systemctl show --property=...`` of several units: blocks of ``Key=Value``, blank-separated."""
    blocks: list[dict[str, str]] = []
    block: dict[str, str] = {}
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if block:
                blocks.append(block)
                block = {}
            continue
        key, sep, value = line.partition("=")
        if sep:
            block[key.strip()] = value.strip()
    return blocks


def unhandled_swap_sources(devices: Sequence[SwapDevice],
                           unit_properties: Sequence[Mapping[str, str]]) -> tuple[str, ...]:
    """Swap that ``swap-off.yml`` cannot keep off; the same rule as its refusal.

    * an active zram device (zram-generator or zramswap recreate it at boot);
    * a ``.swap`` unit with a unit file (``FragmentPath``) that is not generated from
      /etc/fstab (``SourcePath``): it would switch swap on again at boot. Units systemd makes
      for fstab entries, or on the fly for active devices and their aliases, are ours to handle.
    """
    found = [f"zram device {d.name}" for d in devices if d.name.startswith("/dev/zram")]
    for unit in unit_properties:
        name = unit.get("Id", "")
        if name.endswith(".swap") and unit.get("FragmentPath") and \
                unit.get("SourcePath", "") != "/etc/fstab":
            found.append(f"systemd unit {name} ({unit['FragmentPath']})")
    return tuple(found)


@register_host_fact
class SwapFact(HostFact):
    """Swap devices (swapon, else /proc/swaps), fstab's active swap entries, swap that swap-off.yml
    cannot keep off. Also prints plain ``swap-device`` / ``swap-unhandled`` lines for swap-off.yml."""

    NAME = "swap"
    SCRIPT = r"""emit swapon swapon --show --noheadings --raw --bytes
swap_devices=$(printf '%s' "$last_out" | awk '{print $1}')
emit proc_swaps cat /proc/swaps
emit fstab cat /etc/fstab
emit swap_units systemctl list-units --type swap --all --plain --no-legend
units=$(printf '%s' "$last_out" | awk '$1 ~ /\.swap$/ {print $1}')
unit_props=
if [ -n "$units" ]; then
  # shellcheck disable=SC2086
  emit swap_unit_props systemctl show --property=Id,ActiveState,FragmentPath,SourcePath -- $units
  unit_props=$last_out
fi
# Plain lines for playbooks (swap-off.yml acts on them; the engine parser skips them, and
# decides the same from the probes above: engine.hostfacts.unhandled_swap_sources):
# "swap-device NAME" per active swap device; "swap-unhandled WHAT" per swap source that
# commenting out /etc/fstab cannot keep off: a zram device, a .swap unit with a unit file
# (FragmentPath) not generated from /etc/fstab (SourcePath).
for device in $swap_devices; do
  echo "swap-device $device"
  case $device in /dev/zram*) echo "swap-unhandled zram device $device" ;; esac
done
printf '%s\n' "$unit_props" | awk 'BEGIN { RS = ""; FS = "\n" } {
    id = ""; fragment = ""; source = ""
    for (i = 1; i <= NF; i++) {
      if ($i ~ /^Id=/) id = substr($i, 4)
      else if ($i ~ /^FragmentPath=/) fragment = substr($i, 14)
      else if ($i ~ /^SourcePath=/) source = substr($i, 12)
    }
    if (id ~ /\.swap$/ && fragment != "" && source != "/etc/fstab")
      print "swap-unhandled systemd unit " id " (" fragment ")"
  }'
"""

    def parse(self, host: str, probes: Probes, stat: Mapping[str, Any]) -> dict[str, Any]:
        swapon = out(probes, "swapon")
        proc_swaps = out(probes, "proc_swaps")
        if swapon is not None:
            devices = parse_swapon(swapon)
        elif proc_swaps is not None:
            devices = parse_proc_swaps(proc_swaps)
        else:
            raise HostError(f"{host}: cannot read the swap state (swapon and /proc/swaps both failed)",
                            host=host)
        units = parse_unit_properties(out(probes, "swap_unit_props") or "")
        fstab = out(probes, "fstab")
        return {"swap_devices": devices, "fstab": fstab,
                "fstab_active_swap": fstab_active_swap(fstab or ""),
                "unhandled_swap_sources": unhandled_swap_sources(devices, units)}

    def data(self, facts: HostFacts) -> dict[str, Any]:
        return {
            "swap_active": facts.swap_active,
            "swap_devices": [{"name": d.name, "type": d.type, "size_bytes": d.size_bytes}
                             for d in facts.swap_devices],
            "fstab_active_swap": list(facts.fstab_active_swap),
            "unhandled_swap_sources": list(facts.unhandled_swap_sources),
        }


# ============================================================================ services


@register_host_fact
class ServicesFact(HostFact):
    """``systemctl is-active`` and the journal tail of each service the run asks about."""

    NAME = "services"
    SCRIPT = r"""for service in $RUNBOOK_FACTS_SERVICES; do
  emit "active:$service" systemctl is-active "$service"
  emit "journal:$service" journalctl -u "$service" -n "$RUNBOOK_FACTS_JOURNAL_LINES" --no-pager --quiet
done
"""

    def parse(self, host: str, probes: Probes, stat: Mapping[str, Any]) -> dict[str, Any]:
        services: dict[str, ServiceFacts] = {}
        for name in stat.get("services") or ():
            rc, state = probes.get(f"active:{name}", (127, ""))
            first = state.strip().splitlines()[0].strip() if state.strip() else ""
            # is-active exits 3 for activating/inactive/failed: the word is the answer, not the rc.
            services[name] = ServiceFacts(name=name, state=first if rc != 127 and first else "unknown",
                                          journal_tail=out(probes, f"journal:{name}") or "")
        return {"services": MappingProxyType(services)}

    def data(self, facts: HostFacts) -> dict[str, Any]:
        return {"services": {k: {"name": s.name, "state": s.state, "journal_tail": s.journal_tail}
                             for k, s in facts.services.items()}}


# ============================================================================ files


@register_host_fact
class FilesFact(HostFact):
    """The files a runbook's ``file`` checks ask about: exists, first 64 KiB, sha256."""

    NAME = "files"
    SCRIPT = r"""index=0
for path in "${RUNBOOK_FACTS_FILES[@]}"; do
  [ -n "$path" ] || continue
  emit "sha256:$index" sha256sum -- "$path"
  emit "file:$index" head -c 65536 -- "$path"
  index=$((index + 1))
done
"""

    def parse(self, host: str, probes: Probes, stat: Mapping[str, Any]) -> dict[str, Any]:
        files: dict[str, FileFacts] = {}
        for i, path in enumerate(stat.get("files") or ()):
            digest = out(probes, f"sha256:{i}")
            content = out(probes, f"file:{i}")
            exists = digest is not None and content is not None
            files[str(path)] = FileFacts(path=str(path), exists=exists,
                                         content=content or "" if exists else "",
                                         sha256=(digest or "").split(" ")[0] if exists else "")
        return {"files": MappingProxyType(files)}


# ============================================================================ GPUs


_LSPCI_DEVICE = re.compile(
    r"^(?P<slot>[0-9a-fA-F:.]+)\s+(?P<cls>.+?)\s+\[(?P<code>[0-9a-fA-F]{4})\]:\s+(?P<name>.*?)"
    r"\s+\[(?P<vd>[0-9a-fA-F]{4}:[0-9a-fA-F]{4})\](?:\s+\(rev [^)]*\))?\s*$")
_GPU_CLASSES = ("0300", "0302")  # VGA compatible controller, 3D controller


def parse_lspci(text: str) -> tuple[GpuDevice, ...]:
    """``lspci -nnk -d 10de:`` -> the NVIDIA display devices with their bound driver.

    A device's ``Kernel driver in use:`` line names its driver (``nvidia``, ``vfio-pci``, ...);
    none means "none". Other functions of the card (HDMI audio, USB-C) are not GPUs.
    """
    gpus: list[GpuDevice] = []
    current: dict[str, str] | None = None

    def flush() -> None:
        if current is not None and current["code"] in _GPU_CLASSES:
            gpus.append(GpuDevice(slot=current["slot"], vendor_device=current["vd"].lower(),
                                  name=current["name"], driver=current.get("driver", "none")))

    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            flush()
            m = _LSPCI_DEVICE.match(line.strip())
            current = m.groupdict() if m else None
            if current is not None:
                current = {k: v for k, v in current.items() if k != "cls"}
        elif current is not None and line.strip().startswith("Kernel driver in use:"):
            current["driver"] = line.split(":", 1)[1].strip() or "none"
    flush()
    return tuple(gpus)


@register_host_fact
class GpusFact(HostFact):
    """The NVIDIA GPUs (lspci), every one: PCI slot, vendor:device, name, bound driver. No lspci: no
    GPU. Templates see each with the pids of its CUDA processes, the count, and the first one's driver."""

    NAME = "gpus"
    SCRIPT = r"""emit lspci lspci -nnk -d 10de:
emit driverctl command -v driverctl
"""

    def parse(self, host: str, probes: Probes, stat: Mapping[str, Any]) -> dict[str, Any]:
        # driverctl (gpu-bind-driver.yml binds with it): `command -v` exits 1 when it is missing
        driverctl = probes.get("driverctl")
        return {"gpus": parse_lspci(out(probes, "lspci") or ""),
                "driverctl": None if driverctl is None else driverctl[0] == 0}

    def data(self, facts: HostFacts) -> dict[str, Any]:
        return {"gpus": [{"slot": g.slot, "vendor_device": g.vendor_device, "name": g.name, "driver": g.driver,
                          "cuda_processes": [p.pid for p in facts.processes_on(g)]}
                         for g in facts.gpus],
                "gpu_count": len(facts.gpus),
                "gpu_driver": facts.gpu_driver}


_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])$")


def pci_slot(bus_id: str) -> str:
    """nvidia-smi's ``00000000:01:00.0`` -> lspci's ``01:00.0`` (``0001:01:00.0`` outside domain 0)."""
    m = _BUS_ID.match(bus_id.strip())
    if not m:
        return ""
    domain = int(m.group(1) or "0", 16)
    return (f"{domain:04x}:" if domain else "") + m.group(2).lower()


def parse_cuda_processes(text: str) -> tuple[CudaProcess, ...]:
    """``nvidia-smi --query-compute-apps=pid,process_name,gpu_bus_id --format=csv,noheader`` ->
    processes, each with the PCI slot of its GPU (the older two-column form still parses, GPU unknown)."""
    procs = []
    for line in text.splitlines():
        pid, _, rest = line.partition(",")
        if not pid.strip().isdigit():
            continue
        name, _, bus_id = rest.rpartition(",")
        gpu = pci_slot(bus_id)
        if not gpu and not bus_id.strip().startswith("["):  # "[N/A]": no bus id, the name stands
            name = rest  # the older two-column form: all of it is the name
        procs.append(CudaProcess(pid=int(pid.strip()), name=name.strip(), gpu=gpu))
    return tuple(procs)


_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


def parse_cgroup(text: str) -> tuple[str, str]:
    """``/proc/PID/cgroup`` -> (its cgroup path, the UID of the pod it belongs to or "").

    cgroup v2 has one line ``0::PATH``; v1 one per hierarchy (``N:controllers:PATH``), the first whose
    path names kubepods then stands. kubelet puts a pod's containers under ``kubepods...pod<UID>``:
    ``/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<UID, _ for ->.slice/cri-containerd-ID.scope``
    (systemd driver) or ``/kubepods/besteffort/pod<UID>/ID`` (cgroupfs driver). Any other path (a
    system service, a user session) is a host process: no UID."""
    paths = [line.split(":", 2)[2].strip() for line in text.splitlines() if line.count(":") >= 2]
    unified = [line.split(":", 2)[2].strip() for line in text.splitlines() if line.startswith("0::")]
    path = next((p for p in paths if "kubepods" in p), unified[0] if unified else (paths[0] if paths else ""))
    m = _POD_UID.search(path.lower()) if "kubepods" in path else None
    return path, m.group(1).replace("_", "-") if m else ""


def with_pods(procs: Iterable[CudaProcess], probes: Probes) -> tuple[CudaProcess, ...]:
    """Each process with its cgroup and pod UID (``cgroup:PID`` probes); unreadable: both left empty."""
    out_ = []
    for p in procs:
        text = out(probes, f"cgroup:{p.pid}")
        if text is None or not text.strip():
            out_.append(p)
            continue
        cgroup, uid = parse_cgroup(text)
        out_.append(CudaProcess(pid=p.pid, name=p.name, gpu=p.gpu, pod_uid=uid, cgroup=cgroup))
    return tuple(out_)


@register_host_fact
class CudaProcessesFact(HostFact):
    """The host's CUDA processes (nvidia-smi), each with the PCI slot of its GPU and, from its
    /proc/PID/cgroup, the pod it belongs to (kubelet names the pod UID in its containers' cgroups). No
    nvidia-smi: none. A process whose cgroup cannot be read has no pod: callers count it as the host's."""

    NAME = "cuda_processes"
    SCRIPT = r"""emit nvidia_smi nvidia-smi --query-compute-apps=pid,process_name,gpu_bus_id --format=csv,noheader
# the cgroup of each CUDA process names the pod it belongs to (kubepods...pod UID...)
for pid in $(printf '%s' "$last_out" | awk -F, '$1 ~ /^ *[0-9]+ *$/ {print $1 + 0}'); do
  emit "cgroup:$pid" cat "/proc/$pid/cgroup"
done
"""

    def parse(self, host: str, probes: Probes, stat: Mapping[str, Any]) -> dict[str, Any]:
        # 15: a GPU fell off the bus; the other GPUs' processes are still listed
        procs = parse_cuda_processes(out(probes, "nvidia_smi", (0, 15)) or "")
        return {"cuda_processes": with_pods(procs, probes)}

    def data(self, facts: HostFacts) -> dict[str, Any]:
        return {"cuda_processes": [{"pid": p.pid, "name": p.name, "gpu": p.gpu, "pod_uid": p.pod_uid,
                                    "cgroup": p.cgroup} for p in facts.cuda_processes],
                "cuda_process_count": len(facts.cuda_processes)}


@register_host_fact
class BootFact(HostFact):
    """The host's boot id (``/proc/sys/kernel/random/boot_id``, new at every boot): whether the host
    rebooted since something was recorded (gpu-fallen-off-bus's Xid 79 record). "" when unreadable."""

    NAME = "boot"
    SCRIPT = r"""emit boot_id cat /proc/sys/kernel/random/boot_id
"""

    def parse(self, host: str, probes: Probes, stat: Mapping[str, Any]) -> dict[str, Any]:
        text = (out(probes, "boot_id") or "").strip()
        return {"boot_id": text if re.fullmatch(r"[0-9a-fA-F-]{32,36}", text) else ""}

    def data(self, facts: HostFacts) -> dict[str, Any]:
        return {"boot_id": facts.boot_id}


# ============================================================================ GPU health (docs/catalogue.md)


_XID = re.compile(r"NVRM: Xid \(PCI:(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(?:\.[0-7])?(?: [^)]*)?\): "
                  r"(?P<code>\d+),")
_RESET = re.compile(r"NVRM: GPU (?P<pci>[0-9a-fA-F:.]+): GPU reset occurred")
_LOST = re.compile(r"device handle for GPU ?(?P<pci>[0-9a-fA-F:.]+): GPU is lost")


def _slot_of_pci(pci: str) -> str:
    """``0000:5a:00`` (an Xid line: no function) or ``0000:5a:00.0`` -> lspci's ``5a:00.0``."""
    text = pci if "." in pci.rsplit(":", 1)[-1] else pci + ".0"
    return pci_slot(text) or pci.lower()


def parse_kernel_xids(text: str) -> tuple[XidEvent, ...]:
    """The kernel log of this boot (``journalctl -k``) -> the Xids of each GPU since its last reset
    (a reset logs ``GPU reset occurred``, which clears that GPU's earlier Xids, as NVSentinel reads it)."""
    events: list[XidEvent] = []
    for line in text.splitlines():
        reset = _RESET.search(line)
        if reset:
            slot = _slot_of_pci(reset.group("pci"))
            events = [e for e in events if not same_pci_slot(e.slot, slot)]
            continue
        m = _XID.search(line)
        if m:
            events.append(XidEvent(slot=_slot_of_pci(m.group("pci")), code=int(m.group("code")),
                                   line=line.strip()[:300]))
    return tuple(events)


def parse_remapped_rows(text: str) -> tuple[RowRemap, ...]:
    """``nvidia-smi --query-remapped-rows=gpu_bus_id,remapped_rows.pending,remapped_rows.failure,
    remapped_rows.uncorrectable --format=csv,noheader`` -> one RowRemap per GPU."""
    out = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not pci_slot(fields[0]):
            continue
        out.append(RowRemap(slot=pci_slot(fields[0]), pending=fields[1].lower() in ("yes", "1", "true"),
                            failure=fields[2].lower() in ("yes", "1", "true"),
                            uncorrectable=int(fields[3]) if fields[3].isdigit() else 0))
    return tuple(out)


def _smi_error(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.split(",")[0].strip().isdigit():
            return line[:300]
    return ""


@register_host_fact
class GpuHealthFact(HostFact):
    """The NVIDIA stack's own word on the GPUs: nvidia-smi's exit code and error (lost GPU, NVML
    mismatch), this boot's kernel Xids per GPU since its last reset, pending row remaps, persistence
    mode, the loaded driver's and the fabric manager's versions, the NVSwitches on the PCI bus."""

    NAME = "gpu_health"
    SCRIPT = r"""emit kernel_log journalctl -k -o cat --no-pager -q -n 400
emit smi_gpus nvidia-smi --query-gpu=pci.bus_id,driver_version,persistence_mode --format=csv,noheader
remap_fields=gpu_bus_id,remapped_rows.pending,remapped_rows.failure,remapped_rows.uncorrectable
emit remapped_rows nvidia-smi --query-remapped-rows=$remap_fields --format=csv,noheader
emit fm_version nv-fabricmanager --version
emit fm_state systemctl is-active nvidia-fabricmanager
"""

    def parse(self, host: str, probes: Probes, stat: Mapping[str, Any]) -> dict[str, Any]:
        rc, smi_text = probes.get("nvidia_smi", (127, ""))
        driver, persistence = "", {}
        for line in (out(probes, "smi_gpus", (0, 15)) or "").splitlines():
            fields = [f.strip() for f in line.split(",")]
            if len(fields) >= 3 and pci_slot(fields[0]):
                driver = driver or fields[1]
                persistence[pci_slot(fields[0])] = fields[2].lower() == "enabled"
        fm = out(probes, "fm_version") or ""
        fm_version = fm.rsplit(":", 1)[-1].strip() if ":" in fm else fm.strip()
        fm_rc, fm_state = probes.get("fm_state", (127, ""))
        lspci = out(probes, "lspci") or ""
        switches = sum(1 for ln in lspci.splitlines() if "[0680]" in ln and "NVSwitch" in ln)
        health = GpuHealth(
            smi_rc=None if rc == 127 else rc, smi_error=_smi_error(smi_text) if rc not in (0, 127) else "",
            xids=parse_kernel_xids(out(probes, "kernel_log") or ""),
            remaps=parse_remapped_rows(out(probes, "remapped_rows", (0, 15)) or ""),
            lost=tuple(_slot_of_pci(m.group("pci")) for m in _LOST.finditer(smi_text)),
            driver_version=driver, fabric_manager_version=fm_version.split()[0] if fm_version else "",
            fabric_manager_state="" if fm_rc == 127 else (fm_state.strip().splitlines() or [""])[0],
            nvswitches=switches, persistence=MappingProxyType(persistence))
        return {"gpu_health": health}

    def data(self, facts: HostFacts) -> dict[str, Any]:
        h = facts.gpu_health
        return {"gpu_health": {
            "smi_rc": h.smi_rc, "smi_error": h.smi_error,
            "xids": [{"slot": x.slot, "code": x.code, "line": x.line} for x in h.xids],
            "remaps": [{"slot": r.slot, "pending": r.pending, "failure": r.failure,
                        "uncorrectable": r.uncorrectable} for r in h.remaps],
            "lost": list(h.lost), "driver_version": h.driver_version,
            "fabric_manager_version": h.fabric_manager_version, "fabric_manager_state": h.fabric_manager_state,
            "nvswitches": h.nvswitches,
            "persistence": dict(h.persistence)}}


# ============================================================================ the probe and the parser


def decode_probes(lines: Iterable[str]) -> dict[str, tuple[int, str]]:
    """``NAME RC BASE64`` lines (tasks/facts.yml) -> {name: (rc, stdout)}. Bad lines are skipped."""
    probes: dict[str, tuple[int, str]] = {}
    for line in lines:
        parts = line.strip().split(" ")
        if len(parts) not in (2, 3):
            continue
        name, rc_text = parts[0], parts[1]
        try:
            rc = int(rc_text)
            text = base64.b64decode(parts[2] if len(parts) == 3 else "", validate=True)
        except (ValueError, binascii.Error):
            continue
        probes[name] = (rc, text.decode("utf-8", "replace"))
    return probes


def parse_host_facts(host: str, stat: Mapping[str, Any]) -> HostFacts:
    """The ``runbook_facts`` stat of tasks/facts.yml -> ``HostFacts`` (the parse boundary)."""
    version = stat.get("version")
    if version != FACTS_FORMAT_VERSION:
        raise HostError(f"{host}: runbook_facts version {version!r} not understood "
                        f"(expected {FACTS_FORMAT_VERSION}): playbooks and engine differ", host=host)
    probes = decode_probes(stat.get("probes") or ())
    fields: dict[str, Any] = {}
    for fact in _FACTS:
        fields.update(fact.parse(host, probes, stat))
    return HostFacts(host=host, **fields)


def host_data(facts: HostFacts) -> dict[str, Any]:
    """Host facts as plain data (the shape templates see as ``facts.host``)."""
    data: dict[str, Any] = {"host": facts.host}
    for fact in _FACTS:
        data.update(fact.data(facts))
    return data


_PROBE_HEADER = '''\
---
# The probe of tasks/facts.yml, alone: registers `runbook_facts_probe` (read-only).
# GENERATED from engine/hostfacts.py (one unit per host fact: its probe lines and its parser):
#   python -m engine.hostfacts > playbooks/tasks/facts-probe.yml
# swap-off.yml runs it first, to learn the swap devices (the plain "swap-device" and
# "swap-unhandled" lines), and tasks/facts-publish.yml publishes what it found.
#
# One `raw` task runs every probe: a module task costs ~0.4 s more over SSH (Python
# started on the host, the module shipped), a probe inside the script almost nothing;
# `raw` needs no Python on the host either. Each probe prints one line
# "NAME RC BASE64(STDOUT)", so no output (a journal line, a device name) can break the
# framing (raw runs on a tty: lines end in \\r\\n, blank lines appear; the engine's parser
# skips what is not a probe line). A probe whose command is missing reports rc 127 and
# does not fail the play (no lspci -> no GPU, no nvidia-smi -> no CUDA processes).
# `raw` takes no `environment:`: the variables are written into the script, shell-quoted.
# Ansible splits the free-form text of `raw` on quotes and reads backslash escapes: keep
# quotes balanced in the script (no apostrophes in its comments) and write no backslash
# escapes inside Jinja expressions (the file list is a bash array, not a joined string).
#
# Variables: runbook_facts_services (default [kubelet, containerd]),
#            runbook_facts_journal_lines (default 20),
#            runbook_files (default []): files to report on (exists, first 64 KiB, sha256).

- name: Probe swap, services, GPU driver binding and CUDA processes (read-only)
  ansible.builtin.raw: |
'''

_SCRIPT_HEADER = r"""set -o pipefail
RUNBOOK_FACTS_SERVICES={{ runbook_facts_services | default(['kubelet', 'containerd']) | join(' ') | quote }}
RUNBOOK_FACTS_JOURNAL_LINES={{ runbook_facts_journal_lines | default(20) | int }}
RUNBOOK_FACTS_FILES=({{ runbook_files | default([]) | map('quote') | join(' ') }})
export LC_ALL=C SYSTEMD_COLORS=0 SYSTEMD_PAGER=
# swapon, lspci live in sbin, which the PATH of a non-root login lacks on Debian
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"
emit() {
  local name=$1 out rc
  shift
  # the trailing "x" keeps the trailing newlines of the output through $(...)
  out=$("$@" 2>/dev/null; rc=$?; printf x; exit "$rc")
  rc=$?
  last_out=${out%x}
  printf '%s %s %s\n' "$name" "$rc" "$(printf '%s' "$last_out" | base64 -w0)"
}
"""

_PROBE_FOOTER = """\
  args:
    executable: /bin/bash
  register: runbook_facts_probe
  check_mode: false
  changed_when: false
"""


def probe_script() -> str:
    """The bash script of the one raw probe: the header (``emit``), then each fact's lines.

    The facts are independent of each other, so each fact's lines run at once in a process
    substitution, and the main script prints their output in the facts' order: the probe takes
    about its slowest fact's time instead of their sum (every ``nvidia-smi`` initialises the
    driver; on the lab every command is a Python shim). A fact whose output outgrows a pipe's
    buffer just waits until its turn to be printed. Within a fact, lines run in order (they read
    each other's ``last_out``)."""
    opens = [f"exec {{runbook_fact_{i}}}< <(\n{f.SCRIPT.rstrip()}\n)\n" for i, f in enumerate(_FACTS)]
    prints = "".join(f'cat <&"$runbook_fact_{i}"\n' for i in range(len(_FACTS)))
    return (_SCRIPT_HEADER + "# every fact's probes at once; their lines in the facts' order\n"
            + "".join(opens) + prints)


def probe_task_file() -> str:
    """The text of ``playbooks/tasks/facts-probe.yml``."""
    body = "".join(("      " + line if line else "") + "\n" for line in probe_script().splitlines())
    return _PROBE_HEADER + body + _PROBE_FOOTER


if __name__ == "__main__":
    sys.stdout.write(probe_task_file())
