"""Who may approve a run, and how many must: the approval policy (pure).

A policy is a list of rules, the first that matches a run (its runbook, its node's name and labels)
applies; no match is the default (one approval by anyone who may approve at all). A rule names the
identities and roles that may approve, the minimum number of *distinct* approvers (AWS SSM's
MinRequiredApprovals) and whether the person who requested the run may be one of them.

The policy judges a list of ``Approval`` values (identity, plan digest, roles) however they are
stored (journal events, ``RemediationApproval`` objects, signed records): only approvals of the
plan's digest count, each identity once. This module never reads a store or a cluster; the front
ends gather the approvals and the node's labels and call ``judge``/``refusal``.

Configuration: the ``approvals:`` section of the guards configuration (``--guards-config FILE``,
env ``RUNBOOK_GUARDS_CONFIG``) or of the serve configuration::

    approvals:
      cli_identity: ops-bot            # the one name `runbook approve --by` may give (SQLite store)
      policies:
        - runbook: node-reboot         # fnmatch pattern of runbook names (default "*")
          nodes: "gpu=true"            # a label selector over the node's labels (default: every node)
          approvers: {identities: [alice, bob], roles: [sre]}   # none listed: anyone who may approve
          min_approvers: 2
          requester_may_approve: false
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.configfile import read_mapping
from engine.errors import UsageError

__all__ = [
    "Approval",
    "ApprovalConfig",
    "ApprovalRule",
    "PolicyStatus",
    "approval_config_from",
    "judge",
    "load_approval_config",
    "refusal",
    "rule_for",
    "selector_matches",
]


@dataclass(frozen=True)
class Approval:
    """One person's approval of one plan, as any store records it."""

    identity: str
    digest: str
    roles: frozenset[str] = field(default_factory=frozenset)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Approvers(_Model):
    identities: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()

    def allow(self, identity: str, roles: frozenset[str]) -> bool:
        if not self.identities and not self.roles:
            return True
        return identity in self.identities or bool(roles & set(self.roles))

    def describe(self) -> str:
        parts = [*self.identities, *(f"role {r}" for r in self.roles)]
        return ", ".join(parts) if parts else "anyone who may approve"


class ApprovalRule(_Model):
    runbook: str = "*"
    nodes: str = ""  # a label selector: k=v, k!=v, k (exists), !k (absent), comma-separated
    approvers: Approvers = Field(default_factory=Approvers)
    min_approvers: int = Field(default=1, ge=1, le=20)
    requester_may_approve: bool | None = None  # None: the front end's default (serve: auth)

    @field_validator("nodes")
    @classmethod
    def _selector(cls, v: str) -> str:
        parse_selector(v)
        return v

    def matches(self, runbook: str, labels: Mapping[str, str] | None) -> bool:
        if not fnmatch.fnmatchcase(runbook, self.runbook):
            return False
        if not self.nodes:
            return True
        if labels is None:
            raise UsageError(f"approval policy for runbook {self.runbook!r} selects nodes by {self.nodes!r}, "
                             "but the node's labels cannot be read: the approval is refused (fail closed)")
        return selector_matches(self.nodes, labels)


DEFAULT_RULE = ApprovalRule()


class ApprovalConfig(_Model):
    cli_identity: str | None = None
    policies: tuple[ApprovalRule, ...] = ()

    def needs_labels(self, runbook: str) -> bool:
        return any(r.nodes and fnmatch.fnmatchcase(runbook, r.runbook) for r in self.policies)


