"""The guards every run obeys, whatever started it: one call per node, one verdict per guard.

Guards look at the *cluster around* a node, not at the node's own symptoms (those are the
runbook's preconditions). Each guard gives a ``GuardVerdict``; a run may start on a node only when
no verdict ``blocks``. The guards, by name:

* ``exclusion``: the node carries an exclusion label (ours ``runbook.io/exclude=true``, Medik8s'
  ``remediation.medik8s.io/exclude-from-remediation=true``; configurable).
* ``kured-lock``: kured's reboot lock (the ``weave.works/kured-node-lock`` annotation of its
  DaemonSet, single or multi-owner form, TTL honoured) names the node: kured is rebooting it.
* ``nhc-pause``: a Medik8s NodeHealthCheck (``remediation.medik8s.io/v1alpha1``) whose
  ``spec.selector`` selects the node has non-empty ``spec.pauseRequests``. Checked only when API
  discovery shows that resource; a cluster without it has no pause.
* ``medik8s-lease``: the Medik8s node Lease (``coordination.k8s.io`` Lease ``node-<node>`` in
  ``medik8s-leases``, or the namespace in ``LEASE_NAMESPACE``) is held by another remediator
  (NodeHealthCheck, Node Maintenance Operator) that has not let it expire. A run started through
  runbook's own remediation template is the exception: NHC holds that Lease *for* it.
* ``nvsentinel``: NVIDIA NVSentinel quarantines the node (its state label
  ``dgxc.nvidia.com/nvsentinel-state`` present with a state other than done, or its cordon-by label
  naming NVSentinel): NVSentinel's own break-fix flow owns the node until a person overrides.
* ``gpu-budget``: the GPUs already out of service (on nodes that are cordoned or not Ready, and on
  the nodes the same fleet remediates now) plus this node's GPUs would exceed the maximum (a count
  and/or a percent of all the cluster's GPUs). A node already out of service adds nothing: recovering
  it takes no capacity away, so the budget never stands between an incident and its recovery.
* ``unhealthy-capacity``: more nodes (or GPUs on nodes) not Ready than the configured threshold
  (off by default for people; ``runbook serve`` turns its automatic runs into approve-mode runs with
  the same count, see ``engine.serve.guards``).

A guard that cannot be evaluated (an API error, an unreadable lock, an unknown selector operator, a
resource that vanished between discovery and list) **blocks**: guards fail closed. A person may pass
one named guard deliberately (``overrides``: name -> reason); the verdict then records who and why,
and the caller journals it. The server's automatic runs never pass overrides.

This module reads the cluster through ``KubeAPI`` and decides; it never writes, never plans and
never acts. Its configuration is one frozen value, ``GuardConfig``, read from the ``guards:`` section
of a YAML file (``load_guard_config``) or embedded in ``runbook serve``'s configuration.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.configfile import read_mapping
from engine.connectors.base import KubeAPI, LeaseRecord
from engine.errors import KubeError, UsageError
from engine.facts import NodeFacts

GuardName = Literal["exclusion", "kured-lock", "nhc-pause", "medik8s-lease", "nvsentinel", "gpu-budget",
                    "unhealthy-capacity", "window", "concurrency"]
GUARD_NAMES: tuple[GuardName, ...] = ("exclusion", "kured-lock", "nhc-pause", "medik8s-lease", "nvsentinel",
                                      "gpu-budget", "unhealthy-capacity")
# ``window``: the runbook's maintenance windows (engine.run_windows), judged by the run service;
# ``concurrency``: runs in flight in the whole cluster, judged with the GPU budget when the run claims
# its place in the cluster's budget (engine.budget)
OVERRIDABLE: tuple[GuardName, ...] = (*GUARD_NAMES, "window", "concurrency")

EXCLUDE_LABEL = "runbook.io/exclude"  # ours: `runbook.io/exclude=true` keeps every runbook run off a node
MEDIK8S_EXCLUDE_LABEL = "remediation.medik8s.io/exclude-from-remediation"
KURED_LOCK_ANNOTATION = "weave.works/kured-node-lock"
NHC_API_VERSION = "remediation.medik8s.io/v1alpha1"
NHC_PLURAL = "nodehealthchecks"
# The ``source`` of a run started through runbook's remediation template (``engine.serve.remediator``):
# NodeHealthCheck holds the node's Medik8s Lease for such a run, so that Lease does not stop it.
REMEDIATION_SOURCE = "remediation"
MEDIK8S_LEASE_NAMESPACE = "medik8s-leases"  # medik8s/common's default; LEASE_NAMESPACE overrides it
NVSENTINEL_STATE_LABEL = "dgxc.nvidia.com/nvsentinel-state"
NVSENTINEL_CORDON_BY_LABEL = "k8saas.nvidia.com/cordon-by"  # NVSentinel's default label prefix + cordon-by


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class KuredConfig(_Section):
    enabled: bool = True
    namespace: str = "kube-system"
    daemonset: str = "kured"
    annotation: str = KURED_LOCK_ANNOTATION


class ExclusionConfig(_Section):
    """Exclusion labels (label -> value that excludes, compared case-insensitively) and kured's lock."""

    labels: dict[str, str] = Field(default_factory=lambda: {
        EXCLUDE_LABEL: "true", MEDIK8S_EXCLUDE_LABEL: "true"})
    kured: KuredConfig = Field(default_factory=KuredConfig)


