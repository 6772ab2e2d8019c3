"""Runbook + params + facts -> Plan. Pure: no I/O, no clock (``now`` is passed in).

For each step, in order: ``skip_if`` all hold -> no-op (with the observations as the reason);
a required step blocked -> blocked; a guard that does not hold or cannot be evaluated -> blocked
(fail closed); otherwise the action's effect ("label k: vm-passthrough -> container", a playbook
run, a wait) or, for a kube verb whose effect already holds, a no-op.

Steps are evaluated against **predicted** facts: once a step is planned as a change, the facts its
action sets and its verify checks assert (``checks.establish``) are assumed for later steps, so a
later guard "label is container" holds because an earlier step sets it.

Every fact a decision read is recorded in ``Plan.depends_on`` with its value in the *gathered*
facts (not the predicted ones): ``runbook apply`` re-gathers and refuses when any differs.
Volatile readings (journal tails, heartbeats) are not recorded.

A runbook whose templates or ``expr`` checks read ``baseline`` gets the gathered node and host facts
kept in ``Plan.baseline`` (execution compares with them, e.g. "no host CUDA job killed"); the
baseline paths its checks read are recorded in ``depends_on`` too (``baseline.host.cuda_processes``),
so a saved plan whose baseline no longer holds is refused like any other drift. In planning,
``baseline`` is the gathered facts while ``facts`` is the prediction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from engine import checks as chk
from engine.actions import KubeEffect, NoOp, Wait, ansible_command, apply_to_node, kube_effect
from engine.errors import RunbookError
from engine.facts import Facts
from engine.model import (
    AnsibleAction,
    CheckAction,
    CheckEvaluation,
    KubeAction,
    Plan,
    PlannedStep,
    PlannedVerify,
    PlanState,
    PreconditionResult,
    Runbook,
    Step,
    parse_duration,
)

DEFAULT_TTL = 3600.0


def iso(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def render_text(template: str, params: Mapping[str, Any], facts: Facts | None, *,
                baseline: Mapping[str, Any] | None = None) -> str:
    """Render a message/report template; TemplateError on failure."""
    from engine.model import is_template
    from engine.templating import context, render

    if not is_template(template):
        return template
    return render(template, context(params, facts, baseline))


def _message(template: str, params: Mapping[str, Any], facts: Facts, fallback: str, *,
             baseline: Mapping[str, Any] | None = None) -> str:
    if not template:
        return fallback
    try:
        return " ".join(render_text(template, params, facts, baseline=baseline).split())
    except RunbookError as e:
        return f"{fallback} (message could not be rendered: {e})"


def verify_timeout(timeout: str, params: Mapping[str, Any], facts: Facts | None = None, *,
                   baseline: Mapping[str, Any] | None = None) -> float:
    """A verify timeout (possibly templated, e.g. ``"{{ params.ready_timeout }}s"``) in seconds."""
    text = render_text(timeout, params, facts, baseline=baseline)
    try:
        return parse_duration(text)
    except ValueError as e:
        raise RunbookError(f"timeout {timeout!r} rendered to {text!r}: {e}") from e


def _evaluation(check: Any, result: chk.CheckResult, params: Mapping[str, Any], facts: Facts,
                baseline: Mapping[str, Any]) -> CheckEvaluation:
    return CheckEvaluation(check=chk.describe_bound(check, params, facts, baseline=baseline), holds=result.holds,
                           observed=result.observed)


def _runbook_templates(runbook: Runbook) -> list[tuple[str, bool, bool]]:
    """Every template string of a runbook: (source, is an expression, is part of a check)."""
    out: list[tuple[str, bool, bool]] = []

    def walk(value: Any, in_check: bool) -> None:
        from pydantic import BaseModel

        if isinstance(value, chk.ExprCheck):
            out.append((value.expr, True, True))
        elif isinstance(value, str):
            if "{{" in value or "{%" in value:
                out.append((value, False, in_check))
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name), in_check)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(k, in_check)
                walk(v, in_check)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v, in_check)

    for p in runbook.preconditions:
        walk(p.check, True)
        walk(p.when, True)
        walk(p.message, False)
    for st in runbook.steps:
        walk((st.skip_if, st.guards, tuple(v.check for v in st.verify)), True)
        walk((st.action, st.why, tuple(v.timeout for v in st.verify), st.rollback_actions), False)
    if runbook.report:
        walk(runbook.report, False)
    return out


def reads_baseline(runbook: Runbook) -> bool:
    """Whether any check, template or expression of the runbook reads ``baseline``."""
    from engine.probes import runbook_checks
    from engine.templating import names_used

    if any(chk.uses_baseline(c) for c in runbook_checks(runbook)):
        return True
    return any("baseline" in src and "baseline" in names_used(src, expression=expr)
               for src, expr, _ in _runbook_templates(runbook))


def baseline_reads(runbook: Runbook, baseline: Mapping[str, Any]) -> dict[str, Any]:
    """``depends_on`` entries for the baseline paths the runbook's checks read (not its report)."""
    from engine.templating import baseline_paths, lookup

    out: dict[str, Any] = {}
    for src, expr, in_check in _runbook_templates(runbook):
        if in_check and "baseline" in src:
            for path in baseline_paths(src, expression=expr):
                out["baseline." + ".".join(path)] = lookup(baseline, path)
    return out


