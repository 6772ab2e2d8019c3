"""Verbs ``cordon`` and ``uncordon``: ``spec.unschedulable`` as a merge patch (a ``NodePatch``). Pure.

A cordon is stamped with ``runbook.io/cordoned-by: <run>`` when applied (``node_patch.apply``); an
uncordon undoes only such a cordon (and removes the annotation): a node someone else cordoned (a
person, NVSentinel, a drain by another controller) is left cordoned, a no-op with the reason."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from engine.facts import NodeFacts
from engine.kube_verbs.effects import CORDONED_BY_ANNOTATION, NodePatch, NoOp, decides
from engine.kube_verbs.node_patch import q
from engine.model import Change, KubeVerbSpec


class KubeCordon(KubeVerbSpec):
    KEY: ClassVar[str] = "cordon"
    ORDER: ClassVar[int] = 40
    AUTO_INVERSE: ClassVar[bool] = True
    cordon: Literal[True]


class KubeUncordon(KubeVerbSpec):
    KEY: ClassVar[str] = "uncordon"
    ORDER: ClassVar[int] = 50
    AUTO_INVERSE: ClassVar[bool] = True
    uncordon: Literal[True]


THIS_RUN = "(this run)"  # a planned cordon's stamp: the run id is written when it is applied


@decides(KubeCordon, KubeUncordon)
def decide(verb: KubeCordon | KubeUncordon, node: NodeFacts) -> NodePatch | NoOp:
    cordon = isinstance(verb, KubeCordon)
    reads: dict[str, Any] = {"node.unschedulable": node.unschedulable}
    command = f"kubectl {'cordon' if cordon else 'uncordon'} {q(node.name)}"
    if node.unschedulable == cordon:
        return NoOp(f"node already {'cordoned' if cordon else 'schedulable'}", command, reads)
    change = Change(path="node.unschedulable", before=node.unschedulable, after=cordon)
    if cordon:
        # the stamp is a change too: a later uncordon in the same plan is predicted to undo this cordon
        stamp = Change(path=f"node.annotations[{CORDONED_BY_ANNOTATION}]",
                       before=node.annotations.get(CORDONED_BY_ANNOTATION), after=THIS_RUN)
        return NodePatch("cordon", f"cordon: unschedulable {node.unschedulable} -> True", command,
                         {"spec": {"unschedulable": True}}, "merge", (change, stamp), reads)
    by = node.annotations.get(CORDONED_BY_ANNOTATION)
    reads[f"node.annotations[{CORDONED_BY_ANNOTATION}]"] = by
    if not by:
        return NoOp(f"node {node.name} was not cordoned by runbook (no {CORDONED_BY_ANNOTATION} annotation): "
                    "left cordoned for whoever cordoned it", command, reads)
    gone = Change(path=f"node.annotations[{CORDONED_BY_ANNOTATION}]", before=by, after=None)
    return NodePatch("uncordon", f"uncordon (cordoned by run {by}): unschedulable True -> False", command,
                     {"metadata": {"annotations": {CORDONED_BY_ANNOTATION: None}}, "spec": {"unschedulable": False}},
                     "merge", (change, gone), reads)
