"""Recording an approval under the approval policy, for every front end (CLI, serve, the run service).

One function, ``approve``: reads the run and its approvals from the store, refuses an approval the
policy does not count (``ApprovalRefused``: not an approver, the requester, the same person twice),
records it (an ``approval.recorded`` event bound to the plan digest), and only when the policy is
satisfied records the run's approval (``RunStore.record_approval``: the run may start). The policy
itself is ``engine.approval_policy`` (pure); how approvals are stored is this module's business, so
another store of approvals (objects, signatures) changes ``approvals_of`` and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.approval_policy import Approval, ApprovalConfig, PolicyStatus, judge, refusal, rule_for
from engine.errors import ApprovalRefused, StalePlan
from engine.store import EventRecord, RunStore

__all__ = ["APPROVAL_RECORDED", "approvals_of", "approve", "policy_status", "requester_of"]

APPROVAL_RECORDED = "approval.recorded"


def approvals_of(events: Sequence[EventRecord]) -> list[Approval]:
    """Every approval recorded for the run, oldest first (each bound to the digest it names)."""
    return [Approval(str(e.data.get("by")), str(e.data.get("plan_digest")), frozenset(e.data.get("roles") or ()))
            for e in events if e.kind == APPROVAL_RECORDED]


def requester_of(events: Sequence[EventRecord]) -> str | None:
    for e in events:
        if e.kind == "run.requested":
            by = e.data.get("by")
            return str(by) if by else None
    return None


def policy_status(store: RunStore, run_id: str, config: ApprovalConfig, *,
                  labels: Callable[[], Mapping[str, str] | None] = lambda: None,
                  requester_default: bool = True) -> PolicyStatus | None:
    """How far the run's current plan is approved ("1 of 2 approvals"); None without a plan."""
    rec = store.get_run(run_id)
    if rec.plan_digest is None:
        return None
    events = store.events(run_id)
    try:
        rule = rule_for(config, rec.runbook, labels() if config.needs_labels(rec.runbook) else None)
    except Exception:
        return None
    return judge(rule, approvals_of(events), rec.plan_digest, requester=requester_of(events),
                 requester_default=requester_default)


def approve(store: RunStore, run_id: str, digest: str, identity: str, *, config: ApprovalConfig,
            roles: frozenset[str] = frozenset(), labels: Callable[[], Mapping[str, str] | None] = lambda: None,
            requester_default: bool = True) -> dict[str, Any]:
    """Record ``identity``'s approval of plan ``digest``; the run's approval is recorded (it may
    start) once the policy counts enough distinct approvers. Returns the run's summary with
    ``approvals`` (count, required, approvers, satisfied, text)."""
    rec = store.get_run(run_id)
    if rec.plan_digest != digest:
        raise StalePlan(f"run {run_id}: approval names plan {digest!r}, but the run's plan is "
                        f"{rec.plan_digest!r}; re-read the plan and approve that digest")
    if rec.state != "waiting-approval":
        raise StalePlan(f"run {run_id} is {rec.state}, not waiting for approval")
    events = store.events(run_id)
    rule = rule_for(config, rec.runbook, labels() if config.needs_labels(rec.runbook) else None)
    requester = requester_of(events)
    earlier = [a for a in approvals_of(events) if a.digest == digest]
    new = Approval(identity, digest, frozenset(roles))
    why = refusal(rule, new, requester=requester, requester_default=requester_default, earlier=earlier)
    if why is not None:
        raise ApprovalRefused(f"run {run_id}: {why}")
    store.append(run_id, APPROVAL_RECORDED, by=identity, plan_digest=digest, roles=sorted(roles))
    status = judge(rule, [*earlier, new], digest, requester=requester, requester_default=requester_default)
    if status.satisfied:
        rec = store.record_approval(run_id, digest, ", ".join(status.approvers))
    else:
        store.append(run_id, "approval.waiting", plan_digest=digest,
                     reason=f"{status.describe()}: waiting for {status.required - status.count} more "
                            f"({status.who_may})")
        rec = store.get_run(run_id)
    return {**rec.summary(), "approvals": status.as_dict()}