class Medik8sLeaseConfig(_Section):
    """The Medik8s node Lease other remediators (NHC, Node Maintenance Operator) hold while they act."""

    enabled: bool = True
    namespace: str | None = None  # None: env LEASE_NAMESPACE, else medik8s-leases


class NvSentinelConfig(_Section):
    """NVIDIA NVSentinel's quarantine, read from the node's labels."""

    enabled: bool = True
    state_label: str = NVSENTINEL_STATE_LABEL
    done_states: tuple[str, ...] = ("remediation-succeeded",)  # the state label may stay with these
    cordon_by_labels: tuple[str, ...] = (NVSENTINEL_CORDON_BY_LABEL,)  # a value naming NVSentinel blocks


class GpuBudget(_Section):
    """At most ``max_gpus`` GPUs and/or ``max_percent`` % of the cluster's GPUs out of service."""

    max_gpus: int | None = Field(default=None, ge=0)
    max_percent: float | None = Field(default=50.0, ge=0, le=100)


class Concurrency(_Section):
    """At most ``max_runs`` runs in flight at once in the whole cluster (every replica of
    ``runbook serve``, every CLI run), counted from the cluster's budget claims (``engine.budget``)."""

    max_runs: int | None = Field(default=None, ge=1)


class UnhealthyCapacity(_Section):
    """Refuse every run while more than this many nodes (or GPUs on such nodes) are not Ready."""

    max_unhealthy_nodes: int | None = Field(default=None, ge=0)
    max_unhealthy_gpus: int | None = Field(default=None, ge=0)


class GuardConfig(ExclusionConfig):
    """Everything the run guards need: ``labels`` and ``kured`` (the exclusions) plus the rest.

    Defaults: both exclusion labels, kured's lock read from ``kube-system/kured``, NodeHealthCheck
    pause honoured, at most 50 % of the cluster's GPUs out of service, no unhealthy-capacity stop."""

    nhc_pause: bool = True
    medik8s_lease: Medik8sLeaseConfig = Field(default_factory=Medik8sLeaseConfig)
    nvsentinel: NvSentinelConfig = Field(default_factory=NvSentinelConfig)
    gpu_budget: GpuBudget = Field(default_factory=GpuBudget)
    concurrency: Concurrency = Field(default_factory=Concurrency)
    unhealthy_capacity: UnhealthyCapacity = Field(default_factory=UnhealthyCapacity)
    # runbook serve's queued runs: how long (seconds) one whose turn comes while the cluster's budget
    # (gpu_budget, concurrency) has no room waits, pending, for room before it ends blocked (0: it does not wait)
    budget_wait: float = Field(default=600.0, ge=0, le=86400)


