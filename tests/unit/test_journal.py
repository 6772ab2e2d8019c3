"""The journal is the engine's memory: written ahead of every effect, durable, and enough to resume.

Two levels: the journal itself (SQLite pragmas, a write that survives SIGKILL, owner liveness,
progress), and whole runs through ``RunService`` on our fake connectors, where the engine "dies"
right after an event was durably recorded (as ``RUNBOOK_TEST_KILL_AT`` does on the lab, without
killing the test process) and a resume must finish the run doing each effect exactly once.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from engine import probes
from engine.connectors.base import PlaybookResult
from engine.errors import KubeError, UsageError
from engine.execution import Executor, fault_injection_points
from engine.journal import Journal, JournalSink, StepProgress, _process_start
from engine.locks import holder_for, lease_name
from engine.model import Plan, RunState, StepStatus
from engine.params import PreparedRun, prepare_run
from engine.planning import plan_run
from engine.runs import RunService
from engine.settings import Settings
from tests.fakes import (
    GPU_LABEL,
    FakeClock,
    FakeKube,
    FakeNodes,
    incident_host,
    incident_node,
    install_recovery_effects,
)

REPO = Path(__file__).resolve().parents[2]
FLAGSHIP = REPO / "runbooks" / "gpu-node-recovery.yaml"
NOW = datetime(2026, 7, 10, 15, 40, tzinfo=UTC)


# -- the journal itself -----------------------------------------------------------------------


def test_the_journal_is_in_wal_mode_with_full_fsync(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite")
    assert j._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert j._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL: fsync the WAL on every commit


def test_an_appended_event_is_committed_before_append_returns(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite")
    run_id = j.create_run("rb", {"node": "omen2"}, ["omen2"])
    j.append(run_id, "action.intent", step="swap-off", action="ansible")
    other = sqlite3.connect(tmp_path / "j.sqlite")  # another process would see exactly this
    assert other.execute("SELECT kind, step FROM events WHERE run_id=? ORDER BY seq DESC LIMIT 1",
                         (run_id,)).fetchone() == ("action.intent", "swap-off")


def test_a_recorded_event_survives_sigkill_and_the_run_reads_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    script = textwrap.dedent(f"""
        import os, signal, sys
        from engine.journal import Journal
        j = Journal({str(path)!r})
        run_id = j.create_run("rb", {{"node": "omen2"}}, ["omen2"], state="running")
        j.append(run_id, "action.intent", step="swap-off", action="ansible")
        print(run_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == -9, done.stderr
    run_id = done.stdout.strip()
    j = Journal(path)
    assert [e.kind for e in j.events(run_id)] == ["action.intent"]
    assert j.get_run(run_id).state == "interrupted"
    assert j.list_runs()[0].state == "interrupted"


def test_a_run_owned_by_a_live_process_is_not_interrupted(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite")
    run_id = j.create_run("rb", {}, ["omen2"], state="running")
    assert j.get_run(run_id).state == "running"


@pytest.mark.parametrize("state", ["pending", "running", "waiting-approval"])
def test_a_run_whose_owner_is_gone_reads_interrupted_in_any_active_state(tmp_path: Path, state: str) -> None:
    j = Journal(tmp_path / "j.sqlite")
    run_id = j.create_run("rb", {}, ["omen2"], state=state)
    _owner_died(j, run_id)
    assert j.get_run(run_id).state == "interrupted"


def test_a_reboot_is_recognised_even_when_the_pid_and_start_time_come_back(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite")
    run_id = j.create_run("rb", {}, ["omen2"], state="running")
    start = j.get_run(run_id).owner_start
    assert start is not None and start == _process_start(os.getpid())
    ticks = start.rsplit("/", 1)[1]
    with j._tx() as db:  # same pid, same start ticks, but recorded under another boot
        db.execute("UPDATE runs SET owner_start=? WHERE id=?", (f"another-boot/{ticks}", run_id))
    assert j.get_run(run_id).state == "interrupted"
    with j._tx() as db:  # a record of an older version (no boot id) of a live process
        db.execute("UPDATE runs SET owner_start=? WHERE id=?", (ticks, run_id))
    assert j.get_run(run_id).state == "running"


def test_a_run_parked_for_approval_is_not_interrupted_when_its_process_exits(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite")
    run_id = j.create_run("rb", {}, ["omen2"], state="waiting-approval")
    _owner_died(j, run_id)
    j.disown(run_id)
    assert j.get_run(run_id).state == "waiting-approval"


def test_claim_is_refused_while_another_live_process_owns_the_run(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite")
    run_id = j.create_run("rb", {}, ["omen2"], state="running")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = None
        while ident is None:  # /proc/PID/stat exists as soon as the process does
            ident = _process_start(other.pid)
        with j._tx() as db:
            db.execute("UPDATE runs SET owner_pid=?, owner_start=? WHERE id=?", (other.pid, ident, run_id))
        assert j.claim(run_id) is False
        assert j.get_run(run_id).owner_pid == other.pid
    finally:
        other.kill()
        other.wait()
    assert j.claim(run_id) is True
    assert j.get_run(run_id).owner_pid == os.getpid()
    with pytest.raises(UsageError):
        j.claim("r-unknown")


def test_interrupted_is_stored_with_its_exit_code_and_running_again_clears_it(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.sqlite")
    run_id = j.create_run("rb", {}, ["omen2"], state="running")
    j.set_state(run_id, "interrupted", exit_code=1)
    rec = j.get_run(run_id)
    assert (rec.state, rec.exit_code) == ("interrupted", 1) and rec.finished is not None
    j.set_state(run_id, "running")
    rec = j.get_run(run_id)
    assert (rec.state, rec.exit_code, rec.finished) == ("running", None, None)


def test_known_secrets_and_secret_looking_keys_never_reach_the_file(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    j = Journal(path)
    j.add_secret("s3cr3t-Become")
    run_id = j.create_run("rb", {"node": "omen2", "api_token": "tok-123"}, ["omen2"])
    j.append(run_id, "ansible.task", step="s", msg="sudo: s3cr3t-Become rejected", password="p4ss")
    j.close()
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("j.sqlite*"))
    for secret in (b"s3cr3t-Become", b"tok-123", b"p4ss"):
        assert secret not in raw
    # the run and the event around the secrets were written, masked, not dropped
    again = Journal(path)
    assert again.get_run(run_id).params == {"node": "omen2", "api_token": "***"}
    (event,) = again.events(run_id)
    assert (event.kind, event.step) == ("ansible.task", "s")
    assert event.data == {"msg": "sudo: *** rejected", "password": "***"}
    again.close()


# -- progress: what a resume must know -------------------------------------------------------


Events = list[tuple[str, str | None, dict[str, Any]]]


@pytest.fixture
def progress_of(tmp_path: Path) -> Any:
    """Record ``events`` for a new run in a fresh journal; return ``Journal.progress`` of it."""
    def progress(*events: tuple[str, str | None, dict[str, Any]]) -> StepProgress:
        journal = Journal(tmp_path / f"progress-{len(list(tmp_path.iterdir()))}.sqlite")
        run_id = journal.create_run("rb", {}, ["omen2"])
        for kind, step, data in events:
            journal.append(run_id, kind, step=step, **data)
        return journal.progress(run_id)

    return progress


def _step(step: str, status: str | None = None, *, intent: bool = False, result: bool | None = None,
          rollback: bool = False) -> Events:
    events: Events = [("step.start", step, {})]
    if intent:
        events.append(("action.intent", step, {"rollback": False}))
    if result is not None:
        events.append(("action.result", step, {"ok": result, "rollback": False}))
    if rollback:
        events += [("rollback.start", step, {}), ("action.intent", step, {"rollback": True})]
    if status:
        events.append(("step.outcome", step, {"status": status}))
    return events


def test_progress_of_a_run_that_died_before_acting(progress_of: Any) -> None:
    p = progress_of(*_step("a", "succeeded", intent=True, result=True), *_step("b", "skipped"), *_step("c"))
    assert p == StepProgress(completed=frozenset({"a", "b"}))


def test_progress_of_a_run_that_died_after_the_intent(progress_of: Any) -> None:
    p = progress_of(*_step("a", "succeeded", intent=True, result=True), *_step("b", intent=True))
    assert p == StepProgress(completed=frozenset({"a"}), interrupted_step="b", action_finished=False)


def test_progress_of_a_run_that_died_after_the_action_finished(progress_of: Any) -> None:
    p = progress_of(*_step("a", intent=True, result=True))
    assert p == StepProgress(completed=frozenset(), interrupted_step="a", action_finished=True)


def test_a_failed_action_result_does_not_count_as_finished(progress_of: Any) -> None:
    p = progress_of(*_step("a", "failed", intent=True, result=False))
    assert (p.interrupted_step, p.action_finished) == ("a", False)


def test_an_intent_of_an_earlier_attempt_still_counts(progress_of: Any) -> None:
    # attempt 1 announced the action and died; attempt 2 (a resume) died before re-deciding
    p = progress_of(*_step("a", intent=True), ("run.resume", None, {}), *_step("a"))
    assert p.interrupted_step == "a"


def test_a_step_that_died_while_rolling_back_is_reported(progress_of: Any) -> None:
    p = progress_of(*_step("a", intent=True, result=True, rollback=True))
    assert p.rollback_started and p.interrupted_step == "a"


def test_a_cancelled_or_blocked_step_is_not_completed(progress_of: Any) -> None:
    p = progress_of(*_step("a", "cancelled", intent=True, result=True), *_step("b", "blocked"))
    assert p.completed == frozenset() and p.interrupted_step == "a"


def test_the_kill_hook_is_inert_unless_set() -> None:
    assert fault_injection_points("") == frozenset()
    assert fault_injection_points("swap-off:before-action, relabel:after-verify,bad,x:unknown-phase") == frozenset(
        {("swap-off", "before-action"), ("relabel", "after-verify")})


# -- whole runs on fake connectors -----------------------------------------------------------


class Died(BaseException):
    """The engine process is gone (what SIGKILL does; raised only after the event was recorded)."""


class DyingSink:
    """Records like the journal, then 'dies' right after the event that marks ``phase`` of ``step``."""

    def __init__(self, inner: Any, step: str, phase: str, verify_count: int) -> None:
        self.inner, self.step, self.phase, self.verify_left = inner, step, phase, verify_count

    def emit(self, kind: str, **data: Any) -> None:
        self.inner.emit(kind, **data)
        if data.get("step") != self.step or data.get("rollback"):
            return
        if kind == "verify.result" and data.get("holds"):
            self.verify_left -= 1
        if (self.phase, kind) in (("before-action", "action.intent"), ("after-action", "action.result"),
                                  ("after-outcome", "step.outcome")) or \
                (self.phase == "after-verify" and kind == "verify.result" and self.verify_left == 0):
            raise Died


@dataclass
class World:
    clock: FakeClock
    kube: FakeKube
    nodes: FakeNodes
    service: RunService
    prepared: PreparedRun

    def plan(self) -> Plan:
        rb, params = self.prepared.runbook, self.prepared.params
        facts = probes.gather(rb, params, "omen2", self.kube, self.nodes, clock=self.clock.wall)
        return plan_run(rb, params, facts, runbook_digest=self.prepared.loaded.digest, now=NOW)

    def executor(self, sink: Any) -> Executor:
        return Executor(self.kube, self.nodes, events=sink, playbooks_dir=self.prepared.loaded.playbooks_dir,
                        **self.service.executor_options)

    def start_and_die(self, step: str, phase: str) -> str:
        """A run whose engine dies at ``step``/``phase``: the journal holds what SIGKILL leaves."""
        plan = self.plan()
        run_id = self.service.create(self.prepared, plan)
        journal = self.service.journal
        journal.set_state(run_id, RunState.RUNNING.value)
        verify_count = len(next(s for s in self.prepared.runbook.steps if s.id == step).verify)
        with pytest.raises(Died):
            self.executor(DyingSink(JournalSink(journal, run_id), step, phase, verify_count)).execute(
                plan, self.prepared.runbook, self.prepared.params)
        _owner_died(journal, run_id)
        return run_id

    def resume(self, run_id: str, **kw: Any) -> Any:
        prepared, plan = self.service.prepare_from_record(run_id)
        return self.service.execute(run_id, prepared, plan, resume=True, **kw)

    def effects(self) -> dict[str, int]:
        return {"label": sum(1 for _, p, _ in self.kube.patches if GPU_LABEL in str(p)),
                "swap-off": sum(1 for r in self.nodes.runs if r["playbook"] == "swap-off.yml" and not r["check"]),
                "restart": sum(1 for r in self.nodes.runs if r["playbook"] == "restart-kubelet.yml"
                               and not r["check"])}


def _owner_died(journal: Journal, run_id: str) -> None:
    with journal._tx() as db:  # the recorded owner no longer exists (a pid from another boot)
        db.execute("UPDATE runs SET owner_start='a-boot-long-gone/1' WHERE id=?", (run_id,))


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    clock = FakeClock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host()}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=20.0, gpu_after=40.0)
    settings = Settings(journal=tmp_path / "journal.sqlite", runbooks_dir=REPO / "runbooks")
    settings._cache.update(kube=kube, nodes=nodes)  # our fakes instead of the real connectors
    service = RunService(settings, executor_options={"clock": clock, "sleep": clock.sleep, "wall": clock.wall})
    loaded = service.load(str(FLAGSHIP))
    yield World(clock, kube, nodes, service, prepare_run(loaded, {"node": "omen2"}))
    service.journal.close()


STEPS = ("relabel-container", "swap-off", "restart-kubelet")
PHASES = ("before-action", "after-action", "after-verify", "after-outcome")


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("step", STEPS)
def test_a_run_killed_at_any_step_boundary_resumes_and_does_each_effect_exactly_once(
        world: World, step: str, phase: str) -> None:
    run_id = world.start_and_die(step, phase)
    journal = world.service.journal
    assert journal.get_run(run_id).state == "interrupted"
    effect = {"relabel-container": "label", "swap-off": "swap-off", "restart-kubelet": "restart"}[step]
    # the intent is on disk before the effect: a death right after it leaves no effect behind
    assert world.effects()[effect] == (0 if phase == "before-action" else 1)
    result = world.resume(run_id)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert world.effects() == {"label": 1, "swap-off": 1, "restart": 1}
    rec = journal.get_run(run_id)
    assert (rec.state, rec.exit_code) == ("succeeded", 0)
    resumed = next(e.data for e in journal.events(run_id) if e.kind == "run.resume")
    half_way = phase in ("before-action", "after-action", "after-verify")
    assert resumed["started_without_outcome"] == (step if half_way else None)
    assert resumed["action_finished"] == (phase in ("after-action", "after-verify"))
    assert world.kube.leases == {}  # released at the end


def test_the_intent_is_durable_before_the_kube_patch_and_the_playbook_start(world: World) -> None:
    seen: list[tuple[str, str]] = []
    reader = Journal(world.service.journal.path)  # a second connection: what survives a crash

    def last_event() -> tuple[str, str]:
        run = reader.list_runs(limit=1)[0]
        e = reader.events(run.id)[-1]
        return e.kind, str(e.step)

    world.kube.on_patch = lambda name, patch: seen.append(last_event())
    original = world.nodes.effects["swap-off.yml"]

    def swap_off(fn: FakeNodes, node: str, ev: Any) -> Any:
        seen.append(last_event())
        return original(fn, node, ev)

    world.nodes.effects["swap-off.yml"] = swap_off
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    assert world.service.execute(run_id, world.prepared, plan).state is RunState.SUCCEEDED
    # (the fake playbook runner reports its first task before the effect; the intent precedes it)
    assert seen[0] == ("action.intent", "relabel-container")
    assert seen[1] in (("action.intent", "swap-off"), ("ansible.task", "swap-off"))
    events = [(e.kind, e.step) for e in reader.events(run_id)]
    assert events.index(("action.intent", "swap-off")) < events.index(("ansible.task", "swap-off"))


def test_resume_of_a_dead_run_takes_over_its_own_lease(world: World) -> None:
    run_id = world.start_and_die("swap-off", "after-action")
    from engine.locks import acquire_node_lock

    held = acquire_node_lock(world.kube, "omen2", run_id, clock=world.clock.wall)  # the dead run's Lease
    assert held.lease.holder == holder_for(run_id)
    result = world.resume(run_id)
    assert result.state is RunState.SUCCEEDED
    assert ("kube-system", lease_name("omen2")) not in world.kube.leases


def test_a_resume_that_finds_the_node_taken_by_another_run_stays_resumable(world: World) -> None:
    from engine.locks import acquire_node_lock

    run_id = world.start_and_die("swap-off", "after-action")
    acquire_node_lock(world.kube, "omen2", "r-someone-else", clock=world.clock.wall)
    world.service.lock_wait = 0.0
    import time as real_time

    # the other run's Lease is live (renewed "now" on the real clock the service uses)
    lease = world.kube.leases[("kube-system", lease_name("omen2"))]
    world.kube.leases[("kube-system", lease_name("omen2"))] = lease.__class__(
        **{**lease.__dict__, "renew_time": real_time.time()})
    result = world.resume(run_id)
    assert (result.state, result.exit_code) == (RunState.INTERRUPTED, 3)
    assert "r-someone-else" in result.reason
    assert world.service.journal.get_run(run_id).state == "interrupted"
    assert world.effects()["restart"] == 0


def test_a_non_idempotent_half_done_step_is_never_rerun_without_confirmation(tmp_path: Path, world: World) -> None:
    text = FLAGSHIP.read_text().replace("  - id: restart-kubelet\n", "  - id: restart-kubelet\n    idempotent: false\n")
    (tmp_path / "runbooks").mkdir()
    (tmp_path / "runbooks" / "gpu-node-recovery.yaml").write_text(text)
    world.service.settings.runbooks_dir = tmp_path / "runbooks"
    world.prepared = prepare_run(world.service.load("gpu-node-recovery"), {"node": "omen2"})
    run_id = world.start_and_die("restart-kubelet", "before-action")
    result = world.resume(run_id)  # no way to ask (no terminal): blocked, and still resumable
    assert (result.state, result.exit_code) == (RunState.BLOCKED, 3)
    assert "needs confirmation" in result.outcomes[-1].reason
    assert world.service.journal.get_run(run_id).state == "interrupted"
    assert world.effects()["restart"] == 0
    asked: list[str] = []
    result = world.resume(run_id, confirm_rerun=lambda step, why: not asked.append(step))
    assert asked == ["restart-kubelet"] and result.state is RunState.SUCCEEDED
    assert world.effects()["restart"] == 1


def test_a_run_that_died_while_rolling_back_is_not_continued(world: World) -> None:
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    journal = world.service.journal
    for kind, step, data in _step("relabel-container", intent=True, result=True, rollback=True):
        journal.append(run_id, kind, step=step, **data)
    _owner_died(journal, run_id)
    with journal._tx() as db:
        db.execute("UPDATE runs SET state='running' WHERE id=?", (run_id,))
    result = world.resume(run_id)
    assert (result.state, result.exit_code) == (RunState.FAILED, 1)
    assert "rolling it back" in result.reason
    assert world.effects() == {"label": 0, "swap-off": 0, "restart": 0}


def test_two_resumes_of_one_run_never_both_proceed(world: World) -> None:
    run_id = world.start_and_die("swap-off", "before-action")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ident = None
        while ident is None:
            ident = _process_start(other.pid)
        with world.service.journal._tx() as db:
            db.execute("UPDATE runs SET owner_pid=?, owner_start=? WHERE id=?", (other.pid, ident, run_id))
        with pytest.raises(UsageError, match="being executed by another process"):
            world.resume(run_id)
    finally:
        other.kill()
        other.wait()
    assert world.effects()["swap-off"] == 0


# -- outages and cancellation ----------------------------------------------------------------


def test_the_api_server_going_away_during_verification_interrupts_the_run_without_rollback(world: World) -> None:
    def api_down_after_the_label(name: str, patch: Any) -> None:
        world.kube.fail["wait_for_node"] = KubeError("API server https://127.0.0.1:6443 unreachable: "
                                                     "connection refused", retryable=True)

    world.kube.on_patch = api_down_after_the_label
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    result = world.service.execute(run_id, world.prepared, plan)
    assert (result.state, result.exit_code) == (RunState.INTERRUPTED, 1)
    outcome = result.outcomes[-1]
    assert outcome.step == "relabel-container" and outcome.status is StepStatus.FAILED
    assert "could not be evaluated" in outcome.reason and "connection refused" in outcome.evidence["outage"]
    assert "rollback.start" not in [e.kind for e in world.service.journal.events(run_id)]
    assert world.service.journal.get_run(run_id).state == "interrupted"
    # back again: the resume verifies the label it already set and goes on; nothing is done twice
    world.kube.fail.clear()
    world.kube.on_patch = None
    result = world.resume(run_id)
    assert result.state is RunState.SUCCEEDED, result.reason
    assert world.effects() == {"label": 1, "swap-off": 1, "restart": 1}


def test_an_unreachable_host_during_an_action_interrupts_and_a_resume_reruns_the_idempotent_step(
        world: World) -> None:
    real = world.nodes.effects["swap-off.yml"]
    world.nodes.effects["swap-off.yml"] = lambda fn, node, ev: PlaybookResult(
        status="unreachable", rc=4, unreachable_hosts={node: "ssh: connect to host omen2 port 22: Connection refused"})
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    result = world.service.execute(run_id, world.prepared, plan)
    assert (result.state, result.exit_code) == (RunState.INTERRUPTED, 1)
    assert "Connection refused" in result.outcomes[-1].evidence["outage"]
    world.nodes.effects["swap-off.yml"] = real
    assert world.resume(run_id).state is RunState.SUCCEEDED
    assert world.effects() == {"label": 1, "swap-off": 2, "restart": 1}  # the unreachable attempt did nothing


def test_a_cancel_during_a_playbook_records_a_cancelled_step_and_rolls_nothing_back(world: World) -> None:
    cancel = threading.Event()

    def stopped_by_the_operator(fn: FakeNodes, node: str, ev: Any) -> PlaybookResult:
        cancel.set()  # SIGINT twice: the connector ended the playbook's process tree
        return PlaybookResult(status="canceled", rc=254)

    world.nodes.effects["swap-off.yml"] = stopped_by_the_operator
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    result = world.service.execute(run_id, world.prepared, plan, cancel=cancel)
    assert (result.state, result.exit_code) == (RunState.CANCELLED, 4)
    assert result.outcomes[-1].status is StepStatus.CANCELLED
    assert result.outcomes[-1].reason.startswith("cancelled during the action")
    kinds = [e.kind for e in world.service.journal.events(run_id)]
    assert "rollback.start" not in kinds and kinds.count("step.outcome") == 2
    assert world.service.journal.get_run(run_id).state == "cancelled"
    assert world.kube.leases == {}


def test_an_operator_abort_leaves_the_run_interrupted_and_the_lease_released(world: World) -> None:
    def ctrl_c_thrice(fn: FakeNodes, node: str, ev: Any) -> None:
        raise KeyboardInterrupt

    world.nodes.effects["swap-off.yml"] = ctrl_c_thrice
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan)
    with pytest.raises(KeyboardInterrupt):
        world.service.execute(run_id, world.prepared, plan)
    assert world.service.journal.get_run(run_id).state == "interrupted"
    assert world.kube.leases == {}
    assert world.service.journal.progress(run_id).interrupted_step == "swap-off"


def test_waiting_for_approval_parks_the_run_without_an_owner(world: World) -> None:
    text = FLAGSHIP.read_text().replace("\nsteps:", "\napproval: true\nsteps:")
    d = Path(world.service.settings.journal or ".").parent / "rb"
    d.mkdir()
    (d / "gpu-node-recovery.yaml").write_text(text)
    world.service.settings.runbooks_dir = d
    world.prepared = prepare_run(world.service.load("gpu-node-recovery"), {"node": "omen2"})
    plan = world.plan()
    run_id = world.service.create(world.prepared, plan, approval_required=True)
    result = world.service.execute(run_id, world.prepared, plan, wait_approval=False)
    assert result.state is RunState.WAITING_APPROVAL
    rec = world.service.journal.get_run(run_id)
    assert (rec.state, rec.owner_pid) == ("waiting-approval", None)


def test_a_stored_interrupted_run_has_no_owner_so_any_process_may_resume_it(tmp_path: Path) -> None:
    """A server that interrupted a run on an outage keeps running; an operator's resume must not wait for it."""
    j = Journal(tmp_path / "j.sqlite")
    run_id = j.create_run("rb", {}, ["omen2"], state="running")
    j.set_state(run_id, "interrupted", exit_code=1)
    assert j.get_run(run_id).owner_pid is None
    assert j.claim(run_id) is True
