"""runbook as NodeHealthCheck's and MachineHealthCheck's remediator, on the lab's real API server (issue 28).

One ``runbook serve`` (``remediator.enabled``) for the module, the shipped CRDs
(deploy/kubernetes/crd-runbookremediations.yaml) applied, and minimal NodeHealthCheck and Cluster API
Machine CRDs installed for the test (the owners NHC and MHC set). Each RunbookRemediation is created as
NHC (or MHC) creates it: in the template's namespace, named after the node (the Machine), the
template's spec copied, NHC's annotations, an owner reference.

* gpu-3090-2 (down for containerd, not swap) ends ``Succeeded=False`` with the diagnosis as its message
  and nothing changed;
* a held Medik8s Lease ``medik8s-leases/node-omen2`` blocks ``runbook run`` (exit 3, Lease and holder named);
* ``remediation.medik8s.io/nhc-timed-out`` stops a run (here: waiting for approval);
* deleting the object mid-run cancels it cleanly (the step in flight ends, nothing new starts), then the
  finalizer goes and the object is gone;
* an NHC-shaped object for omen2 recovers it: ``Succeeded=True``, ``Processing=False``;
* an MHC-shaped object named after a Machine recovers the Machine's node (``status.nodeRef``);
* a node-condition trigger pages itself once omen2 has been NotReady for its ``for:`` and starts the run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.lab.hoststate import HostState
from tests.integration.lab.flagship_cli import LABEL, kube_node, ready, runbook
from tests.integration.lab.serve_helpers import REPO, Server, serving

pytestmark = [pytest.mark.integration, pytest.mark.lab, pytest.mark.timeout(1500)]

BASE = REPO / "deploy" / "kubernetes"
NS = "runbook-system"
RUN_TIMEOUT = 300  # deadlines, not expectations
WATCH_LABEL = "runbook.io/test-node-condition"

NHC_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: nodehealthchecks.remediation.medik8s.io}
spec:
  group: remediation.medik8s.io
  scope: Cluster
  names: {kind: NodeHealthCheck, plural: nodehealthchecks, singular: nodehealthcheck, listKind: NodeHealthCheckList}
  versions:
  - name: v1alpha1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"""
