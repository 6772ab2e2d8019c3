"""``lab up`` is idempotent and ``lab down`` leaves no process, no mount and no folder behind.

Uses its own small lab (one SSH host), so the session lab of the other modules is not disturbed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.lab import procs
from engine.lab.controlplane import ControlPlane
from engine.lab.manager import Lab

pytestmark = [pytest.mark.integration, pytest.mark.lab]

SMALL = """\
apiVersion: runbook.lab/v1
name: small
timing: {kubelet_restart_seconds: 1}
nodes:
  - {name: worker-1, host: {ssh: false}}
  - {name: worker-2, host: {ssh: false}}
  - name: omen2
    labels: {nvidia.com/gpu.workload.config: vm-passthrough}
    gpus: [{model: "10de:2b85"}]
    host:
      swap: {devices: {/swapfile: {size: 32Gi}}, active: [/swapfile]}
      cuda_jobs: [{name: python3}]
vms:
  - {name: gpu-fedora, host_devices: [nvidia.com/GB202_GEFORCE_RTX_5090]}
  - {name: plain}
"""


def test_up_is_idempotent_and_down_leaves_no_process_mount_or_folder(lab: object, tmp_path: Path) -> None:
    scenario = tmp_path / "small.yaml"
    scenario.write_text(SMALL)
    small = Lab(tmp_path / "lab")
    try:
        first = small.up(scenario, timeout=120)
        assert first["started"] and small.running()
        started = time.monotonic()
        again = small.up(scenario)
        assert again["started"] == [] and time.monotonic() - started < 5
        record = small.record()
        refs = [procs.ProcessRef.from_json(record["simulator"])]
        refs += [procs.ProcessRef.from_json(h["process"]) for h in record["hosts"].values()]
        refs += list(ControlPlane.from_state(record["controlplane_dir"]).process_refs().values())
        # (mount, UTS) pairs: the kernel reuses a freed namespace's inode number at once, and another
        # xdist worker's lab creates namespaces meanwhile; the pair does not come back by chance
        namespaces = [(h["mount_namespace"], h["uts_namespace"]) for h in record["hosts"].values()]
        layers = [Path(h["layers_dir"]) for h in record["hosts"].values()]
        assert len(refs) == 6 and all(r.alive() for r in refs)
        assert all(mnt and uts for mnt, uts in namespaces)
        assert all(procs.pids_in_mount_namespace(mnt, uts) for mnt, uts in namespaces)
    finally:
        result = small.down()
    assert result["stopped"]
    assert not any(r.alive() for r in refs)
    assert not any(procs.pids_in_mount_namespace(mnt, uts) for mnt, uts in namespaces)
    assert not small.dir.exists() and not any(p.exists() for p in layers)
    assert str(tmp_path) not in Path("/proc/self/mountinfo").read_text()
    assert small.down()["stopped"] == []  # down again: nothing left to stop
