"""Progress of a run as it happens: a live display on a terminal, plain lines everywhere else.

Both are ``EventSink``s fed the executor's events (``engine.execution.EventSink``) through the run
service's ``live`` sink; neither decides anything, touches the journal or talks to outside systems.

* ``LiveDisplay`` (a terminal, colours allowed): rich's live rendering of the steps with their state
  (pending / running / succeeded / skipped with reason / failed), the running action's last finished Ansible task,
  and for a verification wait a bar of elapsed time against its timeout with the last observed value
  (``Ready=Unknown, 12 s of 120 s``). A fleet shows one row per node (batch, step, state, elapsed).
* ``PlainProgress`` (pipes, CI, ``--no-tty``, ``NO_COLOR``/``--no-color``): one line per event worth
  seeing, no control characters, so logs stay greppable.

``progress_sink`` picks one. Colours and glyphs come from rich; there are no escape codes here.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.live import Live

    from engine.model import Plan

GLYPH = {"pending": "○", "running": "●", "succeeded": "✓", "skipped": "↷", "failed": "✗",
         "timed-out": "✗", "blocked": "!", "rolled-back": "↶", "cancelled": "■"}
STYLE = {"pending": "dim", "running": "bold yellow", "succeeded": "green", "skipped": "cyan", "failed": "red",
         "timed-out": "red", "blocked": "yellow", "rolled-back": "magenta", "cancelled": "yellow",
         "waiting": "yellow"}


def wants_live(stream: TextIO, *, no_tty: bool = False, no_color: bool = False) -> bool:
    """The live display needs a terminal and colours: ``--no-tty``, ``--no-color``, ``NO_COLOR`` or a
    stream that is not a terminal (a pipe, a CI log) get plain lines."""
    if no_tty or no_color or "NO_COLOR" in os.environ:
        return False
    return bool(getattr(stream, "isatty", lambda: False)())


def progress_sink(stream: TextIO | None = None, *, no_tty: bool = False, no_color: bool = False
                  ) -> LiveDisplay | PlainProgress:
    """The live display on a terminal, else plain lines (both on ``stream``, default stderr)."""
    out = stream if stream is not None else sys.stderr
    return LiveDisplay(out) if wants_live(out, no_tty=no_tty, no_color=no_color) else PlainProgress(out)


# -- plain lines ----------------------------------------------------------------------------------


class PlainProgress:
    """One line per event worth seeing: ``[  12.3s] step swap-off: start``; never a control character."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.t0 = time.monotonic()
        self.step_t0: dict[str, float] = {}
        self.fleet = False
        self._nodes: dict[int, str] = {}

    def expect(self, plans: Sequence[Plan], max_parallel: int = 1) -> None:
        self.fleet = len(plans) > 1

    def stop(self) -> None:
        return None

    def _say(self, text: str) -> None:
        elapsed = time.monotonic() - self.t0
        node = self._nodes.get(threading.get_ident())
        prefix = f"{node}: " if self.fleet and node else ""
        print(f"[{elapsed:6.1f}s] {prefix}{text}", file=self.stream, flush=True)

    def emit(self, kind: str, **data: Any) -> None:
        step = str(data.get("step") or "")
        if kind == "run.start":
            self._nodes[threading.get_ident()] = str(data.get("node") or "")
            if self.fleet:
                self._say(f"run {data.get('runbook', '')} started")
        elif kind == "step.start":
            self.step_t0[step] = time.monotonic()
            self._say(f"step {step}: start")
        elif kind == "guard.result" and not data.get("holds"):
            self._say(f"  guard {data.get('check')}: {short(data.get('observed', ''))}")
        elif kind == "action.intent":
            self._say(f"  act: {short(data.get('summary') or data.get('command', ''))}")
        elif kind == "ansible.task":
            self._say(f"    {data.get('host', '')}: {data.get('task', '')} [{data.get('status', '')}]")
        elif kind == "action.result":
            self._say(f"  action {'ok' if data.get('ok', True) else 'FAILED'}: {short(data.get('summary', ''))}")
        elif kind == "verify.attempt":
            ok = data.get("holds")
            self._say(f"  verify {data.get('check')}: {'ok' if ok else 'waiting'} "
                      f"({short(data.get('observed', ''))}, {float(data.get('elapsed') or 0):.0f} s)")
        elif kind == "step.outcome":
            took = time.monotonic() - self.step_t0.get(step, self.t0)
            self._say(f"step {step}: {data.get('status', '')} in {took:.1f}s {short(data.get('reason', ''))}".rstrip())
        elif kind in ("run.blocked", "run.failed", "approval.waiting", "lock.waiting", "run.escalated"):
            self._say(f"{kind}: {short(data.get('reason', '') or data)}")