MACHINE_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: machines.cluster.x-k8s.io}
spec:
  group: cluster.x-k8s.io
  scope: Namespaced
  names: {kind: Machine, plural: machines, singular: machine, listKind: MachineList}
  versions:
  - name: v1beta1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"""


def _runbooks(tmp: Path) -> Path:
    """The repository's runbooks; gpu-node-recovery with a node-condition trigger (approve mode, only on
    nodes labelled WATCH_LABEL); and a copy that pauses 60 s after its first step (the delete test)."""
    shutil.copytree(REPO / "runbooks", tmp / "runbooks")
    (tmp / "playbooks").symlink_to(REPO / "playbooks")
    path = tmp / "runbooks" / "gpu-node-recovery.yaml"
    doc = yaml.safe_load(path.read_text())
    held = json.loads(json.dumps(doc))
    doc["triggers"].append({"node_conditions": [{"type": "Ready", "status": ["False", "Unknown"], "for": "5s"}],
                            "node_selector": {WATCH_LABEL: "true"}, "mode": "approve", "require_diagnosis": True})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    held["name"] = "gpu-node-recovery-held"
    held["triggers"] = []
    held["steps"].insert(1, {"id": "hold", "action": {"kube": {"wait": {"seconds": 60}}}})
    (tmp / "runbooks" / "gpu-node-recovery-held.yaml").write_text(yaml.safe_dump(held, sort_keys=False))
    return tmp / "runbooks"


def _kubectl(sh: Callable[..., Any], args: str, stdin: str | None = None) -> str:
    cmd = f"kubectl {args}" if stdin is None else f"kubectl {args} -f - <<'EOF'\n{stdin}\nEOF"
    r = sh(cmd, check=True)
    return str(r.stdout)


def _apply(sh: Callable[..., Any], obj: dict[str, Any] | str) -> None:
    _kubectl(sh, "apply", obj if isinstance(obj, str) else yaml.safe_dump(obj))


@pytest.fixture(scope="module")
def cluster(lab: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """CRDs (ours as shipped, NHC's and Machine's minimal), a NodeHealthCheck, our template, and the server."""
    if lab.dirty:
        lab.reset()

    def sh(command: str, check: bool = False, timeout: float = 120) -> Any:
        r = subprocess.run(["bash", "-c", command], env=lab.env(), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{command!r}: {r.stderr}")
        return r

    _kubectl(sh, f"apply -f {BASE / 'namespace.yaml'} -f {BASE / 'crd-runbookremediations.yaml'}")
    _apply(sh, NHC_CRD)
    _apply(sh, MACHINE_CRD)
    for crd in ("runbookremediations.runbook.io", "runbookremediationtemplates.runbook.io",
                "nodehealthchecks.remediation.medik8s.io", "machines.cluster.x-k8s.io"):
        _kubectl(sh, f"wait --for=condition=Established crd/{crd} --timeout=60s")
    _apply(sh, {"apiVersion": "remediation.medik8s.io/v1alpha1", "kind": "NodeHealthCheck",
                "metadata": {"name": "nhc-gpu"},
                "spec": {"selector": {"matchLabels": {"nvidia.com/gpu.present": "true"}},
                         "remediationTemplate": {"apiVersion": "runbook.io/v1alpha1",
                                                 "kind": "RunbookRemediationTemplate",
                                                 "namespace": NS, "name": "gpu-recovery"}}})
    for name, runbook_name, mode in (("gpu-recovery", "gpu-node-recovery", "auto"),
                                     ("gpu-recovery-approve", "gpu-node-recovery", "approve"),
                                     ("gpu-recovery-held", "gpu-node-recovery-held", "auto")):
        _apply(sh, {"apiVersion": "runbook.io/v1alpha1", "kind": "RunbookRemediationTemplate",
                    "metadata": {"name": name, "namespace": NS},
                    "spec": {"template": {"spec": {"runbook": runbook_name, "mode": mode}}}})
    nhc_uid = json.loads(_kubectl(sh, "get nodehealthcheck nhc-gpu -o json"))["metadata"]["uid"]
    tmp = tmp_path_factory.mktemp("remediator")
    config = {"remediator": {"enabled": True, "interval": "1s"}, "node_conditions_interval": "1s",
              "dedup": {"node_cooldown": 0}, "workers": 2,
              # the lab has 4 of 8 nodes down: the default breaker would turn every auto run into approve
              "breaker": {"max_auto_runs": 50, "max_unhealthy_nodes": 8, "max_unhealthy_gpus": 100}}
    with serving(lab.env(), tmp / "serve", config, runbooks_dir=_runbooks(tmp)) as server:
        yield {"server": server, "nhc_uid": nhc_uid, "sh": sh}
    sh(f"kubectl delete runbookremediations --all -n {NS} --wait=false")
    for kind in ("runbookremediations", "machines"):
        names = sh(f"kubectl get {kind} -n {NS} -o name").stdout.split()
        for n in names:  # finalizers of a stopped server: nobody removes them any more
            sh(f"kubectl patch {n} -n {NS} --type=merge -p '{{\"metadata\":{{\"finalizers\":null}}}}'")
    sh("kubectl delete crd nodehealthchecks.remediation.medik8s.io machines.cluster.x-k8s.io "
       "runbookremediations.runbook.io runbookremediationtemplates.runbook.io --wait=false")
    lab.dirty = True


def _nhc_remediation(cluster: dict[str, Any], node: str, template: str = "gpu-recovery") -> dict[str, Any]:
    """What NHC creates for ``node``: named after it in the template's namespace, the template's spec,
    NHC's annotations, an owner reference to the NodeHealthCheck."""
    sh = cluster["sh"]
    tpl = json.loads(_kubectl(sh, f"get runbookremediationtemplate {template} -n {NS} -o json"))
    return {"apiVersion": "runbook.io/v1alpha1", "kind": "RunbookRemediation",
            "metadata": {"name": node, "namespace": NS,
                         "annotations": {"remediation.medik8s.io/node-name": node,
                                         "remediation.medik8s.io/template-name": template},
                         "ownerReferences": [{"apiVersion": "remediation.medik8s.io/v1alpha1",
                                              "kind": "NodeHealthCheck", "name": "nhc-gpu",
                                              "uid": cluster["nhc_uid"], "controller": True}]},
            "spec": tpl["spec"]["template"]["spec"]}


def _get(sh: Callable[..., Any], name: str) -> dict[str, Any] | None:
    r = sh(f"kubectl get runbookremediation {name} -n {NS} -o json")
    return json.loads(r.stdout) if r.returncode == 0 else None


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or ()}


def _wait(what: str, probe: Callable[[], Any], timeout: float, server: Server) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\nserver log:\n{server.log_tail(60)}")
        time.sleep(0.5)


def _finished(sh: Callable[..., Any], name: str, server: Server) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        obj = _get(sh, name)
        if obj is not None and _conditions(obj).get("Succeeded", {}).get("status") in ("True", "False"):
            return obj
        return None

    return dict(_wait(f"RunbookRemediation {name} to finish", done, RUN_TIMEOUT, server))


