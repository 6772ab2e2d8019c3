"""Rendering plans, run results, run history and live progress for people and machines.

Text is coloured on a terminal (unless ``NO_COLOR``) and plain lines when stdout is not a TTY.
``json`` prints one machine-readable document (a plan is ``Plan.model_dump``, format
``runbook-plan/v1``, documented in docs/runbooks.md). ``markdown`` is for tickets and pull
requests: a step table, the diffs, and a Mermaid diagram of step order. Nothing here decides
anything or talks to outside systems.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from engine.model import RunState

if TYPE_CHECKING:
    from engine.model import Plan, RunResult
    from engine.store import EventRecord, RunRecord

DECISION_MARK = {"change": "~", "no-op": "=", "blocked": "!"}
DECISION_COLOR = {"change": "yellow", "no-op": "green", "blocked": "red"}  # rich styles
STATE_COLOR = {"ready": "yellow", "nothing-to-do": "green", "blocked": "bold red"}
STATUS_STYLE = {"succeeded": "green", "skipped": "cyan", "failed": "red", "timed-out": "red",
                "blocked": "yellow", "rolled-back": "magenta", "cancelled": "yellow"}


def use_color(stream: TextIO = sys.stdout) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ


def dump_json(doc: Any) -> str:
    return json.dumps(doc, indent=2, default=str, sort_keys=False)


# -- plans ----------------------------------------------------------------------------------


def preview_gist(preview: str) -> str:
    """One line saying what a step's preview shows: ``diff of /etc/fstab (-1 +1)``, ``would restart
    kubelet on omen2`` (a check-mode task's message), ``server dry-run accepted``; "" for no preview."""
    text = preview.strip()
    if not text:
        return ""
    lines = text.splitlines()
    files = [ln[4:].strip() for ln in lines if ln.startswith("--- ")]
    if files:
        minus = sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("--- "))
        plus = sum(1 for ln in lines if ln.startswith("+") and not ln.startswith("+++ "))
        return f"diff of {', '.join(dict.fromkeys(files))} (-{minus} +{plus})"
    if lines[0].startswith("check mode: would change:"):
        said = [ln.split(": ", 1)[1] if ": " in ln else ln for ln in lines[1:] if ln.strip()]
        return "; ".join(said) or "would change"
    acted = [ln.split(": ", 1)[1] for ln in lines if ln.startswith("server dry-run accepted: ")]
    refused = [ln.split(":", 1)[0].split(" ", 1)[1] for ln in lines if ln.startswith("REFUSED ")]
    skipped = sum(1 for ln in lines if ln.startswith("skip "))
    if refused:  # a drain's pods that refuse it (engine/kube_verbs/drain.py)
        return "drain refused by " + ", ".join(refused)
    if acted and all(a.startswith(("evict ", "delete ")) for a in acted) \
            and len(acted) + skipped + sum(1 for ln in lines if "cordon" in ln) == len(lines):
        verb = acted[0].split()[0]
        return f"would {verb} " + ", ".join(a.split(" ", 1)[1] for a in acted) + \
            (f"; {skipped} skipped" if skipped else "")
    if lines[0].startswith("server dry-run accepted"):
        return "server dry-run accepted"
    return _one_line(lines[0])


def _step_gist(step: Any) -> str:
    """The preview's gist where it adds to the step's summary (playbooks, evictions), else ""."""
    if step.kind != "change":
        return ""
    gist = preview_gist(step.preview)
    return "" if gist == "server dry-run accepted" else gist


def _paint(text: str, style: str | None, color: bool) -> str:
    """``text`` in a rich ``style`` (rendered by rich for a terminal) when ``color``; as is otherwise."""
    if not (color and style):
        return text
    from rich.text import Text

    console = _styling_console()
    with console.capture() as captured:
        console.print(Text(text, style=style), end="", soft_wrap=True)
    return captured.get()


@functools.lru_cache(maxsize=1)
def _styling_console() -> Any:
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=True, color_system="standard", no_color=False,
                   highlight=False, width=10_000)


