"""What an action will do, decided from facts alone (pure; no I/O).

``kube_effect`` turns a kube verb and the node's current facts into a ``KubeEffect`` (the patch
body and type, a before -> after summary, the equivalent ``kubectl`` line) or a ``NoOp`` with its
reason (``label nvidia.com/gpu.workload.config already container``). Execution sends the patch
through ``KubeAPI``; planning shows it. Taint changes are JSON patches that first ``test`` the
node's resourceVersion (or the current taint list), so a concurrent edit makes the patch fail
instead of silently overwriting someone else's taint.

``ansible_command`` gives the ``ansible-playbook`` line an operator would type for a playbook step.
``select_pods`` narrows the pods an ``evict`` / ``delete_pods`` lists on the node to those asking for
the selector's ``resource`` (``evict: {resource: nvidia.com/gpu}``: the node's GPU pods).
Actions must already be bound (templates rendered, ``checks.bind``) before they come here.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Any

from engine.connectors.base import PodRef
from engine.facts import NodeFacts, Taint
from engine.model import (
    AnsibleSpec,
    Change,
    KubeAnnotate,
    KubeCordon,
    KubeDeletePods,
    KubeEvict,
    KubeLabel,
    KubePatch,
    KubeTaint,
    KubeUncordon,
    KubeUnlabel,
    KubeUntaint,
    KubeWait,
    PodSelectorSpec,
)
from engine.resources import parse_quantity


@dataclass(frozen=True)
class KubeEffect:
    """A change to make through the Kubernetes API."""

    verb: str
    summary: str  # "label k: vm-passthrough -> container"
    command: str  # equivalent kubectl line
    patch: Any = None  # body for patch_node; None for pod operations and waits
    patch_type: str = "merge"
    changes: tuple[Change, ...] = ()
    pods: PodSelectorSpec | None = None  # evict / delete_pods: which pods on the node
    wait_seconds: float | None = None
    reads: Mapping[str, Any] = field(default_factory=dict)  # before-values the decision read


@dataclass(frozen=True)
class NoOp:
    """Nothing to do, and why."""

    reason: str
    command: str = ""
    reads: Mapping[str, Any] = field(default_factory=dict)


def _q(text: str) -> str:
    return shlex.quote(text)


def _taint_dict(t: Taint) -> dict[str, str]:
    d = {"key": t.key, "effect": t.effect}
    if t.value:
        d["value"] = t.value
    return d


def _taint_text(t: Taint) -> str:
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


def kube_effect(verb: Any, node: NodeFacts) -> KubeEffect | NoOp:
    """The effect of one kube verb on ``node`` as it is now, or why there is nothing to do."""
    n = node.name
    reads: dict[str, Any]
    if isinstance(verb, KubeLabel | KubeAnnotate):
        is_label = isinstance(verb, KubeLabel)
        what = "label" if is_label else "annotation"
        current = node.labels if is_label else node.annotations
        wanted = verb.label if isinstance(verb, KubeLabel) else verb.annotate
        section = "labels" if is_label else "annotations"
        reads = {f"node.{section}[{k}]": current.get(k) for k in wanted}
        kv = " ".join(_q(f"{k}={v}") for k, v in wanted.items())
        command = f"kubectl {'label' if is_label else 'annotate'} node {_q(n)} {kv} --overwrite"
        todo = {k: v for k, v in wanted.items() if current.get(k) != v}
        if not todo:
            return NoOp("; ".join(f"{what} {k} already {v}" for k, v in wanted.items()), command, reads)
        changes = tuple(Change(path=f"node.{section}[{k}]", before=current.get(k), after=v) for k, v in todo.items())
        summary = "; ".join(f"{what} {k}: {_show(current.get(k))} -> {v}" for k, v in todo.items())
        return KubeEffect(what, summary, command, {"metadata": {section: dict(todo)}}, "merge", changes,
                          reads=reads)
    if isinstance(verb, KubeUnlabel):
        reads = {f"node.labels[{k}]": node.labels.get(k) for k in verb.unlabel}
        command = f"kubectl label node {_q(n)} " + " ".join(_q(f"{k}-") for k in verb.unlabel)
        present = [k for k in verb.unlabel if k in node.labels]
        if not present:
            return NoOp("; ".join(f"label {k} already absent" for k in verb.unlabel), command, reads)
        changes = tuple(Change(path=f"node.labels[{k}]", before=node.labels[k], after=None) for k in present)
        summary = "; ".join(f"label {k}: {node.labels[k]} -> (absent)" for k in present)
        return KubeEffect("unlabel", summary, command, {"metadata": {"labels": dict.fromkeys(present)}}, "merge",
                          changes, reads=reads)
    if isinstance(verb, KubeCordon | KubeUncordon):
        cordon = isinstance(verb, KubeCordon)
        reads = {"node.unschedulable": node.unschedulable}
        command = f"kubectl {'cordon' if cordon else 'uncordon'} {_q(n)}"
        if node.unschedulable == cordon:
            return NoOp(f"node already {'cordoned' if cordon else 'schedulable'}", command, reads)
        change = Change(path="node.unschedulable", before=node.unschedulable, after=cordon)
        return KubeEffect("cordon" if cordon else "uncordon",
                          f"{'cordon' if cordon else 'uncordon'}: unschedulable {node.unschedulable} -> {cordon}",
                          command, {"spec": {"unschedulable": cordon}}, "merge", (change,), reads=reads)
    if isinstance(verb, KubeTaint):
        s = verb.taint
        want = Taint(s.key, s.effect, s.value)
        texts = sorted(_taint_text(t) for t in node.taints if t.key == s.key)
        reads = {f"node.taints[{s.key}]": texts}
        command = f"kubectl taint node {_q(n)} {_q(_taint_text(want))} --overwrite"
        if want in node.taints:
            return NoOp(f"taint {_taint_text(want)} already present", command, reads)
        new = [t for t in node.taints if not (t.key == s.key and t.effect == s.effect)] + [want]
        before = ", ".join(texts) or None
        change = Change(path=f"node.taints[{s.key}]", before=before, after=_taint_text(want))
        return KubeEffect("taint", f"taint {s.key}: {_show(before)} -> {_taint_text(want)}", command,
                          _taint_patch(node, new), "json", (change,), reads=reads)
    if isinstance(verb, KubeUntaint):
        u = verb.untaint
        texts = sorted(_taint_text(t) for t in node.taints if t.key == u.key)
        reads = {f"node.taints[{u.key}]": texts}
        suffix = f"{u.key}:{u.effect}-" if u.effect else f"{u.key}-"
        command = f"kubectl taint node {_q(n)} {_q(suffix)}"
        gone = [t for t in node.taints if t.key == u.key and (u.effect is None or t.effect == u.effect)]
        if not gone:
            return NoOp(f"taint {u.key}{':' + u.effect if u.effect else ''} already absent", command, reads)
        new = [t for t in node.taints if t not in gone]
        change = Change(path=f"node.taints[{u.key}]", before=", ".join(texts),
                        after=", ".join(sorted(_taint_text(t) for t in new if t.key == u.key)) or None)
        return KubeEffect("untaint", f"untaint {', '.join(_taint_text(t) for t in gone)}", command,
                          _taint_patch(node, new), "json", (change,), reads=reads)
    if isinstance(verb, KubePatch):
        p = verb.patch
        body = p.body
        command = f"kubectl patch node {_q(n)} --type {p.type} -p {_q(json.dumps(body, sort_keys=True))}"
        if p.type == "json":
            assert isinstance(body, list)
            return KubeEffect("patch", f"json patch: {len(body)} operation{'s' if len(body) != 1 else ''}",
                              command, body, "json")
        assert isinstance(body, dict)
        known = _known_leaves(body, node)
        reads = {path: before for path, before, _ in known if path is not None}
        if known and all(path is not None and before == after for path, before, after in known) \
                and len(known) == _leaf_count(body):
            return NoOp("patch already applied: " + ", ".join(f"{path}={_show(a)}" for path, _, a in known),
                        command, reads)
        changes = tuple(Change(path=path or "?", before=before, after=after) for path, before, after in known
                        if before != after)
        summary = f"{p.type} patch: " + (", ".join(f"{c.path}: {_show(c.before)} -> {_show(c.after)}"
                                                   for c in changes) or json.dumps(body, sort_keys=True)[:200])
        return KubeEffect("patch", summary, command, body, p.type, changes, reads=reads)
    if isinstance(verb, KubeEvict | KubeDeletePods):
        evict = isinstance(verb, KubeEvict)
        sel = verb.evict if isinstance(verb, KubeEvict) else verb.delete_pods
        scope = f"-n {_q(sel.namespace)}" if sel.namespace else "-A"
        label = f" -l {_q(sel.selector)}" if sel.selector else ""
        listing = f"kubectl get pods {scope} --field-selector spec.nodeName={_q(n)}{label}"
        if sel.resource:
            # kubectl cannot select by requested resource: list, keep those asking for it, act on each
            jq = (f"jq -r '.items[] | select([.spec.containers[].resources | (.requests, .limits) // {{}} "
                  f"| has(\"{sel.resource}\")] | any) | \"\\(.metadata.namespace) \\(.metadata.name)\"'")
            listing = f"{listing} -o json | {jq}"
        if evict:
            command = (f"{listing} -o name" if not sel.resource else listing) + \
                " | # evict each through the Eviction API (policy/v1, policy/v1beta1 before 1.22)"
        elif sel.resource:
            grace = f" --grace-period={sel.grace_seconds}" if sel.grace_seconds is not None else ""
            command = f"{listing} | while read -r ns pod; do kubectl delete pod -n \"$ns\" \"$pod\"{grace}; done"
        else:
            grace = f" --grace-period={sel.grace_seconds}" if sel.grace_seconds is not None else ""
            command = f"kubectl delete pods {scope} --field-selector spec.nodeName={_q(n)}{label}{grace}"
        what = f"pods on {n}" + (f" asking for {sel.resource}" if sel.resource else "") + \
            (f" matching {sel.selector}" if sel.selector else "") + \
            (f" in {sel.namespace}" if sel.namespace else "")
        return KubeEffect("evict" if evict else "delete_pods", f"{'evict' if evict else 'delete'} {what}", command,
                          pods=sel)
    if isinstance(verb, KubeWait):
        return KubeEffect("wait", f"wait {verb.wait.seconds:g}s", f"sleep {verb.wait.seconds:g}",
                          wait_seconds=verb.wait.seconds)
    raise TypeError(f"not a kube verb: {verb!r}")


def _show(v: Any) -> str:
    return "(absent)" if v is None else str(v)


def select_pods(selector: PodSelectorSpec, pods: list[PodRef]) -> list[PodRef]:
    """The pods (already listed by node, label selector and namespace) that ``selector`` selects:
    with ``resource``, only those whose containers request or limit a non-zero quantity of it."""
    if not selector.resource:
        return list(pods)
    return [p for p in pods if p.phase not in ("Succeeded", "Failed") and _asked(p, selector.resource) > 0]


def _asked(pod: PodRef, resource: str) -> Decimal:
    """How much of ``resource`` the pod asks for (``PodRef.requests``, from ``engine.resources``)."""
    try:
        return parse_quantity(pod.requests.get(resource, "0"))
    except ValueError:
        return Decimal(0)


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


def apply_to_node(effect: KubeEffect, node: NodeFacts) -> NodeFacts:
    """The node facts after ``effect`` (for planning's predictions)."""
    from dataclasses import replace

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
    if effect.verb in ("taint", "untaint") and isinstance(effect.patch, list):
        final = effect.patch[-1]["value"]
        taints = tuple(Taint(t["key"], t["effect"], t.get("value", "")) for t in final)
    return replace(node, labels=MappingProxyType(labels), annotations=MappingProxyType(annotations),
                   taints=taints, unschedulable=unschedulable)


def ansible_command(spec: AnsibleSpec, host: str, *, inventory: str = "INVENTORY",
                    playbooks_dir: str = "playbooks", extravars: Mapping[str, Any] | None = None) -> str:
    """``ansible-playbook -i INV playbooks/x.yml --limit omen2 -b -e '{...}'``."""
    parts = ["ansible-playbook", "-i", _q(inventory), _q(f"{playbooks_dir.rstrip('/')}/{spec.playbook}"),
             "--limit", _q(host)]
    if spec.become:
        parts.append("-b")
    evars = dict(extravars if extravars is not None else spec.vars)
    if evars:
        parts += ["-e", _q(json.dumps(evars, sort_keys=True))]
    return " ".join(parts)
