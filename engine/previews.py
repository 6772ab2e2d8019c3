"""Read-only work done for a plan through the connectors: host facts started early, and previews.

A plan is made from facts (``engine.probes``) by a pure function (``engine.planning``); this module
holds what a plan asks of the outside before and after that function: the host-facts run started in
the background before the Kubernetes client is built (``start_host_work``), the check-mode runs of
playbook steps whose closing facts serve as the plan's host facts (``early_previews``), and the
previews attached to changing steps (``preview_plan``: each kube verb's own preview, server-side
dry runs of its patch or of each eviction, see ``engine.kube_verbs``; ``ansible-playbook --check
--diff`` for playbooks, or for ``preview: facts`` the engine's model of the playbook computed from
the plan's host facts, ``engine.playbook_previews``).

It must never change anything: every call here is a read, a ``dryRun=All`` request or an Ansible
check-mode run. It never imports ``kubernetes`` or ``ansible_runner`` (connectors are passed in).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from engine import checks as chk
from engine import kube_verbs as kv
from engine import planning, playbook_previews, probes
from engine.connectors.base import KubeAPI, NodeAutomation
from engine.errors import RunbookError
from engine.facts import HostFacts
from engine.model import AnsibleAction, KubeAction, Plan, parse_duration
from engine.params import PreparedRun


def inventory_host(nodes: NodeAutomation | None, node: str) -> str:
    """The inventory host of ``node`` (the node's own name when unknown: the plan says which)."""
    if nodes is None:
        return node
    try:
        return nodes.inventory_host(node)
    except RunbookError:
        return node


@dataclass(frozen=True)
class HostWork:
    """The Ansible part of a plan, started before the rest (``start_host_work``): it takes
    seconds, so the caller builds its Kubernetes client (~0.2 s of imports) meanwhile."""

    previews: Future[dict[str, tuple[AnsibleAction, str]]] | None = None
    facts: Future[Mapping[str, HostFacts | Exception]] | None = None


def start_host_work(targets: PreparedRun | Sequence[PreparedRun], nodes: NodeAutomation | None, *,
                    preview: bool = True) -> HostWork:
    """Start, in a background thread, what a plan would ask Ansible for first. One node with
    ``preview`` and steps to preview in check mode: those early check-mode previews; otherwise (a
    fleet, no previews, only previews from facts) one host-facts run over every target's host.
    Read-only."""
    many = [targets] if isinstance(targets, PreparedRun) else list(targets)
    if nodes is None or not many:
        return HostWork()
    wanted: set[str] = set()
    reads_hosts = False
    for t in many:
        files = plan_host_files(t)
        if files is not None:
            reads_hosts = True
            wanted.update(files)
    if not reads_hosts:
        return HostWork()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-host")
    try:
        jobs = early_jobs(many[0], nodes) if preview and len(many) == 1 else {}
        if jobs:
            return HostWork(previews=pool.submit(early_previews, many[0], nodes, jobs))
        return HostWork(facts=pool.submit(probes.gather_host_facts, nodes, [t.node for t in many],
                                          sorted(wanted)))
    finally:
        pool.shutdown(wait=False)


# Host facts a check-mode preview published at most this long ago serve as the plan's facts.
PLAN_FACTS_MAX_AGE = 10.0


def plan_host_files(prepared: PreparedRun) -> list[str] | None:
    """The host files a plan of this runbook reads ([] for none), or None when it reads no host facts."""
    wanted = probes.runbook_probes(prepared.runbook, prepared.params)
    files = sorted({p.path for p in wanted if isinstance(p, chk.HostFile)})
    return files if chk.HOST in wanted or files else None


def early_jobs(prepared: PreparedRun, nodes: NodeAutomation | None) -> dict[str, AnsibleAction]:
    """The playbook steps that can be previewed in check mode before the plan: those whose action
    needs no facts to render and whose privilege is that of a facts run (so that their closing facts
    are what a facts run would return). Steps previewed from facts (``preview: facts``) are not:
    with none left, the plan's Ansible work is one facts run. Step id -> bound action."""
    if nodes is None or plan_host_files(prepared) is None:
        return {}  # the plan reads no host facts: previews wait for the plan (changing steps only)
    facts_become = nodes.facts_become
    jobs: dict[str, AnsibleAction] = {}
    for step in prepared.runbook.steps:
        if not isinstance(step.action, AnsibleAction) or step.action.ansible.preview is not True:
            continue  # no preview, or one from the plan's facts (engine.playbook_previews)
        if facts_become is not None and step.action.ansible.become != facts_become:
            continue
        try:
            jobs[step.id] = chk.bind(step.action, prepared.params, None)
        except RunbookError:
            continue  # renders from facts: previewed after the plan
    return jobs


def early_previews(prepared: PreparedRun, nodes: NodeAutomation | None,
                   jobs: Mapping[str, AnsibleAction] | None = None) -> dict[str, tuple[AnsibleAction, str]]:
    """The check-mode runs of ``early_jobs`` (already bound: ``jobs``), at once. Step id -> (bound
    action, preview text)."""
    files = plan_host_files(prepared)
    jobs = early_jobs(prepared, nodes) if jobs is None else jobs
    if files is None or not jobs:
        return {}
    texts = _run_previews(jobs, prepared, nodes, files=files)
    return {sid: (jobs[sid], text) for sid, text in texts.items()}


def preview_plan(p: Plan, prepared: PreparedRun, kube: KubeAPI | None, nodes: NodeAutomation | None, *,
                 facts: Any = None, early: Mapping[str, tuple[AnsibleAction, str]] | None = None) -> Plan:
    """Attach previews to changing steps: server-side dry-run for kube patches, ``--check --diff`` for
    playbooks. Read-only by construction (dryRun=All, Ansible check mode). ``early``: previews
    already run (``early_previews``), used when the step renders to the same action."""
    previews: dict[str, str] = {}
    playbook_jobs: dict[str, AnsibleAction] = {}
    for step in prepared.runbook.steps:
        planned = p.step(step.id)
        if planned.kind != "change":
            continue
        try:
            action = chk.bind(step.action, prepared.params, facts, baseline=p.baseline)
        except RunbookError as e:
            previews[step.id] = f"preview unavailable: {e}"
            continue
        if isinstance(action, KubeAction) and kube is not None:
            node = facts.node if facts is not None else None
            if node is None or not node.exists:
                continue
            effect = kv.kube_effect(action.kube, node)
            if isinstance(effect, kv.NoOp):
                continue
            ctx = kv.KubeContext(kube, prepared.node, time.monotonic, time.sleep, threading.Event())
            text = kv.preview(effect, ctx)
            if text:
                previews[step.id] = text
        elif isinstance(action, AnsibleAction) and nodes is not None and action.ansible.preview:
            modelled = _preview_from_facts(action, facts)
            if modelled is not None:
                previews[step.id] = modelled
                continue
            done = (early or {}).get(step.id)
            if done is not None and done[0] == action:
                previews[step.id] = done[1]
            else:
                playbook_jobs[step.id] = action
    previews.update(_run_previews(playbook_jobs, prepared, nodes))
    ordered = {s.id: previews[s.id] for s in prepared.runbook.steps if s.id in previews}
    return planning.with_previews(p, ordered) if ordered else p


def _preview_from_facts(action: AnsibleAction, facts: Any) -> str | None:
    """``preview: facts``: the engine's model of the playbook, from the plan's host facts (None when
    it cannot say: the step is previewed in check mode instead)."""
    if action.ansible.preview != "facts" or facts is None:
        return None
    return playbook_previews.preview(action.ansible.playbook, facts.host, action.ansible.vars)


def _run_previews(jobs: Mapping[str, AnsibleAction], prepared: PreparedRun, nodes: Any,
                  files: Sequence[str] = ()) -> dict[str, str]:
    """Check-mode runs are independent and read-only: run them at once (each is an
    ansible-playbook process; one after the other they dominate ``runbook plan``)."""
    if len(jobs) <= 1:
        return {sid: _preview_playbook(a, prepared, nodes, files) for sid, a in jobs.items()}
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="preview") as pool:
        futures = {sid: pool.submit(_preview_playbook, a, prepared, nodes, files) for sid, a in jobs.items()}
        return {sid: fut.result() for sid, fut in futures.items()}