# -- the live display -----------------------------------------------------------------------------


@dataclass
class _Step:
    id: str
    state: str = "pending"
    reason: str = ""
    started: float | None = None
    finished: float | None = None


@dataclass
class _Wait:
    check: str
    started: float
    timeout: float | None
    observed: str = ""
    holds: bool | None = None


@dataclass
class _Node:
    name: str
    batch: int = 0
    state: str = "pending"
    runbook: str = ""
    steps: dict[str, _Step] = field(default_factory=dict)
    timeouts: dict[str, dict[str, float]] = field(default_factory=dict)  # step -> check text -> seconds
    current: str = ""
    task: str = ""
    wait: _Wait | None = None
    note: str = ""
    started: float | None = None
    finished: float | None = None


class LiveDisplay:
    """rich's live rendering of a run (one node) or a fleet (one row per node), on ``stream``.

    Starts with the first ``run.start`` (so a confirmation prompt before it is not overdrawn) and
    redraws a few times a second, so a verification wait's elapsed time moves without events.
    ``stop()`` leaves the last frame on the screen; the caller prints the closing table after it.
    """

    def __init__(self, stream: TextIO = sys.stderr, *, clock: Any = time.monotonic, auto_start: bool = True) -> None:
        from rich.console import Console

        self.console = Console(file=stream)
        self.clock = clock
        self.nodes: dict[str, _Node] = {}
        self.batches = 1
        self.fleet = False
        self._threads: dict[int, str] = {}
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._auto_start = auto_start

    def expect(self, plans: Sequence[Plan], max_parallel: int = 1) -> None:
        """The nodes, their batches and steps (pending) and the verify timeouts, from the plans."""
        self.fleet = len(plans) > 1
        width = max(1, max_parallel)
        running = [p for p in plans if p.state.value != "blocked"]
        for p in plans:
            node = self._node(p.node)
            node.runbook = p.runbook
            node.batch = running.index(p) // width + 1 if p in running else 0
            if p.state.value == "blocked":
                node.state, node.note = "blocked", "; ".join(p.blocked_reasons)
            for s in p.steps:
                node.steps.setdefault(s.id, _Step(s.id))
                node.timeouts[s.id] = {v.check: float(v.timeout_seconds) for v in s.verify}
        self.batches = max([n.batch for n in self.nodes.values()] + [1])

    def _node(self, name: str) -> _Node:
        if name not in self.nodes:
            self.nodes[name] = _Node(name)
        return self.nodes[name]

    def _current_node(self, data: Mapping[str, Any]) -> _Node | None:
        name = data.get("node") or self._threads.get(threading.get_ident())
        if not name:
            active = [n for n in self.nodes.values() if n.state == "running"]
            name = active[0].name if len(active) == 1 else None
        return self._node(str(name)) if name else None

    def emit(self, kind: str, **data: Any) -> None:
        with self._lock:
            if kind == "run.start":
                self._threads[threading.get_ident()] = str(data.get("node") or "")
            node = self._current_node(data if kind == "run.start" else {})
            if node is not None:
                self._apply(node, kind, data)
        if kind == "run.start" and self._live is None and self._auto_start:
            self.start()

    def _apply(self, node: _Node, kind: str, data: Mapping[str, Any]) -> None:
        now = self.clock()
        step_id = str(data.get("step") or "")
        step = node.steps.setdefault(step_id, _Step(step_id)) if step_id else None
        if kind == "run.start":
            node.state, node.started, node.runbook = "running", now, str(data.get("runbook") or node.runbook)
            for done in data.get("completed") or ():
                node.steps.setdefault(done, _Step(done)).state = "succeeded"
        elif kind == "step.start" and step is not None:
            step.state, step.started, step.reason = "running", now, ""
            node.current, node.task, node.wait = step_id, "", None
        elif kind == "action.intent":
            node.task = short(data.get("summary") or data.get("command") or "", 90)
        elif kind == "ansible.task":
            # ansible-runner reports a task when it ends: this is the last one done (and how it went)
            node.task = f"last task: {short(data.get('task', ''), 80)} ({data.get('status', '')})"
        elif kind == "action.result" and data.get("ok", True) and not data.get("rollback") and step is not None:
            # The verifications start now; the first observation may take a while to be reported
            # (a watch reports every 15 s until something changes): show the wait from its start.
            checks = node.timeouts.get(step_id) or {}
            if checks:
                check, timeout = next(iter(checks.items()))
                node.wait = _Wait(check, now, timeout, "not observed yet")
        elif kind == "verify.attempt":
            check = str(data.get("check") or "")
            started = now - float(data.get("elapsed") or 0.0)  # the executor's own measure of the wait
            if node.wait is None or node.wait.check != check:
                node.wait = _Wait(check, started, self._timeout(node, step_id, check))
            node.wait.started = started
            node.wait.observed = short(data.get("observed") or "", 60)
            node.wait.holds = data.get("holds")
        elif kind == "verify.result":
            node.wait = None
        elif kind == "step.outcome" and step is not None:
            step.state, step.finished = str(data.get("status") or ""), now
            step.reason = short(data.get("reason", ""), 80)
            node.current, node.task, node.wait = "", "", None
        elif kind == "approval.waiting":
            node.note = short(data.get("reason", ""), 100)
        elif kind == "run.finish":
            node.state, node.finished = str(data.get("state") or "finished"), now
            node.note = short(data.get("reason", ""), 100) if node.state != "succeeded" else ""
        elif kind in ("run.blocked", "run.failed", "run.cancelled", "run.interrupted"):
            node.note = short(data.get("reason", ""), 100)

    @staticmethod
    def _timeout(node: _Node, step_id: str, check: str) -> float | None:
        timeouts = node.timeouts.get(step_id) or {}
        if check in timeouts:
            return timeouts[check]
        return max(timeouts.values()) if timeouts else None

    # -- drawing ---------------------------------------------------------------------------------

    def start(self) -> None:
        from rich.live import Live

        self._live = Live(get_renderable=self.render, console=self.console, refresh_per_second=4,
                          transient=False, redirect_stdout=False, redirect_stderr=False)
        self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.refresh()
            self._live.stop()
            self._live = None

    def render(self) -> RenderableType:
        with self._lock:
            return self._render_fleet() if self.fleet else self._render_one()

    def _render_one(self) -> RenderableType:
        from rich.console import Group
        from rich.padding import Padding
        from rich.table import Table
        from rich.text import Text

        if not self.nodes:
            return Text("")
        node = next(iter(self.nodes.values()))
        now = self.clock()
        head = Text.assemble((f"{node.runbook} on {node.name}", "bold"), "  ",
                             (node.state, STYLE.get(node.state, "")), f"  {_elapsed(node, now)}")
        id_width = max((len(s.id) for s in node.steps.values()), default=4)

        def grid() -> Table:
            # The same column widths in every part, so the steps line up around a verification's bar.
            table = Table.grid(padding=(0, 2))
            table.add_column(min_width=1, max_width=1)
            table.add_column(min_width=id_width, no_wrap=True)
            table.add_column(min_width=10, no_wrap=True)
            table.add_column(min_width=7, no_wrap=True, justify="right")
            # the detail takes what is left of the line (cut with an ellipsis), never the step names' room
            table.add_column(max_width=max(10, self.console.width - id_width - 27), overflow="ellipsis",
                             no_wrap=True)
            return table

        parts: list[Any] = [head]
        table = grid()
        for s in node.steps.values():
            took = ""
            if s.started is not None:
                took = f"{(s.finished if s.finished is not None else now) - s.started:.1f}s"
            detail = Text(node.task if s.state == "running" else s.reason)
            table.add_row(Text(GLYPH.get(s.state, "?"), STYLE.get(s.state, "")), s.id,
                          Text(s.state, STYLE.get(s.state, "")), took, detail)
            if s.state == "running" and node.wait is not None:
                parts += [table, Padding(self._wait_bar(node.wait, now), (0, 0, 0, 3))]
                table = grid()
        if table.row_count:
            parts.append(table)
        if node.note:
            parts.append(Text(node.note, "yellow"))
        return Group(*parts)

    def _wait_bar(self, wait: _Wait, now: float, *, bar_width: int = 30) -> RenderableType:
        """``verify CHECK`` over ``━━━━━━━━───── Ready=Unknown, 12 s of 120 s`` (no timeout: no bar)."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        elapsed = max(0.0, now - wait.started)
        row = Table.grid(padding=(0, 1))
        if wait.timeout:
            row.add_column(width=bar_width, no_wrap=True)
            row.add_column(no_wrap=True, overflow="ellipsis")
            row.add_row(ProgressBar(total=wait.timeout, completed=min(elapsed, wait.timeout), width=bar_width),
                        Text(f"{wait.observed}, {elapsed:.0f} s of {wait.timeout:.0f} s"))
        else:
            row.add_column(no_wrap=True, overflow="ellipsis")
            row.add_row(Text(f"{wait.observed}, {elapsed:.0f} s"))
        return Group(Text(f"verify {wait.check}", "bold", no_wrap=True, overflow="ellipsis"), row)

    def _render_fleet(self) -> RenderableType:
        from rich.table import Table
        from rich.text import Text

        now = self.clock()
        running = sorted({n.batch for n in self.nodes.values() if n.state == "running"})
        title = f"batch {running[0]} of {self.batches}" if running else f"{self.batches} batches"
        table = Table(title=f"{_first_runbook(self.nodes)} on {len(self.nodes)} nodes: {title}", title_justify="left")
        for col in ("batch", "node", "step", "state", "time", "detail"):
            table.add_column(col, no_wrap=col != "detail")
        for node in self.nodes.values():
            step = node.current or next((s.id for s in reversed(list(node.steps.values()))
                                          if s.state != "pending"), "")
            detail: Any = Text(node.note or node.task)
            if node.wait is not None:
                detail = self._wait_bar(node.wait, now, bar_width=16)
            table.add_row(str(node.batch or "-"), node.name, step, Text(node.state, STYLE.get(node.state, "")),
                          _elapsed(node, now), detail)
        return table


def _elapsed(node: _Node, now: float) -> str:
    if node.started is None:
        return ""
    return f"{(node.finished if node.finished is not None else now) - node.started:.0f} s"


def _first_runbook(nodes: Mapping[str, _Node]) -> str:
    return next((n.runbook for n in nodes.values() if n.runbook), "runbook")


def short(v: Any, n: int = 160) -> str:
    if not isinstance(v, str):
        v = json.dumps(v, default=str) if isinstance(v, Mapping | list) else str(v)
    text = " ".join(v.split())
    return text if len(text) <= n else text[: n - 1] + "…"