def parse_selector(selector: str) -> list[tuple[str, str, str]]:
    """``k=v,k!=v,k,!k`` -> [(op, key, value)]; ``ValueError`` for anything else (set-based forms too)."""
    out = []
    for raw in (p.strip() for p in selector.split(",")):
        if not raw:
            continue
        if " in " in raw or "(" in raw:
            raise ValueError(f"selector {selector!r}: only k=v, k!=v, k and !k are supported")
        if "!=" in raw:
            k, v = raw.split("!=", 1)
            out.append(("!=", k.strip(), v.strip()))
        elif "=" in raw:
            k, v = raw.split("==", 1) if "==" in raw else raw.split("=", 1)
            out.append(("=", k.strip(), v.strip()))
        elif raw.startswith("!"):
            out.append(("!", raw[1:].strip(), ""))
        else:
            out.append(("exists", raw, ""))
    return out


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    for op, key, value in parse_selector(selector):
        have = labels.get(key)
        if ((op == "=" and have != value) or (op == "!=" and have == value)
                or (op == "exists" and have is None) or (op == "!" and have is not None)):
            return False
    return True


def rule_for(config: ApprovalConfig, runbook: str, labels: Mapping[str, str] | None) -> ApprovalRule:
    """The first rule matching the run (``UsageError`` when a rule needs labels nobody could read)."""
    for rule in config.policies:
        if rule.matches(runbook, labels):
            return rule
    return DEFAULT_RULE


@dataclass(frozen=True)
class PolicyStatus:
    """How far a plan's approvals go: ``count`` distinct valid approvers of ``required``."""

    count: int
    required: int
    approvers: tuple[str, ...]
    who_may: str

    @property
    def satisfied(self) -> bool:
        return self.count >= self.required

    def describe(self) -> str:
        return f"{self.count} of {self.required} approval{'s' if self.required != 1 else ''}"

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "required": self.required, "approvers": list(self.approvers),
                "satisfied": self.satisfied, "who_may": self.who_may, "text": self.describe()}


def _requester_may(rule: ApprovalRule, requester_default: bool) -> bool:
    return requester_default if rule.requester_may_approve is None else rule.requester_may_approve


def refusal(rule: ApprovalRule, approval: Approval, *, requester: str | None, requester_default: bool = True,
            earlier: Sequence[Approval] = ()) -> str | None:
    """Why ``approval`` must not count under ``rule`` (None: it counts)."""
    if not rule.approvers.allow(approval.identity, approval.roles):
        return (f"{approval.identity} may not approve this run (the policy allows "
                f"{rule.approvers.describe()})")
    if requester is not None and approval.identity == requester and not _requester_may(rule, requester_default):
        return f"the run was requested by {requester}; another person must approve it (approval policy)"
    if any(a.identity == approval.identity and a.digest == approval.digest for a in earlier):
        return (f"{approval.identity} has approved this plan already; the policy needs "
                f"{rule.min_approvers} distinct approvers")
    return None


def judge(rule: ApprovalRule, approvals: Sequence[Approval], digest: str, *, requester: str | None,
          requester_default: bool = True) -> PolicyStatus:
    """The approvals of ``digest`` that count under ``rule``: each identity once, only those the
    rule allows (an approval of another digest, or by someone the rule refuses, never counts)."""
    seen: list[str] = []
    for a in approvals:
        if a.digest != digest or a.identity in seen:
            continue
        if refusal(rule, a, requester=requester, requester_default=requester_default) is None:
            seen.append(a.identity)
    return PolicyStatus(len(seen), rule.min_approvers, tuple(seen), rule.approvers.describe())


def approval_config_from(data: Any, where: str = "approvals") -> ApprovalConfig:
    if data is None:
        return ApprovalConfig()
    if not isinstance(data, Mapping):
        raise UsageError(f"{where}: the approvals configuration must be a mapping")
    try:
        return ApprovalConfig.model_validate(dict(data))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}"
                             for err in e.errors()[:10])
        raise UsageError(f"{where}: invalid approvals configuration: {problems}") from e


def load_approval_config(path: Path | str | None) -> ApprovalConfig:
    """The ``approvals:`` section of a YAML file (other top-level keys are left to their owners)."""
    if path is None:
        return ApprovalConfig()
    raw = read_mapping(path, "the approvals configuration")
    return approval_config_from(raw.get("approvals"), f"{path}: approvals")
