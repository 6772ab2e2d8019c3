"""The packaged catalogue's runbooks, planned on fake facts (pure): containerd-recovery and
kubelet-client-cert-expired refuse what they must before any change (the certificate's renewal plans
its four steps); gpu-node-recovery refuses swap it cannot keep off at plan time."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from engine.facts import Facts, HostFacts, ServiceFacts
from engine.loader import default_runbooks_dir, load_runbook
from engine.model import Plan, PlanState, Runbook
from engine.planning import plan_run
from tests.fakes import GPU_LABEL, incident_host, incident_node, make_host, make_node

NOW = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
CRI_ERROR = 'E run.go:72] "command failed" err="failed to run Kubelet: validate CRI v1 runtime API for endpoint ' \
            '\\"unix:///var/run/containerd/containerd.sock\\": rpc error: code = Unavailable"'
FATAL = 'level=fatal msg="containerd: failed to load TOML from /etc/containerd/config.toml: invalid"'
CERT = ("E bootstrap.go:266] part of the existing bootstrap client certificate in /etc/kubernetes/kubelet.conf "
        "is expired: 2025-03-20 08:12:44 +0000 UTC")


def runbook(name: str) -> Runbook:
    return load_runbook(default_runbooks_dir() / f"{name}.yaml")


def plan(name: str, host: HostFacts, *, node: Any = None, **params: Any) -> Plan:
    rb = runbook(name)
    values = {k: p.default for k, p in rb.params.items() if p.default is not None}
    values.update(node="gpu-3090-2", **params)
    node = node or make_node("gpu-3090-2", ready=False, labels={GPU_LABEL: "container"})
    f = Facts(node_name="gpu-3090-2", node=node, host=host)
    return plan_run(rb, values, f, runbook_digest="f" * 64, now=NOW)


def containerd_host(state: str = "failed", journal: str = "") -> HostFacts:
    host = make_host("gpu-3090-2", kubelet="activating", journal=CRI_ERROR)
    return replace(host, services={**host.services, "containerd": ServiceFacts("containerd", state, journal)})


def test_containerd_down_plans_a_start_and_a_kubelet_restart_only_if_it_stays_down() -> None:
    p = plan("containerd-recovery", containerd_host())
    assert p.state is PlanState.READY, p.blocked_reasons
    assert [(s.id, s.kind) for s in p.steps] == [
        ("start-containerd", "change"), ("restart-kubelet", "change"), ("verify-node-back", "change")]
    assert p.step("restart-kubelet").guards[0].holds is True  # established by start-containerd's verify


def test_containerd_with_a_fatal_error_in_its_journal_is_refused_before_any_change() -> None:
    p = plan("containerd-recovery", containerd_host(journal=f"x\n{FATAL}\nFailed to start containerd.service"))
    assert p.state is PlanState.BLOCKED and p.exit_code == 3
    reasons = " ".join(p.blocked_reasons)
    assert "precondition containerd-can-start" in reasons and "failed to load TOML" in reasons
    assert "nothing was changed" in reasons


def test_containerd_not_read_is_refused_not_guessed() -> None:
    p = plan("containerd-recovery", make_host("gpu-3090-2", kubelet="activating", journal=CRI_ERROR))
    assert p.state is PlanState.BLOCKED
    assert any("containerd-state-read" in r for r in p.blocked_reasons)


def test_a_node_down_for_swap_is_not_containerd_recoverys_business() -> None:
    host = replace(incident_host("gpu-3090-2"),
                   services={**incident_host().services, "containerd": ServiceFacts("containerd", "active")})
    p = plan("containerd-recovery", host)
    assert p.state is PlanState.BLOCKED
    assert any("down-because-of-containerd" in r for r in p.blocked_reasons)


def test_a_vm_passthrough_node_with_host_cuda_jobs_is_refused() -> None:
    host = replace(containerd_host(), cuda_processes=make_host(cuda=1).cuda_processes)
    node = make_node("gpu-3090-2", ready=False, labels={GPU_LABEL: "vm-passthrough"})
    p = plan("containerd-recovery", host, node=node)
    assert p.state is PlanState.BLOCKED
    assert any("no-vfio-risk" in r and "vfio-manager" in r for r in p.blocked_reasons)


def test_an_expired_client_certificate_plans_token_bootstrap_kubeconfig_approval_and_token_deletion() -> None:
    host = make_host("gpu-3090-2", kubelet="activating", journal=CERT)
    p = plan("kubelet-client-cert-expired", host)
    assert p.state is PlanState.READY, p.blocked_reasons
    assert [(s.id, s.kind) for s in p.steps] == [
        ("create-bootstrap-token", "change"), ("write-bootstrap-kubeconfig", "change"),
        ("approve-node-csr", "change"), ("delete-bootstrap-token", "change")]


def test_a_ready_node_has_no_certificate_to_renew_and_nothing_is_planned() -> None:
    p = plan("kubelet-client-cert-expired", make_host("gpu-3090-2"), node=make_node("gpu-3090-2", ready=True))
    assert p.state is not PlanState.BLOCKED and p.exit_code == 0
    assert all(s.kind == "no-op" for s in p.steps), [(s.id, s.kind) for s in p.steps]


def test_a_node_down_for_another_reason_gets_no_bootstrap_token() -> None:
    p = plan("kubelet-client-cert-expired", make_host("gpu-3090-2", kubelet="activating", journal=CRI_ERROR))
    assert p.state is PlanState.BLOCKED and p.exit_code == 3
    assert any("certificate-expired" in r and "nothing was changed" in r for r in p.blocked_reasons)


@pytest.mark.parametrize("source", ["zram device /dev/zram0",
                                    "systemd unit swap2.img.swap (/etc/systemd/system/swap2.img.swap)"])
def test_swap_it_cannot_keep_off_is_refused_at_plan_time_before_the_relabel(source: str) -> None:
    host = replace(incident_host(), unhandled_swap_sources=(source,))
    rb = runbook("gpu-node-recovery")
    f = Facts(node_name="omen2", node=incident_node(), host=host)
    p = plan_run(rb, {"node": "omen2", "workload": "container", "ready_timeout": 120, "gpu_timeout": 180}, f,
                 runbook_digest="f" * 64, now=NOW)
    assert p.state is PlanState.BLOCKED and p.exit_code == 3
    reasons = " ".join(p.blocked_reasons)
    assert "precondition swap-can-be-kept-off" in reasons and source in reasons
    assert "Nothing was changed" in reasons and "zram-generator" in reasons and "systemctl mask" in reasons
    assert p.blocked_reasons[0].startswith("precondition swap-can-be-kept-off")  # a precondition, not a step
