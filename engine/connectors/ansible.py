"""The Ansible connector: the engine's only importer of ``ansible_runner``.

``AnsibleConnector`` implements ``engine.connectors.base.NodeAutomation``. One instance serves one
runbook run (or one CLI invocation) and owns:

* a private data dir (mode 0700, made on first use) holding ``ANSIBLE_HOME``,
  ``ANSIBLE_LOCAL_TEMP``, the SSH control-path dir and an empty ``ansible.cfg``: the user's own
  Ansible state and config are never read or written, and SSH connections (``ControlPersist``)
  are reused across the steps of the run. ``close()`` (or interpreter exit) ends the control
  masters and removes the dir.
* the become password, in memory only. It reaches ``ansible-playbook`` through its
  ``--ask-become-pass`` prompt (ansible-runner's ``passwords=``, pexpect): never through the
  environment, a command line or a file.
* an **allow-listed environment** for ``ansible-playbook`` and everything it starts (issue #14):
  what Ansible, SSH and the locale need (``CHILD_ENV_ALLOWED``, ``LC_*``), the variables the
  operator names in ``RUNBOOK_ANSIBLE_ENV``, the ``ANSIBLE_*`` variables this module sets and the
  ones ansible-runner sets for its callback, nothing else: the allow-list of the inventory read
  too (``engine.connectors.inventory.allowed_environment``). The
  parent's environment is not passed minus a deny-list: a webhook token, a PagerDuty secret, an
  approval credential, any ``RUNBOOK_*`` secret or a cloud key in the engine's environment never
  reaches ansible-playbook, its workers, the node hosts or ansible-runner's artifacts (which
  copy the child's whole environment into ``artifacts/<id>/command``). Each run's artifacts
  folder is deleted as soon as the run ends; a killed engine's private dir (artifacts included)
  is swept by the next connector (``sweep_stale_private_dirs``).

Every run streams task events live to ``on_event`` and ends with the host facts that
``playbooks/tasks/facts.yml`` publishes (``set_stats`` ``runbook_facts``), parsed here into
``engine.facts.HostFacts``. On timeout or cancel the whole process tree is killed:
``ansible-playbook``'s workers and the ``ssh`` processes they start (ansible-runner alone leaves
them running, ansible/ansible-runner#973). The tree is found by a marker variable in each
process's environment, which every descendant inherits, even after it is re-parented.

What it must not do: import ``kubernetes``, keep artifacts, or disable host key checking.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.connectors.base import PlaybookResult, TaskEvent
from engine.connectors.inventory import (  # noqa: F401 - CHILD_ENV_ALLOWED, PASS_ENV: re-exported
    CHILD_ENV_ALLOWED,
    PASS_ENV,
    Inventory,
    allowed_environment,
    load_inventory,
)
from engine.errors import HostError
from engine.facts import HostFacts
from engine.hostfacts import parse_host_facts

FACTS_PLAYBOOK = "node-facts.yml"
RUN_MARKER = "RUNBOOK_ANSIBLE_RUN"  # in the environment of every process of one run
# The engine's variables that reach Ansible's processes: CHILD_ENV_ALLOWED, LC_* and RUNBOOK_ANSIBLE_ENV's
# names (engine.connectors.inventory.allowed_environment, shared with the inventory read).
# Set by ansible-runner itself (its event callback and settings): kept, whatever the parent had.
_RUNNER_ENV = frozenset({
    "ANSIBLE_CALLBACK_PLUGINS", "ANSIBLE_STDOUT_CALLBACK", "AWX_ISOLATED_DATA_DIR",
    "RUNNER_OMIT_EVENTS", "RUNNER_ONLY_FAILED_EVENTS", "ANSIBLE_CACHE_PLUGIN",
    "ANSIBLE_CACHE_PLUGIN_CONNECTION",
})
_BECOME_PROMPT = r"BECOME password[^:\n]*:\s*$"
DIR_PREFIX = "runbook-ansible-"
OWNER_FILE = "owner"  # "<pid> <start time>" of the process that made a private data dir

# ============================================================================ preloading


def preload() -> None:
    """Import ansible-runner now instead of on the first run (``RunService.preload``: a server's
    first run then imports nothing in a worker while webhooks are being answered)."""
    import ansible_runner
    import ansible_runner.interface
    import ptyprocess

    del ansible_runner, ptyprocess


# ============================================================================ events (pure)


def unified_diffs(diff: Any) -> tuple[str, ...]:
    """Ansible's diff result (a dict or a list of them) -> unified diff texts."""
    items = diff if isinstance(diff, list) else [diff]
    texts = []
    for d in items:
        if not isinstance(d, Mapping):
            continue
        if d.get("prepared"):
            texts.append(str(d["prepared"]))
            continue
        before, after = d.get("before"), d.get("after")
        if isinstance(before, str) and isinstance(after, str) and before != after:
            texts.append("".join(difflib.unified_diff(
                before.splitlines(keepends=True), after.splitlines(keepends=True),
                fromfile=str(d.get("before_header", "before")),
                tofile=str(d.get("after_header", "after")))))
    return tuple(texts)


