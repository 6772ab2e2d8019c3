"""One budget for the whole cluster: every run in flight anywhere holds a claim in one object.

The GPU budget and the concurrency limit (``engine.run_guards``: ``gpu_budget``, ``concurrency``)
must count every run in flight in the cluster (every ``runbook serve`` replica, every CLI run,
every run started for a remediation object), not the runs of the deciding process. Each such run
claims its place right after its guards passed and before it takes its node's Lease, and gives it
back when it ends. The claims live in one object beside the node Leases: the Lease
``runbook-budget`` in the Lease namespace, annotation ``runbook.io/budget-claims`` (a JSON list
of ``{node, run, gpus, at}``).

A claim is one read-decide-write with the resourceVersion it read as the write's precondition
(HTTP 409 on a stale one). Two processes deciding at the same instant both read version *v*; the
first write makes *v+1*, the second gets 409, reads again, now sees the first claim and decides
again: a budget with room for one run is passed by exactly one of them. A claim that cannot be
written after ``MAX_ATTEMPTS`` conflicts, or an object that cannot be read or understood, refuses
the run (guards fail closed).

A claim is live while its run holds its node's Lease (``runbook-node-<node>`` held by
``runbook/<run>``), or for ``grace`` seconds after it was made (the moment between the claim and
the Lease). A process that dies leaves its claim behind: when a decision would refuse, the claims
it counted are checked against their node Leases and the dead ones are removed in the same write
(a Lease not renewed for its TTL plus ``grace``, or a claim older than ``grace`` whose run holds no
Lease). These checks compare our wall clock with another machine's stamps, which ``engine.locks``
never does for *taking* a Lease: here an error in either direction within ``grace`` only keeps a
dead claim counted a little longer (over-counting delays a run, it never lets one through early),
and a live claim can only be dropped by a clock more than ``grace`` ahead of the claimant's.

Why the cluster and not the run store: every run, whichever store records it (the SQLite journal
of a CLI run, RemediationRuns of the server), holds a node Lease in the cluster, so the budget
object beside those Leases is the one place they all meet; a budget per SQLite journal would not
see the server's runs.

What it must not do: pass a run on claims it read without writing its own claim on that very
version, or drop a claim it cannot prove dead.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.connectors.base import LeaseRecord
from engine.errors import Conflict, KubeError
from engine.facts import NodeFacts
from engine.locks import holder_for, lease_name
from engine.run_guards import GuardConfig, GuardVerdict, gpu_budget_verdict, gpu_count

log = logging.getLogger(__name__)

BUDGET_LEASE = "runbook-budget"
CLAIMS_ANNOTATION = "runbook.io/budget-claims"
LEASES = ("coordination.k8s.io/v1", "leases")
DEFAULT_GRACE = 30.0
MAX_ATTEMPTS = 50


class BudgetAPI(Protocol):
    """What the budget reads and writes (``engine.connectors.kube.KubeConnector`` has it all)."""

    def read_object(self, api_version: str, kind_plural: str, namespace: str, name: str) -> dict[str, Any] | None: ...

    def create_object(self, api_version: str, kind_plural: str, namespace: str,
                      body: Mapping[str, Any]) -> dict[str, Any]: ...

    def replace_object(self, api_version: str, kind_plural: str, namespace: str, body: Mapping[str, Any], *,
                       subresource: str | None = None) -> dict[str, Any]: ...

    def read_lease(self, namespace: str, name: str) -> LeaseRecord | None: ...

    def list_nodes(self, label_selector: str | None = None) -> list[NodeFacts]: ...


class BudgetUnreadable(KubeError):
    """The budget object cannot be read, written or understood: the run is refused."""


@dataclass(frozen=True)
class Claim:
    """One run's place in the cluster's budget."""

    node: str
    run: str
    gpus: int = 0
    at: float = 0.0  # the claimant's wall clock when it claimed

    def as_json(self) -> dict[str, Any]:
        return {"node": self.node, "run": self.run, "gpus": self.gpus, "at": round(self.at, 3)}


def parse_claims(obj: Mapping[str, Any]) -> list[Claim]:
    """The claims the budget object holds; ``BudgetUnreadable`` for an annotation we cannot read."""
    raw = ((obj.get("metadata") or {}).get("annotations") or {}).get(CLAIMS_ANNOTATION) or "[]"
    try:
        data = json.loads(raw)
        if not isinstance(data, list):
            raise ValueError("not a JSON list")
        return [Claim(str(c["node"]), str(c["run"]), int(c.get("gpus", 0)), float(c.get("at", 0.0))) for c in data]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise BudgetUnreadable(f"annotation {CLAIMS_ANNOTATION} cannot be read ({e}): the budget is refused "
                               "until someone repairs or deletes the object") from e


Decide = Callable[[Sequence[Claim]], str | None]  # the other live claims -> why the run is refused, or None


@dataclass(frozen=True)
class ClaimResult:
    """What a claim came to: granted, or refused with the reason; the claims it was judged with."""

    granted: bool
    reason: str
    others: tuple[Claim, ...]
    attempts: int
    pruned: tuple[Claim, ...] = ()

    def as_event(self) -> dict[str, Any]:
        out: dict[str, Any] = {"granted": self.granted, "in_flight": len(self.others),
                               "nodes": sorted({c.node for c in self.others})[:10], "attempts": self.attempts}
        if self.reason:
            out["reason"] = self.reason
        if self.pruned:
            out["pruned"] = [c.as_json() for c in self.pruned]
        return out


class ClusterBudget:
    """The claims of every run in flight in the cluster, in one Lease object (see the module doc)."""

    def __init__(self, api: BudgetAPI, namespace: str, *, name: str = BUDGET_LEASE, grace: float = DEFAULT_GRACE,
                 wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                 attempts: int = MAX_ATTEMPTS) -> None:
        self.api = api
        self.namespace, self.name = namespace, name
        self.grace = grace
        self.wall, self.sleep = wall, sleep
        self.attempts = attempts

    @property
    def where(self) -> str:
        return f"Lease {self.namespace}/{self.name}"

    def _read(self) -> dict[str, Any]:
        try:
            obj = self.api.read_object(*LEASES, self.namespace, self.name)
            if obj is not None:
                return obj
            body = {"apiVersion": LEASES[0], "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace,
                                 "labels": {"app.kubernetes.io/managed-by": "runbook"},
                                 "annotations": {CLAIMS_ANNOTATION: "[]"}},
                    "spec": {}}
            try:
                return self.api.create_object(*LEASES, self.namespace, body)
            except Conflict:  # another process created it at the same moment
                obj = self.api.read_object(*LEASES, self.namespace, self.name)
                if obj is None:
                    raise BudgetUnreadable(f"{self.where} vanished while it was created") from None
                return obj
        except BudgetUnreadable:
            raise
        except KubeError as e:
            raise BudgetUnreadable(f"cannot read the cluster's budget ({self.where}): {e}") from e

    def _write(self, obj: Mapping[str, Any], claims: Sequence[Claim]) -> None:
        """Replace the claims on the version ``obj`` was read at (``Conflict`` when it is stale)."""
        meta = dict(obj.get("metadata") or {})
        meta["annotations"] = {**(meta.get("annotations") or {}),
                               CLAIMS_ANNOTATION: json.dumps([c.as_json() for c in claims], separators=(",", ":"))}
        self.api.replace_object(*LEASES, self.namespace, {**obj, "metadata": meta})

    def claims(self) -> list[Claim]:
        """Every claim the object holds now (live or not yet pruned)."""
        return parse_claims(self._read())

    def dead(self, claims: Sequence[Claim]) -> list[Claim]:
        """The claims that provably belong to no run in flight (see the module doc); a Lease that
        cannot be read keeps its claim."""
        now = self.wall()
        out = []
        for c in claims:
            if now - c.at <= self.grace:
                continue  # live by its age: no read (a burst's claims are all this young)
            try:
                lease = self.api.read_lease(self.namespace, lease_name(c.node))
            except KubeError:
                continue
            if lease is not None and lease.holder == holder_for(c.run):
                if lease.renew_time + lease.duration_seconds + self.grace < now:
                    out.append(c)  # its holder stopped renewing a TTL and more ago
            elif now - c.at > self.grace:
                out.append(c)  # past the moment between claim and Lease, and its run holds no Lease
        return out

    def claim(self, run_id: str, node: str, decide: Decide, *, gpus: int = 0) -> ClaimResult:
        """Claim ``run_id``'s place when ``decide`` (given the other live claims) finds room.

        Granted: our claim is written on the version the decision read. Refused: nothing of ours is
        written (dead claims found on the way are removed). A run that holds a claim already (a
        resumed run, a second call) keeps it. ``BudgetUnreadable`` when the object cannot be read."""
        for attempt in range(1, self.attempts + 1):
            obj = self._read()
            claims = parse_claims(obj)
            if any(c.run == run_id for c in claims):
                return ClaimResult(True, "", tuple(c for c in claims if c.run != run_id), attempt)
            others = list(claims)
            pruned: list[Claim] = []
            reason = decide(others)
            if reason is not None:
                pruned = self.dead(others)
                if not pruned:
                    return ClaimResult(False, reason, tuple(others), attempt)
                others = [c for c in others if c not in pruned]
                reason = decide(others)
            mine = [Claim(node, run_id, gpus, self.wall())] if reason is None else []
            try:
                self._write(obj, [*others, *mine])
            except Conflict:
                self.sleep(random.uniform(0.0, min(0.05, 0.002 * attempt)))  # jitter
                continue
            except KubeError as e:
                raise BudgetUnreadable(f"cannot write the cluster's budget ({self.where}): {e}") from e
            return ClaimResult(reason is None, reason or "", tuple(others), attempt, tuple(pruned))
        return ClaimResult(False, f"the cluster's budget ({self.where}) kept changing under {self.attempts} "
                           "attempts to claim a place: refused (fail closed), a re-sent page tries again",
                           (), self.attempts)

    def release(self, run_id: str) -> bool:
        """Give ``run_id``'s place back. True when a claim was removed; an API error leaves it to be
        pruned as dead (its run holds no Lease any more) and answers False."""
        try:
            for _ in range(self.attempts):
                obj = self._read()
                claims = parse_claims(obj)
                if not any(c.run == run_id for c in claims):
                    return False
                try:
                    self._write(obj, [c for c in claims if c.run != run_id])
                except Conflict:
                    self.sleep(random.uniform(0.0, 0.02))
                    continue
                return True
        except KubeError as e:
            log.warning("run %s: its claim in %s stays until it is pruned: %s", run_id, self.where, e)
        return False


def budget_configured(config: GuardConfig) -> bool:
    """Whether there is a budget to keep (a GPU budget or a concurrency limit)."""
    b = config.gpu_budget
    return b.max_gpus is not None or b.max_percent is not None or config.concurrency.max_runs is not None


def read_nodes(api: BudgetAPI) -> Sequence[NodeFacts] | Exception:
    """The nodes, or the error that stood in the way (``budget_verdicts`` blocks on it)."""
    try:
        return api.list_nodes()
    except Exception as e:  # KubeError, or a connector that cannot answer: fail closed
        return e


def budget_verdicts(nodes: Sequence[NodeFacts] | Exception, node: str, config: GuardConfig,
                    others: Sequence[Claim], local: Sequence[str] = ()) -> list[GuardVerdict]:
    """``gpu-budget`` and ``concurrency`` for ``node`` with the other runs in flight in the whole
    cluster (``others``, plus ``local``: nodes this process remediates), over ``nodes`` (read once
    per claim: what races is the claims, not the nodes). A node list that could not be read blocks."""
    in_flight = sorted({c.node for c in others} | set(local))
    limit = config.concurrency.max_runs
    runs = len({c.run for c in others})
    if limit is None:
        concurrency = GuardVerdict("concurrency", True, "no concurrency limit is configured")
    elif runs + 1 > limit:
        shown = ", ".join(in_flight[:10]) + (f" and {len(in_flight) - 10} more" if len(in_flight) > 10 else "")
        concurrency = GuardVerdict("concurrency", False, f"{runs} runs in flight in the cluster ({shown}); at most "
                                   f"{limit} at once (guards.concurrency.max_runs)", transient=True)
    else:
        concurrency = GuardVerdict("concurrency", True, f"{runs} runs in flight in the cluster; at most {limit}")
    if isinstance(nodes, Exception):
        why = f"cannot read the nodes: {nodes}"
        return [GuardVerdict("gpu-budget", False, f"guard gpu-budget cannot be evaluated, so it blocks: {why}",
                             evaluated=False, transient=True), concurrency]
    target = next((n for n in nodes if n.name == node), None)
    if target is None:
        return [GuardVerdict("gpu-budget", False, f"guard gpu-budget cannot be evaluated, so it blocks: node {node} "
                             "is not in the cluster", evaluated=False, transient=True), concurrency]
    return [gpu_budget_verdict(target, nodes, in_flight, config.gpu_budget), concurrency]


__all__ = ["BUDGET_LEASE", "CLAIMS_ANNOTATION", "BudgetAPI", "BudgetUnreadable", "Claim", "ClaimResult",
           "ClusterBudget", "budget_configured", "budget_verdicts", "gpu_count", "parse_claims", "read_nodes"]