def guard_config_from(data: Any, where: str = "guards") -> GuardConfig:
    """A ``guards:`` mapping (None: the defaults) -> ``GuardConfig``; ``UsageError`` naming ``where``."""
    if data is None:
        return GuardConfig()
    if not isinstance(data, Mapping):
        raise UsageError(f"{where}: the guards configuration must be a mapping")
    try:
        return GuardConfig.model_validate(dict(data))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
                             for err in e.errors()[:10])
        raise UsageError(f"{where}: invalid guards configuration: {problems}") from e


def load_guard_config(path: Path | str | None) -> GuardConfig:
    """The ``guards:`` section of a YAML file (other top-level keys are left to their owners)."""
    if path is None:
        return GuardConfig()
    raw = read_mapping(path, "the guards configuration")
    return guard_config_from(raw.get("guards"), f"{path}: guards")


def check_overrides(overrides: Mapping[str, str]) -> None:
    """``UsageError`` for an unknown guard name or an override without a reason."""
    for name, reason in overrides.items():
        if name not in OVERRIDABLE:
            raise UsageError(f"--override-guard {name}: no such guard (one of {', '.join(OVERRIDABLE)})")
        if not reason or not reason.strip():
            raise UsageError(f"--override-guard {name}: give the reason (--reason TEXT)")


# ------------------------------------------------------------------------------------------------
# Verdicts
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Override:
    """A person passed a guard on purpose."""

    by: str
    reason: str


@dataclass(frozen=True)
class GuardVerdict:
    """One guard's answer for one node.

    ``holds`` is the guard's own finding; ``blocks`` is what the run path obeys (False when it holds
    or when a person overrode it). ``evaluated`` is False when the guard could not read what it
    needs (then it does not hold). ``transient`` says whether the reason passes by itself (a lock,
    the budget) or lasts until someone acts (a label)."""

    name: GuardName
    holds: bool
    reason: str
    evaluated: bool = True
    transient: bool = False
    overridden: Override | None = None

    @property
    def blocks(self) -> bool:
        return not self.holds and self.overridden is None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"guard": self.name, "holds": self.holds, "blocks": self.blocks,
                               "reason": self.reason}
        if not self.evaluated:
            out["evaluated"] = False
        if self.overridden is not None:
            out["overridden"] = {"by": self.overridden.by, "reason": self.overridden.reason}
        return out


def blocking(verdicts: Iterable[GuardVerdict]) -> list[GuardVerdict]:
    """The verdicts that stop the run (empty: the node may be remediated)."""
    return [v for v in verdicts if v.blocks]


def overridden(verdicts: Iterable[GuardVerdict]) -> list[GuardVerdict]:
    """The verdicts a person passed on purpose: the run journals each (guard, reason, by, why)."""
    return [v for v in verdicts if v.overridden is not None]


def block_reason(verdicts: Iterable[GuardVerdict]) -> str | None:
    """One line for a blocked node (``guard NAME: reason; ...``), or None when nothing blocks."""
    blocks = blocking(verdicts)
    return "; ".join(f"guard {v.name}: {v.reason}" for v in blocks) if blocks else None


# ------------------------------------------------------------------------------------------------
# Reading the cluster
# ------------------------------------------------------------------------------------------------


def _int(value: Any) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def gpu_count(node: NodeFacts) -> int:
    """GPUs a node carries: GPU Feature Discovery's ``nvidia.com/gpu.count`` label, else the
    ``nvidia.com/gpu`` capacity, else the sum of other ``nvidia.com/*`` capacities (passthrough)."""
    label = _int(node.labels.get("nvidia.com/gpu.count"))
    if label:
        return label
    cap = _int(node.capacity.get("nvidia.com/gpu"))
    if cap:
        return cap
    return sum(_int(v) for k, v in node.capacity.items() if k.startswith("nvidia.com/"))


def out_of_service(node: NodeFacts) -> bool:
    """Cordoned or not Ready: its GPUs serve nobody now."""
    return node.unschedulable or not node.ready


def exclusion_reason(node: NodeFacts, labels: Mapping[str, str]) -> str | None:
    for key, value in labels.items():
        actual = node.labels.get(key)
        if actual is not None and actual.strip().lower() == value.lower():
            return f"node {node.name} is excluded from remediation by label {key}={actual}"
    return None


