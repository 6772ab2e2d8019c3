"""The check kind that reads listed Kubernetes objects (``facts.objects``): ``objects``.

Counts the objects of a listable kind (a namespace, a label selector, "asking for" a resource, a
field's value) against bounds. Its probe is one list call (``ObjectsQuery``). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

from pydantic import Field, model_validator

from engine.checkkind import (
    CheckKind,
    CheckResult,
    Env,
    FormatModel,
    ObjectsQuery,
    Probe,
    Reads,
    register_check,
    result,
    unknown,
)
from engine.checks.core import bind, has_template
from engine.facts import Facts
from engine.resources import asks_for


class ObjectsSpec(FormatModel):
    """Objects of any listable kind, e.g. KubeVirt VirtualMachines by ``status.printableStatus``."""

    api_version: str = Field(min_length=1)  # "kubevirt.io/v1", "v1"
    kind: str = Field(min_length=1)  # "VirtualMachine"
    plural: str | None = None  # defaults to lower(kind) + "s"
    namespace: str | None = None  # all namespaces when omitted
    selector: str | None = None  # label selector
    resource: str | None = None  # only objects asking for this extended resource (pods, VMs, VMIs)
    field: str | None = None  # dotted path into each object; all listed objects match when omitted
    equals: str | int | bool | None = None
    # more field = value conditions, all of which one object must meet to be counted (the device
    # plugin pod on THIS node that crash-loops: ``spec.nodeName`` and a waiting reason together)
    where: dict[str, str | int | bool] = Field(default_factory=dict)
    count: int | None = Field(default=None, ge=0)
    min: int | None = Field(default=None, ge=0)
    max: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> ObjectsSpec:
        if self.field is not None and self.equals is None:
            raise ValueError("objects: 'field' needs 'equals'")
        if self.count is not None and (self.min is not None or self.max is not None):
            raise ValueError("objects: use either 'count' or 'min'/'max'")
        return self

    @property
    def plural_name(self) -> str:
        return self.plural or self.kind.lower() + "s"

    @property
    def query(self) -> ObjectsQuery:
        """The list call that reads these objects."""
        return ObjectsQuery(self.api_version, self.plural_name, self.namespace, self.selector)

    def matches(self, obj: Mapping[str, Any]) -> bool:
        """Whether a listed object is one of the objects counted."""
        if self.resource and not asks_for(obj, self.resource):
            return False
        if self.field is not None and field_value(obj, self.field) != self.equals:
            return False
        return all(field_value(obj, path) == want for path, want in self.where.items())

    def conditions(self, sep: str = " = ") -> str:
        """`` with a = b and c = d``: the field conditions, for descriptions; "" without any."""
        pairs = ([(self.field, self.equals)] if self.field else []) + list(self.where.items())
        return " with " + " and ".join(f"{k}{sep}{v}" for k, v in pairs) if pairs else ""


def field_value(obj: Mapping[str, Any], path: str) -> Any:
    """``status.printableStatus`` in a plain object mapping; None when absent."""
    cur: Any = obj
    for part in path.split("."):
        if isinstance(cur, Mapping) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list | tuple) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return cur


def _name(o: Mapping[str, Any]) -> str:
    md = o.get("metadata") or {}
    return f"{md.get('namespace', '')}/{md.get('name', '?')}".lstrip("/")


@register_check
class ObjectsCheck(CheckKind):
    KEY: ClassVar[str] = "objects"
    READS: ClassVar[Reads] = "objects"
    objects: ObjectsSpec

    def describe(self) -> str:
        s = self.objects
        where = s.conditions()
        ns = f" in {s.namespace}" if s.namespace else ""
        sel = f" matching {s.selector}" if s.selector else ""
        if s.resource:
            sel += f" asking for {s.resource}"
        if s.count is not None:
            bound = f"exactly {s.count}"
        elif s.min is not None and s.max is not None:
            bound = f"{s.min}..{s.max}"
        elif s.max is not None:
            bound = f"at most {s.max}"
        else:
            bound = f"at least {s.min if s.min is not None else 1}"
        return f"{bound} {s.kind}{ns}{sel}{where}"

    def probes(self, env: Env) -> set[Probe]:
        spec = self.objects
        if has_template(spec):
            try:
                spec = bind(spec, env.params)
            except Exception:
                return set()  # evaluation will report the render error (fails closed)
        return {spec.query}

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        s = self.objects
        q = s.query
        objs = facts.objects.get(q.key)
        if objs is None:
            return unknown(f"{s.kind} list", facts, f"objects:{q.key}")
        matching = [o for o in objs if s.matches(o)]
        n = len(matching)
        if s.count is not None:
            holds = n == s.count
        else:
            lo = s.min if s.min is not None else (0 if s.max is not None else 1)
            holds = n >= lo and (s.max is None or n <= s.max)
        where = (f" asking for {s.resource}" if s.resource else "") + s.conditions("=")
        observed = f"{n} of {len(objs)} {s.kind}{where}"
        if matching:
            observed += ": " + ", ".join(_name(o) for o in matching[:5]) + (" ..." if n > 5 else "")
        return result(holds, observed, {f"objects[{q.key}]{where}": n}, matching=[_name(o) for o in matching][:50])

    def establish(self, facts: Facts, env: Env) -> Facts:
        """"No such object" (``max: 0`` / ``count: 0``) is predictable: the matching objects are gone
        (an evicted pod). Objects cannot be invented, so every other bound leaves the facts as they are."""
        s = self.objects
        if not (s.max == 0 or s.count == 0):
            return facts
        key = s.query.key
        objs = facts.objects.get(key)
        if objs is None:
            return facts  # unknown stays unknown
        kept = tuple(o for o in objs if not s.matches(o))
        return facts if len(kept) == len(objs) else replace(facts, objects={**facts.objects, key: kept})
