"""Kubernetes quantities and "what an object asks for": one set of rules for every caller.

``parse_quantity`` reads ``"500m"``, ``"4Gi"``, ``1``; ``object_resources`` says which resources a pod
(or a workload's pod template, or a KubeVirt VM/VMI) asks for; ``asks_for`` is what the kube
connector, the kube actions, the ``objects`` check, the run guards and diagnosis all use to decide
"this pod holds a GPU". Pure functions over plain mappings: no I/O, no Kubernetes client objects.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

_SUFFIX = {
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
    "P": Decimal("1e15"), "E": Decimal("1e18"),
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40),
    "Pi": Decimal(2**50), "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def parse_quantity(value: str | int | float) -> Decimal:
    """A Kubernetes quantity (``"1"``, ``"500m"``, ``"4Gi"``, ``"1e3"``) -> Decimal; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY.match(value.strip())
    if not m:
        raise ValueError(f"not a quantity: {value!r}")
    try:
        return Decimal(m.group(1)) * _SUFFIX[m.group(2) or ""]
    except InvalidOperation as e:
        raise ValueError(f"not a quantity: {value!r}") from e


def format_quantity(value: Decimal) -> str:
    """A quantity as a plain decimal string (``Decimal("0.5")`` -> ``"0.5"``, 2Gi -> ``"2147483648"``)."""
    text = format(value.normalize(), "f")
    return text if text not in ("-0",) else "0"


def pod_spec_requests(pod_spec: Mapping[str, Any]) -> dict[str, Decimal]:
    """The effective requests of a pod spec: per container its request or, where none is given, its
    limit (extended resources are often limit-only); summed over containers, at least the largest
    init container's (the scheduler's effective request). Unparsable quantities are ignored."""
    def container_requests(c: Mapping[str, Any]) -> dict[str, Decimal]:
        res = (c.get("resources") or {}) if isinstance(c, Mapping) else {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        out: dict[str, Decimal] = {}
        for k, v in merged.items():
            try:
                out[str(k)] = parse_quantity(v)
            except (ValueError, TypeError):
                continue
        return out

    total: dict[str, Decimal] = {}
    for c in pod_spec.get("containers") or ():
        for k, v in container_requests(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in pod_spec.get("initContainers") or ():
        for k, v in container_requests(c).items():
            total[k] = max(total.get(k, Decimal(0)), v)
    return total


def object_resources(obj: Mapping[str, Any]) -> dict[str, Decimal]:
    """Resources an object asks for, with quantities.

    * Pods (and pod templates of workload kinds): ``pod_spec_requests``.
    * KubeVirt VirtualMachines / VirtualMachineInstances: one per ``hostDevices`` / ``gpus`` entry,
      by ``deviceName`` (the launcher pod will request them).
    """
    spec = obj.get("spec") or {}
    template = (spec.get("template") or {}).get("spec") or {}
    out: dict[str, Decimal] = {}
    for pod_spec in (spec, template):
        for resource, qty in pod_spec_requests(pod_spec).items():
            out[resource] = out.get(resource, Decimal(0)) + qty
        devices = ((pod_spec.get("domain") or {}).get("devices") or {})
        for entry in [*(devices.get("hostDevices") or ()), *(devices.get("gpus") or ())]:
            name = (entry or {}).get("deviceName") if isinstance(entry, Mapping) else None
            if name:
                out[str(name)] = out.get(str(name), Decimal(0)) + 1
    return out


def is_finished(obj: Mapping[str, Any]) -> bool:
    """A pod that has finished (Succeeded / Failed) holds no resources."""
    return (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def asks_for(obj: Mapping[str, Any], resource: str) -> bool:
    """Whether the object asks for ``resource`` (``object_resources``); finished pods hold nothing."""
    if is_finished(obj):
        return False
    return object_resources(obj).get(resource, Decimal(0)) > 0