class _Planner:
    def __init__(self, runbook: Runbook, params: Mapping[str, Any], facts: Facts, *, inventory_host: str,
                 inventory_cmd_hint: str, playbooks_hint: str) -> None:
        from engine.templating import baseline_data

        self.runbook = runbook
        self.params = dict(params)
        self.facts = facts  # as gathered
        self.pred = facts  # as predicted after the steps planned so far
        self.depends: dict[str, Any] = {}
        self.inventory_host = inventory_host
        self.inventory_cmd_hint = inventory_cmd_hint
        self.playbooks_hint = playbooks_hint
        # Plan-time facts for templates reading ``baseline`` (the gathered ones, never the prediction).
        self.baseline: dict[str, Any] = baseline_data(facts) if reads_baseline(runbook) else {}
        if self.baseline:
            self.depends.update(baseline_reads(runbook, self.baseline))
            from engine.probes import runbook_checks

            for c in runbook_checks(runbook):
                if chk.uses_baseline(c):
                    self.depends.update({k: v for k, v in chk.evaluate(c, facts, self.params, baseline=self.baseline)
                                         .reads.items() if k.startswith("baseline.")})

    def read(self, check: Any) -> None:
        """Record what ``check`` reads, with the values in the gathered facts."""
        self.depends.update(chk.evaluate(check, self.facts, self.params, baseline=self.baseline).reads)

    def preconditions(self) -> list[PreconditionResult]:
        out: list[PreconditionResult] = []
        for p in self.runbook.preconditions:
            evidence: dict[str, Any] = {}
            if p.when is not None:
                w = chk.evaluate(p.when, self.facts, self.params, baseline=self.baseline)
                self.depends.update(w.reads)
                evidence["when"] = {"holds": w.holds, "observed": w.observed}
                if w.holds is False:
                    out.append(PreconditionResult(id=p.id, applies=False, holds=None,
                                                  observed=f"does not apply: {w.observed}", on_fail=p.on_fail,
                                                  evidence=evidence))
                    continue
            r = chk.evaluate(p.check, self.facts, self.params, baseline=self.baseline)
            self.depends.update(r.reads)
            evidence.update(jsonable(r.evidence))
            message = ""
            if r.holds is not True:
                fallback = f"{chk.describe_bound(p.check, self.params, self.facts, baseline=self.baseline)}: " \
                    f"{r.observed}"
                message = _message(p.message, self.params, self.facts, fallback, baseline=self.baseline)
                if r.holds is None:
                    message = f"could not be evaluated ({r.observed}): {message}"
            out.append(PreconditionResult(id=p.id, applies=True, holds=r.holds, observed=r.observed,
                                          message=message, on_fail=p.on_fail, evidence=evidence))
        return out

    def step(self, step: Step, kinds: Mapping[str, str], nothing_to_do: str | None) -> PlannedStep:
        params, pred, baseline = self.params, self.pred, self.baseline
        base: dict[str, Any] = {
            "id": step.id, "why": " ".join(step.why.split()), "action": step.action.KEY,
            "requires": step.requires, "idempotent": step.idempotent, "approval": step.approval,
            "mutating": step.mutating, "rollback": step.describe_rollback(),
        }
        problems: list[str] = []
        verify: list[PlannedVerify] = []
        for v in step.verify:
            try:
                seconds = verify_timeout(v.timeout, params, pred, baseline=baseline)
            except RunbookError as e:
                problems.append(str(e))
                seconds = 0.0
            verify.append(PlannedVerify(check=chk.describe_bound(v.check, params, pred, baseline=baseline),
                                        timeout_seconds=seconds))
        base["verify"] = tuple(verify)

        skip = [chk.evaluate(c, pred, params, baseline=baseline) for c in step.skip_if]
        for c in step.skip_if:
            self.read(c)
        base["skip_if"] = tuple(_evaluation(c, r, params, pred, baseline)
                                for c, r in zip(step.skip_if, skip, strict=True))
        guards = [chk.evaluate(c, pred, params, baseline=baseline) for c in step.guards]
        for c in step.guards:
            self.read(c)
        base["guards"] = tuple(_evaluation(c, r, params, pred, baseline)
                               for c, r in zip(step.guards, guards, strict=True))

        try:
            action = chk.bind(step.action, params, pred, baseline=baseline)
        except RunbookError as e:
            action = None
            problems.append(f"action cannot be rendered: {e}")
        command = self._command(action) if action is not None else ""
        base["command"] = command

        def blocked(reason: str) -> PlannedStep:
            return PlannedStep(kind="blocked", summary=f"blocked: {reason}", reason=reason, **base)

        def noop(reason: str) -> PlannedStep:
            return PlannedStep(kind="no-op", summary=f"no-op: {reason}", reason=reason, **base)

        if nothing_to_do is not None:
            return noop(f"{NOTHING_TO_DO}{nothing_to_do}")
        if skip and all(r.holds is True for r in skip):
            return noop("already done: " + "; ".join(r.observed for r in skip))
        if problems:
            return blocked("; ".join(problems))
        for req in step.requires:
            if kinds.get(req) == "blocked":
                return blocked(f"requires {req}, which is blocked")
        failing = [(c, r) for c, r in zip(step.guards, guards, strict=True) if r.holds is not True]
        if failing:
            return blocked("; ".join(
                f"guard {chk.describe_bound(c, params, pred, baseline=baseline)} "
                + ("could not be evaluated: " if r.holds is None else "does not hold: ") + r.observed
                for c, r in failing))
        assert action is not None

        if isinstance(action, KubeAction):
            verb = action.kube
            if not verb.READS_NODE:  # a wait decides from its spec alone
                effect: KubeEffect | NoOp = kube_effect(verb, _placeholder_node(self.facts))
            else:
                if pred.node is None or not pred.node.exists:
                    why = "node does not exist" if pred.node is not None else \
                        "node facts unavailable: " + "; ".join(e.message for e in pred.errors if e.probe == chk.NODE)
                    return blocked(why)
                effect = kube_effect(verb, pred.node)
                if self.facts.node is not None and self.facts.node.exists:
                    self.depends.update(kube_effect(verb, self.facts.node).reads)
            if isinstance(effect, NoOp):
                return noop(effect.reason)
            planned = PlannedStep(kind="change", summary=effect.summary, changes=effect.changes, **base)
            if effect.changes and pred.node is not None:
                self.pred = pred = _with_node(pred, apply_to_node(effect, pred.node))
            if isinstance(effect, Wait) and effect.until is not None:  # later steps may count on it
                self.pred = pred = chk.establish(effect.until, pred, params, baseline=baseline)
        elif isinstance(action, AnsibleAction):
            spec = action.ansible
            summary = f"run playbook {spec.playbook} on {self.inventory_host}" + (" as root" if spec.become else "")
            planned = PlannedStep(kind="change", summary=summary, **base)
        else:
            assert isinstance(action, CheckAction)
            results = [chk.evaluate(v.check, pred, params, baseline=baseline) for v in step.verify]
            for v in step.verify:
                self.read(v.check)
            if results and all(r.holds is True for r in results):
                return noop("already holds: " + "; ".join(r.observed for r in results))
            longest = max((v.timeout_seconds for v in verify), default=0.0)
            planned = PlannedStep(kind="change", summary=f"wait up to {longest:g}s until "
                                  + "; ".join(v.check for v in verify), **base)
        for v in step.verify:
            self.pred = chk.establish(v.check, self.pred, params, baseline=baseline)
        return planned

    def _command(self, action: Any) -> str:
        node = self.facts.node_name
        if isinstance(action, KubeAction):
            from engine.facts import NodeFacts

            target = self.facts.node if self.facts.node is not None else NodeFacts(name=node)
            return kube_effect(action.kube, target).command
        if isinstance(action, AnsibleAction):
            return ansible_command(action.ansible, self.inventory_host, inventory=self.inventory_cmd_hint,
                                   playbooks_dir=self.playbooks_hint)
        return ""


