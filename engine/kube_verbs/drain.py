"""Verb ``drain``, and the pod machinery ``evict`` and ``delete_pods`` share: kubectl drain's semantics.

``drain`` (a ``PodOperation`` with ``strict`` rules):

1. cordon the node first (unless it already is);
2. sort the node's pods (``classify``, pure): mirror pods of static pods are skipped (the kubelet owns
   them); DaemonSet-managed pods are skipped with ``ignore_daemonsets: true`` and refuse the drain
   otherwise; pods with emptyDir volumes refuse it unless ``delete_emptydir_data: true``; pods no
   controller manages refuse it unless ``force: true``; finished pods are always taken. One refusal
   and nothing is evicted (the node stays cordoned, as with kubectl);
3. evict each pod with the Eviction API version the server serves (discovery), or delete it with
   ``disable_eviction: true``; a PodDisruptionBudget's refusal (HTTP 429) is retried with backoff
   (1 s doubling to 5 s, as kubectl's 5 s) until ``timeout``; any other error fails the drain;
4. wait, by a watch on the node's pods, until every evicted pod is gone (at least ``grace_period``);
5. verify: no pod the rules would evict is left on the node.

``evict`` and ``delete_pods`` are the same machinery without the cordon and with lenient rules (mirror
and DaemonSet pods are skipped with their reason, everything else taken). ``preview`` lists what would
be evicted, skipped or refused, and tries each eviction as a server-side dry run.

Talks to Kubernetes only through ``KubeAPI``; time through the injected clock and sleep.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from engine.checkkind import FormatModel
from engine.connectors.base import PodRef
from engine.errors import ActionFailed, KubeError, NamespaceTerminating, RunbookError
from engine.facts import NodeFacts
from engine.kube_verbs.effects import (
    EffectFailed,
    KubeContext,
    PodOperation,
    PodRules,
    applies,
    cordon_patch,
    decides,
    previews,
)
from engine.kube_verbs.evict import PodSelectorSpec
from engine.kube_verbs.node_patch import q
from engine.model import Change, Duration, KubeVerbSpec, parse_duration
from engine.resources import parse_quantity

BACKOFF_START = 1.0
BACKOFF_MAX = 5.0  # kubectl drain retries a refused eviction every 5 s
WATCH_CHUNK = 15.0  # seconds per watch while waiting for the pods to be gone


class DrainSpec(FormatModel):
    """``drain: {...}``: kubectl drain's semantics (engine/kube_verbs/drain.py)."""

    ignore_daemonsets: bool = False  # skip DaemonSet-managed pods; without it they refuse the drain
    delete_emptydir_data: bool = False  # evict pods with emptyDir volumes (their data is lost)
    force: bool = False  # evict pods no controller manages (they are not recreated)
    disable_eviction: bool = False  # delete instead of evicting: bypasses PodDisruptionBudgets
    grace_period: int | None = Field(default=None, ge=0)  # seconds; the pod's own when omitted
    timeout: Duration = "300s"  # evicting (429s retried) and waiting for the pods to be gone
    selector: str | None = None  # only pods matching this label selector (kubectl --pod-selector)
    # Pods a disruption budget still refuses this long after the evictions start are deleted
    # instead (kured #303, NVSentinel's DeleteAfterTimeout), each named in the evidence. Off by default.
    delete_after: Duration | None = None

    @model_validator(mode="before")
    @classmethod
    def _true_is_defaults(cls, v: Any) -> Any:
        return {} if v is None or v is True else v

    @model_validator(mode="after")
    def _delete_after_within_timeout(self) -> DrainSpec:
        if self.delete_after is not None:
            if self.disable_eviction:
                raise ValueError("delete_after deletes pods a budget refuses; with disable_eviction nothing is evicted")
            try:
                after, timeout = parse_duration(self.delete_after), parse_duration(self.timeout)
            except ValueError:
                return self  # templated durations are checked when rendered
            if after >= timeout:
                raise ValueError(f"delete_after ({self.delete_after}) must be shorter than timeout ({self.timeout})")
        return self


class KubeDrain(KubeVerbSpec):
    KEY: ClassVar[str] = "drain"
    ORDER: ClassVar[int] = 120
    SELF_VERIFYING: ClassVar[bool] = True  # no pod it would evict is left on the node
    drain: DrainSpec = Field(default_factory=DrainSpec)


# -- deciding (pure) ------------------------------------------------------------------------------


