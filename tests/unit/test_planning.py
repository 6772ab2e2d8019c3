"""Planning: runbook + params + facts -> a reviewable Plan value (pure, deterministic)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from engine.facts import Facts, NodeFacts, ProbeError, Taint
from engine.loader import load_runbook, parse_runbook
from engine.model import Plan, PlanState, Runbook
from engine.planning import plan_drift, plan_fleet, plan_run, saved_plan_problems, with_previews
from tests.fakes import GPU_LABEL, healthy_host, healthy_node, incident_host, incident_node, make_host, make_node

DATA = Path(__file__).parent / "data"
PLAYBOOKS = DATA / "playbooks"
RUNBOOK = load_runbook(DATA / "runbooks" / "gpu-recovery.yaml", playbooks_dir=PLAYBOOKS)
PARAMS: dict[str, Any] = {"node": "omen2", "workload": "container", "ready_timeout": 180}
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)
DIGEST = "f" * 64


def facts(node: NodeFacts | None = None, host: Any = None, errors: tuple[ProbeError, ...] = ()) -> Facts:
    return Facts(node_name="omen2", node=node, host=host, errors=errors)


INCIDENT = facts(incident_node(), incident_host())
HEALTHY = facts(healthy_node(), healthy_host())


def plan(f: Facts = INCIDENT, runbook: Runbook = RUNBOOK, **kw: Any) -> Plan:
    return plan_run(runbook, PARAMS, f, runbook_digest=DIGEST, now=NOW, **kw)


def test_the_incident_plans_three_changes_in_order() -> None:
    p = plan()
    assert p.state is PlanState.READY and p.exit_code == 0
    assert [(s.id, s.kind) for s in p.steps] == [
        ("relabel-container", "change"), ("swap-off", "change"), ("restart-kubelet", "change")]
    relabel, swap, restart = p.steps
    assert relabel.summary == f"label {GPU_LABEL}: vm-passthrough -> container"
    assert relabel.command == f"kubectl label node omen2 {GPU_LABEL}=container --overwrite"
    assert [(c.path, c.before, c.after) for c in relabel.changes] == [
        (f"node.labels[{GPU_LABEL}]", "vm-passthrough", "container")]
    assert swap.command == ("ansible-playbook -i INVENTORY playbooks/swap-off.yml --limit omen2 -b "
                            "-e '{\"backup\": true}'")
    assert [v.timeout_seconds for v in restart.verify] == [60.0, 180.0, 300.0]
    assert restart.verify[1].check == "node is Ready"


def test_a_later_guard_holds_in_the_plan_because_an_earlier_step_establishes_it() -> None:
    restart = plan().step("restart-kubelet")
    assert [(g.check, g.holds) for g in restart.guards] == [
        (f"label {GPU_LABEL} = container", True), ("swap is off", True)]


def test_a_healthy_node_means_nothing_to_do() -> None:
    p = plan(HEALTHY)
    assert p.state is PlanState.NOTHING_TO_DO and p.exit_code == 0
    assert all(s.kind == "no-op" for s in p.steps)
    assert p.step("relabel-container").reason == f"already done: label {GPU_LABEL}=container"
    assert p.step("swap-off").summary == "no-op: already done: swap off; no active swap entry in fstab"


def test_a_node_down_for_another_cause_is_refused_with_the_rendered_message() -> None:
    other = facts(incident_node(), make_host(kubelet="failed", journal="Failed to start ContainerManager"))
    p = plan(other)
    assert p.state is PlanState.BLOCKED and p.exit_code == 3
    pre = {r.id: r for r in p.preconditions}["down-only-for-swap"]
    assert pre.applies and pre.holds is False
    assert pre.message == "node is down but not because of swap: kubelet=failed"
    assert p.blocked_reasons[0].startswith("precondition down-only-for-swap:")


def test_a_precondition_with_a_false_when_does_not_apply() -> None:
    ready_but_swapping = facts(replace(incident_node(), conditions=healthy_node().conditions), incident_host())
    pre = {r.id: r for r in plan(ready_but_swapping).preconditions}["down-only-for-swap"]
    assert not pre.applies and pre.passed


def test_an_unknown_node_is_a_failed_precondition() -> None:
    p = plan(facts(NodeFacts(name="omen2", exists=False), incident_host()))
    assert p.state is PlanState.BLOCKED
    assert "node omen2 does not exist" in p.blocked_reasons[0]


def test_an_unreachable_host_blocks_the_plan_because_checks_fail_closed() -> None:
    p = plan(facts(incident_node(), None, (ProbeError("host", "omen2: unreachable (ssh: connection refused)"),)))
    assert p.state is PlanState.BLOCKED
    pre = {r.id: r for r in p.preconditions}["down-only-for-swap"]
    assert pre.holds is None and "could not be evaluated" in pre.message
    assert p.probe_errors == ("host: omen2: unreachable (ssh: connection refused)",)
    assert p.step("restart-kubelet").kind == "blocked"


def test_a_guard_that_no_earlier_step_establishes_blocks_the_step() -> None:
    text = (DATA / "runbooks" / "gpu-recovery.yaml").read_text()
    start = text.index("  - id: relabel-container")
    end = text.index("  - id: swap-off")
    without_relabel = text[:start] + text[end:].replace("requires: [relabel-container, swap-off]",
                                                        "requires: [swap-off]")
    rb = parse_runbook(without_relabel.encode(), "gpu-recovery.yaml", playbooks_dir=PLAYBOOKS)
    p = plan(runbook=rb)
    restart = p.step("restart-kubelet")
    assert restart.kind == "blocked"
    assert restart.reason == (f"guard label {GPU_LABEL} = container does not hold: "
                              f"label {GPU_LABEL}=vm-passthrough")
    assert p.exit_code == 3


def test_a_step_that_requires_a_blocked_step_is_blocked() -> None:
    p = plan(facts(NodeFacts(name="omen2", exists=False), incident_host()))
    assert p.step("relabel-container").kind == "blocked"
    assert p.step("restart-kubelet").reason.startswith("requires relabel-container, which is blocked")


def test_depends_on_records_the_gathered_values_decisions_read() -> None:
    deps = plan().depends_on
    assert deps[f"node.labels[{GPU_LABEL}]"] == "vm-passthrough"  # gathered, not the predicted "container"
    assert deps["host.swap_active"] is True
    assert deps["host.fstab_active_swap"] is True
    assert deps["node.ready"] is False
    assert not any("journal" in k for k in deps)  # volatile readings are not dependencies


def test_the_digest_is_stable_and_covers_the_plan() -> None:
    a, b = plan(), plan()
    assert a.digest == b.digest == a.compute_digest()
    again = Plan.model_validate_json(a.model_dump_json())
    assert again == a and again.compute_digest() == a.digest
    assert plan(HEALTHY).digest != a.digest
    assert with_previews(a, {"swap-off": "-/swapfile none swap sw 0 0\n+#/swapfile none swap sw 0 0"}).digest \
        != a.digest


def test_a_saved_plan_applies_when_nothing_changed() -> None:
    saved = plan()
    assert saved_plan_problems(saved, runbook_digest=DIGEST, now=NOW + timedelta(minutes=5), fresh=plan()) == []


def test_a_hand_relabel_between_plan_and_apply_makes_the_plan_stale() -> None:
    saved = plan()
    relabelled = facts(incident_node().with_labels({GPU_LABEL: "container"}), incident_host())
    problems = saved_plan_problems(saved, runbook_digest=DIGEST, now=NOW, fresh=plan(relabelled))
    assert f"node omen2 label {GPU_LABEL}: planned vm-passthrough, now container" in problems


def test_an_expired_changed_or_tampered_plan_is_stale() -> None:
    saved = plan()
    assert saved_plan_problems(saved, runbook_digest=DIGEST, now=NOW + timedelta(hours=2)) == [
        "the plan expired at 2026-07-10T16:40:00Z"]
    assert "changed since the plan was made" in saved_plan_problems(saved, runbook_digest="0" * 64, now=NOW)[0]
    tampered = saved.model_copy(update={"params": {**saved.params, "ready_timeout": 10}})
    assert "digest mismatch" in saved_plan_problems(tampered, runbook_digest=DIGEST, now=NOW)[0]


def test_drift_names_changed_steps() -> None:
    assert "step swap-off: planned" in " ".join(plan_drift(plan(), plan(HEALTHY)))


def test_a_nothing_to_do_precondition_makes_every_step_a_no_op() -> None:
    text = (DATA / "runbooks" / "gpu-recovery.yaml").read_text().replace(
        "preconditions:\n", "preconditions:\n  - id: still-broken\n    check: {node_ready: false}\n"
        "    on_fail: nothing_to_do\n    message: node {{ params.node }} is already Ready\n", 1)
    rb = parse_runbook(text.encode(), "gpu-recovery.yaml", playbooks_dir=PLAYBOOKS)
    ready_with_old_label = facts(make_node(labels={GPU_LABEL: "vm-passthrough"}), incident_host())
    p = plan(ready_with_old_label, runbook=rb)
    assert p.state is PlanState.NOTHING_TO_DO
    assert {s.reason for s in p.steps} == {"nothing to do: node omen2 is already Ready"}


def test_a_fleet_gets_one_plan_per_node() -> None:
    by_node = {n: {**PARAMS, "node": n} for n in ("omen1", "omen2")}
    fs = {"omen1": Facts(node_name="omen1", node=healthy_node("omen1"), host=healthy_host("omen1")),
          "omen2": INCIDENT}
    plans = plan_fleet(RUNBOOK, by_node, fs, runbook_digest=DIGEST, now=NOW, inventory_hosts={"omen2": "omen2.lab"})
    assert [(p.node, p.state) for p in plans] == [("omen1", PlanState.NOTHING_TO_DO), ("omen2", PlanState.READY)]
    assert "--limit omen2.lab" in plans[1].step("swap-off").command


@pytest.mark.parametrize("kube_verb", [
    {"cordon": True}, {"uncordon": True}, {"taint": {"key": "gpu", "value": "down", "effect": "NoSchedule"}},
    {"untaint": {"key": "node.kubernetes.io/not-ready"}}, {"annotate": {"example.com/why": "swap"}},
    {"unlabel": [GPU_LABEL]}, {"patch": {"type": "merge", "body": {"metadata": {"labels": {"a": "b"}}}}},
    {"evict": {"selector": "app=cuda"}}, {"wait": {"seconds": 5}}, {"drain": {"ignore_daemonsets": True}},
])
def test_every_kube_verb_plans_a_change_with_a_kubectl_line(kube_verb: dict[str, Any]) -> None:
    import yaml

    doc = {"apiVersion": "runbook/v1", "name": "verbs", "version": "1",
           "params": {"node": {"type": "node", "required": True}},
           "steps": [{"id": "act", "action": {"kube": kube_verb}, "verify": [{"check": {"node_exists": True}}]}]}
    rb = parse_runbook(yaml.safe_dump(doc).encode(), "verbs.yaml")
    node = make_node(labels={GPU_LABEL: "vm-passthrough"}, unschedulable="uncordon" in kube_verb,
                     taints=[Taint("node.kubernetes.io/not-ready", "NoSchedule")])
    if "uncordon" in kube_verb:  # runbook uncordons only its own cordons
        node = replace(node, annotations=MappingProxyType({"runbook.io/cordoned-by": "r-1"}))
    step = plan(facts(node, healthy_host()), runbook=rb).steps[0]
    assert step.kind == "change", step.summary
    assert step.command.startswith(("kubectl ", "sleep "))