def _placeholder_node(facts: Facts) -> Any:
    from engine.facts import NodeFacts

    return facts.node if facts.node is not None else NodeFacts(name=facts.node_name)


def _with_node(facts: Facts, node: Any) -> Facts:
    from dataclasses import replace

    return replace(facts, node=node)


# The reason of every step's no-op when a ``nothing_to_do`` precondition does not hold (execution
# reads it: a check step of such a plan is skipped, not verified).
NOTHING_TO_DO = "nothing to do: "


def jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def plan_run(runbook: Runbook, params: Mapping[str, Any], facts: Facts, *, runbook_digest: str,
             now: datetime, ttl: float = DEFAULT_TTL, inventory_host: str | None = None,
             inventory_cmd_hint: str = "INVENTORY", playbooks_hint: str = "playbooks") -> Plan:
    """The plan of ``runbook`` for the node ``facts`` describe. Pure and deterministic."""
    planner = _Planner(runbook, params, facts, inventory_host=inventory_host or facts.node_name,
                       inventory_cmd_hint=inventory_cmd_hint, playbooks_hint=playbooks_hint)
    pres = planner.preconditions()
    refuse = any(p.on_fail == "refuse" and not p.passed for p in pres)
    unknown_ntd = any(p.on_fail == "nothing_to_do" and p.applies and p.holds is None for p in pres)
    nothing = next((p.message for p in pres if p.on_fail == "nothing_to_do" and p.applies and p.holds is False),
                   None)
    steps: list[PlannedStep] = []
    kinds: dict[str, str] = {}
    for step in runbook.steps:
        planned = planner.step(step, kinds, nothing)
        kinds[step.id] = planned.kind
        steps.append(planned)
    if refuse or unknown_ntd or any(s.kind == "blocked" for s in steps):
        state = PlanState.BLOCKED
    elif all(s.kind == "no-op" for s in steps):
        state = PlanState.NOTHING_TO_DO
    else:
        state = PlanState.READY
    plan = Plan(
        runbook=runbook.name, version=runbook.version, runbook_digest=runbook_digest, params=dict(params),
        node=facts.node_name, inventory_host=planner.inventory_host, created_at=iso(now),
        expires_at=iso(now + timedelta(seconds=ttl)), state=state, approval=runbook.approval,
        preconditions=tuple(pres), steps=tuple(steps), depends_on=jsonable(planner.depends),
        baseline=jsonable(planner.baseline), probe_errors=tuple(f"{e.probe}: {e.message}" for e in facts.errors),
    )
    return plan.sealed()


