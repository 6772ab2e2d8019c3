"""Kube verbs as units: each verb's module decides its effect from the node's facts, and each effect
variant (``effects``: ``NodePatch``, ``PodOperation``, ``Wait``) has its apply and preview in one place.

``kube_effect(verb, node)`` is what planning and execution call to decide; ``apply(effect, ctx)`` and
``preview(effect, ctx)`` are what the executor and the plan previews call. A new verb is one module
here whose ``decide`` registers itself (``@decides(SpecClass)``), imported below; its spec class is
one ``@kube_verb`` class in ``engine.model`` (the format's union and hints are built from those):
see docs/design.md, "How to add a kube verb".

Deciding is pure. Applying and previewing talk to Kubernetes only through ``KubeAPI``.
"""

from __future__ import annotations

from typing import Any

from engine.facts import NodeFacts

# Importing a verb module registers its decide (``@decides``): one name per verb module on this line.
from engine.kube_verbs import (  # noqa: F401
    cordon,
    drain,
    evict,
    labels,
    node_bootstrap,
    node_patch,
    patch,
    taints,
    wait,
)
from engine.kube_verbs.effects import (
    DECIDE,
    BootstrapOperation,
    EffectFailed,
    KubeContext,
    KubeEffect,
    NodePatch,
    NoOp,
    PodOperation,
    PodRules,
    Wait,
)

__all__ = ["BootstrapOperation", "EffectFailed", "KubeContext", "KubeEffect", "NoOp", "NodePatch", "PodOperation",
           "PodRules", "Wait",
           "apply", "apply_to_node", "kube_effect", "preview", "select_pods"]



def kube_effect(verb: Any, node: NodeFacts) -> KubeEffect | NoOp:
    """The effect of one kube verb on ``node`` as it is now, or why there is nothing to do."""
    decide = DECIDE.get(type(verb))
    if decide is None:
        raise TypeError(f"not a kube verb: {verb!r}")
    return decide(verb, node)


def apply(effect: KubeEffect, ctx: KubeContext) -> dict[str, Any]:
    """Carry ``effect`` out; returns its evidence. Raises ``RunbookError`` (``EffectFailed`` with
    evidence when it got part of the way)."""
    if isinstance(effect, NodePatch):
        return node_patch.apply(effect, ctx)
    if isinstance(effect, PodOperation):
        return drain.apply(effect, ctx)
    if isinstance(effect, BootstrapOperation):
        return node_bootstrap.apply(effect, ctx)
    return wait.apply(effect, ctx)


def preview(effect: KubeEffect, ctx: KubeContext) -> str:
    """What ``effect`` would do, asked of the server without changing anything (``dryRun=All``)."""
    if isinstance(effect, NodePatch):
        return node_patch.preview(effect, ctx)
    if isinstance(effect, PodOperation):
        return drain.preview(effect, ctx)
    if isinstance(effect, BootstrapOperation):
        return node_bootstrap.preview(effect, ctx)
    return wait.preview(effect, ctx)


apply_to_node = node_patch.apply_to_node
select_pods = drain.select
