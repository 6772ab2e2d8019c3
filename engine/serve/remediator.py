"""runbook as an external remediator: reconcile ``RunbookRemediation`` objects (NodeHealthCheck, MHC).

A Medik8s NodeHealthCheck (or a Cluster API MachineHealthCheck) that points at a
``RunbookRemediationTemplate`` creates one ``RunbookRemediation`` (``runbook.io/v1alpha1``) per
unhealthy node, its spec copied from the template (``runbook``, ``params``, ``mode``,
``requireDiagnosis``). This module is the reconciler ``runbook serve`` runs for them (config
``remediator.enabled``), on the leader only:

* **one run per object**, started through the dispatcher exactly like a page (dedup, cluster snapshot,
  exclusions, breaker, approval mode; then the run service: run guards, Lease, journal), source
  ``remediation``, dedup key the object's uid. The node is the annotation
  ``remediation.medik8s.io/node-name`` (NHC), else the Machine's ``status.nodeRef.name`` when the owner
  is a Cluster API ``Machine`` (MHC), else the object's name (NHC names it after the node). A Machine
  annotated ``cluster.x-k8s.io/skip-remediation`` is not remediated; one annotated
  ``cluster.x-k8s.io/paused`` waits.
* **status as NHC reads it**: ``status.conditions`` ``Processing`` (True while the run is pending,
  waiting for approval or running) and ``Succeeded`` (True when the run succeeded; False with the
  reason when it failed, was blocked, refused, or its diagnosis did not match, so NHC escalates at once),
  plus ``status.runName`` (the ``RemediationRun``/journal run) and ``status.phase``.
* **a finalizer** (``runbook.io/remediation``): when the object is deleted (NHC: the node is healthy
  again) or annotated ``remediation.medik8s.io/nhc-timed-out`` (NHC escalates past us), the run is
  cancelled cleanly (the step in flight finishes and is verified, nothing new starts); the finalizer
  goes once the run has ended.

The reconciler is level-triggered: every ``remediator.interval`` seconds it lists the objects and
brings each one's status in line with its run, so a restart or a new leader picks up where the last
one stopped (the run's id is in the status). It reads and writes only ``RunbookRemediation`` objects
(and reads Machines) through ``KubeAPI``; it decides nothing about runs the dispatcher does not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from engine.errors import KubeError, RunbookError
from engine.model import is_node_name
from engine.serve.background import BackgroundLoop
from engine.serve.config import ServeConfig
from engine.serve.dispatcher import Dispatcher
from engine.serve.leader import Leadership
from engine.serve.starter import Mode
from engine.serve.triggers import Candidate
from engine.store import ACTIVE_STATES

log = logging.getLogger(__name__)

API_VERSION = "runbook.io/v1alpha1"
PLURAL = "runbookremediations"
FINALIZER = "runbook.io/remediation"
NODE_NAME_ANNOTATION = "remediation.medik8s.io/node-name"
TEMPLATE_NAME_ANNOTATION = "remediation.medik8s.io/template-name"
TIMED_OUT_ANNOTATION = "remediation.medik8s.io/nhc-timed-out"
SKIP_ANNOTATION = "cluster.x-k8s.io/skip-remediation"
PAUSED_ANNOTATION = "cluster.x-k8s.io/paused"
MACHINE_GROUP = "cluster.x-k8s.io"


class ObjectStore(Protocol):
    """What the reconciler needs of ``KubeAPI``/``ObjectAPI`` (the connector implements both)."""

    def list_objects(self, api_version: str, kind_plural: str, *, namespace: str | None = None,
                     label_selector: str | None = None) -> list[Mapping[str, Any]]: ...

    def read_object(self, api_version: str, kind_plural: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def replace_object(self, api_version: str, kind_plural: str, namespace: str, body: Mapping[str, Any], *,
                       subresource: str | None = None) -> dict[str, Any]: ...


class Starts(Protocol):
    """The dispatcher's door for candidates that are not pages (``Dispatcher.handle_candidates``)."""

    def handle_candidates(self, candidates: Sequence[Candidate], label: str, requested_by: str) -> list[Any]: ...

    def reconcile(self) -> None:
        """Notice runs that ended while waiting for approval (a cancel): the node is free again."""
        ...


class Runs(Protocol):
    """The runs as the starter shows them, and their cancellation (``RunStarter``)."""

    def run(self, run_id: str) -> Mapping[str, Any]: ...

    def cancel(self, run_id: str, reason: str) -> str: ...


