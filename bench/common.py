"""Shared pieces of the benchmarks: metric records, statistics, timed commands, the bench's own lab.

Everything the benchmarks start finds its executables (``runbook``, ``ansible``,
``ansible-playbook``, ``kubectl``) as the CLI does (``tool``): this Python's scripts folder first
(where pip put the project, ansible-core and, with the ``kubectl`` extra, kubectl; the PATH
``engine.connectors.ansible`` gives ``ansible-playbook``), then ``PATH``: a version manager's shims
(pyenv) add 0.1-0.3 s to every call and would distort both sides, and a tool that is not beside the
interpreter (kubectl from the system's ``kubernetes-client``) is found where it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The engine under test: this checkout, or (``bench/run --tree DIR``) another copy of the project,
# e.g. ``git archive HEAD | tar -x -C DIR``: a stable snapshot while others edit this tree.
ENGINE_ROOT = Path(os.environ.get("BENCH_ENGINE_TREE") or ROOT).resolve()
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
SCENARIOS = BENCH / "scenarios"
BIN = Path(sys.executable).parent  # the interpreter's scripts folder: runbook, ansible (kubectl only with the extra)
DEFAULT_LAB_DIR = "/tmp/bench-lab"
DEFAULT_FLEET_LAB_DIR = "/tmp/bench-lab-fleet"
DEFAULT_JOURNAL = "/tmp/bench-journal.sqlite"
DEFAULT_WORK_DIR = "/tmp/bench-work"

# The contract of issue 9: names, units and targets.
TARGETS: dict[str, tuple[str, float, str]] = {
    "p1_recovery_vs_checked_script_ratio": ("<=", 0.7, "ratio"),
    "p1_recovery_vs_bare_script_ratio": ("<=", 1.25, "ratio"),
    "p2_verify_reaction_ratio": ("<=", 1.0, "ratio"),
    "p2_verify_reaction_ms": ("<=", 50.0, "ms"),
    "p3_help_s": ("<=", 0.3, "s"),
    "p3_validate_s": ("<=", 0.6, "s"),
    "p4_plan_1_s": ("<=", 3.0, "s"),
    "p4_plan_100_vs_ansible_ratio": ("<=", 1.5, "ratio"),
    "p5_webhook_rps": (">=", 1000.0, "req/s"),
    "p5_webhook_p99_ms": ("<=", 50.0, "ms"),
    "p6_rss_mb": ("<=", 150.0, "MB"),
    # issue 13: a fleet of 20 swap-broken GPU nodes, --max-parallel 10
    "p7_fleet_20_vs_script_ratio": ("<=", 1.3, "ratio"),
    "p7_fleet_20_vs_1_ratio": ("<=", 3.0, "ratio"),
    # issue 16: the web console's run page (a finished 3-step run) and its live updates
    "p9_run_page_kb": ("<=", 150.0, "KB"),
    "p9_first_paint_ms": ("<=", 300.0, "ms"),
    "p9_live_update_ms": ("<=", 250.0, "ms"),
    # issue 18: the paging loop on the lab with monitoring. The total is mostly the lab's configured
    # delays (grace period, scrape, `for`, group_wait) and planning: reported with its parts, no target.
    "p8_alert_to_run_s": ("", 0.0, "s"),
    # issue 25: answers that must not wait while the server is attacked (bench/p10_floods.py)
    "p10_webhook_flood_delta_ms": ("<=", 100.0, "ms"),
    "p10_healthz_upload_ms": ("<=", 100.0, "ms"),
    "p8_runbook_webhook_ms": ("<=", 100.0, "ms"),
    # issue 32: a burst of 200 failing nodes against one cluster-wide budget (bench/p10_burst.py), and
    # the run store at 10,000 runs (bench/p11_runs_list.py)
    "p10_burst_200_decided_s": ("<=", 2.0, "s"),
    "p10_budget_violations": ("<=", 0.0, "count"),
    "p11_runs_list_10k_s": ("<=", 1.0, "s"),
}
METRICS = tuple(TARGETS)


def log(message: str) -> None:
    """Progress goes to stderr: stdout carries only the metrics' JSON lines."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Metric:
    metric: str
    value: float | None
    runs: int
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return TARGETS[self.metric][2]

    def meets_target(self) -> bool | None:
        op, target, _ = TARGETS[self.metric]
        if self.value is None or not op:  # no value, or a metric without a target
            return None
        return self.value <= target if op == "<=" else self.value >= target

    def as_json(self) -> dict[str, Any]:
        op, target, _ = TARGETS[self.metric]
        detail = {"target": f"{op} {target:g}" if op else None, "meets_target": self.meets_target(), **self.detail}
        value = None if self.value is None else round(self.value, 4)
        return {"metric": self.metric, "value": value, "unit": self.unit, "runs": self.runs, "detail": detail}


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """Median, min, max and every sample (rounded): what a reader needs to judge the noise."""
    if not values:
        return {"median": None, "samples": []}
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "samples": [round(v, digits) for v in values]}


