"""The approval policy (engine.approval_policy, pure) and its recording (engine.approvals) over the
SQLite journal: distinct approvers, roles and identities, the requester rule, the digest binding, and
the CLI's approver (the OS user; --by only for the configured identity)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import approvals
from engine.approval_policy import (
    Approval,
    ApprovalConfig,
    ApprovalRule,
    approval_config_from,
    judge,
    rule_for,
)
from engine.errors import ApprovalRefused, StalePlan, UsageError
from engine.journal import Journal

TWO = ApprovalRule.model_validate({"runbook": "gpu-*", "min_approvers": 2, "requester_may_approve": False,
                                   "approvers": {"identities": ["alice", "bob", "zed"], "roles": ["sre"]}})
CONFIG = ApprovalConfig(policies=(TWO,))


def test_two_distinct_approvers_are_needed_and_the_same_person_counts_once() -> None:
    one = judge(TWO, [Approval("alice", "d1"), Approval("alice", "d1")], "d1", requester="zed")
    assert (one.count, one.satisfied, one.describe()) == (1, False, "1 of 2 approvals")
    two = judge(TWO, [Approval("alice", "d1"), Approval("bob", "d1")], "d1", requester="zed")
    assert two.satisfied and two.approvers == ("alice", "bob")


def test_an_approval_of_another_digest_or_by_the_requester_or_an_outsider_never_counts() -> None:
    got = judge(TWO, [Approval("alice", "old"), Approval("zed", "d1"), Approval("mallory", "d1"),
                      Approval("dave", "d1", frozenset({"sre"}))], "d1", requester="zed")
    assert got.approvers == ("dave",)  # dave by role; alice approved another plan


def test_rules_match_by_runbook_and_node_selector_first_match_wins() -> None:
    cfg = approval_config_from({"policies": [
        {"runbook": "node-reboot", "nodes": "gpu=true,!lab", "min_approvers": 3},
        {"runbook": "*", "min_approvers": 2}]})
    assert rule_for(cfg, "node-reboot", {"gpu": "true"}).min_approvers == 3
    assert rule_for(cfg, "node-reboot", {"gpu": "true", "lab": ""}).min_approvers == 2
    assert rule_for(cfg, "other", None).min_approvers == 2
    with pytest.raises(UsageError, match="labels cannot be read"):
        rule_for(cfg, "node-reboot", None)  # fail closed: no guessing which rule applies


def test_a_bad_policy_is_a_located_usage_error() -> None:
    with pytest.raises(UsageError, match=r"invalid approvals configuration: policies\.0\.min_approvers"):
        approval_config_from({"policies": [{"min_approvers": 0}]})
    with pytest.raises(UsageError, match=r"policies\.0\.nodes"):
        approval_config_from({"policies": [{"nodes": "gpu in (a,b)"}]})


def _waiting(tmp_path: Path, requester: str = "zed") -> tuple[Journal, str]:
    """A run waiting for approval of plan d1, recorded and sealed as the engine records it
    (engine.integrity: the CLI refuses to approve a run it cannot verify)."""
    from engine.integrity import RunIntegrity
    from engine.journal import new_run_id

    j = Journal(tmp_path / "j.sqlite")
    integrity = RunIntegrity(j)
    run_id = new_run_id()
    seal = integrity.first_seal(run_id, runbook="gpu-node-recovery", nodes=["omen2"], params={"node": "omen2"},
                                source="cli", approval_required=True, requested_by=requester)
    j.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"], approval_required=True, run_id=run_id,
                 events=[("run.requested", {"by": requester}), seal])
    j.set_plan(run_id, {"digest": "d1"}, "d1")
    integrity.seal(run_id, plan_digest="d1")
    j.set_state(run_id, "waiting-approval")
    return j, run_id


def test_the_run_is_approved_only_on_the_second_distinct_approval(tmp_path: Path) -> None:
    j, run_id = _waiting(tmp_path)
    first = approvals.approve(j, run_id, "d1", "alice", config=CONFIG)
    assert first["approvals"]["text"] == "1 of 2 approvals" and first["approved_by"] is None
    with pytest.raises(ApprovalRefused, match="alice has approved this plan already"):
        approvals.approve(j, run_id, "d1", "alice", config=CONFIG)
    with pytest.raises(ApprovalRefused, match="requested by zed"):
        approvals.approve(j, run_id, "d1", "zed", config=CONFIG)
    with pytest.raises(ApprovalRefused, match="mallory may not approve"):
        approvals.approve(j, run_id, "d1", "mallory", config=CONFIG)
    with pytest.raises(StalePlan):
        approvals.approve(j, run_id, "other", "bob", config=CONFIG)
    assert j.get_run(run_id).approved_digest is None
    second = approvals.approve(j, run_id, "d1", "bob", config=CONFIG)
    assert second["approvals"]["satisfied"] and j.get_run(run_id).approved_digest == "d1"
    assert j.get_run(run_id).approved_by == "alice, bob"
    kinds = [e.kind for e in j.events(run_id)]
    assert kinds.count("approval.recorded") == 2 and kinds.count("approval.granted") == 1


def test_without_a_policy_one_approval_by_anyone_starts_the_run(tmp_path: Path) -> None:
    j, run_id = _waiting(tmp_path)
    got = approvals.approve(j, run_id, "d1", "zed", config=ApprovalConfig())
    assert got["approvals"]["text"] == "1 of 1 approval" and j.get_run(run_id).approved_digest == "d1"


def _cli(*args: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from engine.cli import main

    got = CliRunner().invoke(main, list(args))
    return got.exit_code, got.output


def test_the_cli_records_the_os_user_refuses_self_approval_and_a_typed_name(tmp_path: Path) -> None:
    from engine.runs import current_user

    me = current_user()
    cfg = tmp_path / "guards.yaml"
    cfg.write_text("approvals:\n  cli_identity: ops-bot\n  policies:\n"
                   "    - {min_approvers: 2, requester_may_approve: false}\n")
    j, run_id = _waiting(tmp_path, requester=me)
    common = ["--journal", str(tmp_path / "j.sqlite"), "--guards-config", str(cfg)]
    code, out = _cli("approve", run_id, "--plan-digest", "d1", *common)
    assert code == 3 and f"requested by {me}" in out
    code, out = _cli("approve", run_id, "--plan-digest", "d1", "--by", "the-boss", *common)
    assert code == 2 and "--by the-boss" in out
    code, out = _cli("approve", run_id, "--plan-digest", "d1", "--by", "ops-bot", *common)
    assert code == 0 and "1 of 2 approvals" in out
    assert j.get_run(run_id).approved_digest is None
    assert [e.data["by"] for e in j.events(run_id) if e.kind == "approval.recorded"] == ["ops-bot"]