_BECOME_WRONG = re.compile(r"incorrect (sudo|su|become) password|sorry, try again|"
                           r"authentication failure|incorrect password", re.I)
_BECOME_MISSING = re.compile(r"missing (sudo|su|become) password|a password is required", re.I)
_BECOME_TIMEOUT = re.compile(r"waiting for privilege escalation prompt", re.I)


def task_message(res: Mapping[str, Any]) -> str:
    """One line for a task result: msg, else stderr, else stdout (shortened). For a loop, the
    first failed item's message (Ansible's own is only "One or more items failed")."""
    if isinstance(res.get("results"), list):
        for item in res["results"]:
            if isinstance(item, Mapping) and item.get("failed"):
                text = task_message(item)
                label = item.get("item")
                return f"{label}: {text}" if isinstance(label, str) and text else text
    for key in ("msg", "stderr", "module_stderr", "stdout", "module_stdout"):
        value = res.get(key)
        if isinstance(value, str) and value.strip():
            return " ".join(value.strip().split())[:500]
    return ""


def explain_failure(node: str, message: str) -> str:
    """Name the cause of the failures people meet most (become password) in plain words."""
    if _BECOME_WRONG.search(message):
        return f"become password rejected on {node}: {message}"
    if _BECOME_MISSING.search(message):
        return f"become password needed on {node} and none was given: {message}"
    if _BECOME_TIMEOUT.search(message):
        return f"privilege escalation (sudo) did not answer on {node}: {message}"
    return f"{node}: {message}" if message else f"{node}: task failed"


def as_ansible_data(value: Any) -> Any:
    """``value`` with every string marked unsafe (``{"__ansible_unsafe": s}``, what YAML's ``!unsafe``
    does): Ansible renders extra vars as templates, so a param holding ``{{ lookup('pipe', ...) }}``
    would otherwise run a command on this machine, even in check mode (``runbook plan``)."""
    if isinstance(value, str):
        return {"__ansible_unsafe": value}
    if isinstance(value, Mapping):
        return {str(k): as_ansible_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_ansible_data(v) for v in value]
    return value


def child_environment(runner_env: Mapping[str, str], ours: Mapping[str, str],
                      parent: Mapping[str, str]) -> dict[str, str]:
    """The environment ansible-playbook gets: from ``parent`` (the engine's) only the allow-listed
    names, ``LC_*`` and those named in ``RUNBOOK_ANSIBLE_ENV`` (``allowed_environment``, as the
    inventory read); every variable we set (``ours``); ansible-runner's own settings from
    ``runner_env`` (parent + ours + runner's). Nothing else of the parent, whatever its name."""
    env = allowed_environment(parent)
    env.update(ours)
    env.update({k: v for k, v in runner_env.items() if k in _RUNNER_ENV or k in ours})
    return {k: str(v) for k, v in env.items()}


