"""The fake node hosts (``NodeAutomation``) for unit tests: scripted ``HostFacts`` per host.

``make_host`` builds a host's facts; ``FakeNodes.run_playbook`` records the run, applies a scripted
effect (a function of the facts, by playbook file name) and returns fresh facts like
``tasks/facts.yml`` does. ``fail`` scripts a method's failures (``tests.fakes.clock.raise_scripted``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.connectors.base import PlaybookResult, TaskEvent
from engine.errors import HostError
from engine.facts import CudaProcess, FileFacts, GpuDevice, HostFacts, ServiceFacts, SwapDevice
from tests.fakes.clock import FakeClock, raise_scripted


def make_host(name: str = "omen2", *, swap: bool = False, fstab_swap: bool = False, kubelet: str = "active",
              journal: str = "", driver: str = "nvidia", cuda: int = 0) -> HostFacts:
    return HostFacts(
        host=name,
        swap_devices=(SwapDevice("/swapfile", "file", 32 << 30),) if swap else (),
        fstab_active_swap=("/swapfile none swap sw 0 0",) if fstab_swap else (),
        services={"kubelet": ServiceFacts("kubelet", kubelet, journal_tail=journal)},
        gpus=(GpuDevice("01:00.0", "10de:2b85", "NVIDIA GB202 [GeForce RTX 5090]", driver),),
        cuda_processes=tuple(CudaProcess(1000 + i, "python") for i in range(cuda)),
    )


def quad_gpus() -> tuple[GpuDevice, ...]:
    """The GPUs of the lab's gpu-quad (engine/lab/scenarios/multi-gpu.yaml) after kubelet came back
    under container: two RTX 5090s (one left on vfio-pci), an RTX 3090, an RTX 4090 without a driver."""
    return (GpuDevice("01:00.0", "10de:2b85", "NVIDIA Corporation GB202 [GeForce RTX 5090]", "nvidia"),
            GpuDevice("02:00.0", "10de:2b85", "NVIDIA Corporation GB202 [GeForce RTX 5090]", "vfio-pci"),
            GpuDevice("41:00.0", "10de:2204", "NVIDIA Corporation GA102 [GeForce RTX 3090]", "nvidia"),
            GpuDevice("c1:00.0", "10de:2684", "NVIDIA Corporation AD102 [GeForce RTX 4090]", "none"))


PlaybookEffect = Callable[["FakeNodes", str, Mapping[str, Any]], PlaybookResult | None]


class FakeNodes:
    """``NodeAutomation`` over scripted host facts (see the module docstring)."""

    def __init__(self, hosts: Mapping[str, HostFacts | Exception] | None = None, *,
                 clock: FakeClock | None = None, inventory: Mapping[str, str] | None = None) -> None:
        self.clock = clock or FakeClock()
        self.hosts: dict[str, HostFacts | Exception] = dict(hosts or {})
        self.inventory = dict(inventory or {})  # node -> inventory host (default: same name)
        self.effects: dict[str, PlaybookEffect] = {}  # playbook file name -> effect
        self.runs: list[dict[str, Any]] = []
        self.gathers: list[tuple[list[str], list[str]]] = []
        self.files: dict[str, dict[str, str]] = {}  # host -> path -> content
        self.fail: dict[str, Any] = {}
        self.closed = False
        self.cancelled = False
        self.facts_become: bool | None = None  # facts do not depend on privilege

    def inventory_host(self, node: str) -> str:
        if node not in self.hosts and node not in self.inventory:
            raise HostError(f"node {node} is not in the inventory", host=node)
        return self.inventory.get(node, node)

    def set_facts(self, node: str, facts: HostFacts | Exception) -> None:
        self.hosts[node] = facts

    def update(self, node: str, **changes: Any) -> None:
        h = self.hosts[node]
        assert isinstance(h, HostFacts)
        self.hosts[node] = replace(h, **changes)

    def _facts(self, node: str, files: Sequence[str]) -> HostFacts | Exception:
        h = self.hosts.get(node)
        if h is None:
            return HostError(f"{node}: unreachable", host=node, unreachable=True)
        if isinstance(h, Exception):
            return h
        if files:
            have = self.files.get(node, {})
            found = {p: FileFacts(p, p in have, have.get(p, "")) for p in files}
            h = replace(h, files=found)
        return h

    def gather_facts(self, nodes: Sequence[str], files: Sequence[str] = ()) -> Mapping[str, HostFacts | Exception]:
        self.gathers.append((list(nodes), list(files)))
        raise_scripted(self.fail, "gather_facts")
        return {n: self._facts(n, files) for n in nodes}

    def run_playbook(self, playbook: Path, nodes: Sequence[str], *, extravars: Mapping[str, Any] | None = None,
                     become: bool = True, timeout: float = 300, check: bool = False,
                     on_event: Callable[[TaskEvent], None] | None = None) -> PlaybookResult:
        evars = dict(extravars or {})
        self.runs.append({"playbook": Path(playbook).name, "path": Path(playbook), "nodes": list(nodes),
                          "extravars": evars, "become": become, "timeout": timeout, "check": check})
        raise_scripted(self.fail, "run_playbook")
        effect = self.effects.get(Path(playbook).name)
        result: PlaybookResult | None = None
        for n in nodes:
            if on_event:
                on_event({"host": n, "task": f"{Path(playbook).stem}", "status": "changed", "msg": ""})
            if effect is not None and not check:
                result = effect(self, n, evars) or result
        if result is not None:
            return result
        files = list(evars.get("runbook_files") or [])
        facts = {n: f for n in nodes if isinstance(f := self._facts(n, files), HostFacts)}
        unreachable = {n: str(f) for n in nodes if isinstance(f := self._facts(n, files), Exception)}
        return PlaybookResult(status="successful" if not unreachable else "failed", rc=0 if not unreachable else 4,
                              changed=dict.fromkeys(facts, not check), unreachable_hosts=unreachable,
                              host_facts=facts)

    def recent_facts(self, nodes: Sequence[str], *, max_age: float,
                     files: Sequence[str] = ()) -> Mapping[str, tuple[HostFacts, float]]:
        return {}  # keeps none (subclasses in tests keep some)

    def cancel(self) -> None:
        self.cancelled = True

    def close(self) -> None:
        self.closed = True
