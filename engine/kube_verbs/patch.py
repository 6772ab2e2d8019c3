"""Verb ``patch``: any merge, strategic or JSON patch of the node (a ``NodePatch``). Pure.

A merge patch whose every leaf the facts can compare (labels, annotations, unschedulable) is already
applied is a ``NoOp``; the parts facts cannot see are reported as they are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import model_validator

from engine.checkkind import FormatModel
from engine.facts import NodeFacts
from engine.kube_verbs.effects import NodePatch, NoOp, decides
from engine.kube_verbs.node_patch import q, show
from engine.model import Change, KubeVerbSpec


class PatchSpec(FormatModel):
    type: Literal["merge", "strategic", "json"] = "merge"
    body: dict[str, Any] | list[dict[str, Any]]

    @model_validator(mode="after")
    def _body_matches_type(self) -> PatchSpec:
        if (self.type == "json") != isinstance(self.body, list):
            raise ValueError("a json patch body is a list of operations; merge/strategic bodies are mappings")
        return self


class KubePatch(KubeVerbSpec):
    KEY: ClassVar[str] = "patch"
    ORDER: ClassVar[int] = 80
    patch: PatchSpec


@decides(KubePatch)
def decide(verb: KubePatch, node: NodeFacts) -> NodePatch | NoOp:
    p = verb.patch
    body = p.body
    command = f"kubectl patch node {q(node.name)} --type {p.type} -p {q(json.dumps(body, sort_keys=True))}"
    if p.type == "json":
        assert isinstance(body, list)
        return NodePatch("patch", f"json patch: {len(body)} operation{'s' if len(body) != 1 else ''}",
                         command, body, "json")
    assert isinstance(body, dict)
    known = _known_leaves(body, node)
    reads = {path: before for path, before, _ in known if path is not None}
    if known and all(path is not None and before == after for path, before, after in known) \
            and len(known) == _leaf_count(body):
        return NoOp("patch already applied: " + ", ".join(f"{path}={show(a)}" for path, _, a in known),
                    command, reads)
    changes = tuple(Change(path=path or "?", before=before, after=after) for path, before, after in known
                    if before != after)
    summary = f"{p.type} patch: " + (", ".join(f"{c.path}: {show(c.before)} -> {show(c.after)}"
                                               for c in changes) or json.dumps(body, sort_keys=True)[:200])
    return NodePatch("patch", summary, command, body, p.type, changes, reads)


def _leaf_count(body: Mapping[str, Any]) -> int:
    n = 0
    for v in body.values():
        n += _leaf_count(v) if isinstance(v, Mapping) and v else 1
    return n


def _known_leaves(body: Mapping[str, Any], node: NodeFacts) -> list[tuple[str | None, Any, Any]]:
    """(fact path, before, after) for the parts of a merge patch we can compare with facts."""
    out: list[tuple[str | None, Any, Any]] = []
    md = body.get("metadata") or {}
    for section, current in (("labels", node.labels), ("annotations", node.annotations)):
        for k, v in (md.get(section) or {}).items():
            out.append((f"node.{section}[{k}]", current.get(k), v))
    spec = body.get("spec") or {}
    if "unschedulable" in spec:
        out.append(("node.unschedulable", node.unschedulable, bool(spec["unschedulable"])))
    return out