def _calls(lab: Any, node: str) -> list[dict[str, Any]]:
    return HostState(lab.lab.record()["nodes"][node]["state_dir"]).calls()


def test_a_held_medik8s_lease_blocks_runbook_run_with_exit_3_naming_the_lease_and_its_holder(
        lab: Any, cluster: dict[str, Any], tmp_path: Path) -> None:
    sh = cluster["sh"]
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    _apply(sh, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "node-omen2", "namespace": "medik8s-leases"},
                "spec": {"holderIdentity": "NodeHealthCheck", "leaseDurationSeconds": 3600,
                         "acquireTime": now, "renewTime": now}})
    calls = _calls(lab, "omen2")
    try:
        r = runbook(sh, "run gpu-node-recovery --node omen2 --yes", journal=tmp_path / "journal.sqlite")
    finally:
        sh("kubectl delete lease node-omen2 -n medik8s-leases")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 3, out
    assert "guard medik8s-lease: Lease medik8s-leases/node-omen2 is held by NodeHealthCheck" in out
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "vm-passthrough"
    assert _calls(lab, "omen2") == calls


def test_gpu_3090_2_down_for_another_cause_ends_succeeded_false_with_the_diagnosis_and_nothing_changed(
        lab: Any, cluster: dict[str, Any]) -> None:
    sh, server = cluster["sh"], cluster["server"]
    labels = kube_node(sh, "gpu-3090-2")["metadata"]["labels"]
    calls = _calls(lab, "gpu-3090-2")
    _apply(sh, _nhc_remediation(cluster, "gpu-3090-2"))
    obj = _finished(sh, "gpu-3090-2", server)
    cond = _conditions(obj)
    assert (cond["Succeeded"]["status"], cond["Processing"]["status"]) == ("False", "False"), obj["status"]
    assert cond["Succeeded"]["reason"] == "DiagnosisDidNotMatch"
    assert cond["Succeeded"]["message"].startswith("diagnosis swap (gpu-node-recovery) does not match gpu-3090-2")
    assert "runbook.io/remediation" in obj["metadata"]["finalizers"]
    run = server.run(obj["status"]["runName"])
    assert (run["state"], run["source"], run["plan"]) == ("blocked", "remediation", None)
    assert kube_node(sh, "gpu-3090-2")["metadata"]["labels"] == labels
    assert _calls(lab, "gpu-3090-2") == calls
    sh(f"kubectl delete runbookremediation gpu-3090-2 -n {NS} --timeout=60s", check=True)  # finalizer goes


def test_nhc_timed_out_stops_the_run(lab: Any, cluster: dict[str, Any]) -> None:
    sh, server = cluster["sh"], cluster["server"]
    _apply(sh, _nhc_remediation(cluster, "omen2", template="gpu-recovery-approve"))
    obj = _wait("the run waiting for approval", lambda: (o := _get(sh, "omen2")) and
                (o.get("status") or {}).get("phase") == "WaitingApproval" and o, RUN_TIMEOUT, server)
    assert _conditions(obj)["Processing"]["status"] == "True"
    run_id = obj["status"]["runName"]
    sh(f"kubectl annotate runbookremediation omen2 -n {NS} remediation.medik8s.io/nhc-timed-out="
       f"{datetime.now(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}", check=True)
    obj = _finished(sh, "omen2", server)
    cond = _conditions(obj)
    assert (cond["Succeeded"]["status"], cond["Succeeded"]["reason"], cond["Processing"]["status"]) == (
        "False", "TimedOut", "False")
    run = server.run(run_id)
    assert run["state"] == "cancelled"
    assert any(e["kind"] == "run.cancel_requested" and "nhc-timed-out" in e["reason"] for e in run["events"])
    sh(f"kubectl delete runbookremediation omen2 -n {NS} --timeout=60s", check=True)
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "vm-passthrough"