def run_forks(hosts: int, forks: int, *, read_only: bool) -> int:
    """Ansible forks for a run over ``hosts`` hosts. A changing run over several hosts is one rolling
    batch (``engine.batch``: every node of it runs now, by the operator's ``--max-parallel``): all
    of its hosts at once, whatever ``forks``. Read-only runs (facts, check mode) may cover a whole
    fleet's plan: at most ``forks`` at a time."""
    return max(1, hosts if not read_only else min(forks, hosts))


# ============================================================================ the connector


@dataclass
class _RunState:
    """Everything one playbook run collects from its event stream (runner thread writes)."""

    node_of: Callable[[str], str]
    on_event: Callable[[TaskEvent], None] | None
    changed: dict[str, bool] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)
    diffs: dict[str, list[str]] = field(default_factory=dict)
    facts: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    # per node, the monotonic time the task before the facts' set_stats (the probe task) started:
    # the facts are at most that old. Without task-start events, the run's own start.
    facts_at: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    task_starts: dict[str, list[float]] = field(default_factory=dict)  # the last two, per node
    tasks: list[TaskEvent] = field(default_factory=list)
    output: list[str] = field(default_factory=list)  # ansible's own error lines (no host)
    callback_error: BaseException | None = None
    processed: set[str] | None = None  # the hosts the play recap names (None: no recap seen)

    def handle(self, event: Mapping[str, Any]) -> bool:
        kind = str(event.get("event", ""))
        data = event.get("event_data") or {}
        host = data.get("host")
        if kind == "playbook_on_stats":
            done = data.get("processed")
            self.processed = {str(h) for h in done} if isinstance(done, Mapping) else set()
            return True
        if kind in ("verbose", "error") and not host:
            text = str(event.get("stdout") or "").strip()
            if text:
                self.output.append(text)
            return True
        if not host:
            return True
        node = self.node_of(str(host))
        if kind == "runner_on_start":
            starts = self.task_starts.setdefault(node, [])
            starts.append(time.monotonic())
            del starts[:-2]
            return True
        res = data.get("res") or {}
        if not isinstance(res, Mapping):
            res = {}
        if kind == "runner_on_file_diff":
            self.diffs.setdefault(node, []).extend(unified_diffs(data.get("diff")))
            return True
        status = {"runner_on_ok": "ok", "runner_on_failed": "failed", "runner_on_skipped": "skipped",
                  "runner_on_unreachable": "unreachable"}.get(kind)
        if status is None:
            return True
        msg = task_message(res) if status in ("failed", "unreachable") else \
            " ".join(str(res.get("msg") or "").split())[:500]
        if status == "ok":
            stats = res.get("ansible_stats")
            if isinstance(stats, Mapping) and isinstance(stats.get("data"), Mapping) and \
                    isinstance(stats["data"].get("runbook_facts"), Mapping):
                self.facts[node] = stats["data"]["runbook_facts"]
                starts = self.task_starts.get(node, [])
                self.facts_at[node] = starts[-2] if len(starts) >= 2 else self.started
            if res.get("changed"):
                status = "changed"
                self.changed[node] = True
        elif status == "failed":
            if data.get("ignore_errors"):
                status = "ignored"
            else:
                self.failed.setdefault(node, explain_failure(node, msg))
        elif status == "unreachable":
            self.unreachable.setdefault(node, f"{node} unreachable: {msg}" if msg else
                                        f"{node} unreachable")
        self.changed.setdefault(node, False)
        task_event: TaskEvent = MappingProxyType({
            "host": node, "inventory_host": str(host), "task": str(data.get("task", "")),
            "status": status, "msg": msg})
        self.tasks.append(task_event)
        if self.on_event is not None:
            try:
                self.on_event(task_event)
            except Exception as e:  # a broken display must not break the run; reported after
                self.callback_error = self.callback_error or e
        return True  # True: ansible-runner keeps the event (and computes stats)


