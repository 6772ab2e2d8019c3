"""runbook never uncordons a node it did not cordon: its cordons carry ``runbook.io/cordoned-by: <run>``
(the verb cordon and drain's cordon), and uncordon undoes only those."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import MappingProxyType

from engine import kube_verbs as kv
from engine.kube_verbs.cordon import KubeCordon, KubeUncordon
from engine.kube_verbs.effects import CORDONED_BY_ANNOTATION, NodePatch, NoOp, PodRules
from tests.fakes import FakeKube, make_node


def ctx(kube: FakeKube, run_id: str = "r-42") -> kv.KubeContext:
    return kv.KubeContext(kube, "omen2", lambda: 0.0, lambda s: None, threading.Event(), run_id=run_id)


def test_a_cordon_carries_the_run_that_made_it() -> None:
    kube = FakeKube([make_node("omen2")])
    effect = kv.kube_effect(KubeCordon(cordon=True), kube.nodes["omen2"])
    assert isinstance(effect, NodePatch)
    kv.apply(effect, ctx(kube))
    node = kube.nodes["omen2"]
    assert node.unschedulable and node.annotations[CORDONED_BY_ANNOTATION] == "r-42"


def test_drain_cordons_with_the_annotation_too() -> None:
    kube = FakeKube([make_node("omen2")])
    op = kv.PodOperation("drain", "drain omen2", "kubectl drain omen2", PodRules(cordon=True, timeout=5))
    kv.apply(op, ctx(kube, "r-7"))
    assert kube.nodes["omen2"].annotations[CORDONED_BY_ANNOTATION] == "r-7"


def test_uncordon_leaves_a_node_someone_else_cordoned() -> None:
    node = make_node("omen2", unschedulable=True)
    effect = kv.kube_effect(KubeUncordon(uncordon=True), node)
    assert isinstance(effect, NoOp)
    assert "not cordoned by runbook" in effect.reason


def test_uncordon_undoes_a_runbook_cordon_and_removes_the_annotation() -> None:
    kube = FakeKube([replace(make_node("omen2", unschedulable=True),
                             annotations=MappingProxyType({CORDONED_BY_ANNOTATION: "r-42"}))])
    effect = kv.kube_effect(KubeUncordon(uncordon=True), kube.nodes["omen2"])
    assert isinstance(effect, NodePatch) and "cordoned by run r-42" in effect.summary
    kv.apply(effect, ctx(kube, "r-43"))
    node = kube.nodes["omen2"]
    assert not node.unschedulable and CORDONED_BY_ANNOTATION not in node.annotations


def test_a_plan_that_cordons_then_uncordons_predicts_the_uncordon() -> None:
    """node-reboot's shape: the cordon's stamp is a planned change, so the uncordon later in the same
    plan is planned as an uncordon (not a no-op that the run would then block on)."""
    from engine.kube_verbs.node_patch import apply_to_node

    node = make_node("omen2")
    cordon = kv.kube_effect(KubeCordon(cordon=True), node)
    assert isinstance(cordon, NodePatch)
    after = apply_to_node(cordon, node)
    assert after.unschedulable and after.annotations[CORDONED_BY_ANNOTATION]
    uncordon = kv.kube_effect(KubeUncordon(uncordon=True), after)
    assert isinstance(uncordon, NodePatch) and uncordon.verb == "uncordon"
