"""Verbs ``evict`` and ``delete_pods``: the node's pods (by selector, namespace, resource) evicted
through the Eviction API or deleted, with drain's machinery (``drain.apply``: 429 retried until
``timeout``, the pods waited for until gone) but without its cordon and refusals: mirror and
DaemonSet-managed pods are skipped with their reason (taken with ``daemonset_pods: true``: restarting an
operand), every other selected pod is taken. Pure here.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from engine.checkkind import FormatModel
from engine.facts import NodeFacts
from engine.kube_verbs.effects import PodOperation, PodRules, decides
from engine.kube_verbs.node_patch import q
from engine.model import Duration, KubeVerbSpec, parse_duration


class PodSelectorSpec(FormatModel):
    selector: str | None = None  # label selector; every pod on the node when omitted
    namespace: str | None = None  # every namespace when omitted
    resource: str | None = None  # only pods whose containers request or limit this resource (nvidia.com/gpu)
    grace_seconds: int | None = Field(default=None, ge=0)  # the pods' termination grace period
    timeout: Duration = "300s"  # retrying budget refusals (429) and waiting for the pods to be gone
    # Take DaemonSet-managed pods too (skipped otherwise): restarting an operand such as the device
    # plugin, whose DaemonSet recreates the pod on the node.
    daemonset_pods: bool = False


class KubeEvict(KubeVerbSpec):
    KEY: ClassVar[str] = "evict"
    ORDER: ClassVar[int] = 90
    evict: PodSelectorSpec


class KubeDeletePods(KubeVerbSpec):
    KEY: ClassVar[str] = "delete_pods"
    ORDER: ClassVar[int] = 100
    delete_pods: PodSelectorSpec


@decides(KubeEvict, KubeDeletePods)
def decide(verb: KubeEvict | KubeDeletePods, node: NodeFacts) -> PodOperation:
    evict = isinstance(verb, KubeEvict)
    sel = verb.evict if isinstance(verb, KubeEvict) else verb.delete_pods
    n = node.name
    scope = f"-n {q(sel.namespace)}" if sel.namespace else "-A"
    label = f" -l {q(sel.selector)}" if sel.selector else ""
    listing = f"kubectl get pods {scope} --field-selector spec.nodeName={q(n)}{label}"
    grace = f" --grace-period={sel.grace_seconds}" if sel.grace_seconds is not None else ""
    if sel.resource:
        # kubectl cannot select by requested resource: list, keep those asking for it, act on each
        jq = (f"jq -r '.items[] | select([.spec.containers[].resources | (.requests, .limits) // {{}} "
              f"| has(\"{sel.resource}\")] | any) | \"\\(.metadata.namespace) \\(.metadata.name)\"'")
        listing = f"{listing} -o json | {jq}"
    if evict:
        command = (f"{listing} -o name" if not sel.resource else listing) + \
            " | # evict each through the Eviction API (policy/v1, policy/v1beta1 before 1.22)"
    elif sel.resource:
        command = f"{listing} | while read -r ns pod; do kubectl delete pod -n \"$ns\" \"$pod\"{grace}; done"
    else:
        command = f"kubectl delete pods {scope} --field-selector spec.nodeName={q(n)}{label}{grace}"
    what = f"pods on {n}" + (f" asking for {sel.resource}" if sel.resource else "") + \
        (f" matching {sel.selector}" if sel.selector else "") + \
        (f" in {sel.namespace}" if sel.namespace else "")
    rules = PodRules(selector=sel.selector, namespace=sel.namespace, resource=sel.resource, delete=not evict,
                     grace_seconds=sel.grace_seconds, timeout=parse_duration(sel.timeout),
                     daemonset_pods=sel.daemonset_pods)
    return PodOperation("evict" if evict else "delete_pods", f"{'evict' if evict else 'delete'} {what}", command,
                        rules)
