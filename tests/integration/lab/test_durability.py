"""The engine survives its own death: SIGKILL at each step boundary of gpu-node-recovery, then resume.

The flagship runs as its own process (the real CLI) against the lab. The test hook
``RUNBOOK_TEST_KILL_AT=STEP:PHASE`` makes the engine SIGKILL itself exactly at a step boundary
(docs/reliability.md); ``runbook runs`` must then show the run ``interrupted``, and
``runbook resume RUN_ID --yes`` must finish it with every mutating action done exactly once:
one label PATCH (the API server's audit log), one ``swapoff`` and one ``systemctl restart kubelet``
(the host's call log). Kubelet is stopped first so the runbook's restart is the only way back.

CI runs one boundary per phase plus the Ansible step killed after its action (4 cases: resume must
verify the kubelet restart instead of redoing it); the other five are marked ``slow`` (``pytest -m
slow``). Every case also asserts that the host's CUDA job survived (the lab's count of killed jobs).
A non-idempotent step left half-way (killed after its intent) is not rerun without confirmation (CI).
SIGTERM and a double SIGINT are tested here too: the outcome is recorded, the Lease released, and no
process of the run (ansible-playbook, its workers, ssh) is left.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.lab.test_durability_helpers import (
    FLAGSHIP,
    NODE,
    REPO,
    Effects,
    Engine,
    lease_holder,
    node_label,
    stop_kubelet,
)

pytestmark = [pytest.mark.integration, pytest.mark.lab]

RUN = ("run", FLAGSHIP, "--node", NODE, "--yes")
CI_POINTS = [("relabel-container", "after-action"), ("swap-off", "before-action"),
             ("restart-kubelet", "after-action"), ("restart-kubelet", "after-verify")]
ALL_POINTS = [(s, p) for s in ("relabel-container", "swap-off", "restart-kubelet")
              for p in ("before-action", "after-action", "after-verify")]
LAST_EVENT = {"before-action": "action.intent", "after-action": "action.result", "after-verify": "verify.result"}
EFFECT = {"relabel-container": "label", "swap-off": "swapoff", "restart-kubelet": "restart"}


@pytest.fixture
def engine(fresh_lab: Any) -> Iterator[Engine]:
    with Engine.for_lab(fresh_lab) as e:
        yield e


def _points() -> list[Any]:
    return [pytest.param(s, p, id=f"{s}:{p}", marks=() if (s, p) in CI_POINTS else pytest.mark.slow)
            for s, p in ALL_POINTS]


@pytest.mark.parametrize(("step", "phase"), _points())
def test_killed_at_a_step_boundary_the_run_resumes_and_does_every_change_exactly_once(
        engine: Engine, step: str, phase: str) -> None:
    stop_kubelet(engine.lab)
    effects = Effects(engine.lab)
    assert effects.cuda_jobs() == (1, 0)  # the job the run must not kill is there
    killed = engine.run(*RUN, env={"RUNBOOK_TEST_KILL_AT": f"{step}:{phase}"})
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    run = engine.last_run()
    events = engine.events(run.id)
    # the journal ends exactly at the boundary: what a crash there leaves behind
    assert (events[-1].kind, events[-1].step) == (LAST_EVENT[phase], step), [e.kind for e in events[-3:]]
    # write-ahead: killed right after the intent, the effect has not happened; after the action, once
    assert effects.counts()[EFFECT[step]] == (0 if phase == "before-action" else 1)
    assert {r["id"]: r["state"] for r in engine.runs_json()}[run.id] == "interrupted"
    assert engine.show_json(run.id)["state"] == "interrupted"
    assert lease_holder(engine.lab) == f"runbook/{run.id}"  # the dead run still holds the node

    if (step, phase) == ("swap-off", "before-action"):
        # another run on the node waits for the dead run's Lease (exit 3, naming it), changing nothing
        other = engine.run(*RUN)
        assert other.returncode == 3, other.stdout + other.stderr
        assert f"runbook/{run.id}" in other.stdout + other.stderr

    resumed = engine.run("resume", run.id, "--yes")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert effects.counts() == {"label": 1, "swapoff": 1, "restart": 1}
    assert effects.timeline() == ["label=container", "swapoff", "systemctl restart kubelet"]
    assert effects.cuda_jobs() == (1, 0)  # relabelled before kubelet came back: vfio-manager killed nothing
    final = engine.journal.get_run(run.id)
    assert (final.state, final.exit_code) == ("succeeded", 0)
    resume_event = next(e.data for e in engine.events(run.id) if e.kind == "run.resume")
    assert resume_event["started_without_outcome"] == step
    assert lease_holder(engine.lab) is None
    assert node_label(engine.lab) == "container"
    assert engine.wait_no_leftovers() == []  # the dead engine's ssh masters were swept too

    again = engine.run("resume", run.id, "--yes")  # a finished run: print its state, exit 0
    assert again.returncode == 0 and "already finished: succeeded" in again.stdout
    assert effects.counts() == {"label": 1, "swapoff": 1, "restart": 1}


def test_sigterm_lets_the_current_action_finish_records_it_and_leaves_nothing_behind(engine: Engine) -> None:
    effects = Effects(engine.lab)
    proc = engine.start(*RUN)
    run_id = engine.wait_for_event("ansible.task", "swap-off")  # the playbook is running
    running = engine.leftovers()
    assert any("ansible-playbook" in p for p in running), running  # the count below is not vacuous
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=180) == 4, engine.output()
    outcomes = {e.step: e.data for e in engine.events(run_id) if e.kind == "step.outcome"}
    assert outcomes["swap-off"]["status"] == "cancelled"
    assert outcomes["swap-off"]["reason"].startswith("cancelled after the action finished")
    assert "restart-kubelet" not in outcomes
    assert effects.swapoffs() == 1 and effects.kubelet_restarts() == 0  # finished, and nothing after it
    rec = engine.journal.get_run(run_id)
    assert (rec.state, rec.exit_code) == ("cancelled", 4)
    assert lease_holder(engine.lab) is None
    assert engine.wait_no_leftovers() == []
    assert "SIGTERM: stopping after the current action" in engine.output()


def test_a_second_sigint_stops_the_playbook_now_records_it_and_leaves_nothing_behind(engine: Engine) -> None:
    proc = engine.start(*RUN)
    run_id = engine.wait_for_event("ansible.task", "swap-off")
    assert any("ansible-playbook" in p for p in engine.leftovers())
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    assert proc.wait(timeout=60) == 4, engine.output()
    assert time.monotonic() - started < 20  # not the playbook's own end
    outcomes = {e.step: e.data for e in engine.events(run_id) if e.kind == "step.outcome"}
    assert outcomes["swap-off"]["status"] == "cancelled", outcomes
    assert "rollback.start" not in [e.kind for e in engine.events(run_id)]
    assert engine.journal.get_run(run_id).state == "cancelled"
    assert lease_holder(engine.lab) is None
    assert engine.wait_no_leftovers() == []
    assert "stopping the current action now" in engine.output()


def test_a_non_idempotent_step_left_half_way_is_not_rerun_without_confirmation(engine: Engine) -> None:
    (engine.root / "runbooks").mkdir()
    text = (REPO / "runbooks" / f"{FLAGSHIP}.yaml").read_text()
    text = text.replace("  - id: restart-kubelet\n", "  - id: restart-kubelet\n    idempotent: false\n")
    (engine.root / "runbooks" / f"{FLAGSHIP}.yaml").write_text(text)
    own = {"RUNBOOK_RUNBOOKS_DIR": str(engine.root / "runbooks")}
    stop_kubelet(engine.lab)
    effects = Effects(engine.lab)
    killed = engine.run(*RUN, env={**own, "RUNBOOK_TEST_KILL_AT": "restart-kubelet:before-action"})
    assert killed.returncode == -signal.SIGKILL
    run_id = engine.last_run().id
    last = engine.events(run_id)[-1]
    assert (last.kind, last.step) == ("action.intent", "restart-kubelet")  # left half-way: intent, no result
    assert effects.counts() == {"label": 1, "swapoff": 1, "restart": 0}  # the steps before it did run
    resumed = engine.run("resume", run_id, "--yes", env=own)  # no terminal: nobody can confirm
    assert resumed.returncode == 3, resumed.stdout + resumed.stderr
    assert "not idempotent" in resumed.stdout + resumed.stderr
    assert effects.kubelet_restarts() == 0
    assert engine.journal.get_run(run_id).state == "interrupted"  # still resumable by a person
    assert lease_holder(engine.lab) is None
