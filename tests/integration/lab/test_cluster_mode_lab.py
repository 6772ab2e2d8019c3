"""Cluster mode as shipped (issue 26): deploy/kubernetes, unedited, runs on the lab and recovers omen2.

One lab for the module: ``runbook lab up --with-cluster-mode --with-monitoring`` on the session's lab
(reset to the incident first) renders the base with kustomize, applies it, and starts its Deployment's
two replicas as pods (engine/lab/cluster_mode.py); Alertmanager pages their Service with the sender
token of the Secret. Then, in order:

1. two pods Running in ``kubectl get pods``, one leads (``kubectl get lease runbook-serve``), each process
   runs as UID 10001 on a read-only root with the Secret's key readable through fsGroup only;
2. omen2's kubelet failing pages the Service through the real Prometheus and Alertmanager; the run waits
   as a RemediationRun; an approver whose token comes from TokenRequest for a ServiceAccount bound by
   approver-rbac.yaml approves it through the console's HTTP API; omen2 recovers (Ready, GPU
   allocatable, CUDA job alive) and ``kubectl describe node omen2`` shows runbook's Events;
3. gpu-3090-1 (swap too) was paged as well; approved at the leader, the leader is killed with SIGKILL
   right after the run's swap-off: its Pod goes, the other replica takes the leader Lease over and
   finishes the run, each change once (the API server's audit log, the host's call log);
4. stopping cluster mode (what ``runbook lab down`` does) ends the replicas and deletes their Pods.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.lab.controlplane import ControlPlane
from engine.lab.hoststate import HostState
from engine.lab.monitoring import binary
from tests.integration.lab.lab_helpers import wait_for
from tests.integration.lab.serve_helpers import alertmanager_binary, node_json, ready_status
from tests.integration.lab.test_durability_helpers import stop_kubelet
from tests.integration.lab.test_serve_lab import omen2_recovered

pytestmark = [pytest.mark.integration, pytest.mark.lab, pytest.mark.timeout(1500)]

NS = "runbook-system"
SA_USER = f"system:serviceaccount:{NS}:runbook"
APPROVER = "approver-cluster-mode"  # a name no other module of the session uses
LABEL = "nvidia.com/gpu.workload.config"
ALERT_TIMEOUT = 180
PLAN_TIMEOUT = 300
RUN_TIMEOUT = 420
TAKEOVER_TIMEOUT = 420  # the leader Lease (15 s) plus the node Lease seen silent for its TTL (120 s), loaded


@dataclass
class Cluster:
    lab: Any
    plane: ControlPlane
    service_url: str
    host_header: str  # the Service's DNS name, as in-cluster clients send it
    approver_token: str

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["kubectl", *args], env=self.lab.env(), capture_output=True, text=True, timeout=60,
                              check=False)
        assert done.returncode == 0 or not check, done.stderr
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def status(self) -> dict[str, Any]:
        done = subprocess.run(["runbook", "lab", "status", "-o", "json"], env=self.lab.env(), capture_output=True,
                              text=True, timeout=60, check=True)
        cluster: dict[str, Any] = json.loads(done.stdout)["cluster_mode"]
        return cluster

    def api(self, method: str, path: str, base: str | None = None, **kw: Any) -> httpx.Response:
        """The console's HTTP API through the Service (or ``base``, a pod's own address), as the approver."""
        headers = {"Authorization": f"Bearer {self.approver_token}"}
        if base is None:
            headers["Host"] = self.host_header
        return httpx.request(method, (base or self.service_url) + path, headers=headers, timeout=30, **kw)

    def remediation_run(self, node: str, name: str | None = None, phase: str | None = None) -> dict[str, Any] | None:
        """A RemediationRun of ``node`` (named ``name``, or in ``phase``). A node may have two: its
        NotReady and its Unreachable alert each page, at either replica."""
        items = self.json("get", "rr", "-n", NS, "-l", f"runbook.io/node={node}")["items"]
        return next((i for i in items if (name is None or i["metadata"]["name"] == name)
                     and (phase is None or i.get("status", {}).get("phase") == phase)), None)

    def leader_pod(self) -> str:
        holder = self.json("get", "lease", "runbook-serve", "-n", NS)["spec"].get("holderIdentity") or ""
        return str(holder).rsplit("_", 1)[0]


@pytest.fixture(scope="module")
def cluster(lab: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    alertmanager_binary()
    binary("prometheus")
    if lab.dirty:
        lab.reset()
    lab.dirty = True
    plane = ControlPlane.from_state(lab.lab.record()["controlplane_dir"])
    up = subprocess.run(["runbook", "lab", "up", "--with-cluster-mode", "--with-monitoring"], env=lab.env(),
                        capture_output=True, text=True, timeout=900, check=False)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        record = lab.lab.record()["cluster_mode"]
        # an on-call person: a ServiceAccount bound as docs/cluster.md binds approvers (1.20: + identity)
        env = lab.env()
        for args in (["create", "serviceaccount", APPROVER, "-n", NS],
                     ["create", "rolebinding", "runbook-approvers-cluster-mode", "-n", NS,
                      "--clusterrole=runbook-approver", f"--serviceaccount={NS}:{APPROVER}"],
                     ["create", "clusterrolebinding", "runbook-approvers-identity-cluster-mode",
                      "--clusterrole=runbook-approver-identity", f"--serviceaccount={NS}:{APPROVER}"]):
            subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, timeout=60, check=True)
        # the approver's token as docs/cluster.md gets it: kubectl create token (TokenRequest)
        token = subprocess.run(["kubectl", "create", "token", APPROVER, "-n", NS, "--audience", "runbook"], env=env,
                               capture_output=True,
                               text=True, timeout=60, check=True).stdout.strip()
        yield Cluster(lab, plane, record["service_url"], f"{record['service_dns']}:8080", token)
    finally:
        lab.lab.stop_monitoring()
        lab.lab.stop_cluster_mode()
        for args in (["delete", "clusterrolebinding", "runbook-approvers-identity-cluster-mode"],
                     ["delete", "rolebinding", "runbook-approvers-cluster-mode", "-n", NS],
                     ["delete", "serviceaccount", APPROVER, "-n", NS]):
            subprocess.run(["kubectl", *args, "--ignore-not-found"], env=lab.env(), capture_output=True,
                           timeout=60, check=False)


def _pods(c: Cluster) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = c.json("get", "pods", "-n", NS, "-l", "app.kubernetes.io/component=serve")["items"]
    return items


def _running(pod: dict[str, Any]) -> bool:
    ready = any(x["type"] == "Ready" and x["status"] == "True" for x in pod.get("status", {}).get("conditions", []))
    return pod.get("status", {}).get("phase") == "Running" and ready


def _ns_run(pid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nsenter", f"--target={pid}", "--mount", "--", *argv], capture_output=True, text=True,
                          timeout=30, check=False)


def test_the_base_runs_as_two_pods_one_leads_each_as_uid_10001_on_a_read_only_root(cluster: Cluster) -> None:
    status = cluster.status()
    pods = {p["metadata"]["name"]: p for p in _pods(cluster)}
    assert sorted(pods) == sorted(p["name"] for p in status["pods"]) and len(pods) == 2, (pods.keys(), status)
    assert all(_running(p) for p in pods.values())
    assert len({p["spec"]["nodeName"] for p in pods.values()}) == 2  # the base's anti-affinity
    assert cluster.leader_pod() in pods
    for pod in status["pods"]:
        pid = pod["pid"]
        proc = Path(f"/proc/{pid}/status").read_text()
        assert "Uid:\t10001\t10001\t10001\t10001" in proc and "NoNewPrivs:\t1" in proc, proc
        assert "CapBnd:\t0000000000000000" in proc
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"serve") - 1].endswith(b"/runbook") and b"--listen" in argv, argv
        env = dict(e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        assert (env["RUNBOOK_STORE"], env["POD_NAME"], env["HOSTNAME"]) == ("kubernetes", pod["name"], pod["name"])
        assert "KUBECONFIG" not in env and env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
        assert _ns_run(pid, "touch", "/usr/x").returncode != 0  # read-only root
        assert _ns_run(pid, "stat", "-c", "%a %u %g", "/etc/runbook/credentials/ssh-private-key").stdout.split() \
            == ["440", "0", "10001"]  # root's file, readable by the process through fsGroup
        assert _ns_run(pid, "cat", "/var/run/secrets/kubernetes.io/serviceaccount/namespace").stdout == NS
    # the Service answers on its loopback address; reads need a token (auth.reads: token)
    assert httpx.get(cluster.service_url + "/readyz", timeout=10).json()["status"] == "ready"
    anonymous = httpx.get(cluster.service_url + "/runs", headers={"Host": cluster.host_header}, timeout=10)
    assert anonymous.status_code == 401, anonymous.text


def test_omen2_pages_the_service_waits_as_a_remediation_run_and_an_rbac_approver_approves_it_to_recovery(
        cluster: Cluster, sh: Any) -> None:
    def waiting() -> dict[str, Any] | None:
        return cluster.remediation_run("omen2", phase="WaitingApproval")

    rr = wait_for(waiting, ALERT_TIMEOUT + PLAN_TIMEOUT, "omen2's RemediationRun to wait for approval")
    run_id = rr["metadata"]["name"]
    assert rr["spec"]["source"] == "alertmanager" and rr["spec"]["runbook"] == "gpu-node-recovery"
    run = cluster.api("GET", f"/runs/{run_id}")  # through the Service
    assert run.status_code == 200, run.text
    assert run.json()["state"] == "waiting-approval" and run.json()["approval_required"] is True
    # Approved at the leading pod's own address: the leader then executes the run, whichever replica
    # planned it (its own run at once, another's at its next sweep). Approved at a follower that
    # planned it, the follower executes it and the leader's sweep could claim it too in between (an
    # owner on another host reads as not alive): a known gap of the run service, not of the base.
    leader = cluster.leader_pod()
    pods = {p["name"]: p for p in cluster.status()["pods"]}
    approved = cluster.api("POST", f"/runs/{run_id}/approve", base=f"http://{pods[leader]['pod_ip']}:8080",
                           json={"plan_digest": run.json()["plan_digest"]})
    assert approved.status_code in (200, 202), approved.text

    def finished() -> dict[str, Any] | None:
        rr = cluster.remediation_run("omen2", run_id)
        return rr if rr and rr["status"].get("phase") in ("Succeeded", "Failed", "Blocked", "Cancelled") else None

    done = wait_for(finished, RUN_TIMEOUT, "omen2's run to finish")
    assert done["status"]["phase"] == "Succeeded", done["status"].get("message")
    assert done["status"]["approval"]["by"] == f"system:serviceaccount:{NS}:{APPROVER}"
    omen2_recovered(cluster.lab, sh)
    described = cluster.kubectl("describe", "node", "omen2").stdout
    assert "RemediationStepSucceeded" in described and "runbook" in described
    # every change of the run was made by the replicas' ServiceAccount
    node = node_json(sh, "omen2")
    assert ready_status(node) == "True"


def _logs(c: Cluster) -> str:
    """The supervisor's log and each replica's last lines (why a replica is gone)."""
    folder = Path(c.lab.lab.record()["cluster_mode"]["dir"])
    parts = [(folder / "supervisor.log").read_text(errors="replace")[-2000:]]
    for log in sorted(folder.glob("pods/*/container.log")):
        parts.append(f"== {log.parent.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(parts)


def _changes(c: Cluster, node: str, since: int, calls_before: int) -> dict[str, Any]:
    labels = []
    for e in c.plane.mutations(since=since, user=SA_USER):
        ref = e.get("objectRef", {})
        if e.get("verb") == "patch" and ref.get("resource") == "nodes" and ref.get("name") == node:
            value = (((e.get("requestObject") or {}).get("metadata") or {}).get("labels") or {}).get(LABEL)
            if value is not None:
                labels.append(value)
    calls = HostState(c.lab.lab.record()["nodes"][node]["state_dir"]).calls()[calls_before:]
    swapoffs = sum(1 for x in calls if x["cmd"] == "swapoff")
    restarts = sum(1 for x in calls if x["cmd"] == "systemctl" and x["argv"][:1] == ["restart"])
    return {"label": labels, "swapoff": swapoffs, "restart": restarts}


def test_kill_9_of_the_leader_during_the_next_paged_run_the_other_replica_finishes_it_each_change_once(
        cluster: Cluster) -> None:
    node = "gpu-3090-1"

    def waiting() -> dict[str, Any] | None:
        return cluster.remediation_run(node, phase="WaitingApproval")

    rr = wait_for(waiting, PLAN_TIMEOUT, f"{node}'s RemediationRun to wait for approval")
    run_id = rr["metadata"]["name"]
    stop_kubelet(cluster.lab, node)  # only the runbook's restart brings kubelet back (the step really acts)
    calls_before = len(HostState(cluster.lab.lab.record()["nodes"][node]["state_dir"]).calls())
    mark = cluster.plane.audit_mark()
    leader = cluster.leader_pod()
    pods = {p["name"]: p for p in cluster.status()["pods"]}
    assert len(pods) == 2 and leader in pods, (leader, pods, _logs(cluster))
    survivor = next(name for name in pods if name != leader)
    # approved at the leader's own address: the leader executes it (its own run, or claimed at its sweep)
    digest = cluster.api("GET", f"/runs/{run_id}").json()["plan_digest"]
    approved = cluster.api("POST", f"/runs/{run_id}/approve", base=f"http://{pods[leader]['pod_ip']}:8080",
                           json={"plan_digest": digest})
    assert approved.status_code in (200, 202), approved.text

    def swapped_off() -> bool:
        events = (cluster.remediation_run(node, run_id) or {}).get("status", {}).get("events", [])
        return any(e.get("kind") == "step.outcome" and e.get("step") == "swap-off" for e in events)

    wait_for(swapped_off, RUN_TIMEOUT, f"{node}'s swap-off step to finish", interval=0.2)
    os.kill(pods[leader]["pid"], signal.SIGKILL)
    wait_for(lambda: [p["metadata"]["name"] for p in _pods(cluster)] == [survivor], 60,
             "the killed replica's Pod to be gone")
    assert [p["name"] for p in cluster.status()["pods"]] == [survivor]

    def finished() -> dict[str, Any] | None:
        rr = cluster.remediation_run(node, run_id)
        return rr if rr and rr["status"].get("phase") in ("Succeeded", "Failed", "Blocked", "Cancelled") else None

    done = wait_for(finished, TAKEOVER_TIMEOUT + RUN_TIMEOUT, f"{node}'s run to finish at the other replica")
    assert done["status"]["phase"] == "Succeeded", done["status"].get("message")
    kinds = [e.get("kind") for e in done["status"].get("events", [])]
    assert "run.taken_over" in kinds, kinds
    assert done["status"]["owner"]["host"] == survivor
    assert cluster.leader_pod() == survivor
    changes = _changes(cluster, node, mark, calls_before)
    assert changes["swapoff"] == 1 and changes["restart"] == 1 and len(changes["label"]) <= 1, changes


def test_stopping_cluster_mode_ends_the_replicas_and_deletes_their_pods(cluster: Cluster) -> None:
    pids = [p["pid"] for p in cluster.status()["pods"]]
    assert pids
    cluster.lab.lab.stop_cluster_mode()
    assert not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
                   for pid in pids)
    deadline = time.monotonic() + 30
    while _pods(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _pods(cluster) == []