@decides(KubeDrain)
def decide(verb: KubeDrain, node: NodeFacts) -> PodOperation:
    s = verb.drain
    rules = PodRules(selector=s.selector, cordon=True, ignore_daemonsets=s.ignore_daemonsets,
                     delete_emptydir_data=s.delete_emptydir_data, force=s.force, strict=True,
                     delete=s.disable_eviction, grace_seconds=s.grace_period, timeout=parse_duration(s.timeout),
                     delete_after=parse_duration(s.delete_after) if s.delete_after is not None else None)
    flags = [flag for flag, on in (("--ignore-daemonsets", s.ignore_daemonsets),
                                   ("--delete-emptydir-data", s.delete_emptydir_data), ("--force", s.force),
                                   ("--disable-eviction", s.disable_eviction)) if on]
    if s.grace_period is not None:
        flags.append(f"--grace-period={s.grace_period}")
    if s.selector:
        flags.append(f"--pod-selector={q(s.selector)}")
    flags.append(f"--timeout={rules.timeout:g}s")
    command = f"kubectl drain {q(node.name)} " + " ".join(flags)
    changes: tuple[Change, ...] = ()
    if not node.unschedulable:
        changes = (Change(path="node.unschedulable", before=False, after=True),)
    how = "delete" if s.disable_eviction else "evict"
    summary = (f"drain {node.name}: " + ("cordon, " if not node.unschedulable else "already cordoned, ")
               + f"{how} its pods" + (f" matching {s.selector}" if s.selector else "")
               + (", DaemonSet pods left" if s.ignore_daemonsets else "")
               + (f"; pods a budget still refuses after {rules.delete_after:g}s are DELETED"
                  if rules.delete_after is not None else ""))
    return PodOperation("drain", summary, command, rules, changes, {"node.unschedulable": node.unschedulable})


Verdict = Literal["evict", "skip", "refuse"]


@dataclass(frozen=True)
class PodDecision:
    pod: PodRef
    verdict: Verdict
    reason: str = ""


def classify(pod: PodRef, rules: PodRules) -> PodDecision:
    """What a drain does with ``pod``, and why (kubectl drain's filters, in its order)."""
    finished = pod.phase in ("Succeeded", "Failed")
    if pod.controller_kind == "DaemonSet" and not rules.daemonset_pods:
        if rules.ignore_daemonsets or not rules.strict:
            return PodDecision(pod, "skip", f"DaemonSet-managed ({pod.controller_name}): it would come back here")
        return PodDecision(pod, "refuse", f"DaemonSet-managed ({pod.controller_name}); "
                                          "set ignore_daemonsets: true to leave it")
    if pod.mirror:
        return PodDecision(pod, "skip", "mirror pod of a static pod (the kubelet owns it)")
    if not rules.strict:
        return PodDecision(pod, "evict")
    notes = []
    if pod.empty_dir and not finished:
        if not rules.delete_emptydir_data:
            return PodDecision(pod, "refuse", f"local storage (emptyDir {', '.join(pod.empty_dir)}); "
                                              "set delete_emptydir_data: true to lose it")
        notes.append(f"emptyDir {', '.join(pod.empty_dir)} deleted")
    if not pod.controller_kind and not finished:
        if not rules.force:
            return PodDecision(pod, "refuse", "not managed by a controller (it would not come back); "
                                              "set force: true to take it anyway")
        notes.append("unmanaged: it will not come back")
    if finished:
        notes.append(f"finished ({pod.phase})")
    return PodDecision(pod, "evict", "; ".join(notes))


def asked(pod: PodRef, resource: str) -> Decimal:
    """How much of ``resource`` the pod asks for: the connector already summed it the scheduler's way
    (``engine.resources.pod_spec_requests``); an unreadable quantity counts as nothing."""
    try:
        return parse_quantity(pod.requests.get(resource, "0"))
    except ValueError:
        return Decimal(0)


def select(rules: PodRules | PodSelectorSpec, pods: list[PodRef]) -> list[PodRef]:
    """The pods (already listed by node, label selector and namespace) the rules take: with ``uids``,
    only the pods with those UIDs; with ``resource``, only live pods whose containers request or limit
    a non-zero quantity of it."""
    uids = rules.uids if isinstance(rules, PodRules) else rules.uid_set()
    if uids is not None:
        pods = [p for p in pods if p.uid and p.uid in uids]
    if not rules.resource:
        return list(pods)
    return [p for p in pods if p.phase not in ("Succeeded", "Failed") and asked(p, rules.resource) > 0]


