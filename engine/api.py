"""The library functions the CLI and the server call: load -> prepare -> plan -> run.

Connectors are passed in (the CLI and the server build them); this module never imports
``kubernetes`` or ``ansible_runner``. Journals, locks, prompts and output belong to the caller:
``run`` takes an ``EventSink`` (write-ahead journal first), a cancel event, and callbacks for
approvals and re-run confirmations.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine import checks as chk
from engine import loader, planning, probes
from engine.connectors.base import KubeAPI, NodeAutomation
from engine.errors import LoadError, Location, RunbookError, UsageError
from engine.facts import HostFacts
from engine.model import AnsibleAction, KubeAction, Plan, Runbook, RunResult
from engine.params import resolve_params


@dataclass(frozen=True)
class LoadedRunbook:
    runbook: Runbook
    path: Path
    digest: str  # sha256 of the file's bytes
    playbooks_dir: Path

    @property
    def name(self) -> str:
        return self.runbook.name


@dataclass(frozen=True)
class PreparedRun:
    """A runbook with resolved, validated params for one node."""

    loaded: LoadedRunbook
    params: dict[str, Any]
    node: str

    @property
    def runbook(self) -> Runbook:
        return self.loaded.runbook


def load(name_or_path: str | Path, runbooks_dir: Path | None = None, *,
         playbooks_dir: Path | None = None) -> LoadedRunbook:
    """A runbook by name (looked up in ``runbooks_dir``) or by path; LoadError lists every problem."""
    path = loader.resolve_runbook_path(str(name_or_path), runbooks_dir)
    pb = playbooks_dir if playbooks_dir is not None else loader.playbooks_dir_for(path.parent)
    runbook, data = loader.read_runbook(path, playbooks_dir=pb)
    return LoadedRunbook(runbook=runbook, path=path, digest=loader.file_digest(data), playbooks_dir=pb)


def list_runbooks(runbooks_dir: Path | None = None) -> tuple[list[LoadedRunbook], list[tuple[Location, str]]]:
    """Every runbook in the folder that loads, and the problems of those that do not."""
    d = runbooks_dir if runbooks_dir is not None else loader.default_runbooks_dir()
    ok: list[LoadedRunbook] = []
    problems: list[tuple[Location, str]] = []
    for path in loader.find_runbooks(d):
        try:
            ok.append(load(path))
        except LoadError as e:
            problems.extend(e.problems)
    return ok, problems


def prepare_run(loaded: LoadedRunbook, raw_params: Mapping[str, Any] | Iterable[str] = (), *,
                node: str | None = None) -> PreparedRun:
    """Resolve ``-p key=value`` (or a mapping) + ``--node`` into typed params for one node."""
    params = resolve_params(loaded.runbook, raw_params, node=node)
    key = loaded.runbook.node_param
    if key is None or key not in params:
        raise UsageError(f"runbook {loaded.name} needs a node: give --node or -p {key or 'node'}=NAME")
    return PreparedRun(loaded=loaded, params=params, node=str(params[key]))


def select_nodes(kube: KubeAPI, selector: str) -> list[str]:
    """Names of the nodes matching a label selector, sorted (fleet runs)."""
    return sorted(n.name for n in kube.list_nodes(label_selector=selector))


def prepare_fleet(loaded: LoadedRunbook, raw_params: Mapping[str, Any] | Iterable[str], node_names: Sequence[str]
                  ) -> list[PreparedRun]:
    """One prepared run per node (the same params, the node param set to each node)."""
    given = dict(raw_params) if isinstance(raw_params, Mapping) else None
    items = list(raw_params) if given is None else []
    out = []
    for n in node_names:
        out.append(prepare_run(loaded, given if given is not None else items, node=n))
    if not out:
        raise UsageError("the selector matches no node")
    return out


def _inventory_host(nodes: NodeAutomation | None, node: str) -> str:
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


def start_host_work(prepared: PreparedRun, nodes: NodeAutomation | None, *, preview: bool = True) -> HostWork:
    """Start, in a background thread, what ``plan`` would ask Ansible for first: the early
    check-mode previews (``preview``), or else the host facts run. Read-only."""
    files = _plan_host_files(prepared)
    if nodes is None or files is None:
        return HostWork()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-host")
    try:
        if preview:
            return HostWork(previews=pool.submit(_early_previews, prepared, nodes))
        return HostWork(facts=pool.submit(probes.gather_host_facts, nodes, [prepared.node], files))
    finally:
        pool.shutdown(wait=False)


def plan(prepared: PreparedRun, kube: KubeAPI | None, nodes: NodeAutomation | None, *,
         now: datetime | None = None, ttl: float = planning.DEFAULT_TTL, preview: bool = True,
         inventory_cmd_hint: str = "INVENTORY", host_work: HostWork | None = None) -> Plan:
    """Gather live facts (read-only), plan, and (``preview``) attach dry-run previews. Changes nothing.

    With previews, the check-mode runs of the runbook's playbook steps go first and their closing
    facts (every playbook ends with ``tasks/facts.yml``; check mode changed nothing) are the plan's
    host facts: one Ansible run instead of a facts run and then a preview. A preview whose step
    the plan does not change is dropped; when no preview returns host facts, a facts run gathers
    them as without previews. ``host_work``: that Ansible work, already started by the caller
    (``start_host_work`` with the same ``preview``).
    """
    work = host_work if host_work is not None else start_host_work(prepared, nodes, preview=preview)
    early = work.previews.result() if work.previews is not None else {}
    facts = probes.gather_probes(probes.runbook_probes(prepared.runbook, prepared.params), prepared.node, kube,
                                 nodes, host_max_age=PLAN_FACTS_MAX_AGE if early else 0.0,
                                 host_results=work.facts)
    p = planning.plan_run(prepared.runbook, prepared.params, facts, runbook_digest=prepared.loaded.digest,
                          now=now or datetime.now(UTC), ttl=ttl,
                          inventory_host=_inventory_host(nodes, prepared.node),
                          inventory_cmd_hint=inventory_cmd_hint)
    if preview:
        p = preview_plan(p, prepared, kube, nodes, facts=facts, early=early)
    return p


# Host facts a check-mode preview published at most this long ago serve as the plan's facts.
PLAN_FACTS_MAX_AGE = 10.0


def _plan_host_files(prepared: PreparedRun) -> list[str] | None:
    """The host files a plan of this runbook reads ([] for none), or None when it reads no host facts."""
    wanted = probes.runbook_probes(prepared.runbook, prepared.params)
    files = sorted({p.path for p in wanted if isinstance(p, chk.HostFile)})
    return files if chk.HOST in wanted or files else None


def _early_previews(prepared: PreparedRun, nodes: NodeAutomation | None) -> dict[str, tuple[AnsibleAction, str]]:
    """Check-mode runs of the playbook steps that can be previewed before the plan: those whose
    action needs no facts to render and whose privilege is that of a facts run (so that their
    closing facts are what a facts run would return). Step id -> (bound action, preview text)."""
    files = _plan_host_files(prepared)
    if nodes is None or files is None:
        return {}  # the plan reads no host facts: previews wait for the plan (changing steps only)
    facts_become = getattr(nodes, "facts_become", None)
    jobs: dict[str, AnsibleAction] = {}
    for step in prepared.runbook.steps:
        if not isinstance(step.action, AnsibleAction) or not step.action.ansible.preview:
            continue
        if facts_become is not None and step.action.ansible.become != facts_become:
            continue
        try:
            jobs[step.id] = chk.bind(step.action, prepared.params, None)
        except RunbookError:
            continue  # renders from facts: previewed after the plan
    texts = _run_previews(jobs, prepared, nodes, files=files)
    return {sid: (jobs[sid], text) for sid, text in texts.items()}


def plan_fleet(prepared: Sequence[PreparedRun], kube: KubeAPI | None, nodes: NodeAutomation | None, *,
               now: datetime | None = None, ttl: float = planning.DEFAULT_TTL, preview: bool = True,
               inventory_cmd_hint: str = "INVENTORY") -> list[Plan]:
    """Plans for many nodes: facts gathered together (one Ansible facts run for every host)."""
    if not prepared:
        return []
    loaded = prepared[0].loaded
    by_node = {p.node: p for p in prepared}
    facts = probes.gather_many(loaded.runbook, {p.node: p.params for p in prepared}, kube, nodes)
    plans = planning.plan_fleet(loaded.runbook, {p.node: p.params for p in prepared}, facts,
                                runbook_digest=loaded.digest, now=now or datetime.now(UTC), ttl=ttl,
                                inventory_hosts={p.node: _inventory_host(nodes, p.node) for p in prepared},
                                inventory_cmd_hint=inventory_cmd_hint)
    if preview:
        plans = [preview_plan(pl, by_node[pl.node], kube, nodes, facts=facts[pl.node]) for pl in plans]
    return plans


def preview_plan(p: Plan, prepared: PreparedRun, kube: KubeAPI | None, nodes: NodeAutomation | None, *,
                 facts: Any = None, early: Mapping[str, tuple[AnsibleAction, str]] | None = None) -> Plan:
    """Attach previews to changing steps: server-side dry-run for kube patches, ``--check --diff`` for
    playbooks. Read-only by construction (dryRun=All, Ansible check mode). ``early``: previews
    already run (``_early_previews``), used when the step renders to the same action."""
    from engine.actions import KubeEffect, kube_effect

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
            effect = kube_effect(action.kube, node)
            if isinstance(effect, KubeEffect) and effect.pods is not None:
                previews[step.id] = _preview_pods(kube, prepared.node, effect)
                continue
            if not isinstance(effect, KubeEffect) or effect.patch is None:
                continue
            try:
                kube.patch_node(prepared.node, effect.patch, patch_type=effect.patch_type,  # type: ignore[arg-type]
                                dry_run=True)
                previews[step.id] = f"server dry-run accepted: {effect.summary}"
            except RunbookError as e:
                previews[step.id] = f"server dry-run REJECTED: {e}"
        elif isinstance(action, AnsibleAction) and nodes is not None and action.ansible.preview:
            done = (early or {}).get(step.id)
            if done is not None and done[0] == action:
                previews[step.id] = done[1]
            else:
                playbook_jobs[step.id] = action
    previews.update(_run_previews(playbook_jobs, prepared, nodes))
    ordered = {s.id: previews[s.id] for s in prepared.runbook.steps if s.id in previews}
    return planning.with_previews(p, ordered) if ordered else p


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
                                    timeout=_seconds(spec.timeout), check=True)
    except RunbookError as e:
        return f"check mode unavailable: {e}"
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


def _preview_pods(kube: KubeAPI, node: str, effect: Any) -> str:
    """Which pods an evict/delete_pods step would act on now, each tried with a server-side dry run."""
    from engine.actions import select_pods

    sel = effect.pods
    try:
        pods = select_pods(sel, kube.list_pods(node=node, label_selector=sel.selector, namespace=sel.namespace))
    except RunbookError as e:
        return f"server dry-run unavailable: {e}"
    verb = "evict" if effect.verb == "evict" else "delete"
    if not pods:
        return f"server dry-run: no pod to {verb} now ({effect.summary})"
    lines = []
    for pod in pods:
        try:
            if verb == "evict":
                kube.evict_pod(pod, dry_run=True)
            else:
                kube.delete_pod(pod, dry_run=True, grace_seconds=sel.grace_seconds)
            lines.append(f"server dry-run accepted: {verb} {pod.namespace}/{pod.name}")
        except RunbookError as e:
            lines.append(f"server dry-run REJECTED: {verb} {pod.namespace}/{pod.name}: {e}")
    return "\n".join(lines)


def _seconds(duration: str) -> float:
    from engine.model import parse_duration

    return parse_duration(duration)


def run(prepared: PreparedRun, the_plan: Plan, kube: KubeAPI | None, nodes: NodeAutomation | None, *,
        events: Any, cancel: threading.Event | None = None, approve: Any = None, approved: bool = False,
        confirm_rerun: Callable[[str, str], bool] | None = None,
        completed_steps: set[str] | frozenset[str] = frozenset(), started_without_outcome: str | None = None,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
        wall: Callable[[], float] = time.time, inventory_cmd_hint: str = "INVENTORY",
        host_facts_max_age: float | None = None) -> RunResult:
    """Execute a plan (see ``engine.execution.Executor.execute``; ``host_facts_max_age``: see
    ``Executor``, None for its default)."""
    from engine.execution import Executor

    extra: dict[str, Any] = {} if host_facts_max_age is None else {"host_facts_max_age": host_facts_max_age}
    executor = Executor(kube, nodes, events=events, playbooks_dir=prepared.loaded.playbooks_dir, clock=clock,
                        sleep=sleep, wall=wall, cancel=cancel, inventory_cmd_hint=inventory_cmd_hint, **extra)
    return executor.execute(the_plan, prepared.runbook, prepared.params, completed_steps=completed_steps,
                            started_without_outcome=started_without_outcome, confirm_rerun=confirm_rerun,
                            approve=approve, approved=approved)


def run_fleet(runs: Sequence[tuple[PreparedRun, Plan]], kube: KubeAPI | None, nodes: NodeAutomation | None, *,
              events_for: Callable[[str], Any], max_parallel: int = 1, settle: float = 0.0,
              cancel: threading.Event | None = None, sleep: Callable[[float], None] = time.sleep,
              run_one: Callable[[PreparedRun, Plan, Any], RunResult] | None = None) -> list[RunResult]:
    """Rolling runs over a fleet: batches of ``max_parallel`` nodes run concurrently, ``settle``
    seconds between batches; a batch with any run not succeeded stops the rollout (later nodes are
    not started). ``events_for(node)`` gives each node's sink (its journal); ``run_one`` lets the
    caller wrap a run (e.g. take the node's Lease) and defaults to ``run``."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.model import RunState

    cancel = cancel if cancel is not None else threading.Event()

    def default_run(prepared: PreparedRun, the_plan: Plan, sink: Any) -> RunResult:
        return run(prepared, the_plan, kube, nodes, events=sink, cancel=cancel)

    one = run_one or default_run
    results: list[RunResult] = []
    batches = planning.fleet_batches([p.node for p, _ in runs], max_parallel)
    by_node = {p.node: (p, pl) for p, pl in runs}
    for i, batch in enumerate(batches):
        if cancel.is_set():
            break
        if i and settle > 0:
            sleep(settle)
        with ThreadPoolExecutor(max_workers=len(batch), thread_name_prefix="fleet") as pool:
            futures = [pool.submit(one, by_node[n][0], by_node[n][1], events_for(n)) for n in batch]
            batch_results = [f.result() for f in futures]
        results += batch_results
        if any(r.state is not RunState.SUCCEEDED for r in batch_results):
            break
    return results


def check_saved_plan(saved: Plan, loaded: LoadedRunbook, kube: KubeAPI | None, nodes: NodeAutomation | None, *,
                     now: datetime | None = None) -> tuple[list[str], PreparedRun]:
    """Re-gather the facts a saved plan depends on; the reasons it is stale ([] = apply it)."""
    if saved.runbook != loaded.name:
        return [f"the plan is for runbook {saved.runbook}, not {loaded.name}"], PreparedRun(loaded, {}, saved.node)
    prepared = prepare_run(loaded, {k: v for k, v in saved.params.items()})
    now = now or datetime.now(UTC)
    facts = probes.gather(loaded.runbook, prepared.params, prepared.node, kube, nodes)
    fresh = planning.plan_run(loaded.runbook, prepared.params, facts, runbook_digest=loaded.digest, now=now,
                              inventory_host=saved.inventory_host or None)
    return planning.saved_plan_problems(saved, runbook_digest=loaded.digest, now=now, fresh=fresh), prepared


def save_plan(p: Plan, path: Path) -> None:
    Path(path).write_text(p.model_dump_json(indent=2) + "\n", encoding="utf-8")


def load_plan(path: Path) -> Plan:
    """A saved plan file -> Plan; LoadError when it is not one."""
    from pydantic import ValidationError

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return Plan.model_validate(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError([(Location(str(path)), f"not a plan file: {e}")]) from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise LoadError([(Location(str(path), 1, None, where), f"not a valid plan: {first['msg']}")]) from None