def plan_text(plan: Plan, *, color: bool = False) -> str:
    """The plan for a terminal: preconditions, then per step the decision (``~`` change, ``=`` no-op,
    ``!`` blocked), what changes, the command, guards with their current values, the verifications
    that follow, and the dry-run preview (the fstab diff, "would restart kubelet on omen2")."""
    state = _paint(plan.state.value, STATE_COLOR.get(plan.state.value), color)
    lines = [_paint(f"Plan for {plan.runbook} {plan.version} on node {plan.node}", "bold", color)
             + f"  (digest {plan.digest[:12]})",
             f"state: {state}; created {plan.created_at}, expires {plan.expires_at}",
             f"params: {', '.join(f'{k}={v}' for k, v in plan.params.items())}"]
    if plan.probe_errors:
        lines.append("probe errors (checks over them fail closed):")
        lines += [f"  ! {e}" for e in plan.probe_errors]
    if plan.preconditions:
        lines.append("preconditions:")
        for p in plan.preconditions:
            mark = "-" if not p.applies else ("ok" if p.holds else ("??" if p.holds is None else "FAIL"))
            detail = p.message if not p.passed and p.message else p.observed
            mark_text = _paint(f"[{mark:>4}]", "red" if mark in ("FAIL", "??") else None, color)
            lines.append(f"  {mark_text} {p.id}: {detail}" if detail else f"  {mark_text} {p.id}")
    lines.append("steps:")
    for i, s in enumerate(plan.steps, 1):
        mark = _paint(f"[{DECISION_MARK[s.kind]}]", DECISION_COLOR[s.kind], color)
        gist = _step_gist(s)
        lines.append(f"  {i}. {mark} {s.id} ({s.action}): {s.summary}" + (f" -- {gist}" if gist else ""))
        if s.why and s.kind == "change":
            lines.append(f"       why: {_one_line(s.why)}")
        if s.command:
            lines.append(f"       command: {s.command}")
        for c in s.changes:
            lines.append(f"       change: {c.path}: {_val(c.before)} -> {_val(c.after)}")
        for g in s.guards:
            lines.append(f"       guard: {g.check} = {_holds(g.holds)} ({g.observed})")
        for v in s.verify:
            lines.append(f"       then verify: {v.check} (within {v.timeout_seconds:g}s)")
        if s.rollback and s.kind == "change":
            lines.append(f"       rollback: {s.rollback}")
        if s.preview:
            lines.append("       preview:")
            for ln in s.preview.rstrip().splitlines():
                code = "red" if ln.startswith("-") and not ln.startswith("---") else \
                    "green" if ln.startswith("+") and not ln.startswith("+++") else None
                lines.append(f"         {_paint(ln, code, color)}")
    if plan.state.value == "blocked":
        lines.append(_paint("BLOCKED:", "bold red", color))
        lines += [f"  {r}" for r in plan.blocked_reasons]
    elif plan.state.value == "nothing-to-do":
        lines.append("Nothing to do: every step is a no-op.")
    return "\n".join(lines)


def plan_markdown(plan: Plan) -> str:
    """The plan for a ticket or pull request (GitHub-flavoured Markdown): summary, preconditions, the
    step table, a Mermaid diagram of the step order, then per step its changes, guards, verifications
    and the dry-run preview in a fenced block (``diff`` for unified diffs)."""
    out = [f"# Plan: `{plan.runbook}` {plan.version} on `{plan.node}`", "",
           f"- state: **{plan.state.value}**",
           f"- digest: `{plan.digest}`",
           f"- runbook digest: `{plan.runbook_digest}`",
           f"- created: {plan.created_at}; expires: {plan.expires_at}",
           f"- params: {', '.join(f'`{k}={v}`' for k, v in plan.params.items())}", ""]
    if plan.approval:
        out += [f"Approval required: `runbook approve RUN_ID --plan-digest {plan.digest}`", ""]
    if plan.probe_errors:
        out += ["## Probe errors", ""] + [f"- {_cell(e)}" for e in plan.probe_errors] + [""]
    if plan.preconditions:
        out += ["## Preconditions", "", "| precondition | applies | holds | observed |", "|---|---|---|---|"]
        for p in plan.preconditions:
            out.append(f"| {p.id} | {'yes' if p.applies else 'no'} | {_holds(p.holds)} | "
                       f"{_cell(p.message if not p.passed else p.observed)} |")
        out.append("")
    out += ["## Steps", "", "| # | step | action | decision | what happens | command |",
            "|---|---|---|---|---|---|"]
    for i, s in enumerate(plan.steps, 1):
        gist = _step_gist(s)
        what = s.summary + (f": {gist}" if gist else "")
        command = f"`{_cell(s.command)}`" if s.command else ""
        out.append(f"| {i} | {s.id} | {s.action} | {s.kind} | {_cell(what)} | {command} |")
    out += ["", "## Step order", "", "```mermaid", "graph TD"]
    for s in plan.steps:
        out.append(f'  {_mid(s.id)}["{s.id}: {s.kind}"]')
    for i, s in enumerate(plan.steps):
        if i:
            out.append(f"  {_mid(plan.steps[i - 1].id)} --> {_mid(s.id)}")
        for r in s.requires:
            out.append(f"  {_mid(r)} -. requires .-> {_mid(s.id)}")
    out += ["```", ""]
    for s in plan.steps:
        out += [f"### {s.id}", "", f"**{s.kind}**: {_cell(s.summary)}", ""]
        if s.why:
            out += [_one_line(s.why), ""]
        for c in s.changes:
            out.append(f"- change `{c.path}`: `{_val(c.before)}` -> `{_val(c.after)}`")
        for g in s.guards:
            out.append(f"- guard `{g.check}`: {_holds(g.holds)} ({_cell(g.observed)})")
        for k in s.skip_if:
            out.append(f"- skip if `{k.check}`: {_holds(k.holds)} ({_cell(k.observed)})")
        for v in s.verify:
            out.append(f"- verify `{v.check}` within {v.timeout_seconds:g}s")
        if s.preview:
            fence = "diff" if _is_diff(s.preview) else "text"
            out += ["", f"```{fence}", s.preview.rstrip().replace("```", "``\u200b`"), "```"]
        out.append("")
    if plan.state.value == "blocked":
        out += ["## Blocked", ""] + [f"- {_cell(r)}" for r in plan.blocked_reasons]
    return "\n".join(out) + "\n"