def plan_fleet(runbook: Runbook, params_by_node: Mapping[str, Mapping[str, Any]],
               facts_by_node: Mapping[str, Facts], *, runbook_digest: str, now: datetime,
               ttl: float = DEFAULT_TTL, inventory_hosts: Mapping[str, str] | None = None,
               inventory_cmd_hint: str = "INVENTORY", playbooks_hint: str = "playbooks") -> list[Plan]:
    """One plan per node, in the order of ``params_by_node``."""
    hosts = inventory_hosts or {}
    return [plan_run(runbook, params, facts_by_node[node], runbook_digest=runbook_digest, now=now, ttl=ttl,
                     inventory_host=hosts.get(node), inventory_cmd_hint=inventory_cmd_hint,
                     playbooks_hint=playbooks_hint)
            for node, params in params_by_node.items()]


def with_previews(plan: Plan, previews: Mapping[str, str]) -> Plan:
    """The plan with preview text (Ansible --check --diff, server dry-run) per step id, resealed."""
    steps = tuple(s.model_copy(update={"preview": previews[s.id]}) if s.id in previews else s for s in plan.steps)
    return plan.model_copy(update={"steps": steps}).sealed()


# --------------------------------------------------------------------------------------------
# Saved plans: is this plan still the truth?
# --------------------------------------------------------------------------------------------


