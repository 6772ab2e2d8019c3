"""``runbook lab inject``: put a fault into a running lab's node, as a real node would show it (game days).

A fault is one ``Fault``: its name (the word ``runbook lab inject FAULT`` takes, and the cause id
``runbook diagnose -o json`` names it by), a one-line summary (``runbook lab inject --list``), whether
it acts on one GPU (``--gpu SLOT``; default: the node's first GPU) and its inject function. The
function receives an ``Injection`` (the lab, the node, its host state folder, the GPU slot) and
changes only the lab: the node's host state (``engine.lab.hoststate``: state.json, the journal) and,
where the fault lives in the cluster, the lab's API objects. It returns one line saying what it did.

Registering a fault from another module (one call, no edit here)::

    from engine.lab.inject import Injection, register_fault

    @register_fault("swap", "turn swap on (kubelet then refuses to start)", gpu=False)
    def inject_swap(inj: Injection) -> str:
        inj.host.update(lambda state: ...)
        return f"{inj.node}: swap on"

and import that module from ``FAULT_MODULES`` below (the registry imports them on first use, so the
CLI lists every fault). Names are unique (a second registration of a name is a ValueError) and
lower-case words with dashes.

Must not: touch anything outside the lab (no command on this machine, no other cluster), or change
a node that is not named.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.lab.errors import LabError
from engine.lab.hoststate import HostState

if TYPE_CHECKING:
    from engine.lab.manager import Lab

# Modules that register faults (imported by ``faults()``): this one's GPU faults, and others'.
FAULT_MODULES: tuple[str, ...] = ("engine.lab.gpu_faults", "engine.lab.node_faults")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


@dataclass(frozen=True)
class Injection:
    """What an inject function may act on: one node of one lab (and, for GPU faults, one GPU)."""

    lab: Lab
    node: str
    host: HostState
    gpu: str | None  # the PCI slot (``01:00.0``) for a fault that takes --gpu; None otherwise

    def journal(self, unit: str, ident: str, lines: list[str], pid: int = 0) -> None:
        """Append lines to the host's journal (``unit`` ``kernel`` is the kernel log, ``journalctl -k``)."""
        self.host.append_journal(unit, ident, pid, lines)


InjectFunction = Callable[[Injection], str]


@dataclass(frozen=True)
class Fault:
    name: str
    summary: str
    gpu: bool  # takes --gpu SLOT
    inject: InjectFunction


_FAULTS: dict[str, Fault] = {}
_loaded = False


def register_fault(name: str, summary: str, *, gpu: bool = False) -> Callable[[InjectFunction], InjectFunction]:
    """Register ``inject`` (the decorated function) as fault ``name`` (see the module docstring)."""
    if not _NAME.match(name):
        raise ValueError(f"fault name {name!r}: lower-case letters, digits and dashes")
    if not summary.strip():
        raise ValueError(f"fault {name}: a one-line summary is needed")

    def decorate(func: InjectFunction) -> InjectFunction:
        if name in _FAULTS:
            raise ValueError(f"fault {name!r} is already registered")
        _FAULTS[name] = Fault(name, summary.strip(), gpu, func)
        return func

    return decorate


def faults() -> dict[str, Fault]:
    """Every registered fault by name, sorted (the fault modules imported on first use)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in FAULT_MODULES:
            importlib.import_module(module)
    return dict(sorted(_FAULTS.items()))


def gpu_slots(state: dict[str, Any]) -> list[str]:
    """The node's GPUs (display functions), by PCI slot."""
    return sorted(str(d["slot"]) for d in state.get("pci_devices", []) if d.get("display"))


def inject(lab: Lab, name: str, node: str, gpu: str | None = None) -> dict[str, Any]:
    """Put fault ``name`` into ``node`` of the running ``lab``; returns what was done.

    Bad input (an unknown fault, node or GPU, ``--gpu`` for a fault that takes none) is a LabError
    naming what is known, and changes nothing."""
    known = faults()
    fault = known.get(name)
    if fault is None:
        raise LabError(f"no fault named {name!r} (one of: {', '.join(known) or 'none registered'}; "
                       "`runbook lab inject --list` says what each does)")
    record = lab.record()
    entry = record["nodes"].get(node)
    if entry is None:
        raise LabError(f"no node {node!r} in this lab (its nodes: {', '.join(sorted(record['nodes']))})")
    if not lab.running():
        raise LabError(f"the lab in {lab.dir} is not (fully) running: `runbook lab up` first")
    host = HostState(entry["state_dir"])
    slot: str | None = None
    if fault.gpu:
        slots = gpu_slots(host.read())
        if not slots:
            raise LabError(f"{node} has no GPU: fault {name} acts on one")
        slot = gpu if gpu is not None else slots[0]
        if slot not in slots:
            raise LabError(f"{node}: no GPU in slot {slot} (its GPUs: {', '.join(slots)})")
    elif gpu is not None:
        raise LabError(f"fault {name} acts on the whole node: it takes no --gpu")
    said = fault.inject(Injection(lab, node, host, slot))
    return {"fault": name, "node": node, "gpu": slot, "did": said}