def _preview_playbook(action: AnsibleAction, prepared: PreparedRun, nodes: Any, files: Sequence[str] = ()) -> str:
    spec = action.ansible
    extravars: dict[str, Any] = dict(spec.vars)
    if files:
        extravars.setdefault("runbook_files", list(files))  # so its closing facts report on them
    try:
        result = nodes.run_playbook(prepared.loaded.playbooks_dir / spec.playbook, [prepared.node],
                                    extravars=extravars, become=spec.become,
                                    timeout=parse_duration(spec.timeout), check=True)
    except RunbookError as e:
        return f"check mode unavailable: {e}"
    return check_mode_text(result)


def check_mode_text(result: Any) -> str:
    """The preview text of a check-mode run's result (``PlaybookResult``): what its tasks say they
    would change, then the diffs; or that it failed."""
    diffs = [d for ds in result.diffs.values() for d in ds]
    # Tasks that would change something but show no diff (a service restart) say so in their msg.
    said = [f"{t.get('task', '')}: {t.get('msg')}" for t in result.tasks
            if t.get("status") == "changed" and t.get("msg")]
    if not result.ok:
        return "\n".join([f"check mode: {result.status} (rc {result.rc})", *diffs])
    if said or diffs:
        return "\n".join([*(["check mode: would change:", *said] if said else []), *diffs])
    changed = any(result.changed.values())
    return "check mode: " + ("would change (no diff reported)" if changed else "no changes")