def _decisions(rules: PodRules, ctx: KubeContext) -> list[PodDecision]:
    pods = ctx.kube.list_pods(node=ctx.node, label_selector=rules.selector, namespace=rules.namespace)
    return [classify(p, rules) for p in select(rules, pods)]


def _listing(decisions: list[PodDecision]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"skipped": [], "refused": []}
    for d in decisions:
        if d.verdict == "skip":
            out["skipped"].append({"pod": d.pod.key, "reason": d.reason})
        elif d.verdict == "refuse":
            out["refused"].append({"pod": d.pod.key, "reason": d.reason})
    return out


# -- applying -------------------------------------------------------------------------------------


@applies(PodOperation)
def apply(effect: PodOperation, ctx: KubeContext) -> dict[str, Any]:
    rules = effect.rules
    kube = ctx.kube
    start = ctx.clock()
    deadline = start + rules.timeout
    evidence: dict[str, Any] = {}
    if rules.cordon:
        node = kube.read_node(ctx.node)
        if node is None:
            raise ActionFailed(f"node {ctx.node} does not exist")
        if not node.unschedulable:
            kube.patch_node(ctx.node, cordon_patch(ctx.run_id), patch_type="merge")
        evidence["cordoned"] = not node.unschedulable  # False: it already was
    decisions = _decisions(rules, ctx)
    evidence.update(_listing(decisions))
    if evidence["refused"]:
        raise EffectFailed(
            f"{effect.verb} refused: {len(evidence['refused'])} pod(s) cannot be {_past(rules)}: "
            + "; ".join(f"{r['pod']}: {r['reason']}" for r in evidence["refused"][:5]), evidence)
    todo = [d.pod for d in decisions if d.verdict == "evict"]
    if not rules.delete and todo:
        evidence["eviction_api"] = kube.eviction_version()
    evidence["pods"], evidence["evictions"] = [], []
    refusals: dict[str, int] = {}
    pending = list(todo)
    backoff = BACKOFF_START
    while pending:
        if ctx.cancel.is_set():
            raise EffectFailed(f"{effect.verb} cancelled with {len(pending)} pod(s) left", evidence)
        for pod in list(pending):
            try:
                if rules.delete:
                    kube.delete_pod(pod, grace_seconds=rules.grace_seconds)
                else:
                    kube.evict_pod(pod, grace_seconds=rules.grace_seconds)
            except NamespaceTerminating:
                if not pod.deleting:  # kubectl: retried until the timeout
                    refusals[pod.key] = refusals.get(pod.key, 0) + 1
                    ctx.progress(f"{pod.key}: eviction refused (namespace terminating), retrying")
                    continue
                # kubectl: a pod already being deleted is waited for (the eviction can never succeed)
                evidence.setdefault("namespace_terminating", []).append(pod.key)
                ctx.progress(f"{pod.key}: its namespace is terminating and the pod is being deleted: waiting")
            except KubeError as e:
                if e.status != 429:
                    evidence["failed"] = {"pod": pod.key, "error": str(e)}
                    raise EffectFailed(f"{effect.verb}: {pod.key}: {e}", evidence, outage=e.retryable) from e
                refusals[pod.key] = refusals.get(pod.key, 0) + 1
                if rules.delete_after is None or ctx.clock() - start < rules.delete_after:
                    ctx.progress(f"{pod.key}: eviction refused (429), retrying: {e}")
                    continue
                _delete_past_budget(pod, rules, ctx, evidence, refusals[pod.key], ctx.clock() - start)
            pending.remove(pod)
            evidence["pods"].append(pod.key)
            evidence["evictions"].append({"pod": pod.key, "at": round(ctx.clock() - start, 3),
                                          "refused": refusals.get(pod.key, 0)})
            ctx.progress(f"{pod.key}: {'deleted' if rules.delete else 'evicted'}")
        if pending:
            left = deadline - ctx.clock()
            if left <= 0:
                evidence["refusals"] = refusals
                raise EffectFailed(
                    f"{effect.verb} timed out after {rules.timeout:g}s: a disruption budget still refuses "
                    + ", ".join(p.key for p in pending), evidence)
            if rules.delete_after is not None and (due := start + rules.delete_after - ctx.clock()) > 0:
                left = min(left, max(due, 0.001))  # wake up when delete_after is reached
            ctx.sleep(min(backoff, left))
            backoff = min(backoff * 2, BACKOFF_MAX)
    evidence["refusals"] = refusals
    taken = [d.pod for d in decisions if d.verdict == "evict" and d.pod.key in set(evidence["pods"])]
    if taken:
        until = max(deadline, start + float(rules.grace_seconds or 0))
        left_over = taken
        while left_over:  # watched in chunks, so that a cancellation is seen within WATCH_CHUNK
            left = until - ctx.clock()
            left_over = kube.wait_for_pods_gone(left_over, min(max(left, 0.0), WATCH_CHUNK))
            if ctx.cancel.is_set() and left_over:
                raise EffectFailed(f"{effect.verb} cancelled while {len(left_over)} pod(s) terminate", evidence)
            if left <= WATCH_CHUNK:
                break
        if left_over:
            raise EffectFailed(f"{effect.verb}: {len(left_over)} pod(s) still on {ctx.node} after "
                               f"{rules.timeout:g}s: " + ", ".join(p.key for p in left_over), evidence)
    evidence["gone_after"] = round(ctx.clock() - start, 3)
    if not rules.cordon:
        return evidence  # evict/delete_pods: new pods may land on an uncordoned node
    # Verification: nothing the rules would take is left on the node (new pods included).
    still = [d.pod.key for d in _decisions(rules, ctx) if d.verdict != "skip" and not d.pod.deleting]
    if still:
        evidence["left"] = still
        raise EffectFailed(f"{effect.verb}: pods still on {ctx.node}: " + ", ".join(still[:10]), evidence)
    return evidence


