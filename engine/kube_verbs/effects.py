"""What a kube verb does, as one of four closed variants; what applying one may use; the registries.

A kube verb (a ``engine.model.KubeVerbSpec`` defined in its module) decided against the node's facts
(``decide`` in the verb's module) is a ``NoOp`` with its reason or one of:

* ``NodePatch``: a patch of the Node object (label, unlabel, annotate, cordon, uncordon, taint,
  untaint, patch). Applied with ``KubeAPI.patch_node``, previewed with the same patch as a server-side
  dry run (``node_patch``).
* ``PodOperation``: evictions or deletions of the node's pods (evict, delete_pods, drain), each with
  kubectl drain's rules (``drain``).
* ``Wait``: a condition (a check) waited for with a timeout, or the old fixed pause (``wait``).
* ``BootstrapOperation``: a kubelet's TLS bootstrap, API side (``node_bootstrap``).

The registries: ``@decides(Spec, ...)`` is a verb module's one registration (its specs become verbs
of the format, ``engine.model.kube_verb``, and the decorated function decides them);
``@applies(Variant)`` and ``@previews(Variant)`` register the apply and preview of an effect
variant in the module that carries it out. Pure data otherwise; no I/O here. ``KubeContext`` is what
an effect's ``apply`` is handed by the executor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from engine.connectors.base import KubeAPI
from engine.errors import ActionFailed
from engine.facts import NodeFacts
from engine.model import Change, KubeVerbSpec, kube_verb

# Every cordon runbook makes carries the run that made it; runbook uncordons only nodes that carry it
# (a node cordoned by a person, NVSentinel or another controller stays cordoned).
CORDONED_BY_ANNOTATION = "runbook.io/cordoned-by"


def cordon_patch(run_id: str) -> dict[str, Any]:
    """The merge patch of a cordon by run ``run_id``: unschedulable, and the annotation naming the run."""
    return {"metadata": {"annotations": {CORDONED_BY_ANNOTATION: run_id or "runbook"}},
            "spec": {"unschedulable": True}}


class EffectFailed(ActionFailed):
    """An effect that could not finish (refused pods, a budget refusing until the timeout, pods that
    did not go, a condition that did not come): the evidence gathered so far goes with it."""

    def __init__(self, message: str, evidence: Mapping[str, Any] | None = None, *, outage: bool = False,
                 refused: bool = False) -> None:
        super().__init__(message)
        self.evidence = dict(evidence or {})
        self.outage = outage
        # refused: the effect found the cluster unfit and undid what it had begun (a bootstrap token
        # the API server does not authenticate, deleted again): the step is blocked, not failed
        self.refused = refused


@dataclass(frozen=True)
class NoOp:
    """Nothing to do, and why."""

    reason: str
    command: str = ""
    reads: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodePatch:
    """A change to the Node object through one PATCH."""

    verb: str
    summary: str  # "label k: vm-passthrough -> container"
    command: str  # the equivalent kubectl line
    patch: Any  # the body: a mapping (merge/strategic) or a list of operations (json)
    patch_type: Literal["merge", "strategic", "json"] = "merge"
    changes: tuple[Change, ...] = ()
    reads: Mapping[str, Any] = field(default_factory=dict)  # before-values the decision read


@dataclass(frozen=True)
class PodRules:
    """Which pods of the node a pod operation takes, and how (kubectl drain's options)."""

    selector: str | None = None
    namespace: str | None = None
    resource: str | None = None  # only pods asking for this resource (evict/delete_pods)
    delete: bool = False  # delete instead of evicting
    cordon: bool = False  # cordon the node first (drain)
    ignore_daemonsets: bool = False
    delete_emptydir_data: bool = False
    force: bool = False
    strict: bool = False  # drain: DaemonSet, emptyDir and unmanaged pods refuse the whole operation
    grace_seconds: int | None = None
    timeout: float = 300.0
    delete_after: float | None = None  # drain: delete the pods a budget still refuses after this long
    daemonset_pods: bool = False  # evict/delete_pods: take DaemonSet pods too (restart an operand)
    uids: tuple[str, ...] | None = None  # evict/delete_pods: only the pods with these UIDs (None: any)


@dataclass(frozen=True)
class PodOperation:
    """Evictions (or deletions) of pods on the node, waited for until they are gone."""

    verb: str  # evict | delete_pods | drain
    summary: str
    command: str
    rules: PodRules
    changes: tuple[Change, ...] = ()  # drain: node.unschedulable -> True
    reads: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Wait:
    """Wait until ``until`` holds (at most ``timeout`` seconds), or pause ``seconds``."""

    verb: str
    summary: str
    command: str
    until: Any = None  # a bound check
    timeout: float = 0.0
    seconds: float | None = None
    changes: tuple[Change, ...] = ()
    reads: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BootstrapOperation:
    """A kubelet's TLS bootstrap, API side (``node_bootstrap``): a bootstrap token created (and proved
    to authenticate), the node's CSR approved after its check, or the node's tokens deleted."""

    verb: str  # bootstrap_token | approve_node_csr | delete_bootstrap_tokens
    summary: str
    command: str
    ttl: float = 0.0  # bootstrap_token: seconds until the token expires
    group: str = ""  # bootstrap_token: its extra group
    timeout: float = 0.0  # approve_node_csr: for the CSR to come and its certificate to be issued
    changes: tuple[Change, ...] = ()
    reads: Mapping[str, Any] = field(default_factory=dict)


KubeEffect = NodePatch | PodOperation | Wait | BootstrapOperation
Decide = Callable[[Any, NodeFacts], KubeEffect | NoOp]  # a verb module's decide(verb, node)
D = TypeVar("D", bound=Decide)

# The registry: a verb's spec class (defined in its module) -> its module's decide(verb, node).
DECIDE: dict[type, Decide] = {}


def decides(*specs: type[KubeVerbSpec]) -> Callable[[D], D]:
    """Register the decorated ``decide`` for the kube verbs ``specs`` and make them verbs of the
    format (``engine.model.kube_verb``): a verb module's one registration. A spec decided twice, or
    a key another spec has, is a programming error (nothing is registered then)."""

    def register(decide: D) -> D:
        for spec in specs:
            if spec in DECIDE:
                raise ValueError(f"kube verb {spec.__qualname__} already has a decide ({DECIDE[spec].__qualname__})")
        for spec in specs:
            kube_verb(spec)
            DECIDE[spec] = decide
        return decide

    return register

WaitUntil = Callable[[Any, float], tuple[bool, str, Mapping[str, Any]]]  # (check, timeout) -> holds, observed, evidence


@dataclass
class KubeContext:
    """What applying an effect may use: the API, the node, time and cancellation (injected, so unit
    tests never sleep), and for ``Wait`` the executor's way of waiting for a check."""

    api: KubeAPI | None
    node: str
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    cancel: threading.Event
    wait_until: WaitUntil | None = None
    run_id: str = ""  # the run acting (a cordon's ``runbook.io/cordoned-by``)
    progress: Callable[[str], None] = field(default=lambda _msg: None)
    # secrets one step hands to a later step of the same run (a bootstrap token for the playbook that
    # writes the bootstrap kubeconfig); this process's memory only, never an event or a plan
    handoff: dict[str, str] = field(default_factory=dict)

    @property
    def kube(self) -> KubeAPI:
        if self.api is None:
            raise ActionFailed("no Kubernetes connection")
        return self.api


# The effect registries: a variant's class -> the apply and the preview of the module carrying it out.
Apply = Callable[[Any, KubeContext], dict[str, Any]]
Preview = Callable[[Any, KubeContext], str]
APPLY: dict[type, Apply] = {}
PREVIEW: dict[type, Preview] = {}
A = TypeVar("A", bound=Apply)
P = TypeVar("P", bound=Preview)


def _register(table: dict[type, Any], variant: type, what: str, func: Any) -> None:
    if variant in table:
        raise ValueError(f"effect {variant.__qualname__} already has {what} ({table[variant].__qualname__})")
    table[variant] = func


def applies(variant: type) -> Callable[[A], A]:
    """Register the decorated ``apply(effect, ctx) -> evidence`` for the effect ``variant``."""

    def register(apply: A) -> A:
        _register(APPLY, variant, "an apply", apply)
        return apply

    return register


def previews(variant: type) -> Callable[[P], P]:
    """Register the decorated ``preview(effect, ctx) -> text`` for the effect ``variant``."""

    def register(preview: P) -> P:
        _register(PREVIEW, variant, "a preview", preview)
        return preview

    return register