class AnsibleConnector:
    """``NodeAutomation`` through ansible-runner. Use as a context manager or call ``close()``."""

    def __init__(self, inventory: Path, playbooks_dir: Path, *, become_password: str | None = None,
                 forks: int = 10, ssh_timeout: int = 10, control_persist: int = 300,
                 facts_services: Sequence[str] | None = None, journal_lines: int | None = None,
                 facts_become: bool | None = None, facts_timeout: float = 120.0) -> None:
        self.inventory_path = Path(inventory).resolve()
        self.playbooks_dir = Path(playbooks_dir).resolve()
        self.inventory: Inventory = load_inventory(self.inventory_path)
        self._become_password = become_password
        self.forks = forks
        self.ssh_timeout = ssh_timeout
        self.control_persist = control_persist
        # None: the playbook's default ([kubelet, containerd], 20 lines) or the inventory's variables
        self.facts_services = tuple(facts_services) if facts_services is not None else None
        self.journal_lines = journal_lines
        self.facts_become = become_password is not None if facts_become is None else facts_become
        self.facts_timeout = facts_timeout
        self._cancel = threading.Event()
        self._closed = False
        self._lock = threading.Lock()
        self._dir_path: Path | None = None  # made on first use: a connector never used leaves nothing
        self._finalizer: weakref.finalize[Any, Any] | None = None
        # node -> (monotonic time, facts): the latest host facts a run returned (recent_facts)
        self._recent: dict[str, tuple[float, HostFacts]] = {}
        self._recent_lock = threading.Lock()

    # ------------------------------------------------------------------ protocol

    @property
    def private_data_dir(self) -> Path:
        """The private data dir (mode 0700), made on first use and removed by ``close()``."""
        with self._lock:
            if self._dir_path is None:
                if self._closed:
                    raise HostError("the Ansible connector is closed")
                sweep_stale_private_dirs()
                path = Path(tempfile.mkdtemp(prefix=DIR_PREFIX))
                (path / OWNER_FILE).write_text(_process_identity(os.getpid()) or "")
                for sub in ("home", "tmp", "cp", "artifacts"):
                    (path / sub).mkdir(mode=0o700)
                (path / "ansible.cfg").write_text(
                    "# written by runbook: isolates its runs from the user's ansible.cfg\n[defaults]\n")
                self._finalizer = weakref.finalize(self, _cleanup, path)
                self._dir_path = path
            return self._dir_path

    @property
    def _dir(self) -> Path:
        return self.private_data_dir

    def inventory_host(self, node: str) -> str:
        return self.inventory.host_for_node(node)

    def gather_facts(self, nodes: Sequence[str],
                     files: Sequence[str] = ()) -> Mapping[str, HostFacts | Exception]:
        """One read-only ``node-facts.yml`` run for all nodes; per node, facts or a ``HostError``
        (``unreachable=True`` when SSH could not connect). ``files``: paths to report on."""
        results: dict[str, HostFacts | Exception] = {}
        known = []
        for node in dict.fromkeys(nodes):
            try:
                self.inventory_host(node)
                known.append(node)
            except HostError as e:
                results[node] = e
        if not known:
            return results
        result = self._run_playbook(Path(FACTS_PLAYBOOK), known, become=self.facts_become,
                                    timeout=self.facts_timeout, read_only=True,
                                    extravars={"runbook_files": list(files)} if files else None)
        for node in known:
            facts = result.host_facts.get(node)
            if facts is not None:
                results[node] = facts
            elif node in result.unreachable_hosts:
                results[node] = HostError(result.unreachable_hosts[node], host=node, unreachable=True,
                                          retryable=True)
            elif node in result.failed_hosts:
                results[node] = HostError(f"facts of {result.failed_hosts[node]}", host=node)
            elif result.status in ("timeout", "canceled"):
                results[node] = HostError(f"gathering facts of {node}: {result.status}", host=node,
                                          retryable=result.status == "timeout")
            else:
                results[node] = HostError(f"gathering facts of {node}: the playbook returned none "
                                          f"(status {result.status}, rc {result.rc})", host=node)
        return results

    def recent_facts(self, nodes: Sequence[str], *, max_age: float,
                     files: Sequence[str] = ()) -> dict[str, tuple[HostFacts, float]]:
        """The latest facts this connector received for each node (from a facts run or from the
        facts a playbook publishes at its end) and their age in seconds, if at most ``max_age``
        seconds old, counted from the start of the task that probed them, and reporting on every
        path in ``files``. Nodes without such facts are left out. Every run on a node forgets its
        facts first, so a run that ends without facts (failed early, timed out, cancelled, Ansible
        could not start) leaves none.

        For callers that may use facts this fresh instead of gathering again (the checks before a
        step, right after the previous step's playbook); a verification poll must gather anew.
        """
        if max_age <= 0:
            return {}
        now = time.monotonic()
        out: dict[str, tuple[HostFacts, float]] = {}
        with self._recent_lock:
            for node in nodes:
                entry = self._recent.get(node)
                if entry is None:
                    continue
                at, facts = entry
                if now - at <= max_age and all(str(f) in facts.files for f in files):
                    out[node] = (facts, max(0.0, now - at))
        return out

    def _forget(self, nodes: Iterable[str]) -> None:
        with self._recent_lock:
            for node in nodes:
                self._recent.pop(node, None)

    def _remember(self, facts: Mapping[str, HostFacts], facts_at: Mapping[str, float]) -> None:
        with self._recent_lock:
            for node, value in facts.items():
                if node in facts_at:
                    self._recent[node] = (facts_at[node], value)

    def run_playbook(self, playbook: Path, nodes: Sequence[str], *,
                     extravars: Mapping[str, Any] | None = None, become: bool = True,
                     timeout: float = 300, check: bool = False,
                     on_event: Callable[[TaskEvent], None] | None = None) -> PlaybookResult:
        """Run ``playbook`` (relative to the playbooks dir) against the nodes' inventory hosts.

        Returns the outcome as a value (``status`` successful/failed/timeout/canceled; failed and
        unreachable hosts with a message each; per-node unified diffs in check mode; the host
        facts the playbook published). Raises ``HostError`` only when Ansible could not start or
        a node is not in the inventory. ``on_event`` is called from a worker thread.
        """
        return self._run_playbook(playbook, nodes, extravars=extravars, become=become,
                                  timeout=timeout, check=check, on_event=on_event)

    def _run_playbook(self, playbook: Path, nodes: Sequence[str], *,
                      extravars: Mapping[str, Any] | None = None, become: bool = True,
                      timeout: float = 300, check: bool = False,
                      on_event: Callable[[TaskEvent], None] | None = None,
                      read_only: bool = False) -> PlaybookResult:
        if self._closed:
            raise HostError("the Ansible connector is closed")
        path = playbook if playbook.is_absolute() else self.playbooks_dir / playbook
        if not path.is_file():
            raise HostError(f"playbook not found: {path}")
        hosts = [self.inventory_host(n) for n in nodes]
        if not hosts:
            raise HostError("run_playbook: no nodes given")
        if self._cancel.is_set():
            return PlaybookResult(status="canceled", rc=254)
        run_id = uuid.uuid4().hex
        state = _RunState(node_of=self.inventory.node_for_host, on_event=on_event)
        use_password = become and self._become_password is not None
        cmdline = []
        if check:
            cmdline += ["--check", "--diff"]
        if use_password:
            cmdline.append("--ask-become-pass")
        evars: dict[str, Any] = {}
        if self.facts_services is not None:
            evars["runbook_facts_services"] = list(self.facts_services)
        if self.journal_lines is not None:
            evars["runbook_facts_journal_lines"] = self.journal_lines
        evars.update(as_ansible_data(extravars or {}))  # values stay data: Ansible templates extra vars
        evars.update(target=",".join(hosts), runbook_become=become)
        if not become:
            evars["ansible_become"] = False
        kwargs: dict[str, Any] = dict(
            private_data_dir=str(self._dir),
            project_dir=str(self.playbooks_dir),
            artifact_dir=str(self._dir / "artifacts"),
            ident=run_id,
            playbook=str(path),
            inventory=str(self.inventory_path),
            limit=",".join(hosts),
            forks=run_forks(len(hosts), self.forks, read_only=read_only or check),
            extravars=evars,
            cmdline=" ".join(cmdline) or None,
            envvars=self._envvars(run_id, pipelining=read_only or check, hosts=len(hosts)),
            passwords={_BECOME_PROMPT: self._become_password} if use_password else None,
            event_handler=state.handle,
            cancel_callback=lambda: self._cancel.is_set(),
            settings={"suppress_output_file": True},
            suppress_env_files=True,  # else extravars/passwords would be written to env/
            quiet=True,
        )
        self._forget([*nodes, *(self.inventory.node_for_host(h) for h in hosts)])  # the run may change them
        outcome = self._run(kwargs, run_id, timeout)
        facts: dict[str, HostFacts] = {}
        for node, data in state.facts.items():
            try:
                facts[node] = parse_host_facts(str(data.get("host") or node), data)
            except HostError as e:
                state.failed.setdefault(node, str(e))
        if outcome[0] not in ("timeout", "canceled"):  # a killed run may change hosts after its facts
            self._remember(facts, state.facts_at)
        status, rc = outcome
        if status == "failed" and not state.failed and not state.unreachable:
            # Ansible stopped before any host ran (syntax error, bad inventory, ...)
            errors = [o for o in state.output if "ERROR" in o] or state.output[-1:] or [f"rc {rc}"]
            reason = " ".join(" ".join(errors).split())[:500]
            for node in nodes:
                state.failed[node] = f"{node}: ansible-playbook failed: {reason}"
        if status == "successful" and state.processed is not None:
            # Why: ansible-playbook only warns when --limit matches nothing and exits 0; a run that
            # touched no host is a failure, never "successful"
            for node, host in zip(nodes, hosts, strict=True):
                if host not in state.processed:
                    state.failed[node] = (f"{node}: inventory host {host} matched nothing in {self.inventory_path} "
                                          f"(ansible-playbook --limit {host} ran on no host; was the inventory "
                                          "changed since it was read?)")
            if state.failed:
                status, rc = "failed", 2
        if state.callback_error is not None:
            state.output.append(f"on_event failed: {state.callback_error!r}")
        return PlaybookResult(
            status=status, rc=rc,
            changed=MappingProxyType(dict(state.changed)),
            failed_hosts=MappingProxyType(dict(state.failed)),
            unreachable_hosts=MappingProxyType(dict(state.unreachable)),
            diffs=MappingProxyType({k: tuple(v) for k, v in state.diffs.items() if v}),
            host_facts=MappingProxyType(facts),
            tasks=tuple(state.tasks),
        )

    def cancel(self) -> None:
        """End every playbook this connector is running (thread-safe); later runs are refused."""
        self._cancel.set()

    def close(self) -> None:
        """End the SSH control masters and remove the private data dir. Idempotent."""
        with self._lock:
            self._closed = True
            finalizer = self._finalizer
        if finalizer is not None:
            finalizer()

    def __enter__(self) -> AnsibleConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _envvars(self, run_id: str, *, pipelining: bool, hosts: int = 1) -> dict[str, str]:
        """The child's environment additions. Pipelining (one SSH round trip per task, ~25 %
        faster) only for runs that change nothing (facts runs, ``--check`` previews): without it,
        a become task runs on a tty, so when a timeout or cancel kills the control master the
        remote command gets SIGHUP and ends instead of finishing unobserved. A read-only command
        finishing unobserved is harmless (a preview's ``check_mode: false`` tasks must be read-only
        anyway: previews are read-only by contract)."""
        d = self._dir
        env = {
            "ANSIBLE_CONFIG": str(d / "ansible.cfg"),
            "ANSIBLE_HOME": str(d / "home"),
            "ANSIBLE_LOCAL_TEMP": str(d / "tmp"),
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(d / "cp"),
            "ANSIBLE_SSH_ARGS": f"-o ControlMaster=auto -o ControlPersist={self.control_persist}s",
            "ANSIBLE_TIMEOUT": str(self.ssh_timeout),
            # ansible-runner turns host key checking off unless told; the inventory decides
            # (ansible_host_key_checking, ansible_ssh_common_args with a known_hosts file).
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_PYTHON_INTERPRETER": "auto_silent",
            "ANSIBLE_RETRY_FILES_ENABLED": "False",
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_GATHERING": "explicit",
            "ANSIBLE_PIPELINING": str(pipelining),
            # Several hosts are several nodes, each with its own executor (engine.batch): under the
            # default linear strategy every task waits for the slowest host, so one slow node held
            # its whole batch back, task by task, and a timeout then ended the others' runs too.
            # Free: each host goes through the play at its own pace (a playbook's own `strategy:`
            # still wins). One host: linear and free are the same.
            **({"ANSIBLE_STRATEGY": "free"} if hosts > 1 else {}),
            # the ansible-playbook installed with this Python, even outside an activated venv
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            RUN_MARKER: run_id,
            "RUNBOOK_ANSIBLE_DIR": str(d),
            # ansible-runner appends its callback dir to these: start from nothing, not the parent's
            "ANSIBLE_CALLBACK_PLUGINS": "",
            "AWX_LIB_DIRECTORY": "",
        }
        return env

    def _run(self, kwargs: dict[str, Any], run_id: str, timeout: float) -> tuple[str, int]:
        """Run ansible-runner in a worker thread; on timeout/cancel/^C kill the process tree."""
        import ansible_runner
        import ansible_runner.interface

        _no_delay_after_close()

        box: dict[str, Any] = {}

        def work() -> None:
            try:
                # ansible_runner.run() = init_runner() + run(), with the parent's whole environment
                # in between: replace it by the allow-listed one before anything starts.
                runner = ansible_runner.interface.init_runner(**kwargs)
                runner.config.env = child_environment(runner.config.env, kwargs["envvars"], os.environ)
                runner.run()
                box["status"], box["rc"] = runner.status, runner.rc
            except BaseException as e:  # reported in the calling thread
                box["error"] = e

        deadline = time.monotonic() + timeout
        worker = threading.Thread(target=work, name=f"ansible-{run_id[:8]}", daemon=True)
        ended: str | None = None
        try:
            worker.start()
            while worker.is_alive():
                if self._cancel.is_set():
                    ended = "canceled"
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ended = "timeout"
                    break
                worker.join(min(remaining, 0.05))
        except BaseException:
            # KeyboardInterrupt while waiting: leave nothing running, then let it propagate.
            kill_run(run_id, self._dir / "cp")
            worker.join(10)
            self._purge_artifacts(run_id)
            raise
        if ended is not None:
            kill_run(run_id, self._dir / "cp")
            worker.join(15)
            _remove_stale_sockets(self._dir / "cp")
        self._purge_artifacts(run_id)
        if "error" in box:
            err = box["error"]
            raise HostError(f"ansible-runner could not run {kwargs['playbook']}: {err}") from err
        if ended is not None:
            return ended, 254
        rc = box.get("rc")
        return str(box.get("status", "failed")), int(rc) if isinstance(rc, int) else 254

    def _purge_artifacts(self, run_id: str) -> None:
        # artifacts/<id>/command and the status payload hold the full environment.
        shutil.rmtree(self._dir / "artifacts" / run_id, ignore_errors=True)