def _human(node: str, path: str) -> str:
    for prefix, word in (("node.labels[", "label"), ("node.annotations[", "annotation"),
                         ("node.taints[", "taints"), ("node.conditions[", "condition"),
                         ("node.allocatable[", "allocatable")):
        if path.startswith(prefix) and path.endswith("]"):
            return f"node {node} {word} {path[len(prefix):-1]}"
    if path.startswith("node."):
        return f"node {node} {path[5:]}"
    if path.startswith("host."):
        return f"host of {node}: {path[5:]}"
    if path.startswith("baseline."):
        return f"{_human(node, path[len('baseline.'):])} (the plan's baseline)"
    return f"{node}: {path}"


def _show(v: Any) -> str:
    if v is None:
        return "(absent)"
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def plan_drift(saved: Plan, fresh: Plan) -> list[str]:
    """What differs between a saved plan and one made now from fresh facts (empty: no drift)."""
    out: list[str] = []
    missing = object()
    for key in sorted(set(saved.depends_on) | set(fresh.depends_on)):
        a = saved.depends_on.get(key, missing)
        b = fresh.depends_on.get(key, missing)
        if a == b:
            continue
        if a is missing:
            continue  # read only now: a consequence of another difference, reported there
        if b is missing:
            out.append(f"{_human(saved.node, key)}: planned {_show(a)}, no longer read")
        else:
            out.append(f"{_human(saved.node, key)}: planned {_show(a)}, now {_show(b)}")
    fresh_steps = {s.id: s for s in fresh.steps}
    for s in saved.steps:
        f = fresh_steps.get(s.id)
        if f is None:
            out.append(f"step {s.id}: no longer in the runbook")
        elif f.kind != s.kind or f.summary != s.summary:
            out.append(f"step {s.id}: planned {s.summary!r}, now {f.summary!r}")
    if saved.state != fresh.state and not out:
        out.append(f"plan state: planned {saved.state.value}, now {fresh.state.value}")
    return out


def saved_plan_problems(saved: Plan, *, runbook_digest: str, now: datetime, fresh: Plan | None = None) -> list[str]:
    """Why a saved plan must not be applied (exit 5), or [] when it still holds."""
    out: list[str] = []
    if saved.digest != saved.compute_digest():
        out.append("the plan file was modified after it was made (digest mismatch)")
    if saved.runbook_digest != runbook_digest:
        out.append(f"runbook {saved.runbook} changed since the plan was made "
                   f"(planned {saved.runbook_digest[:12]}, now {runbook_digest[:12]})")
    if now >= parse_iso(saved.expires_at):
        out.append(f"the plan expired at {saved.expires_at}")
    if fresh is not None:
        out += plan_drift(saved, fresh)
    return out


def fleet_batches(nodes: Sequence[str], max_parallel: int) -> list[list[str]]:
    """Rolling batches of at most ``max_parallel`` nodes, in order."""
    size = max(1, max_parallel)
    return [list(nodes[i:i + size]) for i in range(0, len(nodes), size)]