# ------------------------------------------------------------------------------------------------
# The object, parsed at the boundary
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Remediation:
    """One ``RunbookRemediation`` as the reconciler reads it."""

    namespace: str
    name: str
    uid: str
    generation: int
    runbook: str
    params: Mapping[str, str]
    mode: Mode
    require_diagnosis: bool
    annotations: Mapping[str, str]
    owner: Mapping[str, Any] | None  # the controller owner reference (NodeHealthCheck or Machine)
    finalizers: tuple[str, ...]
    deleting: bool
    run_name: str
    conditions: tuple[Mapping[str, Any], ...]
    problem: str = ""  # an invalid spec: reported, never run

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def timed_out(self) -> bool:
        return TIMED_OUT_ANNOTATION in self.annotations

    @property
    def machine(self) -> Mapping[str, Any] | None:
        o = self.owner
        if o is not None and o.get("kind") == "Machine" and \
                str(o.get("apiVersion", "")).startswith(MACHINE_GROUP + "/"):
            return o
        return None

    def origin(self) -> str:
        o = self.owner
        if o is None:
            return f"RunbookRemediation {self.key}"
        return f"RunbookRemediation {self.key} ({o.get('kind')} {o.get('name')})"


def _owner(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    refs = [r for r in meta.get("ownerReferences") or () if isinstance(r, Mapping)]
    for r in refs:
        if r.get("kind") in ("NodeHealthCheck", "Machine"):
            return r
    return refs[0] if refs else None


def parse_remediation(obj: Mapping[str, Any]) -> Remediation:
    """The object -> ``Remediation``; a bad spec gives one whose ``problem`` says what is wrong."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    problems: list[str] = []
    runbook = spec.get("runbook")
    if not isinstance(runbook, str) or not runbook:
        problems.append("spec.runbook: a runbook name is required")
        runbook = ""
    raw_params = spec.get("params") or {}
    params: dict[str, str] = {}
    if not isinstance(raw_params, Mapping):
        problems.append("spec.params: must be a mapping of names to strings")
    else:
        for k, v in raw_params.items():
            if isinstance(v, bool) or not isinstance(v, str | int | float):
                problems.append(f"spec.params.{k}: must be a string")
            else:
                params[str(k)] = str(v)
    mode = spec.get("mode", "approve")
    if mode not in ("auto", "approve"):
        problems.append(f"spec.mode: {mode!r} is not auto or approve")
        mode = "approve"
    diag = spec.get("requireDiagnosis", True)
    if not isinstance(diag, bool):
        problems.append("spec.requireDiagnosis: must be true or false")
        diag = True
    conditions = tuple(c for c in status.get("conditions") or () if isinstance(c, Mapping))
    return Remediation(
        namespace=str(meta.get("namespace", "")), name=str(meta.get("name", "")), uid=str(meta.get("uid", "")),
        generation=int(meta.get("generation") or 0), runbook=runbook, params=params, mode=mode,
        require_diagnosis=diag, annotations={str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
        owner=_owner(meta), finalizers=tuple(meta.get("finalizers") or ()),
        deleting=bool(meta.get("deletionTimestamp")), run_name=str(status.get("runName") or ""),
        conditions=conditions, problem="; ".join(problems))


# ------------------------------------------------------------------------------------------------
# What the status says
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """The status to write: phase, the two conditions NHC reads (reason, message), the run."""

    phase: str
    processing: bool
    succeeded: bool | None  # None: Unknown (still working)
    reason: str
    message: str
    run_name: str = ""
    node: str = ""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, value: bool | None, reason: str, message: str, previous: Sequence[Mapping[str, Any]],
               generation: int) -> dict[str, Any]:
    status = "Unknown" if value is None else ("True" if value else "False")
    before = next((c for c in previous if c.get("type") == kind), None)
    since = before.get("lastTransitionTime") if before is not None and before.get("status") == status else None
    return {"type": kind, "status": status, "reason": reason, "message": message[:32000],
            "lastTransitionTime": since or _now(), "observedGeneration": generation}


def status_of(report: Report, r: Remediation) -> dict[str, Any]:
    """The ``status`` document for ``report`` (transition times kept while a condition's status stays)."""
    out: dict[str, Any] = {
        "phase": report.phase,
        "conditions": [
            _condition("Processing", report.processing, report.reason, report.message, r.conditions, r.generation),
            _condition("Succeeded", report.succeeded, report.reason, report.message, r.conditions, r.generation),
        ],
    }
    if report.run_name:
        out["runName"] = report.run_name
    if report.node:
        out["nodeName"] = report.node
    return out


def _diagnosis(run: Mapping[str, Any]) -> str | None:
    for e in run.get("events") or ():
        if e.get("kind") == "diagnosis" and not e.get("matched", True):
            return str(e.get("reason") or "the runbook's diagnosis does not match the node")
    return None


def report_for_run(run: Mapping[str, Any], *, run_name: str, node: str, timed_out: bool = False) -> Report:
    """The status a run in its current state gives its remediation."""
    state = str(run.get("state"))
    why = str(run.get("outcome_reason") or run.get("reason") or "")
    if state == "succeeded":
        return Report("Succeeded", False, True, "RunSucceeded", why or f"run {run_name} succeeded", run_name, node)
    if state in ACTIVE_STATES:
        if timed_out:
            return Report("Cancelling", True, None, "TimedOut", f"NodeHealthCheck timed out: cancelling run "
                          f"{run_name} (the step in flight finishes and is verified)", run_name, node)
        waiting = state == "waiting-approval"
        return Report("WaitingApproval" if waiting else "Running", True, None,
                      "WaitingApproval" if waiting else "RunInProgress",
                      f"run {run_name} is {state}" + (f": {why}" if why else ""), run_name, node)
    if state == "blocked":
        diagnosis = _diagnosis(run)
        if diagnosis is not None:
            return Report("Failed", False, False, "DiagnosisDidNotMatch", diagnosis, run_name, node)
        return Report("Failed", False, False, "RunBlocked", why or f"run {run_name} was blocked", run_name, node)
    if state == "cancelled":
        reason = "TimedOut" if timed_out else "RunCancelled"
        return Report("Cancelled", False, False, reason, why or f"run {run_name} was cancelled", run_name, node)
    if state == "interrupted":
        return Report("Failed", False, False, "RunInterrupted", why or f"run {run_name} was interrupted",
                      run_name, node)
    return Report("Failed", False, False, "RunFailed", why or f"run {run_name} failed", run_name, node)


# ------------------------------------------------------------------------------------------------
# The reconciler
# ------------------------------------------------------------------------------------------------


@dataclass
class Remediator:
    """Level-triggered reconciler of ``RunbookRemediation`` objects (see the module docstring)."""

    kube: Callable[[], ObjectStore]
    dispatcher: Starts
    runs: Runs
    leadership: Leadership
    interval: float = 5.0
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    actions: list[str] = field(default_factory=list)  # what was done, newest last (tests, debugging)
    _cancelled: set[str] = field(default_factory=set)  # runs asked to stop by this process (asked once)
    _last_error: str = ""
    _loop: BackgroundLoop = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._loop = BackgroundLoop("runbook-remediator", self._pass, lambda: self.interval, at_start=True,
                                    log=log, what="remediator: reconcile")

    # -- loop ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def _pass(self) -> None:
        try:
            self.reconcile_all()
            self._last_error = ""
        except KubeError as e:  # e.g. the CRDs are not installed, or RBAC: say it once, keep trying
            if str(e) != self._last_error:
                log.warning("remediator: cannot list %s.%s: %s", PLURAL, API_VERSION, e)
            self._last_error = str(e)

    def reconcile_all(self) -> int:
        """One pass over every object (the leader's duty; nothing on a follower). How many were seen."""
        if not self.leadership.is_leader():
            return 0
        kube = self.kube()
        objects: list[Mapping[str, Any]] = []
        for ns in self.namespaces or (None,):
            objects += kube.list_objects(API_VERSION, PLURAL, namespace=ns)
        for obj in objects:
            try:
                self.reconcile(kube, obj)
            except KubeError as e:  # a conflict or an API hiccup: the next pass tries again
                log.info("remediator: %s/%s: %s", (obj.get("metadata") or {}).get("namespace"),
                         (obj.get("metadata") or {}).get("name"), e)
        return len(objects)

    def _note(self, what: str) -> None:
        self.actions.append(what)
        del self.actions[:-200]
        log.info("remediator: %s", what)

    # -- one object ---------------------------------------------------------------------------------

    def reconcile(self, kube: ObjectStore, obj: Mapping[str, Any]) -> None:
        r = parse_remediation(obj)
        if r.deleting:
            self._deleting(kube, obj, r)
            return
        if FINALIZER not in r.finalizers:
            obj = self._set_finalizers(kube, obj, (*r.finalizers, FINALIZER))
            r = parse_remediation(obj)
            self._note(f"{r.key}: finalizer added")
        if r.run_name:
            self._follow(kube, obj, r)
            return
        if r.problem:
            self._report(kube, obj, r, Report("Failed", False, False, "InvalidSpec", r.problem))
            return
        if r.timed_out:
            self._report(kube, obj, r, Report("Cancelled", False, False, "TimedOut",
                                              "NodeHealthCheck timed out before a run started; nothing was done"))
            return
        if self._already_reported(r):
            return  # refused once (a lasting answer): NHC escalates or deletes; we do not start again
        node, wait = self._node(kube, r)
        if wait is not None:
            self._report(kube, obj, r, wait)
            return
        assert node is not None
        self._start(kube, obj, r, node)

    def _already_reported(self, r: Remediation) -> bool:
        succeeded = next((c for c in r.conditions if c.get("type") == "Succeeded"), None)
        return succeeded is not None and succeeded.get("status") in ("True", "False")

    def _node(self, kube: ObjectStore, r: Remediation) -> tuple[str | None, Report | None]:
        """The node to remediate, or the report that says why not (now)."""
        machine = r.machine
        if machine is not None:
            api, name = str(machine.get("apiVersion")), str(machine.get("name", ""))
            try:
                obj = kube.read_object(api, "machines", r.namespace, name)
            except KubeError as e:
                return None, Report("Pending", False, None, "MachineUnreadable", f"cannot read Machine {name}: {e}")
            if obj is None:
                return None, Report("Failed", False, False, "MachineNotFound",
                                    f"Machine {r.namespace}/{name} does not exist")
            annotations = (obj.get("metadata") or {}).get("annotations") or {}
            if SKIP_ANNOTATION in annotations:
                return None, Report("Skipped", False, False, "SkipRemediation",
                                    f"Machine {name} is annotated {SKIP_ANNOTATION}: not remediated")
            if PAUSED_ANNOTATION in annotations:
                return None, Report("Paused", False, None, "Paused",
                                    f"Machine {name} is annotated {PAUSED_ANNOTATION}: waiting")
            node = ((obj.get("status") or {}).get("nodeRef") or {}).get("name")
            if not isinstance(node, str) or not node:
                return None, Report("Pending", False, None, "WaitingForNodeRef",
                                    f"Machine {name} has no status.nodeRef yet")
        else:
            node = r.annotations.get(NODE_NAME_ANNOTATION) or r.name
        if not is_node_name(node):
            return None, Report("Failed", False, False, "InvalidNode", f"{node[:80]!r} is not a node name")
        return node, None

    def _start(self, kube: ObjectStore, obj: Mapping[str, Any], r: Remediation, node: str) -> None:
        template = r.annotations.get(TEMPLATE_NAME_ANNOTATION)
        reason = r.origin() + (f" from template {template}" if template else "")
        candidate = Candidate(runbook=r.runbook, params=dict(r.params), node=node, mode=r.mode,
                              source="remediation", reason=reason, dedup_key=f"remediation-{r.uid or r.key}",
                              require_diagnosis=r.require_diagnosis)
        decisions = self.dispatcher.handle_candidates([candidate], r.origin(), "remediator")
        d = decisions[0] if decisions else None
        run_id = getattr(d, "run_id", None)
        outcome = getattr(d, "outcome", "rejected")
        why = str(getattr(d, "reason", "no decision"))
        if outcome == "started" and run_id:
            self._note(f"{r.key}: started run {run_id} on {node}")
            started = Report("Running", True, None, "RunStarted", f"run {run_id} started on {node}", run_id, node)
            for attempt in range(3):  # Why: the run exists now; its id must reach the status, or it is lost
                try:
                    self._report(kube, obj, r, started)
                    return
                except KubeError:
                    if attempt == 2:
                        raise
                    fresh = kube.read_object(API_VERSION, PLURAL, r.namespace, r.name)
                    if fresh is None:
                        return
                    obj, r = fresh, parse_remediation(fresh)
            return
        if outcome == "duplicate" and run_id:  # the same object's run (a retried status write): follow it
            self._report(kube, obj, r, Report("Running", True, None, "RunStarted", why, run_id, node))
            return
        kind = {"blocked": "Blocked", "duplicate": "NodeBusy", "rejected": "Refused"}.get(outcome, "Refused")
        self._note(f"{r.key}: {outcome}: {why}")
        self._report(kube, obj, r, Report("Failed", False, False, kind, why, node=node))

    def _run(self, r: Remediation) -> Mapping[str, Any] | None:
        try:
            return self.runs.run(r.run_name)
        except RunbookError:
            return None

    def _follow(self, kube: ObjectStore, obj: Mapping[str, Any], r: Remediation) -> None:
        run = self._run(r)
        node = str((obj.get("status") or {}).get("nodeName") or "")
        if run is None:
            self._report(kube, obj, r, Report("Failed", False, False, "RunNotFound",
                                              f"run {r.run_name} is not in the run store", r.run_name, node))
            return
        if r.timed_out and run.get("state") in ACTIVE_STATES:
            self._cancel(r, "NodeHealthCheck timed out (remediation.medik8s.io/nhc-timed-out): escalating past runbook")
            run = self._run(r) or run
        self._report(kube, obj, r, report_for_run(run, run_name=r.run_name, node=node, timed_out=r.timed_out))

    def _cancel(self, r: Remediation, reason: str) -> None:
        if r.run_name in self._cancelled:
            return  # asked already: the step in flight is finishing
        self._cancelled.add(r.run_name)
        try:
            what = self.runs.cancel(r.run_name, reason)
        except RunbookError as e:
            log.warning("remediator: cannot cancel run %s: %s", r.run_name, e)
            return
        self._note(f"{r.key}: cancel run {r.run_name}: {what}")
        self.dispatcher.reconcile()

    def _deleting(self, kube: ObjectStore, obj: Mapping[str, Any], r: Remediation) -> None:
        if FINALIZER not in r.finalizers:
            return
        if r.run_name:
            run = self._run(r)
            if run is not None and run.get("state") in ACTIVE_STATES:
                self._cancel(r, f"{r.origin()} was deleted (the node is healthy again or the remediation was "
                                "withdrawn)")
                run = self._run(r) or run
                if run.get("state") in ACTIVE_STATES:
                    return  # the step in flight finishes and is verified; the finalizer goes after
        self._set_finalizers(kube, obj, tuple(f for f in r.finalizers if f != FINALIZER))
        self._note(f"{r.key}: finalizer removed")

    # -- writes -------------------------------------------------------------------------------------

    def _set_finalizers(self, kube: ObjectStore, obj: Mapping[str, Any], finalizers: tuple[str, ...]) -> dict[str, Any]:
        meta = dict(obj.get("metadata") or {})
        meta["finalizers"] = list(finalizers)
        body = {**obj, "metadata": meta}
        return kube.replace_object(API_VERSION, PLURAL, r_ns(obj), body)

    def _report(self, kube: ObjectStore, obj: Mapping[str, Any], r: Remediation, report: Report) -> None:
        status = status_of(report, r)
        current = dict(obj.get("status") or {})
        if _same(current, status):
            return
        kube.replace_object(API_VERSION, PLURAL, r.namespace, {**obj, "status": status}, subresource="status")
        self._note(f"{r.key}: {report.phase} ({report.reason})")


def r_ns(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("namespace", ""))


def _same(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    def strip(s: Mapping[str, Any]) -> Any:
        conds = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in s.get("conditions") or ()]
        return ({k: v for k, v in s.items() if k != "conditions"}, conds)

    return bool(strip(current) == strip(wanted))



class Loop(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


def cluster_loops(config: ServeConfig, dispatcher: Dispatcher, kube: Callable[[], Any] | None) -> list[Loop]:
    """The leader's loops over cluster objects this server's configuration asks for: the
    ``RunbookRemediation`` reconciler (``remediator.enabled``) and the Node-condition watcher (runbook
    triggers with ``node_conditions``). None without a Kubernetes connection."""
    if kube is None:
        return []
    from engine.serve.node_conditions import NodeConditionWatcher

    loops: list[Loop] = []
    if config.remediator.enabled:
        loops.append(Remediator(kube, dispatcher, dispatcher.starter, dispatcher.leadership,
                                interval=config.remediator.interval, namespaces=config.remediator.namespaces))
    specs = dispatcher.index.condition_triggers()
    if specs:
        loops.append(NodeConditionWatcher(kube, dispatcher, specs, dispatcher.leadership,
                                          interval=config.node_conditions_interval))
    return loops