# ============================================================================ processes


def _no_delay_after_close() -> None:
    """ansible-runner closes its pexpect child only once the child has exited (it loops on
    ``isalive()``), yet ptyprocess then sleeps ``delayafterclose`` (0.1 s, "give the kernel time to
    update process status") on every close: 0.1 s of every Ansible run, for nothing. The sleep is
    ptyprocess's class attribute; in this process ansible-runner is its only user."""
    with contextlib.suppress(ImportError):
        import ptyprocess

        ptyprocess.PtyProcess.delayafterclose = 0.0


def _pids_with_env(entry: bytes, cmdline_part: bytes | None = None) -> list[int]:
    """Processes (other than this one) whose environment holds ``entry`` (``NAME=value``), or
    whose command line contains ``cmdline_part``.

    The command line is needed for ssh control masters: their process title
    (``ssh: <control path> [mux]``) overwrites the memory /proc shows as their environment.
    """
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
            if entry in env.split(b"\0"):
                found.append(int(name))
                continue
            if cmdline_part is not None:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if cmdline_part in f.read():
                        found.append(int(name))
        except OSError:  # gone, or not ours
            continue
    return found


def kill_processes_with_env(name: str, value: str, *, cmdline_part: str | None = None,
                            first: signal.Signals = signal.SIGKILL, grace: float = 0.5,
                            rounds: int = 100) -> int:
    """Signal every process carrying ``name=value`` in its environment (or ``cmdline_part`` in
    its command line) until none is left; returns how many.

    ``first`` is sent once (SIGTERM lets ssh masters remove their sockets); whatever is still
    there after ``grace`` seconds, and anything that appears meanwhile, gets SIGKILL.
    """
    entry = f"{name}={value}".encode()
    part = cmdline_part.encode() if cmdline_part else None
    seen: set[int] = set()
    if first != signal.SIGKILL:
        for pid in _pids_with_env(entry, part):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, first)
                seen.add(pid)
        end = time.monotonic() + grace
        while seen and time.monotonic() < end and _pids_with_env(entry, part):
            time.sleep(0.02)
    for _ in range(rounds):
        pids = _pids_with_env(entry, part)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                seen.add(pid)
        time.sleep(0.02)  # a process that was forking when killed leaves a child: look again
    return len(seen)