def test_deleting_the_remediation_mid_run_cancels_cleanly_then_the_finalizer_goes(
        lab: Any, cluster: dict[str, Any]) -> None:
    sh, server = cluster["sh"], cluster["server"]
    _apply(sh, _nhc_remediation(cluster, "omen2", template="gpu-recovery-held"))
    lab.dirty = True
    run_id = _wait("the run", lambda: ((_get(sh, "omen2") or {}).get("status") or {}).get("runName"),
                   RUN_TIMEOUT, server)

    def holding() -> bool:
        run = server.run(run_id)
        assert run["state"] not in ("succeeded", "failed", "blocked", "cancelled", "interrupted"), (
            run["state"], run.get("outcome_reason"), [(e["kind"], e.get("step")) for e in run["events"]])
        return any(e["kind"] == "step.start" and e.get("step") == "hold" for e in run["events"])

    _wait("the run to reach its hold step", holding, RUN_TIMEOUT, server)
    sh(f"kubectl delete runbookremediation omen2 -n {NS} --wait=false", check=True)
    _wait("the object to be gone", lambda: _get(sh, "omen2") is None, 120, server)
    run = server.run(run_id)
    assert run["state"] == "cancelled", run.get("outcome_reason")
    steps = [(e["step"], e["status"]) for e in run["events"] if e["kind"] == "step.outcome"]
    assert steps[0] == ("relabel-container", "succeeded") and steps[-1][0] == "hold", steps
    assert not any(e.get("step") == "swap-off" for e in run["events"] if e["kind"] == "step.start")
    node = kube_node(sh, "omen2")
    assert node["metadata"]["labels"][LABEL] == "container" and not ready(node)  # step 1 done, nothing after


def test_an_nhc_remediation_recovers_omen2_and_reports_succeeded_true_processing_false(
        fresh_lab: Any, cluster: dict[str, Any]) -> None:
    sh, server = cluster["sh"], cluster["server"]
    _apply(sh, _nhc_remediation(cluster, "omen2"))
    obj = _finished(sh, "omen2", server)
    cond = _conditions(obj)
    assert (cond["Succeeded"]["status"], cond["Processing"]["status"]) == ("True", "False"), obj["status"]
    assert (obj["status"]["phase"], obj["status"]["nodeName"]) == ("Succeeded", "omen2")
    assert server.run(obj["status"]["runName"])["state"] == "succeeded"
    node = kube_node(sh, "omen2")
    assert ready(node) and node["metadata"]["labels"][LABEL] == "container"
    sh(f"kubectl delete runbookremediation omen2 -n {NS} --timeout=60s", check=True)  # NHC: healthy again


def test_an_mhc_remediation_named_after_a_machine_recovers_the_machines_node(
        fresh_lab: Any, cluster: dict[str, Any]) -> None:
    sh, server = cluster["sh"], cluster["server"]
    _apply(sh, {"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Machine",
                "metadata": {"name": "gpu-pool-7x2k9", "namespace": NS},
                "spec": {"clusterName": "lab", "bootstrap": {"dataSecretName": "none"}},
                "status": {"nodeRef": {"apiVersion": "v1", "kind": "Node", "name": "omen2"}}})
    machine = json.loads(_kubectl(sh, f"get machine gpu-pool-7x2k9 -n {NS} -o json"))
    tpl = json.loads(_kubectl(sh, f"get runbookremediationtemplate gpu-recovery -n {NS} -o json"))
    _apply(sh, {"apiVersion": "runbook.io/v1alpha1", "kind": "RunbookRemediation",
                "metadata": {"name": "gpu-pool-7x2k9", "namespace": NS,
                             "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "Machine",
                                                  "name": "gpu-pool-7x2k9", "uid": machine["metadata"]["uid"]}]},
                "spec": tpl["spec"]["template"]["spec"]})
    obj = _finished(sh, "gpu-pool-7x2k9", server)
    assert _conditions(obj)["Succeeded"]["status"] == "True", obj["status"]
    assert obj["status"]["nodeName"] == "omen2"
    assert ready(kube_node(sh, "omen2"))
    sh(f"kubectl delete runbookremediation gpu-pool-7x2k9 machine/gpu-pool-7x2k9 -n {NS} --timeout=60s")


def test_a_node_condition_trigger_pages_itself_after_its_for_and_starts_the_run(
        fresh_lab: Any, cluster: dict[str, Any]) -> None:
    sh, server = cluster["sh"], cluster["server"]
    triggers = server.get("/triggers").json()
    assert any(t["source"] == "node-condition" and t["node_selector"] == {WATCH_LABEL: "true"} for t in triggers)
    before = {r["id"] for r in server.runs()}
    sh(f"kubectl label node omen2 {WATCH_LABEL}=true --overwrite", check=True)
    try:
        runs = server.wait_runs(lambda rs: any(r["source"] == "node-condition" and r["id"] not in before
                                               for r in rs), 120, "a node-condition run")
    finally:
        sh(f"kubectl label node omen2 {WATCH_LABEL}-")
    run = next(r for r in runs if r["source"] == "node-condition" and r["id"] not in before)
    assert run["nodes"] == ["omen2"] and run["runbook"] == "gpu-node-recovery"
    detail = server.wait_state(run["id"], ("waiting-approval",), RUN_TIMEOUT)
    assert detail["reason"].startswith("node-condition: omen2 Ready=")
    (diag,) = [e for e in detail["events"] if e["kind"] == "diagnosis"]
    assert diag["matched"] is True
