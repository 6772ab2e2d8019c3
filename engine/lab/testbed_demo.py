"""``python -m engine.lab.testbed_demo``: bring the test bed up and show it working, then tear it down.

Starts the control plane (building its binaries first if needed), registers one Ready Node per node
host, starts the SSH node hosts, and prints ``kubectl get nodes`` and an Ansible ping plus a
become-root read of a host's /etc/fstab. The setup script runs this until the lab CLI exists.
Must not leave anything running unless ``--keep`` is given (then it prints how to stop it).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from engine.lab.assets import ensure_assets
from engine.lab.controlplane import ControlPlane
from engine.lab.kubectl import Kubectl
from engine.lab.nodehosts import NodeHostSpec, start_node_hosts


def register_ready_node(plane: ControlPlane, name: str) -> None:
    from kubernetes import client

    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    with plane.new_api_client() as api:
        core = client.CoreV1Api(api)
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(
            name=name, labels={"nvidia.com/gpu.present": "true"})))
        core.patch_node_status(name, {"status": {
            "capacity": {"cpu": "32", "memory": "128Gi", "pods": "110", "nvidia.com/gpu": "1"},
            "allocatable": {"cpu": "32", "memory": "128Gi", "pods": "110", "nvidia.com/gpu": "1"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}]}})


def show(title: str, argv: list[str]) -> bool:
    print(f"\n$ {title}", flush=True)
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    print((result.stdout + result.stderr).rstrip(), flush=True)
    return result.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--hosts", nargs="+", default=["omen1", "omen2"], help="node host names")
    parser.add_argument("--workdir", type=Path, default=None, help="state folder (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="leave the test bed running")
    args = parser.parse_args(argv)

    assets = ensure_assets(progress=print)
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="runbook-testbed-"))).resolve()
    print(f"test bed in {workdir} (binaries: {assets})", flush=True)
    plane = ControlPlane(workdir / "control-plane", assets=assets)
    plane.start()
    hosts = None
    ok = False
    try:
        print(f"control plane ready at {plane.url}; pids {plane.pids()}", flush=True)
        specs = [NodeHostSpec(name, sudo="password") for name in args.hosts]
        hosts = start_node_hosts(specs, workdir / "node-hosts")
        for host in hosts:
            register_ready_node(plane, host.k8s_node_name)
            print(f"node host {host.name}: ssh {host.user}@{host.address} (sshd pid {host.pid})", flush=True)
        kubectl = Kubectl(plane.kubeconfig, workdir / "kubectl-home")
        inventory = str(hosts.inventory_path)
        ok = all([
            show(f"kubectl --kubeconfig {plane.kubeconfig} get nodes -o wide",
                 kubectl.argv("get", "nodes", "-o", "wide")),
            show(f"ansible -i {inventory} all -m ping", ["ansible", "-i", inventory, "all", "-m", "ping"]),
            show(f"ansible -i {inventory} {args.hosts[-1]} -b -m command -a 'cat /etc/fstab'",
                 ["ansible", "-i", inventory, args.hosts[-1], "-b", "-m", "command", "-a", "cat /etc/fstab"]),
        ])
        print("\ntest bed works" if ok else "\ntest bed check FAILED", flush=True)
        if args.keep:
            print(f"left running: KUBECONFIG={plane.kubeconfig} inventory {inventory}\nstop it with: "
                  f"python -c 'from engine.lab.controlplane import ControlPlane; "
                  f"ControlPlane.from_state(\"{plane.state_dir}\").stop()'  and kill the sshd pids "
                  f"{list(hosts.pids().values())}")
    finally:
        if not args.keep:
            if hosts is not None:
                hosts.stop()
            plane.stop()
            if args.workdir is None:
                shutil.rmtree(workdir, ignore_errors=True)
            print("test bed stopped", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
