"""RBAC and the Kubernetes store tested for real on the lab (issue 15): the base's ServiceAccount
`runbook` recovers omen2 with nothing but its own TokenRequest token and `--store kubernetes` (the run a
RemediationRun that `kubectl get rr` shows Succeeded with its steps); a ServiceAccount without the role
is stopped before any change (exit 3, "forbidden" and the missing permission); the ClusterRole/Roles
grant nothing the code does not use, derived from the API server's audit log of that recovery; the
run's step outcomes are Events on the Node; and docs/reliability.md's guarantees hold with the
Kubernetes store (kill -9 mid-run, the run reads Interrupted, a resume does every change once).

The module turns read auditing on (audit policy rewritten, kube-apiserver restarted) so that gets,
lists and watches are in the audit log too, and turns it off again at its end.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.lab import controlplane as cp
from engine.lab.controlplane import ControlPlane
from engine.lab.hoststate import HostState
from tests.integration.audit_helpers import is_phase_label_write
from tests.integration.lab.flagship_cli import LABEL, kube_node, ready, runbook
from tests.integration.lab.test_durability_helpers import FLAGSHIP, NODE, Effects, Engine, node_label, stop_kubelet

pytestmark = [pytest.mark.integration, pytest.mark.lab]

BASE = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
NS = "runbook-system"
SA_USER = f"system:serviceaccount:{NS}:runbook"
NO_ROLE = "runbook-no-role"

# Permissions the base grants that a full recovery of omen2 does not exercise: (apiGroup, resource,
# verb, namespace or "" for cluster scope) -> the code path that needs it.
UNEXERCISED: dict[tuple[str, str, str, str], str] = {
    ("", "pods", "list", ""): "the gpu-budget run guard (runbook serve), drain, runbook diagnose and the "
                              "workload switch's probes; the recovery reads host CUDA processes, not pods",
    ("", "pods", "delete", ""): "delete_pods, and drain with disable_eviction (engine/kube_verbs/drain.py)",
    ("", "pods", "watch", ""): "drain/evict wait for the evicted pods to be gone (engine/kube_verbs/drain.py)",
    ("", "pods/eviction", "create", ""): "drain: evict_pod (the workload switch evicts GPU pods)",
    ("kubevirt.io", "virtualmachineinstances", "list", ""): "gpu-workload-switch's probes (engine/probes.py)",
    ("remediation.medik8s.io", "nodehealthchecks", "list", ""):
        "the nhc-pause run guard (engine/run_guards.py) lists them only where the API serves NHC; the lab does not",
    ("", "nodes", "watch", ""): "verification waits on a node watch; a recovery whose checks already "
                                "hold after the playbook does not open one",
}
# Permissions granted for parts of issue 15 not built yet (docs/cluster.md, "Not built yet"): none now.
FOR_THE_FUTURE_STORE: dict[tuple[str, str, str, str], str] = {}
# Leases live in the store namespace in cluster mode (issue 25 item 8: none in kube-system). The
# recovery reads, creates and releases omen2's and updates the cluster's budget Lease (its claim,
# engine/budget.py, issue 32): lease update is exercised.
UNEXERCISED[("", "events", "create", NS)] = \
    "a Warning Event on a RemediationRun refused because it does not verify (engine/integrity.py)"
UNEXERCISED[("certificates.k8s.io", "certificatesigningrequests", "list", "")] = \
    "serve's leader reads `runbook approve --store kubernetes` requests (engine/store_approvals.py)"
UNEXERCISED.update({
    ("authentication.k8s.io", "tokenreviews", "create", ""):
        "serve with auth.mode kubernetes: who a caller's token is (engine/serve/kube_identity.py)",
    ("authorization.k8s.io", "subjectaccessreviews", "create", ""):
        "serve with auth.mode kubernetes: may that user approve/read runs (engine/serve/kube_identity.py)",
})
# runbook serve's RunbookRemediation reconciler (engine/serve/remediator.py; its lab test is
# test_remediator_lab.py): a recovery from the CLI neither reads nor writes RunbookRemediations.
UNEXERCISED.update({
    ("runbook.io", "runbookremediations", verb, ""):
        "the RunbookRemediation reconciler of runbook serve (engine/serve/remediator.py)"
    for verb in ("get", "list", "update")
})
UNEXERCISED[("runbook.io", "runbookremediations/status", "update", "")] = \
    "the reconciler reports Processing/Succeeded, runName and phase (engine/serve/remediator.py)"
UNEXERCISED[("cluster.x-k8s.io", "machines", "get", "")] = \
    "the reconciler resolves an MHC object's node from its Machine (engine/serve/remediator.py)"
# The store's permissions a recovery does not exercise (the recovery uses get, list, create and
# remediationruns/status update).
UNEXERCISED[("runbook.io", "remediationruns", "delete", NS)] = "retention: KubeRunStore.prune (engine/kube_store.py)"
UNEXERCISED[("runbook.io", "remediationruns", "watch", NS)] = \
    "runbook serve's watch-fed copy of the runs (KubeRunStore.follow, engine/kube_run_index.py)"
STORE = "--store kubernetes"
RUN = ("run", FLAGSHIP, "--node", NODE, "--yes")


def _granted(cluster_roles: dict[str, list[dict[str, Any]]]) -> set[tuple[str, str, str, str]]:
    """Every (apiGroup, resource, verb, namespace) the base's ClusterRole and Roles grant, plus the rules
    of the cluster's own ClusterRoles it binds (``cluster_roles``: name -> rules, read from the server)."""
    out = set()
    docs = [d for d in yaml.safe_load_all((BASE / "rbac.yaml").read_text()) if d]
    defined = {d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"}
    for doc in docs:
        if doc["kind"] == "ClusterRoleBinding" and doc["roleRef"]["name"] not in defined:
            doc = {"kind": "ClusterRole", "metadata": {}, "rules": cluster_roles[doc["roleRef"]["name"]]}
        if doc["kind"] not in ("ClusterRole", "Role"):
            continue
        scope = doc["metadata"].get("namespace", "") if doc["kind"] == "Role" else ""
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        out.add((group, resource, verb, scope))
    return out


def _used(events: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    out = set()
    for e in events:
        ref = e.get("objectRef")
        if not ref or e.get("user", {}).get("username") != SA_USER:
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        out.add((ref.get("apiGroup", ""), resource, e["verb"], ref.get("namespace", "")))
    return out


def _covered(used: tuple[str, str, str, str], granted: set[tuple[str, str, str, str]]) -> bool:
    group, resource, verb, ns = used
    return (group, resource, verb, ns) in granted or (group, resource, verb, "") in granted


@pytest.fixture(scope="module")
def rbac(lab: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    plane = ControlPlane.from_state(lab.lab.record()["controlplane_dir"])
    policy = plane.state_dir / "audit-policy.yaml"
    original = policy.read_text()
    policy.write_text(cp._audit_policy(audit_reads=True))
    plane.restart_apiserver()
    try:
        admin = f"kubectl --kubeconfig {plane.kubeconfig}"
        env = lab.env()

        def kubectl(args: str) -> None:
            r = subprocess.run(f"{admin} {args}", shell=True, env=env, capture_output=True, text=True, check=False)
            assert r.returncode == 0, r.stderr

        for name in ("namespace.yaml", "crd-remediationruns.yaml", "serviceaccount.yaml", "rbac.yaml"):
            kubectl(f"apply -f {BASE / name}")
        # the run key is made by the first process that needs it: the recovery below (audited)
        kubectl(f"-n {NS} delete secret runbook-run-key --ignore-not-found")
        kubectl(f"create serviceaccount {NO_ROLE} -n {NS} --dry-run=client -o yaml | {admin} apply -f -")
        bound = {d["roleRef"]["name"] for d in yaml.safe_load_all((BASE / "rbac.yaml").read_text())
                 if d and d["kind"] == "ClusterRoleBinding"} - {"runbook"}
        cluster_roles = {}  # the cluster's own ClusterRoles the base binds (system:auth-delegator), as served
        for name in bound:
            r = subprocess.run(f"{admin} get clusterrole {name} -o json", shell=True, env=env,
                               capture_output=True, text=True, check=False)
            assert r.returncode == 0, r.stderr
            cluster_roles[name] = json.loads(r.stdout)["rules"]
        home = tmp_path_factory.mktemp("rbac")
        yield {"plane": plane, "cluster_roles": cluster_roles,
               "runbook": plane.service_account_kubeconfig(NS, "runbook", home / "kubeconfig-runbook"),
               "no_role": plane.service_account_kubeconfig(NS, NO_ROLE, home / "kubeconfig-no-role"),
               "recovery_audit": []}
    finally:
        policy.write_text(original)
        plane.restart_apiserver()


def test_without_the_role_the_run_stops_before_any_change_with_exit_3_naming_the_forbidden_permission(
        incident: Any, sh: Any, rbac: dict[str, Any], tmp_path: Path) -> None:
    state_dir = incident.lab.record()["nodes"]["omen2"]["state_dir"]
    calls_before = HostState(state_dir).calls()
    label_before = kube_node(sh, "omen2")["metadata"]["labels"][LABEL]
    runs_before = _remediation_runs(sh)
    r = runbook(sh, f"run gpu-node-recovery --node omen2 --yes --kubeconfig {rbac['no_role']} {STORE}",
                journal=tmp_path / "journal.sqlite")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 3, out
    assert "forbidden" in out
    assert f'User "system:serviceaccount:{NS}:{NO_ROLE}" cannot get resource "nodes"' in out
    assert "grant this permission to the identity in use, see deploy/kubernetes/rbac.yaml" in out
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == label_before == "vm-passthrough"
    assert HostState(state_dir).calls() == calls_before
    assert _remediation_runs(sh) == runs_before
    assert not (tmp_path / "journal.sqlite").exists()  # --store kubernetes: the SQLite journal is not used


@pytest.mark.timeout(1200)
def test_a_full_recovery_with_only_the_runbook_service_account_token_succeeds_and_leaves_node_events(
        fresh_lab: Any, sh: Any, rbac: dict[str, Any], tmp_path: Path) -> None:
    plane: ControlPlane = rbac["plane"]
    mark = plane.audit_mark()
    r = runbook(sh, f"run gpu-node-recovery --node omen2 --yes --kubeconfig {rbac['runbook']} {STORE}",
                journal=tmp_path / "journal.sqlite")
    listed = runbook(sh, f"runs -o json --kubeconfig {rbac['runbook']} {STORE}", journal=tmp_path / "journal.sqlite")
    assert listed.returncode == 0, listed.stderr
    shown = runbook(sh, f"runs show {json.loads(listed.stdout)[0]['id']} -o json --kubeconfig {rbac['runbook']} "
                        f"{STORE}", journal=tmp_path / "journal.sqlite")
    audit = plane.audit_events(mark)  # read before this test's own kubectl calls (as admin)
    assert r.returncode == 0, r.stdout + r.stderr
    assert shown.returncode == 0, shown.stderr
    assert not (tmp_path / "journal.sqlite").exists()
    node = kube_node(sh, "omen2")
    assert ready(node) and node["metadata"]["labels"][LABEL] == "container"
    rbac["recovery_audit"] = audit
    mutations = [e for e in audit if e["verb"] in cp.MUTATING_VERBS and e["user"]["username"] == SA_USER]
    assert any(e["objectRef"]["resource"] == "nodes" and e["verb"] == "patch" for e in mutations)
    as_admin = [(e["verb"], e["requestURI"]) for e in audit if e["user"]["username"] == cp.ADMIN_USER]
    assert not as_admin  # the run had only the ServiceAccount's token

    run = json.loads(listed.stdout)[0]
    run_id = run["id"]
    assert (run["runbook"], run["nodes"], run["state"], run["exit_code"]) == (
        "gpu-node-recovery", ["omen2"], "succeeded", 0)
    rr = next(o for o in _remediation_runs(sh) if o["metadata"]["name"] == run_id)
    assert (rr["spec"]["runbook"], rr["spec"]["node"], rr["status"]["phase"]) == (
        "gpu-node-recovery", "omen2", "Succeeded")
    steps = {s["id"]: s["status"] for s in rr["status"]["steps"]}
    assert {"relabel-container", "swap-off", "restart-kubelet"} <= set(steps), steps
    assert set(steps.values()) <= {"succeeded", "skipped"} and "succeeded" in steps.values(), steps
    kinds = [e["kind"] for e in rr["status"]["events"]]
    assert [(e["seq"], e["kind"]) for e in json.loads(shown.stdout)["events"]] == [
        (e["seq"], e["kind"]) for e in rr["status"]["events"]]  # `runbook runs show` reads the same record
    assert kinds.index("action.intent") < kinds.index("action.result")  # intent recorded before acting
    assert [e["seq"] for e in rr["status"]["events"]] == list(range(1, len(kinds) + 1))
    store_writes = [e for e in mutations if e["objectRef"]["resource"] == "remediationruns"]
    progress = [e for e in store_writes if e["verb"] == "update" and not is_phase_label_write(e)]
    assert progress and {e["objectRef"].get("subresource") for e in progress} == {"status"}  # to the status only
    assert rr["metadata"]["generation"] == 1  # the spec as created: the object's own writes were the phase label
    events = json.loads(sh("kubectl get events --field-selector involvedObject.name=omen2 -o json",
                           check=True).stdout)["items"]
    ours = [e for e in events if e.get("reportingComponent") == "runbook" and run_id in e.get("message", "")]
    assert ours, [e.get("reason") for e in events]
    assert {e["reason"] for e in ours} <= {"RemediationStepSucceeded", "RemediationStepSkipped"}
    assert any(e["reason"] == "RemediationStepSucceeded" for e in ours)
    assert all("runbook gpu-node-recovery, step " in e["message"] for e in ours)
    described = sh("kubectl describe node omen2", check=True).stdout
    assert "RemediationStepSucceeded" in described


def test_the_roles_grant_nothing_the_code_does_not_use_per_the_audit_log_of_the_recovery(
        rbac: dict[str, Any]) -> None:
    audit = rbac["recovery_audit"]
    assert audit, "needs the recovery test of this module to have run first"
    used = _used(audit)
    granted = _granted(rbac["cluster_roles"])
    not_granted = {u for u in used if not _covered(u, granted)}
    assert not not_granted, f"the recovery used permissions the base does not grant: {sorted(not_granted)}"
    used_or_explained = set(FOR_THE_FUTURE_STORE) | set(UNEXERCISED)
    used_or_explained |= {g for g in granted if g in used or (g[3] == "" and any(
        (u[0], u[1], u[2]) == (g[0], g[1], g[2]) for u in used))}
    unexplained = granted - used_or_explained
    assert not unexplained, (f"granted but neither used by the recovery nor explained: {sorted(unexplained)}; "
                             f"used: {sorted(used)}")
    stale = {k for k in {**UNEXERCISED, **FOR_THE_FUTURE_STORE} if k not in granted}
    assert not stale, f"UNEXERCISED/FOR_THE_FUTURE_STORE name permissions the base no longer grants: {sorted(stale)}"
    assert not {k for k in FOR_THE_FUTURE_STORE if k in used}, "built now: move it out of FOR_THE_FUTURE_STORE"
    assert {("runbook.io", "remediationruns", v, NS) for v in ("get", "list", "create")} | {
        ("runbook.io", "remediationruns/status", "update", NS)} <= used  # the store ran as the ServiceAccount
    assert {("", "secrets", "get", NS), ("", "secrets", "create", NS)} <= used  # the run key, made at first use
    assert {("coordination.k8s.io", "leases", v, NS) for v in ("get", "create", "update", "delete")} <= used
    assert not {u for u in used if u[1] == "leases" and u[3] == "kube-system"}  # item 8: out of kube-system
    # the medik8s-lease run guard read the node's Medik8s Lease as the ServiceAccount (Role in medik8s-leases)
    assert ("coordination.k8s.io", "leases", "get", "medik8s-leases") in used
    exercised_anyway = {k for k in UNEXERCISED if k in used or any(
        (u[0], u[1], u[2]) == k[:3] for u in used if k[3] == "")}
    assert not exercised_anyway, f"listed as unexercised but the recovery used them: {sorted(exercised_anyway)}"


def _label_patches(plane: ControlPlane, mark: int) -> int:
    """The workload-label PATCHes of omen2 the ServiceAccount sent since ``mark`` (the audit log)."""
    found = 0
    for e in plane.mutations(since=mark, user=SA_USER):
        ref = e.get("objectRef") or {}
        labels = ((e.get("requestObject") or {}).get("metadata") or {}).get("labels") or {}
        if e["verb"] == "patch" and ref.get("resource") == "nodes" and ref.get("name") == NODE \
                and not ref.get("subresource") and LABEL in labels:
            found += 1
    return found


def _remediation_runs(sh: Any) -> list[dict[str, Any]]:
    """``kubectl get rr -n runbook-system -o json`` (as the lab's admin)."""
    return list(json.loads(sh(f"kubectl get rr -n {NS} -o json", check=True).stdout)["items"])


@pytest.mark.timeout(1200)
def test_with_the_kubernetes_store_a_run_killed_mid_step_reads_interrupted_and_resumes_doing_each_change_once(
        fresh_lab: Any, sh: Any, rbac: dict[str, Any]) -> None:
    """docs/reliability.md with `--store kubernetes`, as the ServiceAccount: the intent is in the
    RemediationRun before the effect, SIGKILL right after swap-off's action leaves it there, `runbook runs`
    and `kubectl get rr` show the run Interrupted, and `runbook resume` finishes it with one label PATCH,
    one swapoff and one kubelet restart."""
    store_env = {"KUBECONFIG": str(rbac["runbook"]), "RUNBOOK_STORE": "kubernetes"}
    plane: ControlPlane = rbac["plane"]
    with Engine.for_lab(fresh_lab) as engine:
        stop_kubelet(engine.lab)
        effects = Effects(engine.lab)
        mark = plane.audit_mark()

        def counts() -> dict[str, int]:  # the label PATCHes are the ServiceAccount's (Effects counts the admin's)
            return {"label": _label_patches(plane, mark), "swapoff": effects.swapoffs(),
                    "restart": effects.kubelet_restarts()}

        killed = engine.run(*RUN, env={**store_env, "RUNBOOK_TEST_KILL_AT": "swap-off:after-action"})
        assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
        assert not engine.journal_path.exists()  # every record went to the cluster
        listed = engine.run("runs", "-o", "json", env=store_env)
        assert listed.returncode == 0, listed.stderr
        run = json.loads(listed.stdout)[0]
        assert run["state"] == "interrupted"
        rr = next(o for o in _remediation_runs(sh) if o["metadata"]["name"] == run["id"])
        assert rr["status"]["phase"] == "Interrupted", listed.stderr  # what kubectl get rr shows too
        last = rr["status"]["events"][-1]
        assert (last["kind"], last["step"]) == ("action.result", "swap-off")  # recorded before the kill
        assert counts() == {"label": 1, "swapoff": 1, "restart": 0}

        resumed = engine.run("resume", run["id"], "--yes", env=store_env)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert counts() == {"label": 1, "swapoff": 1, "restart": 1}  # nothing done twice
        rr = next(o for o in _remediation_runs(sh) if o["metadata"]["name"] == run["id"])
        assert (rr["status"]["phase"], rr["status"]["exitCode"]) == ("Succeeded", 0)
        resume = next(e["data"] for e in rr["status"]["events"] if e["kind"] == "run.resume")
        assert resume["started_without_outcome"] == "swap-off"
        assert node_label(engine.lab) == "container"
        assert engine.wait_no_leftovers() == []
