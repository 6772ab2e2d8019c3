"""Verbs ``cordon`` and ``uncordon``: ``spec.unschedulable`` as a merge patch (a ``NodePatch``). Pure."""

from __future__ import annotations

from engine.facts import NodeFacts
from engine.kube_verbs.effects import NodePatch, NoOp, decides
from engine.kube_verbs.node_patch import q
from engine.model import Change, KubeCordon, KubeUncordon

CORDON_PATCH = {"spec": {"unschedulable": True}}


@decides(KubeCordon, KubeUncordon)
def decide(verb: KubeCordon | KubeUncordon, node: NodeFacts) -> NodePatch | NoOp:
    cordon = isinstance(verb, KubeCordon)
    reads = {"node.unschedulable": node.unschedulable}
    command = f"kubectl {'cordon' if cordon else 'uncordon'} {q(node.name)}"
    if node.unschedulable == cordon:
        return NoOp(f"node already {'cordoned' if cordon else 'schedulable'}", command, reads)
    change = Change(path="node.unschedulable", before=node.unschedulable, after=cordon)
    return NodePatch("cordon" if cordon else "uncordon",
                     f"{'cordon' if cordon else 'uncordon'}: unschedulable {node.unschedulable} -> {cordon}",
                     command, {"spec": {"unschedulable": cordon}}, "merge", (change,), reads)