def _is_diff(text: str) -> bool:
    return bool(re.search(r"^(--- |\+\+\+ |@@ )", text, flags=re.MULTILINE))


def plan_json(plan: Plan) -> dict[str, Any]:
    return plan.model_dump(mode="json")


def render_plans(plans: Sequence[Plan], output: str, *, color: bool | None = None) -> str:
    """Plans as ``json`` (one document; ``{"plans": [...]}`` for several), ``markdown`` or ``text``
    (coloured when ``color``, by default when stdout is a terminal)."""
    if output == "json":
        docs = [plan_json(p) for p in plans]
        return dump_json(docs[0] if len(docs) == 1 else {"plans": docs})
    if output == "markdown":
        return "\n".join(plan_markdown(p) for p in plans)
    paint = use_color() if color is None else color
    return "\n\n".join(plan_text(p, color=paint) for p in plans)


# -- results --------------------------------------------------------------------------------


def result_text(result: RunResult, run_id: str | None = None) -> str:
    head = f"run {run_id} " if run_id else ""
    lines = [f"{head}{result.runbook} on {result.node}: {result.state.value} (exit {result.exit_code})"]
    width = max((len(o.step) for o in result.outcomes), default=4)
    for o in result.outcomes:
        took = max(0.0, o.finished_at - o.started_at)
        lines.append(f"  {o.step:<{width}}  {o.status.value:<11} {took:6.1f}s  {_one_line(o.reason)}")
    if result.reason:
        lines.append(f"reason: {result.reason}")
    if result.report:
        lines += ["", result.report.rstrip()]
    return "\n".join(lines)


def fleet_text(doc: Mapping[str, Any]) -> str:
    """A fleet's closing summary (``RunService.run_targets(...).as_json()``): one row per node
    (node, outcome, run id, duration, reason), then the counts and the exit code."""
    rows = list(doc.get("runs") or [])
    width = max((len(str(r["node"])) for r in rows), default=4)
    run_w = max((len(str(r.get("run_id") or "-")) for r in rows), default=3)
    lines = [f"{'node':<{width}}  {'outcome':<13} {'run':<{run_w}} {'time':>7}  reason"]
    for r in rows:
        took = f"{float(r.get('duration') or 0):6.1f}s"
        lines.append(f"{r['node']:<{width}}  {r['outcome']:<13} {r.get('run_id') or '-':<{run_w}} {took:>7}  "
                     f"{_one_line(str(r.get('reason') or ''))}")
    summary = dict(doc.get("summary") or {})
    counts = ", ".join(f"{v} {k}" for k, v in summary.items() if k not in ("nodes", "exit_code", "refused"))
    lines.append(f"fleet: {summary.get('nodes', len(rows))} nodes: {counts} (exit {summary.get('exit_code')})")
    if summary.get("refused"):
        lines.append(str(summary["refused"]))
    return "\n".join(lines)


def result_json(result: RunResult, run_id: str | None = None) -> dict[str, Any]:
    doc = result.model_dump(mode="json")
    if run_id:
        doc = {"run_id": run_id, **doc}
    return doc


def print_result_table(result: RunResult, run_id: str | None, stream: TextIO = sys.stdout) -> None:
    """The final summary table; rich on a terminal, plain text otherwise."""
    if not use_color(stream):
        print(result_text(result, run_id), file=stream)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream)
    table = Table(title=f"{result.runbook} on {result.node}: {result.state.value}", title_justify="left")
    for col in ("step", "status", "time", "reason"):
        table.add_column(col)
    for o in result.outcomes:
        style = STATUS_STYLE.get(o.status.value, "")
        table.add_row(o.step, f"[{style}]{o.status.value}[/]", f"{max(0.0, o.finished_at - o.started_at):.1f}s",
                      _one_line(o.reason))
    console.print(table)
    if result.reason:
        console.print(f"reason: {result.reason}", markup=False)
    if result.report:
        console.print(result.report.rstrip(), markup=False)
    if run_id:
        console.print(f"run id: {run_id}  (runbook runs show {run_id})", markup=False)