def _parse_go_time(text: str) -> float:
    # Go writes RFC 3339 with up to 9 fractional digits; Python reads at most 6.
    if "." in text:
        head, _, tail = text.partition(".")
        digits = "".join(c for c in tail if c.isdigit())
        zone = tail[len(digits):]
        text = f"{head}.{digits[:6]}{zone}"
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def kured_locks(value: str, now: float) -> dict[str, str]:
    """Nodes named by a live kured lock annotation (single or multi-owner); ValueError if unreadable."""
    data = json.loads(value)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    entries = data.get("locks", [data])
    if not isinstance(entries, list):
        raise ValueError("'locks' is not a list")
    out: dict[str, str] = {}
    for entry in entries or ():
        node = entry.get("nodeID") if isinstance(entry, dict) else None
        if not isinstance(node, str) or not node:
            raise ValueError("a lock without nodeID")
        ttl_ns = _int(entry.get("TTL"))
        created = entry.get("created")
        if ttl_ns > 0 and isinstance(created, str) and now - _parse_go_time(created) >= ttl_ns / 1e9:
            continue  # expired: kured itself would take it over
        out[node] = f"kured holds its reboot lock for node {node} (since {created or 'unknown'})"
    return out


class GuardUnreadable(Exception):
    """What a guard needs could not be read or understood: the guard blocks."""


def read_kured_locks(kube: KubeAPI, cfg: KuredConfig, now: float) -> dict[str, str]:
    """node -> lock description; ``GuardUnreadable`` for a lock that cannot be understood.
    ``KubeError`` passes through (the caller decides what an API error means)."""
    if not cfg.enabled:
        return {}
    for ds in kube.list_objects("apps/v1", "daemonsets", namespace=cfg.namespace):
        meta = ds.get("metadata") or {}
        if meta.get("name") != cfg.daemonset:
            continue
        value = (meta.get("annotations") or {}).get(cfg.annotation)
        if not value:
            return {}
        try:
            return kured_locks(value, now)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise GuardUnreadable(
                f"cannot read kured's lock ({cfg.namespace}/{cfg.daemonset} {cfg.annotation}): {e}") from e
    return {}  # no kured installed: no lock


def selector_matches(selector: Any, labels: Mapping[str, str]) -> bool:
    """A ``metav1.LabelSelector`` (matchLabels, matchExpressions) against labels, as Kubernetes
    evaluates it (an empty selector selects everything); ``ValueError`` for one we cannot read."""
    if selector is None:
        selector = {}
    if not isinstance(selector, Mapping):
        raise ValueError(f"selector is not a mapping: {selector!r}")
    match_labels = selector.get("matchLabels") or {}
    if not isinstance(match_labels, Mapping):
        raise ValueError("matchLabels is not a mapping")
    for key, value in match_labels.items():
        if labels.get(str(key)) != str(value):
            return False
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise ValueError("matchExpressions is not a list")
    for expr in expressions:
        if not isinstance(expr, Mapping) or not isinstance(expr.get("key"), str):
            raise ValueError(f"matchExpressions entry without a key: {expr!r}")
        key, op, values = expr["key"], expr.get("operator"), expr.get("values") or []
        if not isinstance(values, list):
            raise ValueError(f"matchExpressions {key}: values is not a list")
        values = [str(v) for v in values]
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = labels.get(key) not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise ValueError(f"matchExpressions {key}: unknown operator {op!r}")
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class NhcPause:
    """A NodeHealthCheck with pause requests, and its selector."""

    name: str
    selector: Mapping[str, Any]
    pause_requests: tuple[str, ...]


