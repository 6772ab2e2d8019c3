"""Lab: ``runbook rollback RUN_ID`` undoes the flagship's recovery of omen2 on the real API server and
the real node host: refused (exit 3, the guard named) while the host's CUDA job runs, since restoring
vm-passthrough would let vfio-manager kill it; once the job is stopped, the workload label and
/etc/fstab come back byte for byte (fstab-restore.yml, over real SSH), and the journal links both runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.lab.flagship_cli import LABEL, host_lines, kube_node, runbook

pytestmark = [pytest.mark.integration, pytest.mark.lab]


def fstab_bytes(sh: Any) -> str:
    (line,) = host_lines(sh, "omen2", "base64 -w0 /etc/fstab")
    return line


@pytest.mark.timeout(1200)
def test_a_rolled_back_run_restores_the_label_and_fstab_byte_for_byte_and_the_journal_links_both(
        fresh_lab: Any, sh: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.sqlite"
    label_before = kube_node(sh, "omen2")["metadata"]["labels"][LABEL]
    fstab_before = fstab_bytes(sh)
    done = runbook(sh, "run gpu-node-recovery --node omen2 --yes -o json", journal=journal)
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = json.loads(done.stdout)["run_id"]
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "container" and fstab_bytes(sh) != fstab_before

    # The plan of the rollback names each inverse; with the host's CUDA job running it is refused.
    planned = runbook(sh, f"plan --rollback {run_id}", journal=journal)
    assert planned.returncode == 3, planned.stdout + planned.stderr
    assert "undo-relabel-container" in planned.stdout and "cuda_process_count" in planned.stdout
    assert "undo-swap-off" in planned.stdout and "fstab-restore.yml" in planned.stdout
    refused = runbook(sh, f"rollback {run_id} --yes", journal=journal)
    assert refused.returncode == 3 and "nothing was changed" in refused.stderr, refused.stdout + refused.stderr
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == "container"

    stop = runbook(sh, "lab job stop omen2")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    # The run guards hold for a rollback as for any run: omen2 back out of service would exceed the
    # lab's GPU budget (the other GPU nodes are down by design), so a person passes it, saying why.
    blocked = runbook(sh, f"rollback {run_id} --yes", journal=journal)
    assert blocked.returncode == 3 and "guard gpu-budget" in blocked.stdout, blocked.stdout + blocked.stderr
    undone = runbook(sh, f"rollback {run_id} --yes -o json --override-guard gpu-budget "
                         "--reason 'lab: the other GPU nodes are down by design'", journal=journal)
    assert undone.returncode == 0, undone.stdout + undone.stderr
    back = json.loads(undone.stdout)
    assert [o["step"] for o in back["outcomes"]] == ["undo-swap-off", "undo-relabel-container"]
    assert kube_node(sh, "omen2")["metadata"]["labels"][LABEL] == label_before
    assert fstab_bytes(sh) == fstab_before

    shown = runbook(sh, f"runs show {run_id}", journal=journal)
    assert f"rolled back by run {back['run_id']}" in shown.stdout, shown.stdout
    child = runbook(sh, f"runs show {back['run_id']} -o json", journal=journal)
    assert json.loads(child.stdout)["parent"] == {"run": run_id, "why": "rolls back"}
    again = runbook(sh, f"rollback {run_id} --yes", journal=journal)
    assert again.returncode == 2 and f"rolled back already by run {back['run_id']} (succeeded)" in again.stderr