# -- history --------------------------------------------------------------------------------


def runbooks_text(loaded: Sequence[Any], *, wide: bool = False) -> str:
    """``runbook list``: name, version, the description's first line; ``wide`` adds params and path."""
    lines = []
    for lr in loaded:
        first = lr.runbook.description.strip().splitlines()
        line = f"{lr.name:<28} {lr.runbook.version:<8} {first[0] if first else ''}"
        if wide:
            line = f"{line:<90} params={','.join(sorted(lr.runbook.params)) or '-'}  {lr.path}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def age(seconds: float) -> str:
    """A duration as kubectl's AGE column shows it (``HumanDuration``: 45s, 5m30s, 3h, 2d4h, 40d)."""
    sec = int(seconds)
    if sec < -1:
        return "<invalid>"
    if sec < 120:
        return f"{max(sec, 0)}s"
    minutes, hours = sec // 60, sec // 3600
    if minutes < 10:
        return f"{minutes}m" + (f"{sec % 60}s" if sec % 60 else "")
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h" + (f"{minutes % 60}m" if minutes % 60 else "")
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" + (f"{hours % 24}h" if hours % 24 else "")
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        years, days = hours // 24 // 365, hours // 24 % 365
        return f"{years}y" + (f"{days}d" if days else "")
    return f"{hours // 24 // 365}y"


def runs_text(runs: Sequence[RunRecord], *, wide: bool = False, now: float | None = None) -> str:
    """``runbook runs``: RUNBOOK, NODE, PHASE and AGE as ``kubectl get rr`` shows them (either store);
    ``wide`` adds the state, times, exit code, source, approver, all nodes and params."""
    if not runs:
        return "no runs recorded"
    now = time.time() if now is None else now
    # Runs waiting for approval show their whole plan digest: `runbook approve ID --plan-digest DIGEST`.
    head = ("ID", "RUNBOOK", "NODE", "PHASE", "AGE", "PLAN DIGEST (to approve)")
    more = ("STATE", "STARTED", "FINISHED", "EXIT", "SOURCE", "APPROVED BY", "NODES", "PARAMS")
    rows = [head + (more if wide else ())]
    for r in runs:
        s = r.summary()
        state = RunState(r.state)
        row: tuple[str, ...] = (r.id, r.runbook, r.nodes[0] if r.nodes else "", state.phase,
                                age(now - r.created),
                                (r.plan_digest or "") if state is RunState.WAITING_APPROVAL else "")
        if wide:
            row += (state.value, s["started"] or "", s["finished"] or "",
                    "" if s["exit_code"] is None else str(s["exit_code"]), str(s["source"] or ""),
                    str(s["approved_by"] or ""), ",".join(r.nodes), json.dumps(s["params"], sort_keys=True))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def events_text(run: RunRecord, events: Sequence[EventRecord]) -> str:
    lines = [f"run {run.id}: {run.runbook} {json.dumps(run.params)} state={run.state}"
             + (f" plan={run.plan_digest}" if run.plan_digest else "")]
    for e in events:
        ts = time.strftime("%H:%M:%S", time.localtime(e.ts)) + f".{int(e.ts % 1 * 1000):03d}"
        data = ", ".join(f"{k}={_short(v)}" for k, v in e.data.items())
        lines.append(f"  {ts} #{e.seq:<3} {e.kind:<16} {e.step or '':<18} {data}")
    return "\n".join(lines)


# -- live view ------------------------------------------------------------------------------


class Fanout:
    """Send every event to several sinks (journal first: write-ahead, then the live view)."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def emit(self, kind: str, **data: Any) -> None:
        for s in self.sinks:
            s.emit(kind, **dict(data))


# -- helpers --------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _cell(text: str) -> str:
    return _one_line(text).replace("|", "\\|")


def _mid(step_id: str) -> str:
    return "s_" + step_id.replace("-", "_")


def _val(v: Any) -> str:
    return "(absent)" if v is None else str(v)


def _holds(h: bool | None) -> str:
    return "yes" if h is True else ("no" if h is False else "unknown")


def _short(v: Any, n: int = 160) -> str:
    if not isinstance(v, str):
        v = json.dumps(v, default=str) if isinstance(v, Mapping | list) else str(v)
    text = _one_line(v)
    return text if len(text) <= n else text[: n - 1] + "…"
