"""runbook serve under an approval policy: a two-approver run starts only on the second distinct
approval, the page shows "1 of 2 approvals", and the policy's refusals are 403s."""

from __future__ import annotations

from engine.approval_policy import approval_config_from
from tests.fakes import APPROVE, FakeRunStarter, alert, served, trigger_spec

BOB_TOKEN = "bob-approver-token-0123456789"
BOB = {"Authorization": f"Bearer {BOB_TOKEN}"}
MALLORY_TOKEN = "mallory-approver-token-0123456789"
MALLORY = {"Authorization": f"Bearer {MALLORY_TOKEN}"}
POLICY = approval_config_from({"policies": [{"runbook": "gpu-node-recovery", "min_approvers": 2,
                                             "approvers": {"identities": ["alice", "bob"]}}]})


def test_a_two_approver_policy_starts_the_run_only_on_the_second_distinct_approval() -> None:
    starter = FakeRunStarter([trigger_spec(mode="approve", matchers=('node=~"omen.*"',))], approvals=POLICY)
    env = {"RUNBOOK_APPROVER_TOKEN_BOB": BOB_TOKEN, "RUNBOOK_APPROVER_TOKEN_MALLORY": MALLORY_TOKEN}
    with served(starter=starter, env=env) as s:
        (run_id,) = s.post_alerts(alert("omen2")).json()["runs"]
        s.idle()
        digest = s.client.get(f"/runs/{run_id}").json()["plan_digest"]
        url = f"/runs/{run_id}/approve"
        first = s.client.post(url, json={"plan_digest": digest}, headers=APPROVE)
        assert first.status_code == 200 and first.json()["queued"] is False
        assert first.json()["approvals"]["text"] == "1 of 2 approvals"
        assert starter.executed == [run_id]  # parked, not run
        again = s.client.post(url, json={"plan_digest": digest}, headers=APPROVE)
        assert again.status_code == 403 and "alice has approved this plan already" in again.json()["error"]
        outsider = s.client.post(url, json={"plan_digest": digest}, headers=MALLORY)
        assert outsider.status_code == 403 and "mallory may not approve" in outsider.json()["error"]
        page = s.client.get(f"/ui/runs/{run_id}", headers=APPROVE)
        assert "1 of 2 approvals" in page.text and "(by alice)" in page.text
        second = s.client.post(url, json={"plan_digest": digest}, headers=BOB)
        assert second.status_code == 202 and second.json()["queued"] is True
        s.idle()
        assert starter.executed == [run_id, run_id]
        assert s.client.get(f"/runs/{run_id}").json()["approved_by"] == "alice, bob"


def test_the_run_page_links_an_escalated_run_to_its_parent_and_children() -> None:
    run = {"id": "r-child", "runbook": "node-reboot", "params": {"node": "omen5"}, "nodes": ["omen5"],
           "state": "succeeded", "source": "escalation", "plan_digest": None, "approval_required": True,
           "approved_by": "bob", "started": None, "finished": None, "exit_code": 0,
           "events": [{"kind": "escalation.of", "run": "r-parent", "runbook": "gpu-node-recovery"},
                      {"kind": "run.rolled_back", "run": "r-undo"}]}
    starter = FakeRunStarter([trigger_spec()], preload=[run])
    with served(starter=starter) as s:
        page = s.client.get("/ui/runs/r-child", headers=APPROVE).text
    assert 'Escalated from</dt><dd class="parent-run"><a href="/ui/runs/r-parent">r-parent</a>' in page
    assert 'Rolled back by</dt><dd class="child-run"><a href="/ui/runs/r-undo">r-undo</a>' in page
