"""The ``NodePatch`` effect's apply and preview, and what it predicts about the node.

Every verb that changes the Node object (label, unlabel, annotate, cordon, uncordon, taint, untaint,
patch) decides a ``NodePatch`` in its own module; this one sends it (``apply``), tries it as a
server-side dry run (``preview``) and predicts the node after it for planning (``apply_to_node``).
Must not decide anything: what to patch is the verb's business.
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from engine.errors import RunbookError
from engine.facts import NodeFacts, Taint
from engine.kube_verbs.effects import KubeContext, NodePatch, applies, cordon_patch, previews


def q(text: str) -> str:
    return shlex.quote(text)


def show(v: Any) -> str:
    return "(absent)" if v is None else str(v)


def stamped(effect: NodePatch, run_id: str) -> Any:
    """The patch as sent: a cordon carries ``runbook.io/cordoned-by: <run>``."""
    return cordon_patch(run_id) if effect.verb == "cordon" else effect.patch


@applies(NodePatch)
def apply(effect: NodePatch, ctx: KubeContext) -> dict[str, Any]:
    patch = stamped(effect, ctx.run_id)
    ctx.kube.patch_node(ctx.node, patch, patch_type=effect.patch_type)
    return {"patch": patch, "patch_type": effect.patch_type}


@previews(NodePatch)
def preview(effect: NodePatch, ctx: KubeContext) -> str:
    try:
        ctx.kube.patch_node(ctx.node, stamped(effect, ctx.run_id), patch_type=effect.patch_type, dry_run=True)
    except RunbookError as e:
        return f"server dry-run REJECTED: {e}"
    return f"server dry-run accepted: {effect.summary}"


def apply_to_node(effect: Any, node: NodeFacts) -> NodeFacts:
    """The node facts after ``effect`` (for planning's predictions): its changes, and a taint patch's
    final taint list."""
    labels = dict(node.labels)
    annotations = dict(node.annotations)
    taints = node.taints
    unschedulable = node.unschedulable
    for c in effect.changes:
        if c.path.startswith("node.labels["):
            key = c.path[len("node.labels["):-1]
            if c.after is None:
                labels.pop(key, None)
            else:
                labels[key] = str(c.after)
        elif c.path.startswith("node.annotations["):
            key = c.path[len("node.annotations["):-1]
            if c.after is None:
                annotations.pop(key, None)
            else:
                annotations[key] = str(c.after)
        elif c.path == "node.unschedulable":
            unschedulable = bool(c.after)
    if isinstance(effect, NodePatch) and effect.verb in ("taint", "untaint") and isinstance(effect.patch, list):
        final = effect.patch[-1]["value"]
        taints = tuple(Taint(t["key"], t["effect"], t.get("value", "")) for t in final)
    return replace(node, labels=MappingProxyType(labels), annotations=MappingProxyType(annotations),
                   taints=taints, unschedulable=unschedulable)
