"""The terminal experience without a cluster: the live display's frames, plain progress lines, the
kubectl-style options (-o yaml, -o wide), the editor schema, errors that name the kubeconfig, shell
completion in a real bash, and ``kubectl runbook`` through the real kubectl."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from rich.console import Console

from engine.cli import main
from engine.live import LiveDisplay, PlainProgress, wants_live
from engine.model import Plan

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plan(node: str = "omen2", steps: tuple[str, ...] = ("relabel", "restart-kubelet")) -> Plan:
    return Plan.model_validate({
        "runbook": "gpu-node-recovery", "version": "1", "node": node, "params": {"node": node},
        "digest": "d" * 64, "runbook_digest": "r" * 64, "created_at": "2026-01-01T00:00:00Z",
        "expires_at": "2026-01-01T01:00:00Z", "state": "ready",
        "steps": [{"id": s, "action": "kube", "kind": "change", "summary": f"do {s}",
                   "verify": [{"check": "node Ready", "timeout_seconds": 120.0}]} for s in steps]})


def _frame(display: LiveDisplay) -> str:
    console = Console(file=io.StringIO(), width=150, color_system=None)
    with console.capture() as cap:
        console.print(display.render())
    return cap.get()


def test_the_live_display_shows_each_step_state_the_task_and_a_verification_bar_against_its_timeout() -> None:
    clock = FakeClock()
    display = LiveDisplay(io.StringIO(), clock=clock, auto_start=False)
    display.expect([_plan()])
    display.emit("run.start", runbook="gpu-node-recovery", node="omen2")
    display.emit("step.start", step="relabel")
    display.emit("step.outcome", step="relabel", status="skipped", reason="label already container")
    display.emit("step.start", step="restart-kubelet")
    display.emit("ansible.task", step="restart-kubelet", host="omen2", task="Restart kubelet", status="ok")
    frame = _frame(display)
    assert re.search(r"↷\s+relabel\s+skipped\s+\S+\s+label already container", frame), frame
    assert re.search(r"●\s+restart-kubelet\s+running.*last task: Restart kubelet \(ok\)", frame), frame
    display.emit("action.result", step="restart-kubelet", ok=True, changed=True, summary="restarted")
    clock.now += 2
    assert "not observed yet, 2 s of 120 s" in _frame(display)  # the wait shows from its start
    display.emit("verify.attempt", step="restart-kubelet", check="node Ready", attempt=1, holds=False,
                 observed="Ready=Unknown", elapsed=0.0)
    clock.now += 12
    frame = _frame(display)
    assert "verify node Ready" in frame and "Ready=Unknown, 12 s of 120 s" in frame, frame
    assert "━" in frame
    display.emit("step.outcome", step="restart-kubelet", status="failed", reason="node Ready: timed out")
    display.emit("run.finish", state="failed", exit_code=1, reason="step restart-kubelet failed")
    frame = _frame(display)
    assert re.search(r"✗\s+restart-kubelet\s+failed", frame) and "of 120 s" not in frame, frame
    assert "step restart-kubelet failed" in frame


def test_a_fleet_shows_one_row_per_node_with_its_batch_step_and_state() -> None:
    clock = FakeClock()
    display = LiveDisplay(io.StringIO(), clock=clock, auto_start=False)
    display.expect([_plan("a"), _plan("b"), _plan("c")], max_parallel=2)
    display.emit("run.start", runbook="gpu-node-recovery", node="a")
    display.emit("step.start", step="relabel")
    frame = _frame(display)
    assert "batch 1 of 2" in frame, frame
    assert re.search(r"1\s+│\s+a\s+│\s+relabel\s+│\s+running", frame), frame
    assert re.search(r"2\s+│\s+c\s+│\s+│\s+pending", frame), frame


def test_plain_progress_is_one_line_per_event_without_control_characters() -> None:
    out = io.StringIO()
    plain = PlainProgress(out)
    plain.emit("step.start", step="swap-off")
    plain.emit("ansible.task", step="swap-off", host="omen2", task="swapoff -a", status="changed")
    plain.emit("verify.attempt", step="swap-off", check="swap off", holds=False, observed="SwapTotal=2G", elapsed=3)
    plain.emit("step.outcome", step="swap-off", status="succeeded", reason="")
    text = out.getvalue()
    assert len(text.splitlines()) == 4
    assert "step swap-off: start" in text and "verify swap off: waiting (SwapTotal=2G, 3 s)" in text
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", text)


def test_the_live_display_needs_a_terminal_and_colours(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert wants_live(Tty()) and not wants_live(io.StringIO())
    assert not wants_live(Tty(), no_tty=True) and not wants_live(Tty(), no_color=True)
    monkeypatch.setenv("NO_COLOR", "1")
    assert not wants_live(Tty())


def test_no_engine_source_writes_escape_codes_by_hand() -> None:
    offenders = [str(p) for p in (ROOT / "engine").rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".j2")
                 and re.search(r"\\x1b|\\033|\\u001b|\\e\[", p.read_text(errors="replace"))]
    assert offenders == []


def test_the_committed_editor_schema_is_what_runbook_schema_prints() -> None:
    got = CliRunner().invoke(main, ["schema"])
    assert got.exit_code == 0
    committed = (ROOT / "docs" / "runbook.schema.json").read_text()
    assert json.loads(committed) == json.loads(got.output), (
        "docs/runbook.schema.json is stale: regenerate with `runbook schema > docs/runbook.schema.json`")
    for rb in (ROOT / "runbooks").glob("*.yaml"):
        assert rb.read_text().splitlines()[0] == "# yaml-language-server: $schema=../docs/runbook.schema.json"


def test_output_yaml_is_the_json_document_as_yaml() -> None:
    runner = CliRunner()
    as_json = runner.invoke(main, ["list", "-o", "json", "--runbooks-dir", str(ROOT / "runbooks")])
    as_yaml = runner.invoke(main, ["list", "-o", "yaml", "--runbooks-dir", str(ROOT / "runbooks")])
    assert as_json.exit_code == 0 and as_yaml.exit_code == 0, as_yaml.output
    assert yaml.safe_load(as_yaml.output) == json.loads(as_json.output)
    assert not as_yaml.output.lstrip().startswith(("[", "{"))


def test_output_wide_adds_columns_to_list_and_runs(tmp_path: Path) -> None:
    runner = CliRunner()
    wide = runner.invoke(main, ["list", "-o", "wide", "--runbooks-dir", str(ROOT / "runbooks")])
    assert wide.exit_code == 0 and "params=" in wide.output and "gpu-node-recovery.yaml" in wide.output
    from engine.journal import Journal

    journal = Journal(tmp_path / "j.db")
    journal.create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"])
    runs = runner.invoke(main, ["runs", "-o", "wide", "--journal", str(tmp_path / "j.db")])
    assert runs.exit_code == 0, runs.output
    assert "SOURCE" in runs.output and '{"node": "omen2"}' in runs.output
    narrow = runner.invoke(main, ["runs", "--journal", str(tmp_path / "j.db")])
    assert "SOURCE" not in narrow.output
    assert narrow.output.split()[:5] == ["ID", "RUNBOOK", "NODE", "PHASE", "AGE"] and "Pending" in narrow.output
    as_json = runner.invoke(main, ["runs", "-o", "json", "--journal", str(tmp_path / "j.db")])
    (run,) = json.loads(as_json.output)  # the JSON contract keeps its fields (no phase/age there)
    assert set(run) == {"id", "runbook", "params", "nodes", "state", "source", "plan_digest", "approval_required",
                        "approved_by", "started", "finished", "exit_code"} and run["state"] == "pending"


def _cli(args: list[str], env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False, cwd=cwd)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "RUNBOOK_INVENTORY", "NO_COLOR")}
    return {**env, "HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path / "state"),
            "RUNBOOK_RUNBOOKS_DIR": str(ROOT / "runbooks"), **extra}


def test_a_missing_kubeconfig_is_a_usage_error_that_says_how_to_give_one(tmp_path: Path) -> None:
    given = _cli(["run", "gpu-node-recovery", "-l", "gpu=true", "--kubeconfig", str(tmp_path / "nope")],
                 _env(tmp_path))
    assert given.returncode == 2, given.stderr
    assert f"kubeconfig {tmp_path / 'nope'} not found" in given.stderr and "--kubeconfig FILE" in given.stderr
    default = _cli(["run", "gpu-node-recovery", "-l", "gpu=true"], _env(tmp_path))
    assert default.returncode == 2, default.stderr
    assert f"{tmp_path}/.kube/config does not exist" in default.stderr and "KUBECONFIG" in default.stderr


def test_an_unreachable_api_names_the_kubeconfig_and_context_used(tmp_path: Path) -> None:
    cfg = tmp_path / "kubeconfig"
    cfg.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "x"}}],
        "contexts": [{"name": "lab", "context": {"cluster": "c", "user": "u"}}]}))
    got = _cli(["run", "gpu-node-recovery", "-l", "gpu=true", "--context", "lab", "--request-timeout", "2",
                "--kubeconfig", str(cfg)], _env(tmp_path))
    assert got.returncode == 1, got.stderr
    assert "unreachable" in got.stderr
    assert f"used kubeconfig {cfg}, context lab; choose another with --kubeconfig FILE" in got.stderr


def test_bash_completion_loads_in_bash_and_completes_runbook_names_and_options(tmp_path: Path) -> None:
    bash = shutil.which("bash")
    assert bash is not None
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "runbook"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m engine \"$@\"\n")
    shim.chmod(0o755)
    env = _env(tmp_path, PATH=f"{bindir}:{os.environ['PATH']}")
    script = ("source <(runbook completion bash)\n"
              "complete -p runbook\n"
              "COMP_WORDS=(runbook run gpu-); COMP_CWORD=2; _runbook_completion runbook\n"
              "printf 'got:%s\\n' \"${COMPREPLY[@]}\"\n"
              "COMP_WORDS=(runbook run gpu-node-recovery --no-t); COMP_CWORD=3; _runbook_completion runbook\n"
              "printf 'opt:%s\\n' \"${COMPREPLY[@]}\"\n")
    got = subprocess.run([bash, "--norc", "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert got.returncode == 0, got.stderr
    assert "complete -o nosort -F _runbook_completion runbook" in got.stdout
    assert "got:gpu-node-recovery" in got.stdout.splitlines(), got.stdout
    assert "opt:--no-tty" in got.stdout.splitlines(), got.stdout
    for shell in ("zsh", "fish"):
        src = _cli(["completion", shell], env)
        assert src.returncode == 0 and "_RUNBOOK_COMPLETE" in src.stdout


def test_run_ids_complete_from_the_journal(tmp_path: Path) -> None:
    from engine.journal import Journal

    run_id = Journal(tmp_path / "j.db").create_run("gpu-node-recovery", {"node": "omen2"}, ["omen2"])
    env = _env(tmp_path, _RUNBOOK_COMPLETE="bash_complete", COMP_WORDS=f"runbook resume --journal "
               f"{tmp_path / 'j.db'} {run_id[:3]}", COMP_CWORD="4")
    got = subprocess.run([sys.executable, "-c", "import sys; from engine.cli import main; "
                          "sys.argv[0] = 'runbook'; main()"], env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert f"plain,{run_id}" in got.stdout.splitlines(), got.stdout + got.stderr


def test_kubectl_runbook_works_through_the_real_kubectl(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl on PATH")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-runbook"] == scripts["runbook"] == "engine.cli:main"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    plugin = bindir / "kubectl-runbook"  # what pip writes for the console script: import and call the entry
    plugin.write_text(f"#!{sys.executable}\nimport sys\nfrom engine.cli import main\nsys.exit(main())\n")
    plugin.chmod(0o755)
    env = _env(tmp_path, PATH=f"{bindir}:{os.environ['PATH']}")
    got = subprocess.run([kubectl, "runbook", "--help"], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert got.returncode == 0, got.stderr
    assert "Usage: kubectl-runbook" in got.stdout and "completion" in got.stdout
    listed = subprocess.run([kubectl, "runbook", "list", "-o", "yaml"], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert listed.returncode == 0 and any(d["name"] == "gpu-node-recovery" for d in yaml.safe_load(listed.stdout))


@pytest.mark.parametrize("namespace", [None, "runbook-locks"])
def test_the_node_lease_lives_in_the_namespace_given_with_n(tmp_path: Path, namespace: str | None) -> None:
    from engine.params import prepare_run
    from engine.runs import RunService
    from engine.settings import Settings
    from tests.fakes import FakeClock as Clock
    from tests.fakes import FakeKube, FakeNodes, incident_host, incident_node, install_recovery_effects

    clock = Clock()
    kube = FakeKube([incident_node()], clock=clock)
    nodes = FakeNodes({"omen2": incident_host()}, clock=clock)
    install_recovery_effects(kube, nodes, ready_after=20.0, gpu_after=40.0)
    settings = Settings(journal=tmp_path / "j.sqlite", runbooks_dir=ROOT / "runbooks", namespace=namespace)
    settings._cache.update(kube=kube, nodes=nodes)  # our fakes instead of the real connectors
    service = RunService(settings, executor_options={"clock": clock, "sleep": clock.sleep, "wall": clock.wall})
    prepared = prepare_run(service.load("gpu-node-recovery"), {"node": "omen2"})
    plan = service.plan(prepared)
    run_id = service.create(prepared, plan)
    result = service.execute(run_id, prepared, plan)
    assert result.state.value == "succeeded", result.reason
    acquired = [e.data for e in service.journal.events(run_id) if e.kind == "lock.acquired"]
    assert [a["namespace"] for a in acquired] == [namespace or "kube-system"]
    service.journal.close()
