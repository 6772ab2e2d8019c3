"""Check kinds that read the node host's facts (``facts.host``, the one SSH facts probe): swap,
fstab, services, journals, the GPU driver (of the first GPU or of every GPU), CUDA processes, files.

One class per kind: its spec, ``describe``, ``evaluate_host`` and ``establish_host``. ``HostCheck``
does what they share: unknown without host facts; predictions only where the host was read. The
host facts themselves (probe lines and parsers) are in ``engine.hostfacts``. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from engine.checkkind import (
    HOST,
    CheckKind,
    CheckResult,
    Env,
    FormatModel,
    HostFile,
    Probe,
    Reads,
    register_check,
    result,
    unknown,
)
from engine.checks.core import bind
from engine.facts import CudaProcess, Facts, FileFacts, GpuDevice, HostFacts, ServiceFacts, SwapDevice, same_pci_slot
from engine.model import is_template


class HostCheck(CheckKind):
    """A check over ``facts.host``. Subclasses implement ``evaluate_host`` and ``establish_host``."""

    READS: ClassVar[Reads] = "host"

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        host = facts.host
        if host is None:
            return unknown("host facts", facts, HOST)
        return self.evaluate_host(host, env)

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        raise NotImplementedError

    def establish(self, facts: Facts, env: Env) -> Facts:
        if facts.host is None:
            return facts
        host = self.establish_host(facts.host)
        return facts if host is facts.host else replace(facts, host=host)

    def establish_host(self, host: HostFacts) -> HostFacts:
        return host


@register_check
class SwapActiveCheck(HostCheck):
    KEY: ClassVar[str] = "swap_active"
    swap_active: bool

    def describe(self) -> str:
        return "swap is on" if self.swap_active else "swap is off"

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        devices = ", ".join(d.name for d in host.swap_devices)
        observed = f"swap on: {devices}" if devices else "swap off"
        return result(host.swap_active == self.swap_active, observed, {"host.swap_active": host.swap_active},
                      swap_devices=[d.name for d in host.swap_devices])

    def establish_host(self, host: HostFacts) -> HostFacts:
        if self.swap_active == host.swap_active:
            return host
        return replace(host, swap_devices=(SwapDevice("(predicted)"),) if self.swap_active else ())


@register_check
class FstabActiveSwapCheck(HostCheck):
    KEY: ClassVar[str] = "fstab_active_swap"
    fstab_active_swap: bool

    def describe(self) -> str:
        return "fstab has an active swap entry" if self.fstab_active_swap else "fstab has no active swap entry"

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        active = bool(host.fstab_active_swap)
        observed = ("fstab active swap: " + "; ".join(host.fstab_active_swap)) if active \
            else "no active swap entry in fstab"
        return result(active == self.fstab_active_swap, observed, {"host.fstab_active_swap": active},
                      fstab_lines=list(host.fstab_active_swap))

    def establish_host(self, host: HostFacts) -> HostFacts:
        if self.fstab_active_swap == bool(host.fstab_active_swap):
            return host
        return replace(host, fstab_active_swap=("(predicted)",) if self.fstab_active_swap else ())


class ServiceSpec(FormatModel):
    name: str = Field(min_length=1)
    state: str | tuple[str, ...]  # systemctl is-active output; a list means any of them

    @property
    def states(self) -> tuple[str, ...]:
        return (self.state,) if isinstance(self.state, str) else self.state


@register_check
class ServiceCheck(HostCheck):
    KEY: ClassVar[str] = "service"
    service: ServiceSpec

    def describe(self) -> str:
        return f"service {self.service.name} is {'|'.join(self.service.states)}"

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        s = self.service
        svc = host.service(s.name)
        holds = svc.state in s.states
        return result(holds, f"{s.name} is {svc.state}",
                      {f"host.services[{s.name}].state in [{'|'.join(s.states)}]": holds}, state=svc.state)

    def establish_host(self, host: HostFacts) -> HostFacts:
        s = self.service
        if host.service(s.name).state in s.states:
            return host
        services = dict(host.services)
        old = host.service(s.name)
        services[s.name] = ServiceFacts(s.name, s.states[0], journal_tail=old.journal_tail)
        return replace(host, services=services)


class JournalSpec(FormatModel):
    unit: str = Field(min_length=1)
    text: str = Field(min_length=1)


@register_check
class JournalContainsCheck(HostCheck):
    # A journal line is volatile: no ``reads`` recorded, and never predicted.
    KEY: ClassVar[str] = "journal_contains"
    journal_contains: JournalSpec

    def describe(self) -> str:
        return f"journal of {self.journal_contains.unit} contains {self.journal_contains.text!r}"

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        s = self.journal_contains
        tail = host.service(s.unit).journal_tail
        holds = s.text in tail
        line = next((ln for ln in tail.splitlines() if s.text in ln), "")
        observed = f"{s.unit} journal: {line.strip()[:200]}" if holds else \
            f"{s.unit} journal does not contain {s.text!r}"
        return result(holds, observed, None, journal_line=line.strip()[:500])  # volatile: no reads


GpuDriverName = Literal["nvidia", "vfio-pci", "none"]


class GpuDriverSpec(FormatModel):
    """``gpu_driver: {driver: nvidia, all: true}``: every GPU the host lists is on ``driver`` (and it
    lists at least one); ``all: false`` (the default, like ``gpu_driver: nvidia``): the first GPU."""

    driver: GpuDriverName
    all: bool = False


@register_check
class GpuDriverCheck(HostCheck):
    """``gpu_driver: nvidia``: the host's first NVIDIA GPU is bound to that driver;
    ``gpu_driver: {driver: nvidia, all: true}``: every one is, by PCI slot."""

    KEY: ClassVar[str] = "gpu_driver"
    gpu_driver: GpuDriverName | GpuDriverSpec

    @property
    def driver(self) -> str:
        return self.gpu_driver if isinstance(self.gpu_driver, str) else self.gpu_driver.driver

    @property
    def every_gpu(self) -> bool:
        return not isinstance(self.gpu_driver, str) and self.gpu_driver.all

    def describe(self) -> str:
        return f"every GPU's driver is {self.driver}" if self.every_gpu else f"GPU driver is {self.driver}"

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        if not self.every_gpu:
            return result(host.gpu_driver == self.driver, f"GPU driver {host.gpu_driver}",
                          {"host.gpu_driver": host.gpu_driver})
        reads = {"host.gpus[].driver": {g.slot: g.driver for g in host.gpus}}
        gpus = [{"slot": g.slot, "model": g.vendor_device, "name": g.name, "driver": g.driver} for g in host.gpus]
        if not host.gpus:
            return result(False, "the host lists no NVIDIA GPU (lspci -nnk -d 10de:)", reads, gpus=gpus)
        off = host.gpus_not_on(self.driver)
        if not off:
            n = len(host.gpus)
            return result(True, f"all {n} GPU{'s' if n != 1 else ''} on {self.driver}", reads, gpus=gpus)
        return result(False, f"GPUs not on {self.driver}: " + ", ".join(_gpu_text(g) for g in off), reads,
                      gpus=gpus, not_on_driver=[g.slot for g in off])

    def establish_host(self, host: HostFacts) -> HostFacts:
        if self.every_gpu:  # GPUs cannot be invented: a host that lists none stays so
            if not host.gpus_not_on(self.driver):
                return host
            return replace(host, gpus=tuple(replace(g, driver=self.driver) for g in host.gpus))
        if not host.gpus or host.gpu_driver == self.driver:
            return host
        first = replace(host.gpus[0], driver=self.driver)
        return replace(host, gpus=(first, *host.gpus[1:]))


def _gpu_text(g: GpuDevice) -> str:
    """``02:00.0 NVIDIA Corporation GB202 [GeForce RTX 5090] (vfio-pci)``: a GPU named in evidence."""
    return f"{g.slot} {g.name or g.vendor_device} ({g.driver})"


class CudaProcessesSpec(FormatModel):
    min: int | None = Field(default=None, ge=0)
    max: int | None = Field(default=None, ge=0)
    # Every host CUDA process of the plan's baseline (the facts the plan was made from) still runs,
    # by pid: "no host CUDA job killed". Unknown without a baseline (fail closed).
    none_killed: Literal[True] | None = None
    # With none_killed: but those of the GPU in this PCI slot (gpu-reset: the pods it evicted from the
    # GPU it resets were taken on purpose; every other GPU's processes must live).
    except_gpu: str | None = None
    # With min/max: count only the processes of the GPU in this PCI slot ({gpu: SLOT, max: 0}: nothing
    # holds that GPU; establishes it for later steps, as an evict of its pods verifies it).
    gpu: str | None = None

    @model_validator(mode="after")
    def _some_bound(self) -> CudaProcessesSpec:
        if self.min is None and self.max is None and self.none_killed is None:
            raise ValueError("cuda_processes needs 'min', 'max' or 'none_killed: true'")
        if self.except_gpu is not None and self.none_killed is None:
            raise ValueError("cuda_processes: except_gpu goes with none_killed: true")
        if self.gpu is not None and self.none_killed is not None:
            raise ValueError("cuda_processes: gpu counts one GPU's processes (min/max); "
                             "with none_killed use except_gpu")
        return self


@register_check
class CudaProcessesCheck(HostCheck):
    KEY: ClassVar[str] = "cuda_processes"
    cuda_processes: CudaProcessesSpec

    def describe(self) -> str:
        s = self.cuda_processes
        parts = ([f">= {s.min}"] if s.min is not None else []) + ([f"<= {s.max}"] if s.max is not None else [])
        on = f" on GPU {s.gpu}" if s.gpu else ""
        text = f"CUDA processes{on} {' and '.join(parts)}" if parts else ""
        if s.none_killed:
            text = (text + "; " if text else "") + "no host CUDA process killed since the plan" + \
                (f" but GPU {s.except_gpu}'s" if s.except_gpu else "")
        return text

    def uses_baseline(self) -> bool:
        return bool(self.cuda_processes.none_killed)

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        if self.cuda_processes.none_killed:
            return self._evaluate_survivors(facts, env.baseline)
        return super().evaluate(facts, env)

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        s = self.cuda_processes
        procs = self._counted(host)
        n = len(procs)
        holds = (s.min is None or n >= s.min) and (s.max is None or n <= s.max)
        on = f" on GPU {s.gpu}" if s.gpu else ""
        return result(holds, f"{n} CUDA process{'es' if n != 1 else ''}{on}" + (
            ": " + ", ".join(f"{p.pid} {p.name}" + (f" (pod {p.pod_uid})" if p.pod_uid else "") for p in procs[:10])
            if s.gpu and procs else ""),
            {f"host.cuda_processes ({self.describe()})": holds},
            processes=[f"{p.pid} {p.name}" for p in procs][:20])

    def _counted(self, host: HostFacts) -> tuple[CudaProcess, ...]:
        gpu = self.cuda_processes.gpu
        return tuple(p for p in host.cuda_processes if gpu is None or same_pci_slot(p.gpu, gpu))

    def _evaluate_survivors(self, facts: Facts, baseline: Any) -> CheckResult:
        """``{none_killed: true}`` (and its min/max): the baseline's CUDA pids all still run."""
        bounds = self.cuda_processes
        before = ((baseline or {}).get("host") or {}).get("cuda_processes")
        if before is None:
            return CheckResult(None, "no baseline host facts to compare with (the plan kept none)",
                               {"error": "no baseline"})
        host = facts.host
        if host is None:
            return unknown("host facts", facts, HOST)
        if bounds.except_gpu:
            before = [p for p in before if not same_pci_slot(str(p.get("gpu", "")), bounds.except_gpu)]
        now = {p.pid for p in host.cuda_processes}
        gone = [p for p in before if int(p.get("pid", -1)) not in now]
        pids = sorted(int(p.get("pid", -1)) for p in before)
        reads = {"baseline.host.cuda_processes": pids}
        n = len(host.cuda_processes)
        holds = not gone and (bounds.min is None or n >= bounds.min) and (bounds.max is None or n <= bounds.max)
        if gone:
            observed = "CUDA processes gone since the plan: " + ", ".join(
                f"{p.get('pid')} {p.get('name', '')}".strip() for p in gone)
        else:
            observed = f"{n} CUDA process{'es' if n != 1 else ''}; all {len(before)} from the plan still run"
        return result(holds, observed, reads, killed=[f"{p.get('pid')} {p.get('name', '')}".strip() for p in gone],
                      processes=[f"{p.pid} {p.name}" for p in host.cuda_processes][:20])

    def establish_host(self, host: HostFacts) -> HostFacts:
        bound = self.cuda_processes.max
        counted = self._counted(host)
        if bound is not None and len(counted) > bound:
            dropped = set(counted[bound:])
            return replace(host, cuda_processes=tuple(p for p in host.cuda_processes if p not in dropped))
        return host


