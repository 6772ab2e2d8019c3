"""Verbs ``evict`` and ``delete_pods``: the node's pods (by selector, namespace, resource, pod UIDs)
evicted through the Eviction API or deleted, with drain's machinery (``drain.apply``: 429 retried until
``timeout``, the pods waited for until gone) but without its cordon and refusals: mirror and
DaemonSet-managed pods are skipped with their reason (taken with ``daemonset_pods: true``: restarting an
operand), every other selected pod is taken. ``pod_uids`` names the pods by UID, as the node host knows
them (a CUDA process's cgroup names its pod's UID: gpu-reset evicts the pods of one GPU): given and
empty, nothing is selected (a no-op), never every pod. Pure here.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from engine.checkkind import FormatModel
from engine.facts import NodeFacts
from engine.kube_verbs.effects import NoOp, PodOperation, PodRules, decides
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
    # Only the pods with these UIDs (comma- or space-separated; a template rendering to them, e.g. the
    # pod UIDs of one GPU's CUDA processes): a UID no pod of the node has selects nothing.
    pod_uids: str | None = None

    def uid_set(self) -> frozenset[str] | None:
        """The UIDs ``pod_uids`` names (None: not given, every pod the other fields select)."""
        if self.pod_uids is None:
            return None
        return frozenset(u for u in self.pod_uids.replace(",", " ").split() if u)


class KubeEvict(KubeVerbSpec):
    KEY: ClassVar[str] = "evict"
    ORDER: ClassVar[int] = 90
    evict: PodSelectorSpec


class KubeDeletePods(KubeVerbSpec):
    KEY: ClassVar[str] = "delete_pods"
    ORDER: ClassVar[int] = 100
    delete_pods: PodSelectorSpec


@decides(KubeEvict, KubeDeletePods)
def decide(verb: KubeEvict | KubeDeletePods, node: NodeFacts) -> PodOperation | NoOp:
    evict = isinstance(verb, KubeEvict)
    sel = verb.evict if isinstance(verb, KubeEvict) else verb.delete_pods
    n = node.name
    uids = sel.uid_set()
    if uids is not None and not uids:
        return NoOp(f"no pod UID given: no pod on {n} to {'evict' if evict else 'delete'}")
    scope = f"-n {q(sel.namespace)}" if sel.namespace else "-A"
    label = f" -l {q(sel.selector)}" if sel.selector else ""
    listing = f"kubectl get pods {scope} --field-selector spec.nodeName={q(n)}{label}"
    grace = f" --grace-period={sel.grace_seconds}" if sel.grace_seconds is not None else ""
    filters = []
    if uids:
        filters.append("select(" + " or ".join(f'.metadata.uid == "{u}"' for u in sorted(uids)) + ")")
    if sel.resource:
        filters.append(f"select([.spec.containers[].resources | (.requests, .limits) // {{}} "
                       f"| has(\"{sel.resource}\")] | any)")
    if filters:
        # kubectl cannot select by requested resource or UID: list, keep those, act on each
        jq = "jq -r '.items[] | " + " | ".join(filters) + " | \"\\(.metadata.namespace) \\(.metadata.name)\"'"
        listing = f"{listing} -o json | {jq}"
    if evict:
        command = (f"{listing} -o name" if not filters else listing) + \
            " | # evict each through the Eviction API (policy/v1, policy/v1beta1 before 1.22)"
    elif filters:
        command = f"{listing} | while read -r ns pod; do kubectl delete pod -n \"$ns\" \"$pod\"{grace}; done"
    else:
        command = f"kubectl delete pods {scope} --field-selector spec.nodeName={q(n)}{label}{grace}"
    what = f"pods on {n}" + (f" with UID {', '.join(sorted(uids))}" if uids else "") + \
        (f" asking for {sel.resource}" if sel.resource else "") + \
        (f" matching {sel.selector}" if sel.selector else "") + \
        (f" in {sel.namespace}" if sel.namespace else "")
    rules = PodRules(selector=sel.selector, namespace=sel.namespace, resource=sel.resource, delete=not evict,
                     grace_seconds=sel.grace_seconds, timeout=parse_duration(sel.timeout),
                     daemonset_pods=sel.daemonset_pods, uids=tuple(sorted(uids)) if uids is not None else None)
    return PodOperation("evict" if evict else "delete_pods", f"{'evict' if evict else 'delete'} {what}", command,
                        rules)
