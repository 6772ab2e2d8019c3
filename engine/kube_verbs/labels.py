"""Verbs ``label``, ``annotate`` and ``unlabel``: merge patches of the node's metadata (a ``NodePatch``).

Decides from the node's facts only (pure): labels already as wanted are a ``NoOp`` with the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from engine.facts import NodeFacts
from engine.kube_verbs.effects import NodePatch, NoOp, decides
from engine.kube_verbs.node_patch import q, show
from engine.model import Change, KubeVerbSpec


class KubeLabel(KubeVerbSpec):
    KEY: ClassVar[str] = "label"
    ORDER: ClassVar[int] = 10
    AUTO_INVERSE: ClassVar[bool] = True
    label: dict[str, str] = Field(min_length=1)


class KubeUnlabel(KubeVerbSpec):
    KEY: ClassVar[str] = "unlabel"
    ORDER: ClassVar[int] = 20
    AUTO_INVERSE: ClassVar[bool] = True
    unlabel: tuple[str, ...] = Field(min_length=1)


class KubeAnnotate(KubeVerbSpec):
    KEY: ClassVar[str] = "annotate"
    ORDER: ClassVar[int] = 30
    AUTO_INVERSE: ClassVar[bool] = True
    annotate: dict[str, str] = Field(min_length=1)


@decides(KubeLabel, KubeAnnotate)
def decide_set(verb: KubeLabel | KubeAnnotate, node: NodeFacts) -> NodePatch | NoOp:
    is_label = isinstance(verb, KubeLabel)
    what = "label" if is_label else "annotation"
    current = node.labels if is_label else node.annotations
    wanted = verb.label if isinstance(verb, KubeLabel) else verb.annotate
    section = "labels" if is_label else "annotations"
    reads: dict[str, Any] = {f"node.{section}[{k}]": current.get(k) for k in wanted}
    kv = " ".join(q(f"{k}={v}") for k, v in wanted.items())
    command = f"kubectl {'label' if is_label else 'annotate'} node {q(node.name)} {kv} --overwrite"
    todo = {k: v for k, v in wanted.items() if current.get(k) != v}
    if not todo:
        return NoOp("; ".join(f"{what} {k} already {v}" for k, v in wanted.items()), command, reads)
    changes = tuple(Change(path=f"node.{section}[{k}]", before=current.get(k), after=v) for k, v in todo.items())
    summary = "; ".join(f"{what} {k}: {show(current.get(k))} -> {v}" for k, v in todo.items())
    return NodePatch(what, summary, command, {"metadata": {section: dict(todo)}}, "merge", changes, reads)


@decides(KubeUnlabel)
def decide_unlabel(verb: KubeUnlabel, node: NodeFacts) -> NodePatch | NoOp:
    reads: dict[str, Any] = {f"node.labels[{k}]": node.labels.get(k) for k in verb.unlabel}
    command = f"kubectl label node {q(node.name)} " + " ".join(q(f"{k}-") for k in verb.unlabel)
    present = [k for k in verb.unlabel if k in node.labels]
    if not present:
        return NoOp("; ".join(f"label {k} already absent" for k in verb.unlabel), command, reads)
    changes = tuple(Change(path=f"node.labels[{k}]", before=node.labels[k], after=None) for k in present)
    summary = "; ".join(f"label {k}: {node.labels[k]} -> (absent)" for k in present)
    return NodePatch("unlabel", summary, command, {"metadata": {"labels": dict.fromkeys(present)}}, "merge",
                     changes, reads)
