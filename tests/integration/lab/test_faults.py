"""The cluster's faults during gpu-node-recovery on the lab: each ends cleanly, with evidence and the
right exit code, and nothing is lost or doubled.

* the API server stopped during the kubelet restart: the run is interrupted (exit 1, evidence in the
  journal, no blind rollback); once it is back, ``runbook resume`` completes with every change once;
* the node host unreachable before the run (blocked by the fail-closed precondition, exit 3,
  nothing changed) and during it (interrupted, exit 1; resume completes; ``slow``);
* a wrong become password: a clear error naming it, exit 3 (the host facts cannot be read, so the
  fail-closed precondition refuses before anything changes);
* a verification that never passes: timed out, the step's rollback runs, exit 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.lab.test_durability_helpers import (
    FLAGSHIP,
    LABEL,
    NODE,
    Effects,
    Engine,
    inventory_without_become_passwords,
    lease_holder,
    node_label,
    stop_kubelet,
)

pytestmark = [pytest.mark.integration, pytest.mark.lab]

RUN = ("run", FLAGSHIP, "--node", NODE, "--yes")
NOTHING = {"label": 0, "swapoff": 0, "restart": 0}
ONCE = {"label": 1, "swapoff": 1, "restart": 1}


@pytest.fixture
def engine(fresh_lab: Any) -> Iterator[Engine]:
    with Engine.for_lab(fresh_lab) as e:
        yield e


@pytest.fixture
def refused(lab: Any) -> Iterator[Engine]:
    """For runs that must change nothing: the incident (reset first if needed), left as it was."""
    if lab.dirty:
        lab.reset()
    with Engine.for_lab(lab) as e:
        yield e


def _outcomes(engine: Engine, run_id: str) -> dict[str, dict[str, Any]]:
    return {str(e.step): e.data for e in engine.events(run_id) if e.kind == "step.outcome"}


def test_the_api_server_stopped_mid_run_interrupts_it_with_evidence_and_resume_completes(engine: Engine) -> None:
    stop_kubelet(engine.lab)
    effects = Effects(engine.lab)
    plane = effects.plane
    proc = engine.start(*RUN, "-p", "ready_timeout=15")
    run_id = engine.wait_for_event("action.intent", "restart-kubelet")
    try:
        plane.stop_apiserver()
        assert proc.wait(timeout=300) == 1, engine.output()
        out = engine.output()
        rec = engine.journal.get_run(run_id)
        assert (rec.state, rec.exit_code) == ("interrupted", 1)
        outcome = _outcomes(engine, run_id)["restart-kubelet"]
        assert outcome["status"] == "failed"
        assert "unreachable" in outcome["evidence"]["outage"] or "refused" in outcome["evidence"]["outage"]
        assert "rollback.start" not in [e.kind for e in engine.events(run_id)]
        shown = engine.show_json(run_id)  # the evidence, from the journal alone (the API is still down)
        assert shown["state"] == "interrupted"
        assert any(e["kind"] == "verify.attempt" and "watch failed" in str(e.get("observed")) for e in shown["events"])
        assert f"runbook resume {run_id}" in out
        assert effects.counts() == ONCE  # the restart happened once before the API went away
    finally:
        plane.start_apiserver()
    resumed = engine.run("resume", run_id, "--yes")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert effects.counts() == ONCE  # verified on resume, not redone
    assert engine.journal.get_run(run_id).state == "succeeded"
    assert lease_holder(engine.lab) is None
    assert engine.wait_no_leftovers() == []


def test_an_unreachable_node_host_blocks_the_run_before_anything_changes(refused: Engine) -> None:
    engine = refused
    effects = Effects(engine.lab)
    inventory = engine.lab.lab.record()["inventory"]
    unreachable = inventory_without_become_passwords(engine.lab, engine.root / "inventory.yml", ansible_port=1)
    done = engine.run(*RUN, env={"RUNBOOK_INVENTORY": str(unreachable)})
    assert done.returncode == 3, done.stdout + done.stderr
    assert "unreachable" in done.stdout and "host-reachable" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert effects.counts() == NOTHING
    assert node_label(engine.lab) == "vm-passthrough"
    assert engine.last_run().state == "blocked"
    assert Path(inventory).exists() and engine.wait_no_leftovers() == []


@pytest.mark.slow
def test_a_node_host_lost_mid_run_interrupts_it_and_resume_completes_once_it_is_back(engine: Engine) -> None:
    stop_kubelet(engine.lab)  # only the runbook's restart brings kubelet back: the resumed run must do it
    effects = Effects(engine.lab)
    inventory = engine.root / "inventory.yml"
    reachable = inventory_without_become_passwords(engine.lab, inventory)
    good = reachable.read_text()
    proc = engine.start(*RUN, env={"RUNBOOK_INVENTORY": str(inventory)})
    run_id = engine.wait_for_event("step.outcome", "relabel-container")
    # ansible-playbook reads the inventory on every run: from now on omen2's sshd refuses connections
    inventory_without_become_passwords(engine.lab, inventory, ansible_port=1)
    assert proc.wait(timeout=300) == 1, engine.output()
    assert engine.journal.get_run(run_id).state == "interrupted"
    outcome = _outcomes(engine, run_id)["swap-off"]
    assert outcome["status"] == "failed" and "unreachable" in outcome["evidence"]["outage"]
    assert effects.counts() == {"label": 1, "swapoff": 0, "restart": 0}
    assert engine.wait_no_leftovers() == []
    inventory.write_text(good)  # the host is back
    resumed = engine.run("resume", run_id, "--yes", env={"RUNBOOK_INVENTORY": str(inventory)})
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert effects.counts() == ONCE
    assert effects.timeline() == ["label=container", "swapoff", "systemctl restart kubelet"]
    assert _outcomes(engine, run_id)["restart-kubelet"]["status"] == "succeeded"
    assert effects.cuda_jobs() == (1, 0)  # (running, killed)
    assert engine.journal.get_run(run_id).state == "succeeded"


def test_a_wrong_become_password_is_a_clear_error_and_changes_nothing(refused: Engine) -> None:
    engine = refused
    effects = Effects(engine.lab)
    inventory = inventory_without_become_passwords(engine.lab, engine.root / "inventory.yml")
    wrong = "not-the-password-Xq7"
    done = engine.run(*RUN, env={"RUNBOOK_INVENTORY": str(inventory), "RUNBOOK_BECOME_PASSWORD": wrong})
    out = done.stdout + done.stderr
    assert done.returncode == 3, out
    assert f"become password rejected on {NODE}" in out
    assert "Traceback" not in out and wrong not in out
    assert effects.counts() == NOTHING
    assert node_label(engine.lab) == "vm-passthrough"
    run = engine.last_run()
    assert run.state == "blocked"
    assert wrong.encode() not in b"".join(p.read_bytes() for p in engine.root.glob("journal.sqlite*"))


NEVER_VERIFIED = f"""\
apiVersion: runbook/v1
name: never-verified
version: "1"
description: A relabel whose verification can never pass (fault injection); its rollback relabels back.
params:
  node: {{type: node, required: true}}
