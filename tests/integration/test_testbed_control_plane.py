"""The control plane's own contract: fault injection keeps state, other processes can find and stop it,
two of them never collide, and stopping one leaves no process behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.rest import ApiException

from engine.lab.assets import BINARIES, assets_complete, find_assets
from engine.lab.controlplane import COMPONENTS, ControlPlane
from engine.lab.procs import ProcessRef


def test_restarting_the_api_server_keeps_objects_port_and_credentials(control_plane: ControlPlane,
                                                                      kube_client: client.CoreV1Api) -> None:
    kube_client.create_node({"metadata": {"name": "survivor", "labels": {"keep": "me"}}})
    url, etcd_pid = control_plane.url, control_plane.pids()["etcd"]
    old_apiserver = control_plane.pids()["kube-apiserver"]

    control_plane.restart_apiserver()

    assert control_plane.url == url
    assert control_plane.pids()["etcd"] == etcd_pid
    assert control_plane.pids()["kube-apiserver"] != old_apiserver
    assert kube_client.read_node("survivor").metadata.labels == {"keep": "me"}  # same client, same token


def test_a_stopped_api_server_refuses_connections_until_started_again(control_plane: ControlPlane,
                                                                      kube_client: client.CoreV1Api) -> None:
    control_plane.stop_apiserver()
    try:
        with pytest.raises(urllib3.exceptions.MaxRetryError) as refused:  # the client's retries, all refused
            kube_client.list_node(_request_timeout=2)
        assert isinstance(refused.value.reason, urllib3.exceptions.NewConnectionError)
        assert "Connection refused" in str(refused.value.reason)
    finally:
        control_plane.start_apiserver()

    kube_client.create_node({"metadata": {"name": "after-restart"}})  # serving again: reads and writes
    assert [n.metadata.name for n in kube_client.list_node().items] == ["after-restart"]
    assert set(control_plane.pids()) == set(COMPONENTS)


def test_the_state_file_lets_another_process_find_the_control_plane(control_plane: ControlPlane) -> None:
    state = json.loads((control_plane.state_dir / "controlplane.json").read_text())
    attached = ControlPlane.from_state(control_plane.state_dir)

    assert state["url"] == control_plane.url == attached.url
    assert attached.pids() == control_plane.pids()
    assert attached.is_running()
    assert Path(state["kubeconfig"]) == control_plane.kubeconfig


def test_the_controllers_run_with_the_configured_node_lifecycle_timings(control_plane: ControlPlane) -> None:
    argv = Path(f"/proc/{control_plane.pids()['kube-controller-manager']}/cmdline").read_bytes().split(b"\0")

    assert b"--node-monitor-grace-period=8s" in argv
    controllers = next(a for a in argv if a.startswith(b"--controllers=")).split(b"=", 1)[1].split(b",")
    assert {b"nodelifecycle", b"podgc", b"disruption", b"replicaset", b"csrsigning"} <= set(controllers)
    assert b"--node-eviction-rate=10.0" in argv


def test_the_assets_folder_holds_all_four_binaries() -> None:
    assets = find_assets()
    assert assets is not None and assets_complete(assets)
    versions = subprocess.run([str(assets / "kube-apiserver"), "--version"], capture_output=True, text=True)
    assert versions.stdout.strip() == "Kubernetes v1.20.2"
    assert set(BINARIES) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}


def test_a_second_control_plane_runs_beside_the_first_and_stopping_it_from_another_process_leaves_nothing(
        control_plane: ControlPlane, tmp_path: Path) -> None:
    second = ControlPlane(tmp_path / "second", die_with_parent=True, node_monitor_grace_period="5s",
                          default_unreachable_toleration_seconds=30)
    second.start()
    try:
        assert set(second.ports.values()).isdisjoint(control_plane.ports.values())
        with second.new_api_client() as api:
            client.CoreV1Api(api).create_node({"metadata": {"name": "only-in-second"}})
        with pytest.raises(ApiException), control_plane.new_api_client() as api:
            client.CoreV1Api(api).read_node("only-in-second")
        refs = list(second.process_refs().values())
        assert len(refs) == 4 and all(r.alive() for r in refs)

        stopper = subprocess.run(  # what `runbook lab down` does: attach through the state file and stop
            [sys.executable, "-c", "import sys; from engine.lab.controlplane import ControlPlane; "
             "ControlPlane.from_state(sys.argv[1]).stop()", str(second.state_dir)],
            capture_output=True, text=True, timeout=120)
        assert stopper.returncode == 0, stopper.stderr

        deadline = time.monotonic() + 10
        while any(r.alive() for r in refs) and time.monotonic() < deadline:
            second.pids()  # reaps our exited children
            time.sleep(0.05)
        assert not any(r.alive() for r in refs)
        assert not second.state_dir.exists()
        assert control_plane.is_running()
    finally:
        second.stop()


def test_stop_leaves_no_etcd_or_apiserver_process(tmp_path: Path) -> None:
    plane = ControlPlane(tmp_path / "cp", die_with_parent=True).start()
    refs: dict[str, ProcessRef] = plane.process_refs()

    plane.stop()

    assert plane.pids() == {}
    assert {name for name, ref in refs.items() if ref.alive()} == set()
    assert not (tmp_path / "cp").exists()