class FileSpec(FormatModel):
    path: str = Field(min_length=2)  # absolute path on the node host
    exists: bool | None = None  # defaults to true when 'contains' is not given
    contains: str | None = None  # substring of the file's text (first 64 KiB)

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") and not v.startswith("{{"):
            raise ValueError(f"file path must be absolute, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> FileSpec:
        if self.contains is not None and self.exists is False:
            raise ValueError("file: 'contains' with 'exists: false' can never hold")
        return self


@register_check
class FileCheck(HostCheck):
    KEY: ClassVar[str] = "file"
    file: FileSpec

    def describe(self) -> str:
        f = self.file
        if f.contains is not None:
            return f"file {f.path} contains {f.contains!r}"
        return f"file {f.path} {'exists' if f.exists is not False else 'does not exist'}"

    def probes(self, env: Env) -> set[Probe]:
        """The host probe, told to read this file (its path rendered over the params)."""
        path = self.file.path
        if is_template(path):
            try:
                path = bind(self, env.params).file.path
            except Exception:
                return {HOST}
        return {HOST, HostFile(path)}

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        f = self.file
        ff: FileFacts | None = host.files.get(f.path)
        if ff is None:
            return CheckResult(None, f"file {f.path} not gathered", {"error": "file not gathered"})
        want_exists = f.exists if f.exists is not None else True
        holds = ff.exists == want_exists
        reads: dict[str, Any] = {f"host.files[{f.path}].exists": ff.exists}
        if f.contains is not None:
            found = ff.exists and f.contains in ff.content
            holds = holds and found
            reads[f"host.files[{f.path}] contains {f.contains!r}"] = found
            observed = f"file {f.path} {'contains' if found else 'does not contain'} {f.contains!r}" \
                if ff.exists else f"file {f.path} does not exist"
        else:
            observed = f"file {f.path} {'exists' if ff.exists else 'does not exist'}"
        return result(holds, observed, reads, sha256=ff.sha256)

    def establish_host(self, host: HostFacts) -> HostFacts:
        f = self.file
        old_file = host.files.get(f.path)
        if f.exists is False:
            new = FileFacts(f.path, exists=False)
        else:
            content = old_file.content if old_file is not None and old_file.exists else ""
            if f.contains is not None and f.contains not in content:
                content = (content + ("\n" if content and not content.endswith("\n") else "") + f.contains)
            new = FileFacts(f.path, exists=True, content=content)
        if old_file == new:
            return host
        return replace(host, files={**host.files, f.path: new})


# -- the NVIDIA stack's own word on the GPUs (facts.host.gpu_health; docs/catalogue.md) -------------


def _on_gpu(slot: str, want: str | None) -> bool:
    return want is None or same_pci_slot(slot, want)


class GpuXidSpec(FormatModel):
    codes: tuple[int, ...] = Field(min_length=1)
    gpu: str | None = None  # one GPU by PCI slot (``02:00.0``); default: any GPU of the host


@register_check
class GpuXidCheck(HostCheck):
    """``gpu_xid: {codes: [48, 95], gpu: SLOT}``: a GPU (that GPU) logged one of these Xids in the kernel
    log of this boot, since its last reset. Volatile like a journal line: never predicted."""

    KEY: ClassVar[str] = "gpu_xid"
    gpu_xid: GpuXidSpec

    def describe(self) -> str:
        s = self.gpu_xid
        where = f"GPU {s.gpu}" if s.gpu else "a GPU"
        return f"{where} logged Xid {'|'.join(str(c) for c in s.codes)} since its last reset"

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        s = self.gpu_xid
        hits = [x for x in host.gpu_health.xids if x.code in s.codes and _on_gpu(x.slot, s.gpu)]
        per_gpu: dict[str, list[int]] = {}
        for x in hits:
            per_gpu.setdefault(x.slot, []).append(x.code)
        codes_text = "|".join(str(c) for c in s.codes)
        observed = "; ".join(f"GPU {slot}: Xid {', '.join(str(c) for c in sorted(set(codes)))}"
                             for slot, codes in sorted(per_gpu.items())) if hits else \
            f"no Xid {codes_text} in this boot's kernel log" + (f" for GPU {s.gpu}" if s.gpu else "")
        return result(bool(hits), observed, None, gpus=sorted(per_gpu), lines=[x.line for x in hits][:10])


class GpuRowRemapSpec(FormatModel):
    pending: bool | None = None
    failure: bool | None = None
    gpu: str | None = None  # one GPU by PCI slot; default: any GPU (pending: true) / every GPU (pending: false)

    @model_validator(mode="after")
    def _one(self) -> GpuRowRemapSpec:
        if (self.pending is None) == (self.failure is None):
            raise ValueError("gpu_row_remap needs exactly one of 'pending' or 'failure'")
        return self


@register_check
class GpuRowRemapCheck(HostCheck):
    """``gpu_row_remap: {pending: true}``: a GPU (``gpu: SLOT``: that GPU) has a row remap waiting for a
    reset; ``{pending: false}``: none has. ``failure`` likewise for a failed remap (nvidia-smi's
    ``--query-remapped-rows``)."""

    KEY: ClassVar[str] = "gpu_row_remap"
    gpu_row_remap: GpuRowRemapSpec

    def describe(self) -> str:
        s = self.gpu_row_remap
        what = "a row remap pending" if s.pending is not None else "a row remap failure"
        where = f"GPU {s.gpu}" if s.gpu else "a GPU"
        want = s.pending if s.pending is not None else s.failure
        return f"{where} has {what}" if want else f"{'GPU ' + s.gpu if s.gpu else 'no GPU'} has no{what[1:]}"

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        s = self.gpu_row_remap
        field = "pending" if s.pending is not None else "failure"
        want = bool(s.pending if s.pending is not None else s.failure)
        rows = [r for r in host.gpu_health.remaps if _on_gpu(r.slot, s.gpu)]
        flagged = sorted(r.slot for r in rows if getattr(r, field))
        if not rows:
            return CheckResult(None, "nvidia-smi reported no row-remapper state"
                               + (f" for GPU {s.gpu}" if s.gpu else ""), {"error": "no remapped rows read"})
        observed = (f"row remap {field} on GPU {', '.join(flagged)}" if flagged
                    else f"no row remap {field} on {len(rows)} GPU{'s' if len(rows) != 1 else ''}")
        return result(bool(flagged) == want, observed, {f"host.gpu_health.remaps[].{field}": flagged}, gpus=flagged)

    def establish_host(self, host: HostFacts) -> HostFacts:
        s = self.gpu_row_remap
        if s.pending is False:
            remaps = tuple(replace(r, pending=False) if _on_gpu(r.slot, s.gpu) else r for r in host.gpu_health.remaps)
            return replace(host, gpu_health=replace(host.gpu_health, remaps=remaps))
        return host


class NvidiaSmiSpec(FormatModel):
    ok: bool | None = None  # nvidia-smi exits 0
    exit_code: int | None = None
    error_contains: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _some(self) -> NvidiaSmiSpec:
        if self.ok is None and self.exit_code is None and self.error_contains is None:
            raise ValueError("nvidia_smi needs 'ok', 'exit_code' or 'error_contains'")
        return self


@register_check
class NvidiaSmiCheck(HostCheck):
    """``nvidia_smi: {ok: true}``: nvidia-smi answers (exit 0); ``{exit_code: 15}`` (a GPU fell off the
    bus); ``{error_contains: "Driver/library version mismatch"}``: what it printed when it failed."""

    KEY: ClassVar[str] = "nvidia_smi"
    nvidia_smi: NvidiaSmiSpec

    def describe(self) -> str:
        s = self.nvidia_smi
        parts = ([f"nvidia-smi {'works' if s.ok else 'fails'}"] if s.ok is not None else []) + \
            ([f"nvidia-smi exits {s.exit_code}"] if s.exit_code is not None else []) + \
            ([f"nvidia-smi says {s.error_contains!r}"] if s.error_contains is not None else [])
        return " and ".join(parts)

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        s, h = self.nvidia_smi, host.gpu_health
        if h.smi_rc is None:
            return result(s.ok is False and s.exit_code is None and s.error_contains is None,
                          "no nvidia-smi on the host", {"host.gpu_health.smi_rc": None})
        holds = (s.ok is None or (h.smi_rc == 0) == s.ok) and (s.exit_code is None or h.smi_rc == s.exit_code) \
            and (s.error_contains is None or s.error_contains in h.smi_error)
        observed = f"nvidia-smi exit {h.smi_rc}" + (f": {h.smi_error}" if h.smi_error else "")
        return result(holds, observed, {"host.gpu_health.smi_rc": h.smi_rc}, error=h.smi_error)

    def establish_host(self, host: HostFacts) -> HostFacts:
        s = self.nvidia_smi
        if s.ok is True and host.gpu_health.smi_rc not in (0, None):
            return replace(host, gpu_health=replace(host.gpu_health, smi_rc=0, smi_error="", lost=()))
        return host