def read_nhc_pauses(kube: KubeAPI) -> tuple[NhcPause, ...] | None:
    """Paused NodeHealthChecks; None when the cluster serves no NodeHealthCheck resource.
    ``GuardUnreadable`` when it is served but cannot be listed or read."""
    served = kube.served_resources(NHC_API_VERSION)
    if served is None or NHC_PLURAL not in served:
        return None
    try:
        items = kube.list_objects(NHC_API_VERSION, NHC_PLURAL)
    except KubeError as e:
        raise GuardUnreadable(f"NodeHealthCheck is served but cannot be listed: {e}") from e
    out: list[NhcPause] = []
    for item in items:
        name = str((item.get("metadata") or {}).get("name") or "?")
        spec = item.get("spec") or {}
        if not isinstance(spec, Mapping):
            raise GuardUnreadable(f"NodeHealthCheck {name}: spec is not a mapping")
        pauses = spec.get("pauseRequests") or []
        if not isinstance(pauses, list):
            raise GuardUnreadable(f"NodeHealthCheck {name}: spec.pauseRequests is not a list")
        if pauses:
            selector = spec.get("selector") or {}
            out.append(NhcPause(name, selector if isinstance(selector, Mapping) else {"?": selector},
                                tuple(str(p) for p in pauses)))
    return tuple(out)


def medik8s_lease_namespace(config: Medik8sLeaseConfig, env: Mapping[str, str] | None = None) -> str:
    """Where Medik8s keeps its node Leases: the configured namespace, else ``LEASE_NAMESPACE`` (the
    variable medik8s/common's lease manager reads), else ``medik8s-leases``."""
    env = os.environ if env is None else env
    return config.namespace or env.get("LEASE_NAMESPACE", "").strip() or MEDIK8S_LEASE_NAMESPACE


def medik8s_lease_name(node: str) -> str:
    return f"node-{node}"


def read_medik8s_leases(kube: KubeAPI, config: Medik8sLeaseConfig,
                        nodes: Iterable[str]) -> dict[str, LeaseRecord | GuardUnreadable | None]:
    """Each node's Medik8s Lease (None: there is none); an unreadable one is ``GuardUnreadable``."""
    namespace = medik8s_lease_namespace(config)
    out: dict[str, LeaseRecord | GuardUnreadable | None] = {}
    for node in dict.fromkeys(nodes):
        try:
            out[node] = kube.read_lease(namespace, medik8s_lease_name(node))
        except Exception as e:  # KubeError, RBAC, a connector that cannot be built: fail closed
            out[node] = GuardUnreadable(f"cannot read Lease {namespace}/{medik8s_lease_name(node)}: {e}")
    return out


@dataclass(frozen=True)
class GuardFacts:
    """One read of what the guards look at. Each field is a value or the ``GuardUnreadable`` that
    stood in its way; ``read_guard_facts`` never raises."""

    nodes: tuple[NodeFacts, ...] | GuardUnreadable
    kured: Mapping[str, str] | GuardUnreadable = field(default_factory=dict)
    nhc: tuple[NhcPause, ...] | GuardUnreadable | None = None
    taken_at: float = 0.0
    medik8s: Mapping[str, LeaseRecord | GuardUnreadable | None] = field(default_factory=dict)


