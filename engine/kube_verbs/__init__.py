"""Kube verbs as units: each verb's module holds its spec class and decides its effect from the node's
facts, and each effect variant (``effects``: ``NodePatch``, ``PodOperation``, ``Wait``,
``BootstrapOperation``) has its apply and preview in one place.

``kube_effect(verb, node)`` is what planning and execution call to decide; ``apply(effect, ctx)`` and
``preview(effect, ctx)`` are what the executor and the plan previews call. A new verb is one module
here: its spec class (a ``engine.model.KubeVerbSpec`` with its ``KEY``) and its ``decide``, whose
``@decides(SpecClass)`` makes the spec a verb of the format and registers the decide (the format's
``KubeVerb``, the loader's hints and ``runbook schema`` read that registry). Importing this package
imports every module in it (``_import_every_module``), so no line here names a verb: see
docs/design.md, "How to add a kube verb".

Deciding is pure. Applying and previewing talk to Kubernetes only through ``KubeAPI``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from engine.facts import NodeFacts
from engine.kube_verbs.drain import select as select_pods
from engine.kube_verbs.effects import (
    APPLY,
    DECIDE,
    PREVIEW,
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
from engine.kube_verbs.node_patch import apply_to_node

__all__ = ["DECIDE", "BootstrapOperation", "EffectFailed", "KubeContext", "KubeEffect", "NoOp", "NodePatch",
           "PodOperation", "PodRules", "Wait",
           "apply", "apply_to_node", "kube_effect", "preview", "select_pods", "verb_modules"]


def _import_every_module() -> tuple[str, ...]:
    """Import each module of this package (a verb module registers its verbs with ``@decides``, an
    effect's module its apply and preview): the package's own files, in name order; nothing outside
    it is reached this way. Returns their names."""
    names = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))
    for name in names:
        importlib.import_module(f"{__name__}.{name}")
    return names


_MODULES = _import_every_module()


def verb_modules() -> tuple[str, ...]:
    """The modules of this package that define kube verbs (``cordon``, ``drain``, ...)."""
    return tuple(sorted({spec.__module__.rpartition(".")[2] for spec in DECIDE}))


def kube_effect(verb: Any, node: NodeFacts) -> KubeEffect | NoOp:
    """The effect of one kube verb on ``node`` as it is now, or why there is nothing to do."""
    decide = DECIDE.get(type(verb))
    if decide is None:
        raise TypeError(f"not a kube verb: {verb!r}")
    return decide(verb, node)


def apply(effect: KubeEffect, ctx: KubeContext) -> dict[str, Any]:
    """Carry ``effect`` out; returns its evidence. Raises ``RunbookError`` (``EffectFailed`` with
    evidence when it got part of the way)."""
    carry_out = APPLY.get(type(effect))
    if carry_out is None:
        raise TypeError(f"no apply for the effect {type(effect).__qualname__}")
    return carry_out(effect, ctx)


def preview(effect: KubeEffect, ctx: KubeContext) -> str:
    """What ``effect`` would do, asked of the server without changing anything (``dryRun=All``)."""
    show = PREVIEW.get(type(effect))
    if show is None:
        raise TypeError(f"no preview for the effect {type(effect).__qualname__}")
    return show(effect, ctx)