def _delete_past_budget(pod: PodRef, rules: PodRules, ctx: KubeContext, evidence: dict[str, Any], refused: int,
                        elapsed: float) -> None:
    """``delete_after``: the budget still refuses ``pod``: delete it (never silently: named in the
    evidence and the progress), then it is waited for like an evicted pod."""
    try:
        ctx.kube.delete_pod(pod, grace_seconds=rules.grace_seconds)
    except KubeError as e:
        evidence["failed"] = {"pod": pod.key, "error": f"delete after budget refusals: {e}"}
        raise EffectFailed(f"drain: {pod.key}: deleting it after {elapsed:g}s of budget refusals failed: {e}",
                           evidence, outage=e.retryable) from e
    evidence.setdefault("deleted_after_budget", []).append({
        "pod": pod.key, "refused": refused, "after": round(elapsed, 3),
        "reason": f"a disruption budget refused its eviction for {rules.delete_after:g}s (delete_after): deleted"})
    ctx.progress(f"{pod.key}: DELETED: a disruption budget still refused its eviction after "
                 f"{rules.delete_after:g}s (delete_after)")


def _past(rules: PodRules) -> str:
    return "deleted" if rules.delete else "evicted"


# -- previewing -----------------------------------------------------------------------------------


@previews(PodOperation)
def preview(effect: PodOperation, ctx: KubeContext) -> str:
    """One line per pod: evicted (each tried as a server-side dry run), skipped or refused, and why."""
    rules = effect.rules
    verb = "delete" if rules.delete else "evict"
    try:
        decisions = _decisions(rules, ctx)
    except RunbookError as e:
        return f"server dry-run unavailable: {e}"
    lines = []
    if rules.cordon:
        lines.append(f"{'cordon ' + ctx.node if effect.changes else ctx.node + ' already cordoned'}")
    refused = [d for d in decisions if d.verdict == "refuse"]
    for d in decisions:
        if d.verdict == "skip":
            lines.append(f"skip {d.pod.key}: {d.reason}")
        elif d.verdict == "refuse":
            lines.append(f"REFUSED {d.pod.key}: {d.reason}")
        elif refused:
            lines.append(f"not tried {d.pod.key}: the {effect.verb} is refused")
        else:
            try:
                if rules.delete:
                    ctx.kube.delete_pod(d.pod, dry_run=True, grace_seconds=rules.grace_seconds)
                else:
                    ctx.kube.evict_pod(d.pod, dry_run=True, grace_seconds=rules.grace_seconds)
                lines.append(f"server dry-run accepted: {verb} {d.pod.key}" + (f" ({d.reason})" if d.reason else ""))
            except RunbookError as e:
                lines.append(f"server dry-run REJECTED: {verb} {d.pod.key}: {e}")
    if not any(d.verdict == "evict" for d in decisions):
        lines.append(f"server dry-run: no pod to {verb} now ({effect.summary})")
    return "\n".join(lines)