def loadavg() -> list[float]:
    with contextlib.suppress(OSError):
        return [round(x, 2) for x in os.getloadavg()]
    return []


def rotations(names: Sequence[str], runs: int) -> Iterator[tuple[int, str]]:
    """Alternating order A B C, B C A, C A B, ...: no variant always runs first after a reset."""
    for i in range(runs):
        k = i % len(names)
        for name in [*names[k:], *names[:k]]:
            yield i, name


@dataclass
class Timed:
    seconds: float
    rc: int
    output: str  # stdout + stderr (tail)


def run_timed(cmd: Sequence[str], *, env: Mapping[str, str], cwd: Path = ENGINE_ROOT, timeout: float = 600,
              log_path: Path | None = None) -> Timed:
    """Wall time of one command, from spawn to exit (stdout/stderr to a file, never a pipe we drain late)."""
    with tempfile.TemporaryFile("w+b") if log_path is None else open(log_path, "w+b") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(list(cmd), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = -9
        seconds = time.perf_counter() - start
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    return Timed(seconds, rc, text[-4000:])


def base_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env.setdefault("NO_COLOR", "1")
    env["RUNBOOK_PLAYBOOKS_DIR"] = str(ENGINE_ROOT / "playbooks")  # the baseline scripts' playbooks
    if ENGINE_ROOT != ROOT:  # the engine from the other tree, the bench package from this one
        env["PYTHONPATH"] = os.pathsep.join([str(ENGINE_ROOT), str(ROOT)])
    env.update(extra or {})
    return env


class ToolNotFound(RuntimeError):
    """An executable a benchmark needs is neither beside this Python nor on ``PATH``."""


def scripts_dirs() -> list[Path]:
    """Where this Python's installs put console scripts: beside the interpreter (a venv's ``bin``),
    the install scheme's scripts folder, the user scheme's (``pip install --user``)."""
    found: list[Path] = [BIN]
    for scheme in (None, f"{os.name}_user"):
        with contextlib.suppress(KeyError, ValueError):
            folder = sysconfig.get_path("scripts", scheme) if scheme else sysconfig.get_path("scripts")
            if folder and Path(folder) not in found:
                found.append(Path(folder))
    return found


def tool(name: str, *, path: str | None = None, scripts: Sequence[Path] | None = None) -> str:
    """The executable ``name`` as the CLI finds it: this Python's scripts folders first (``scripts``,
    default ``scripts_dirs()``), then ``path`` (default: this process's ``PATH``). ``ToolNotFound``
    saying where it looked when none is there."""
    folders = scripts_dirs() if scripts is None else scripts
    search = [str(d) for d in folders] + [p for p in (os.environ.get("PATH", "") if path is None
                                                      else path).split(os.pathsep) if p]
    found = shutil.which(name, path=os.pathsep.join(search))
    if found is None:
        hint = {"kubectl": " (pip install 'runbook[kubectl]', or apt-get install kubernetes-client)"}.get(name, "")
        raise ToolNotFound(f"{name} not found beside {sys.executable} nor on PATH{hint}; looked in "
                           f"{os.pathsep.join(search)}")
    return found


def runbook_cmd(*args: str) -> list[str]:
    """The installed console script of this Python (not a shim); ``python -m engine`` when there is
    none (never a ``runbook`` of another install found on ``PATH``: it would be another engine)."""
    script = next((d / "runbook" for d in scripts_dirs() if (d / "runbook").is_file()), None)
    return [str(script), *args] if script is not None else [sys.executable, "-m", "engine", *args]


# ---------------------------------------------------------------------------------------------- the lab


class BenchLab:
    """One lab folder driven through ``runbook lab`` (up / env / status / reset / down)."""

    def __init__(self, lab_dir: str | Path, scenario: Path | None = None) -> None:
        self.dir = Path(lab_dir)
        self.scenario = scenario
        self._env: dict[str, str] | None = None

    def _cli(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        env = base_env({"RUNBOOK_LAB_DIR": str(self.dir)})
        return subprocess.run(runbook_cmd("lab", *args), env=env, cwd=ENGINE_ROOT, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def status(self) -> dict[str, Any] | None:
        r = self._cli("status", "-o", "json", timeout=120)
        if r.returncode != 0:
            return None
        try:
            return dict(json.loads(r.stdout))
        except ValueError:
            return None

    def running(self) -> bool:
        s = self.status()
        return bool(s and s.get("running"))

    def up(self) -> float:
        """Bring the lab up (idempotent); returns seconds spent."""
        start = time.perf_counter()
        current = self.status()
        if current and current.get("running"):
            wanted = str(self.scenario.resolve()) if self.scenario else None
            if wanted is None or current.get("scenario") == wanted:
                return 0.0
            log(f"lab {self.dir} runs another scenario: taking it down")
            self.down()
        elif current is not None or (self.dir / "lab.json").exists():
            self.down()
        log(f"lab up in {self.dir}" + (f" with {self.scenario.name}" if self.scenario else ""))
        args = ["up", "--timeout", "600"] + (["--scenario", str(self.scenario)] if self.scenario else [])
        r = self._cli(*args)
        if r.returncode != 0:
            raise RuntimeError(f"runbook lab up failed (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
        self._env = None
        return time.perf_counter() - start

    def reset(self) -> float:
        start = time.perf_counter()
        r = self._cli("reset", timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"runbook lab reset failed (rc {r.returncode}): {r.stderr.strip()[-2000:]}")
        return time.perf_counter() - start

    def down(self) -> None:
        self._cli("down", timeout=300)
        self._env = None

    def env(self) -> dict[str, str]:
        """KUBECONFIG, RUNBOOK_INVENTORY, RUNBOOK_BECOME_PASSWORD, KUBECACHEDIR, RUNBOOK_LAB_DIR."""
        if self._env is None:
            r = self._cli("env", timeout=60)
            if r.returncode != 0:
                raise RuntimeError(f"runbook lab env failed: {r.stderr.strip()}")
            env: dict[str, str] = {}
            for line in r.stdout.splitlines():
                words = shlex.split(line)
                if len(words) == 2 and words[0] == "export" and "=" in words[1]:
                    key, value = words[1].split("=", 1)
                    env[key] = value
            self._env = env
        return dict(self._env)

    def record(self) -> dict[str, Any]:
        return dict(json.loads((self.dir / "lab.json").read_text()))

    def timing(self) -> dict[str, Any]:
        """The scenario's compressed clock: the delays both sides of a comparison live with."""
        from engine.lab.scenario import load_scenario

        scenario = load_scenario(self.record()["scenario"])
        return {"scenario": scenario.name, **scenario.timing.model_dump()}

    def node(self, name: str) -> dict[str, Any]:
        s = self.status() or {}
        return next((n for n in s.get("nodes", []) if n["name"] == name), {})


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return True
        time.sleep(interval)
    return False


@contextlib.contextmanager
def started_server(cmd: Sequence[str], *, env: Mapping[str, str], log: Path, ready_url: str,
                   timeout: float = 60, new_session: bool = True) -> Iterator[subprocess.Popen[bytes]]:
    """A server process (``cmd``, output appended to ``log``) once ``ready_url`` answers 200; SIGTERM
    on exit, SIGKILL after 40 s. A process that dies or never answers within ``timeout`` is an
    error quoting the end of its log."""
    import httpx

    with log.open("ab") as out:
        proc = subprocess.Popen(list(cmd), env=dict(env), cwd=ENGINE_ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=new_session)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd[:4])} did not start: {log.read_text(errors='replace')[-1500:]}")
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def ssh_control_dir() -> Iterator[Path]:
    """A fresh SSH control-path folder for one baseline run (a cold start, as the engine has), whose
    control masters are ended afterwards through their own sockets (``ssh -O exit``)."""
    folder = Path(tempfile.mkdtemp(prefix="bench-cp-"))
    try:
        yield folder
    finally:
        for sock in folder.iterdir():
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "bench-control-master"],
                           capture_output=True, timeout=10, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def write_results(metrics: Sequence[Metric], meta: Mapping[str, Any], results_dir: Path = RESULTS) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    doc = {**meta, "metrics": [m.as_json() for m in metrics]}
    path = results_dir / f"{stamp}.json"
    text = json.dumps(doc, indent=2) + "\n"
    path.write_text(text)
    (results_dir / "latest.json").write_text(text)
    return path


# ---------------------------------------------------------------------------------------------- context


@dataclass
class Context:
    """What every benchmark gets: sizes, where the labs and the journal live, where logs go."""

    quick: bool = False
    runs: int = 5
    lab_dir: Path = Path(DEFAULT_LAB_DIR)
    fleet_lab_dir: Path = Path(DEFAULT_FLEET_LAB_DIR)
    journal: Path = Path(DEFAULT_JOURNAL)
    work_dir: Path = Path(DEFAULT_WORK_DIR)
    keep_fleet_lab: bool = False
    compare_tree: Path | None = None  # P1: also time the engine of this tree, interleaved (before/after)
    _lab: BenchLab | None = None

    def lab(self) -> BenchLab:
        """The incident lab (default scenario), brought up on first use."""
        if self._lab is None:
            lab = BenchLab(self.lab_dir)
            seconds = lab.up()
            if seconds:
                log(f"lab up in {seconds:.0f} s")
            self._lab = lab
        return self._lab

    def lab_env(self, lab: BenchLab | None = None) -> dict[str, str]:
        """The environment of a command run against the lab (as after ``eval "$(runbook lab env)"``)."""
        lab = lab or self.lab()
        return base_env({**lab.env(), "RUNBOOK_JOURNAL": str(self.journal)})

    def log_path(self, name: str) -> Path:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        return self.work_dir / name
