"""In-cluster configuration, for real: ``runbook run`` started in a private mount namespace with the
ServiceAccount's token, CA and namespace at /var/run/secrets/kubernetes.io/serviceaccount/ and
KUBERNETES_SERVICE_HOST/PORT set, no kubeconfig anywhere, talks to the API server as that
ServiceAccount (the audit log names it) under the base's RBAC.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl
from tests.conftest import require

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
SA_USER = "system:serviceaccount:runbook-system:runbook"
SECRETS = "/var/run/secrets/kubernetes.io/serviceaccount"
RUNBOOK = """\
apiVersion: runbook/v1
name: mark-node
version: "1.0.0"
description: Label a node through the Kubernetes API only.
params:
  node: {type: node, required: true, description: The node}
preconditions:
  - id: node-exists
    check: {node_exists: true}
    message: "node {{ params.node }} does not exist"
steps:
  - id: label-node
    why: Mark the node.
    action:
      kube:
        label: {runbook.example/in-cluster: "yes"}
    verify:
      - check: {node_label: {key: runbook.example/in-cluster, equals: "yes"}}
        timeout: 30s
"""


def _in_cluster(control_plane: ControlPlane, tmp: Path, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    secrets = tmp / "sa"
    secrets.mkdir()
    (secrets / "token").write_text(token)
    shutil.copy(control_plane.ca_file, secrets / "ca.crt")
    (secrets / "namespace").write_text("runbook-system")
    home = tmp / "home"
    home.mkdir()
    command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "engine", *args))
    script = (f"mount -t tmpfs -o mode=755 tmpfs /run && mkdir -p {SECRETS} && "
              f"cp {shlex.quote(str(secrets))}/* {SECRETS}/ && cd {shlex.quote(str(tmp))} && exec {command}")
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "RUNBOOK_INVENTORY")}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), KUBERNETES_SERVICE_HOST="127.0.0.1",
               KUBERNETES_SERVICE_PORT=str(control_plane.ports["apiserver"]),
               RUNBOOK_JOURNAL=str(tmp / "journal.sqlite"), XDG_STATE_HOME=str(tmp / "state"),
               # as the Deployment sets it: node Leases in the store namespace (the ServiceAccount has
               # no Lease rights in kube-system, deploy/kubernetes/rbac.yaml)
               RUNBOOK_NAMESPACE="runbook-system")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def test_runbook_run_in_a_pod_like_mount_namespace_uses_the_service_account_with_no_kubeconfig(
        control_plane: ControlPlane, kubectl: Kubectl, kube_client: Any, tmp_path: Path) -> None:
    require(None if os.geteuid() == 0 and shutil.which("unshare") else "needs root and unshare (mount namespace)")
    from kubernetes import client

    kube_client.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="incluster-node")))
    for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml"):
        kubectl("apply", "-f", str(BASE / name))
    (tmp_path / "mark-node.yaml").write_text(RUNBOOK)
    token = control_plane.issue_token("runbook-system", "runbook")
    assert not Path(SECRETS).exists()  # the secrets exist only inside the private mount namespace
    mark = control_plane.audit_mark()
    r = _in_cluster(control_plane, tmp_path, token, "run", str(tmp_path / "mark-node.yaml"),
                    "--node", "incluster-node", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    labels = kube_client.read_node("incluster-node").metadata.labels
    assert labels["runbook.example/in-cluster"] == "yes"
    patches = [e for e in control_plane.mutations(since=mark, user=SA_USER)
               if e["objectRef"]["resource"] == "nodes" and e["verb"] == "patch"]
    assert [p["objectRef"]["name"] for p in patches] == ["incluster-node"]
    assert not control_plane.mutations(since=mark, user="admin")
    listed = kubectl.json("get", "events", "--field-selector", "involvedObject.name=incluster-node")["items"]
    events = [e for e in listed if e.get("reportingComponent") == "runbook"]
    assert [e["reason"] for e in events] == ["RemediationStepSucceeded"], r.stdout + r.stderr


def test_with_a_token_of_another_service_account_the_in_cluster_run_is_forbidden_and_blocked(
        control_plane: ControlPlane, kubectl: Kubectl, kube_client: Any, tmp_path: Path) -> None:
    require(None if os.geteuid() == 0 and shutil.which("unshare") else "needs root and unshare (mount namespace)")
    from kubernetes import client

    kube_client.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="incluster-node")))
    kubectl("apply", "-f", str(BASE / "namespace.yaml"))
    kubectl("create", "serviceaccount", "nobody", "-n", "runbook-system")
    (tmp_path / "mark-node.yaml").write_text(RUNBOOK)
    r = _in_cluster(control_plane, tmp_path, control_plane.issue_token("runbook-system", "nobody"),
                    "run", str(tmp_path / "mark-node.yaml"), "--node", "incluster-node", "--yes")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 3, out
    assert 'User "system:serviceaccount:runbook-system:nobody" cannot get resource "nodes"' in out
    assert "grant this permission to the identity in use, see deploy/kubernetes/rbac.yaml" in out
    assert "runbook.example/in-cluster" not in (kube_client.read_node("incluster-node").metadata.labels or {})


def test_a_service_account_missing_only_the_lease_role_is_blocked_at_the_lease_with_exit_3(
        control_plane: ControlPlane, kubectl: Kubectl, kube_client: Any, tmp_path: Path) -> None:
    """Cluster-wide reads are allowed (the plan is made), kube-system is not: the run is blocked (exit 3)
    before any change, the message naming the verb, the resource and where the permission is granted."""
    require(None if os.geteuid() == 0 and shutil.which("unshare") else "needs root and unshare (mount namespace)")
    from kubernetes import client

    kube_client.create_node(client.V1Node(metadata=client.V1ObjectMeta(name="incluster-node")))
    for name in ("namespace.yaml", "rbac.yaml"):
        kubectl("apply", "-f", str(BASE / name))
    kubectl("create", "serviceaccount", "partial", "-n", "runbook-system")
    kubectl("create", "clusterrolebinding", "runbook-partial", "--clusterrole=runbook",
            "--serviceaccount=runbook-system:partial")
    (tmp_path / "mark-node.yaml").write_text(RUNBOOK)
    mark = control_plane.audit_mark()
    r = _in_cluster(control_plane, tmp_path, control_plane.issue_token("runbook-system", "partial"),
                    "run", str(tmp_path / "mark-node.yaml"), "--node", "incluster-node", "--yes")
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 3, out
    # the first kube-system read is refused: the node Lease, or (where CLI runs evaluate the run guards
    # first) kured's DaemonSets; either way a permission of the missing kube-system Role is named
    assert "forbidden" in out and "kube-system" in out
    assert re.search(r'cannot (get resource "leases"|list resource "daemonsets")', out), out
    assert "grant this permission to the identity in use, see deploy/kubernetes/rbac.yaml" in out
    assert "runbook.example/in-cluster" not in (kube_client.read_node("incluster-node").metadata.labels or {})
    assert not control_plane.mutations(since=mark, user="system:serviceaccount:runbook-system:partial")