def kill_run(run_id: str, control_dir: Path | None = None) -> int:
    """End one run's whole tree: ansible-playbook, its workers and ssh clients; with
    ``control_dir``, also the ssh control masters that live there."""
    return kill_processes_with_env(RUN_MARKER, run_id,
                                   cmdline_part=f"ssh: {control_dir}/" if control_dir else None)


def _remove_stale_sockets(cp_dir: Path) -> None:
    """Remove control sockets whose master is gone (killed), so the next run starts afresh."""
    for path in cp_dir.iterdir() if cp_dir.is_dir() else ():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()
        finally:
            s.close()


def _process_identity(pid: int) -> str | None:
    """``"<pid> <start time>"`` of a live process (start time tells a reused pid apart), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return f"{pid} {fields[19]}" if len(fields) > 19 else None


def sweep_stale_private_dirs(tmp: Path | None = None) -> list[Path]:
    """Remove the private data dirs of connectors whose process died without ``close()``
    (SIGKILL, an unhandled SIGTERM), with their leftover ssh control masters. Only dirs with an
    owner file whose process is gone are touched; returns them."""
    removed = []
    for path in Path(tmp or tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        try:
            if not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            owner = (path / OWNER_FILE).read_text().split()
        except OSError:
            continue
        if len(owner) != 2 or not owner[0].isdigit() or _process_identity(int(owner[0])) == " ".join(owner):
            continue
        _cleanup(path)
        removed.append(path)
    return removed


def _cleanup(private_dir: Path) -> None:
    """Stop this connector's SSH control masters (and anything else it left), remove its dir.

    Every process the connector starts carries the dir's path in its environment, so the
    masters are found without guessing by name; SIGTERM lets them remove their sockets.
    """
    kill_processes_with_env("RUNBOOK_ANSIBLE_DIR", str(private_dir), first=signal.SIGTERM,
                            cmdline_part=f"ssh: {private_dir / 'cp'}/")
    shutil.rmtree(private_dir, ignore_errors=True)