def read_guard_facts(kube: KubeAPI, config: GuardConfig, *, now: float | None = None,
                     lease_nodes: Sequence[str] = ()) -> GuardFacts:
    """Nodes, kured's lock, paused NodeHealthChecks and the Medik8s Leases of ``lease_nodes`` (the nodes
    about to be judged): 1 to 4 API calls plus one per node."""
    now = time.time() if now is None else now

    def attempt(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except GuardUnreadable as e:
            return e
        except KubeError as e:
            return GuardUnreadable(f"cannot read {what}: {e}")
        except Exception as e:  # a connector that cannot even be built or a malformed answer
            return GuardUnreadable(f"cannot read {what}: {type(e).__name__}: {e}")

    nodes = attempt("the nodes", lambda: tuple(kube.list_nodes()))
    kured = attempt("kured's lock", lambda: read_kured_locks(kube, config.kured, now))
    nhc = attempt("NodeHealthChecks", lambda: read_nhc_pauses(kube)) if config.nhc_pause else None
    leases = read_medik8s_leases(kube, config.medik8s_lease, lease_nodes) if config.medik8s_lease.enabled else {}
    return GuardFacts(nodes=nodes, kured=kured, nhc=nhc, taken_at=now, medik8s=leases)


# ------------------------------------------------------------------------------------------------
# Judging
# ------------------------------------------------------------------------------------------------


def _unreadable(name: GuardName, error: GuardUnreadable) -> GuardVerdict:
    return GuardVerdict(name, False, f"guard {name} cannot be evaluated, so it blocks: {error}",
                        evaluated=False, transient=True)


def _exclusion(node: NodeFacts, config: GuardConfig) -> GuardVerdict:
    why = exclusion_reason(node, config.labels)
    if why is not None:
        return GuardVerdict("exclusion", False, why)
    return GuardVerdict("exclusion", True, f"node {node.name} carries no exclusion label")


def _kured(node: str, config: GuardConfig, locks: Mapping[str, str]) -> GuardVerdict:
    if not config.kured.enabled:
        return GuardVerdict("kured-lock", True, "kured's lock is not checked (guards.kured.enabled: false)")
    if node in locks:
        return GuardVerdict("kured-lock", False, locks[node], transient=True)
    return GuardVerdict("kured-lock", True, f"kured's lock does not name node {node}")


def _nhc(node: NodeFacts, pauses: tuple[NhcPause, ...] | None) -> GuardVerdict:
    if pauses is None:
        return GuardVerdict("nhc-pause", True, "no NodeHealthCheck resource in this cluster")
    for p in pauses:
        try:
            selected = selector_matches(p.selector, node.labels)
        except ValueError as e:
            return _unreadable("nhc-pause", GuardUnreadable(f"NodeHealthCheck {p.name}: spec.selector: {e}"))
        if selected:
            return GuardVerdict(
                "nhc-pause", False,
                f"NodeHealthCheck {p.name} selects node {node.name} and is paused "
                f"(spec.pauseRequests: {', '.join(p.pause_requests)})", transient=True)
    return GuardVerdict("nhc-pause", True, f"no paused NodeHealthCheck selects node {node.name}")


def _medik8s_lease(node: str, config: Medik8sLeaseConfig, facts: GuardFacts,
                   through_template: bool) -> GuardVerdict:
    name = f"{medik8s_lease_namespace(config)}/{medik8s_lease_name(node)}"
    if not config.enabled:
        return GuardVerdict("medik8s-lease", True, "the Medik8s node Lease is not checked "
                            "(guards.medik8s_lease.enabled: false)")
    if node not in facts.medik8s:
        return _unreadable("medik8s-lease", GuardUnreadable(f"Lease {name} was not read"))
    lease = facts.medik8s[node]
    if isinstance(lease, GuardUnreadable):
        return _unreadable("medik8s-lease", lease)
    if lease is None or not lease.holder:
        return GuardVerdict("medik8s-lease", True, f"no remediator holds Lease {name}")
    expires = lease.renew_time + lease.duration_seconds if lease.renew_time and lease.duration_seconds else None
    if expires is not None and expires <= facts.taken_at:
        return GuardVerdict("medik8s-lease", True, f"Lease {name} of {lease.holder} expired "
                            f"{facts.taken_at - expires:.0f}s ago")
    if through_template:
        return GuardVerdict("medik8s-lease", True, f"Lease {name} is held by {lease.holder} for this run: "
                            "it was started through runbook's remediation template")
    return GuardVerdict("medik8s-lease", False, f"Lease {name} is held by {lease.holder}: another remediator "
                        "(NodeHealthCheck, Node Maintenance Operator) is working on node " + node, transient=True)


def nvsentinel_quarantine(node: NodeFacts, config: NvSentinelConfig) -> str | None:
    """Why NVSentinel owns the node now (its state label, or its cordon-by label), or None."""
    state = node.labels.get(config.state_label)
    if state is not None and state.strip() not in config.done_states:
        return f"node {node.name} is quarantined by NVIDIA NVSentinel ({config.state_label}={state})"
    for label in config.cordon_by_labels:
        value = node.labels.get(label, "")
        if "nvsentinel" in value.lower():
            return f"node {node.name} was cordoned by NVIDIA NVSentinel ({label}={value})"
    return None


def _nvsentinel(node: NodeFacts, config: NvSentinelConfig) -> GuardVerdict:
    if not config.enabled:
        return GuardVerdict("nvsentinel", True, "NVSentinel's quarantine is not checked "
                            "(guards.nvsentinel.enabled: false)")
    why = nvsentinel_quarantine(node, config)
    if why is not None:
        return GuardVerdict("nvsentinel", False, why + "; its break-fix flow owns the node "
                            "(--override-guard nvsentinel to act anyway)")
    return GuardVerdict("nvsentinel", True, f"NVSentinel does not quarantine node {node.name}")


def _gpu_budget(node: NodeFacts, nodes: Sequence[NodeFacts], in_flight: Sequence[str],
                budget: GpuBudget) -> GuardVerdict:
    if budget.max_gpus is None and budget.max_percent is None:
        return GuardVerdict("gpu-budget", True, "no GPU budget is configured")
    mine = gpu_count(node)
    if out_of_service(node):
        state = "cordoned" if node.unschedulable else "not Ready"
        return GuardVerdict("gpu-budget", True, f"node {node.name} is already out of service ({state}): "
                            f"remediating it takes no GPUs away")
    if mine == 0:
        return GuardVerdict("gpu-budget", True, f"node {node.name} advertises no GPUs")
    flying = set(in_flight) - {node.name}
    total = sum(gpu_count(n) for n in nodes)
    down = [n for n in nodes if n.name != node.name and (out_of_service(n) or n.name in flying)]
    down_gpus = sum(gpu_count(n) for n in down)
    after = down_gpus + mine
    limits: list[str] = []
    if budget.max_gpus is not None:
        limits.append(f"{budget.max_gpus} GPUs")
    if budget.max_percent is not None:
        limits.append(f"{budget.max_percent:g}% of the cluster's {total} GPUs")
    over = ((budget.max_gpus is not None and after > budget.max_gpus)
            or (budget.max_percent is not None and after * 100 > budget.max_percent * total))
    detail = (f"{down_gpus} GPUs out of service (cordoned, not Ready or remediated by this fleet"
              f"{': ' + ', '.join(sorted(n.name for n in down)[:10]) if down else ''}) "
              f"+ {mine} on node {node.name} = {after}; the budget is at most {' and '.join(limits)}")
    if over:
        return GuardVerdict("gpu-budget", False, f"GPU budget exceeded: {detail}", transient=True)
    return GuardVerdict("gpu-budget", True, detail)


def gpu_budget_verdict(node: NodeFacts, nodes: Sequence[NodeFacts], in_flight: Sequence[str],
                       budget: GpuBudget) -> GuardVerdict:
    """The ``gpu-budget`` verdict for ``node`` with ``in_flight`` (nodes remediated now, anywhere)
    counted out of service: what a budget claim (``engine.budget``) decides with."""
    return _gpu_budget(node, nodes, in_flight, budget)


def unhealthy(nodes: Iterable[NodeFacts]) -> tuple[list[str], int]:
    """Names of the nodes that are not Ready (sorted) and the GPUs they carry."""
    sick = [n for n in nodes if not n.ready]
    return sorted(n.name for n in sick), sum(gpu_count(n) for n in sick)


def _unhealthy_capacity(nodes: Sequence[NodeFacts], cfg: UnhealthyCapacity) -> GuardVerdict:
    if cfg.max_unhealthy_nodes is None and cfg.max_unhealthy_gpus is None:
        return GuardVerdict("unhealthy-capacity", True, "no unhealthy-capacity threshold is configured")
    names, gpus = unhealthy(nodes)
    shown = ", ".join(names[:10])
    if cfg.max_unhealthy_nodes is not None and len(names) > cfg.max_unhealthy_nodes:
        return GuardVerdict("unhealthy-capacity", False,
                            f"{len(names)} of {len(nodes)} nodes are not Ready ({shown}); runs stop above "
                            f"{cfg.max_unhealthy_nodes}: a bigger outage, a person decides", transient=True)
    if cfg.max_unhealthy_gpus is not None and gpus > cfg.max_unhealthy_gpus:
        return GuardVerdict("unhealthy-capacity", False,
                            f"{gpus} GPUs are on nodes that are not Ready ({shown}); runs stop above "
                            f"{cfg.max_unhealthy_gpus}", transient=True)
    return GuardVerdict("unhealthy-capacity", True, f"{len(names)} of {len(nodes)} nodes are not Ready")


def judge(facts: GuardFacts, node: str, config: GuardConfig, *, overrides: Mapping[str, str] | None = None,
          in_flight: Sequence[str] = (), actor: str = "", through_template: bool = False) -> list[GuardVerdict]:
    """Every guard's verdict for ``node`` from one read of the cluster, overrides applied.

    ``in_flight``: nodes the same fleet remediates now (counted against the GPU budget).
    ``through_template``: the run was started through runbook's remediation template (NHC holds the
    node's Medik8s Lease for it).
    ``overrides``: guard name -> reason, by ``actor``; ``UsageError`` for an unknown name."""
    overrides = dict(overrides or {})
    check_overrides(overrides)
    verdicts: list[GuardVerdict] = []
    target: NodeFacts | None = None
    if isinstance(facts.nodes, GuardUnreadable):
        node_error: GuardUnreadable | None = facts.nodes
    else:
        target = next((n for n in facts.nodes if n.name == node), None)
        node_error = None if target is not None else GuardUnreadable(f"node {node} is not in the cluster")
    if target is None:
        assert node_error is not None
        verdicts.append(_unreadable("exclusion", node_error))
    else:
        verdicts.append(_exclusion(target, config))
    verdicts.append(_unreadable("kured-lock", facts.kured) if isinstance(facts.kured, GuardUnreadable)
                    else _kured(node, config, facts.kured))
    if not config.nhc_pause:
        verdicts.append(GuardVerdict("nhc-pause", True, "NodeHealthCheck pause is not checked "
                                     "(guards.nhc_pause: false)"))
    elif isinstance(facts.nhc, GuardUnreadable):
        verdicts.append(_unreadable("nhc-pause", facts.nhc))
    elif target is None:
        assert node_error is not None
        verdicts.append(_unreadable("nhc-pause", node_error))
    else:
        verdicts.append(_nhc(target, facts.nhc))
    verdicts.append(_medik8s_lease(node, config.medik8s_lease, facts, through_template))
    if target is None:
        assert node_error is not None
        verdicts.append(_unreadable("nvsentinel", node_error))
    else:
        verdicts.append(_nvsentinel(target, config.nvsentinel))
    if target is None or isinstance(facts.nodes, GuardUnreadable):
        assert node_error is not None
        verdicts.append(_unreadable("gpu-budget", node_error))
    else:
        verdicts.append(_gpu_budget(target, facts.nodes, in_flight, config.gpu_budget))
    if isinstance(facts.nodes, GuardUnreadable):
        verdicts.append(_unreadable("unhealthy-capacity", facts.nodes))
    else:
        verdicts.append(_unhealthy_capacity(facts.nodes, config.unhealthy_capacity))
    who = actor or "unknown"
    return [GuardVerdict(v.name, v.holds, v.reason, v.evaluated, v.transient,
                         Override(who, overrides[v.name].strip()))
            if v.name in overrides and not v.holds else v for v in verdicts]


def evaluate_run_guards(kube: KubeAPI, node: str, config: GuardConfig, *,
                        overrides: Mapping[str, str] | None = None, in_flight: Sequence[str] = (),
                        actor: str = "", now: float | None = None,
                        through_template: bool = False) -> list[GuardVerdict]:
    """Read the cluster and judge ``node``: one verdict per guard, in ``GUARD_NAMES`` order.

    Never raises for the cluster's state (an unreadable guard blocks); ``UsageError`` for an
    override naming no guard. For a fleet, pass the nodes already being remediated as
    ``in_flight``; to judge many nodes from one read use ``read_guard_facts`` + ``judge``."""
    check_overrides(dict(overrides or {}))
    return judge(read_guard_facts(kube, config, now=now, lease_nodes=[node]), node, config, overrides=overrides,
                 in_flight=in_flight, actor=actor, through_template=through_template)