steps:
  - id: relabel
    why: the verify below waits for a value nobody sets
    action:
      kube:
        label: {{{LABEL}: container}}
    verify:
      - check: {{node_label: {{key: {LABEL}, equals: never-this-value}}}}
        timeout: 4s
    on_failure:
      rollback:
        - kube: {{label: {{{LABEL}: vm-passthrough}}}}
"""


def test_a_verification_that_never_passes_times_out_and_rolls_back(engine: Engine) -> None:
    runbooks = engine.root / "runbooks"
    runbooks.mkdir()
    (runbooks / "never-verified.yaml").write_text(NEVER_VERIFIED)
    effects = Effects(engine.lab)
    done = engine.run("run", "never-verified", "--node", NODE, "--yes", "-o", "json",
                      env={"RUNBOOK_RUNBOOKS_DIR": str(runbooks)})
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["state"] == "failed"
    run = engine.last_run()
    outcome = _outcomes(engine, run.id)["relabel"]
    assert outcome["status"] == "rolled-back"
    assert outcome["reason"].startswith(f"verify label {LABEL} = never-this-value timed out")
    assert outcome["evidence"]["failure_status"] == "timed-out"
    assert effects.label_patches() == ["container", "vm-passthrough"]
    assert node_label(engine.lab) == "vm-passthrough"
    assert lease_holder(engine.lab) is None
