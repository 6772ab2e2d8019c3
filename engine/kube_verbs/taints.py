"""Verbs ``taint`` and ``untaint``: JSON patches of ``spec.taints`` (a ``NodePatch``). Pure.

Each patch first ``test``s the node's resourceVersion (or the current taint list), so a concurrent
edit makes the patch fail instead of silently overwriting someone else's taint.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from engine.checkkind import FormatModel
from engine.facts import NodeFacts, Taint
from engine.kube_verbs.effects import NodePatch, NoOp, decides
from engine.kube_verbs.node_patch import q, show
from engine.model import Change, KubeVerbSpec

TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class TaintSpec(FormatModel):
    key: str = Field(min_length=1)
    value: str = ""
    effect: TaintEffect


class UntaintSpec(FormatModel):
    key: str = Field(min_length=1)
    effect: TaintEffect | None = None  # every effect of the key when omitted


class KubeTaint(KubeVerbSpec):
    KEY: ClassVar[str] = "taint"
    ORDER: ClassVar[int] = 60
    taint: TaintSpec


class KubeUntaint(KubeVerbSpec):
    KEY: ClassVar[str] = "untaint"
    ORDER: ClassVar[int] = 70
    untaint: UntaintSpec


def _taint_dict(t: Taint) -> dict[str, str]:
    d = {"key": t.key, "effect": t.effect}
    if t.value:
        d["value"] = t.value
    return d


def taint_text(t: Taint) -> str:
    return f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}"


def _taint_patch(node: NodeFacts, new: list[Taint]) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    if node.resource_version:
        ops.append({"op": "test", "path": "/metadata/resourceVersion", "value": node.resource_version})
    elif node.taints:
        ops.append({"op": "test", "path": "/spec/taints", "value": [_taint_dict(t) for t in node.taints]})
    # "add" replaces an existing member, and creates /spec/taints when the node has none.
    ops.append({"op": "add", "path": "/spec/taints", "value": [_taint_dict(t) for t in new]})
    return ops


@decides(KubeTaint)
def decide_taint(verb: KubeTaint, node: NodeFacts) -> NodePatch | NoOp:
    s = verb.taint
    want = Taint(s.key, s.effect, s.value)
    texts = sorted(taint_text(t) for t in node.taints if t.key == s.key)
    reads: dict[str, Any] = {f"node.taints[{s.key}]": texts}
    command = f"kubectl taint node {q(node.name)} {q(taint_text(want))} --overwrite"
    if want in node.taints:
        return NoOp(f"taint {taint_text(want)} already present", command, reads)
    new = [t for t in node.taints if not (t.key == s.key and t.effect == s.effect)] + [want]
    before = ", ".join(texts) or None
    change = Change(path=f"node.taints[{s.key}]", before=before, after=taint_text(want))
    return NodePatch("taint", f"taint {s.key}: {show(before)} -> {taint_text(want)}", command,
                     _taint_patch(node, new), "json", (change,), reads)


@decides(KubeUntaint)
def decide_untaint(verb: KubeUntaint, node: NodeFacts) -> NodePatch | NoOp:
    u = verb.untaint
    texts = sorted(taint_text(t) for t in node.taints if t.key == u.key)
    reads: dict[str, Any] = {f"node.taints[{u.key}]": texts}
    suffix = f"{u.key}:{u.effect}-" if u.effect else f"{u.key}-"
    command = f"kubectl taint node {q(node.name)} {q(suffix)}"
    gone = [t for t in node.taints if t.key == u.key and (u.effect is None or t.effect == u.effect)]
    if not gone:
        return NoOp(f"taint {u.key}{':' + u.effect if u.effect else ''} already absent", command, reads)
    new = [t for t in node.taints if t not in gone]
    change = Change(path=f"node.taints[{u.key}]", before=", ".join(texts),
                    after=", ".join(sorted(taint_text(t) for t in new if t.key == u.key)) or None)
    return NodePatch("untaint", f"untaint {', '.join(taint_text(t) for t in gone)}", command,
                     _taint_patch(node, new), "json", (change,), reads)
