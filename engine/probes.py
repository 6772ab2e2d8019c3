"""Gather facts through the connectors: read-only, independent probes in parallel.

A probe never changes anything. A probe that fails does not raise: its error goes into
``Facts.errors`` and every check over it evaluates to "unknown", which fails closed downstream.
Only what the checks need is gathered (``checks.required_probes``): the node object, the host's
facts (one Ansible run, batched over all hosts of a fleet), and object lists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine import checks as chk
from engine.checks import HOST, NODE, HostFile, ObjectsQuery, Probe
from engine.connectors.base import KubeAPI, NodeAutomation
from engine.errors import RunbookError
from engine.facts import Facts, HostFacts, NodeFacts, ProbeError
from engine.model import KubeAction, Runbook

Clock = Callable[[], float]


def runbook_checks(runbook: Runbook) -> list[Any]:
    """Every check the runbook evaluates (preconditions, when, skip_if, guards, verify)."""
    out: list[Any] = []
    for p in runbook.preconditions:
        out.append(p.check)
        if p.when is not None:
            out.append(p.when)
    for s in runbook.steps:
        out += [*s.skip_if, *s.guards, *(v.check for v in s.verify)]
    return out


def runbook_probes(runbook: Runbook, params: Mapping[str, Any]) -> set[Probe]:
    """The probes a plan of this runbook needs: those of its checks, plus the node for kube actions."""
    probes = chk.required_probes(runbook_checks(runbook), params)
    probes.add(NODE)  # cheap, and needed for kube effects, node_exists and the report
    if runbook.report and "facts.host" in runbook.report:
        probes.add(HOST)
    if any(isinstance(s.action, KubeAction) for s in runbook.steps):
        probes.add(NODE)
    return probes


def _error(probe: str, e: BaseException) -> ProbeError:
    msg = str(e) or type(e).__name__
    if not isinstance(e, RunbookError):
        msg = f"{type(e).__name__}: {msg}"
    return ProbeError(probe, msg)


def _host_files(probes: Iterable[Probe]) -> tuple[str, ...]:
    return tuple(sorted({p.path for p in probes if isinstance(p, HostFile)}))


def gather_host_facts(nodes: NodeAutomation, names: Sequence[str],
                      files: Sequence[str] = ()) -> Mapping[str, HostFacts | Exception]:
    """One read-only facts run for all ``names``, reporting on ``files`` too."""
    return nodes.gather_facts(list(names), list(files))


def recent_host_facts(nodes: NodeAutomation, names: Sequence[str], max_age: float,
                      files: Sequence[str] = ()) -> Mapping[str, tuple[HostFacts, float]]:
    """Host facts at most ``max_age`` seconds old that the connector already holds (the facts the
    previous playbook published at its end, or the last facts run), with their age in seconds:
    {} when it keeps none."""
    if max_age <= 0:
        return {}
    return dict(nodes.recent_facts(list(names), max_age=max_age, files=list(files)))


def _read_node(kube: KubeAPI, node: str) -> NodeFacts:
    found = kube.read_node(node)
    return found if found is not None else NodeFacts(name=node, exists=False)


def _list(kube: KubeAPI, q: ObjectsQuery) -> tuple[Mapping[str, Any], ...]:
    return tuple(kube.list_objects(q.api_version, q.plural, namespace=q.namespace, label_selector=q.selector))


def _run_parallel(tasks: dict[str, Callable[[], Any]]) -> dict[str, Any | BaseException]:
    """Run independent read-only tasks; each result is its value or the exception it raised."""
    results: dict[str, Any | BaseException] = {}
    if len(tasks) <= 1:
        for name, fn in tasks.items():
            try:
                results[name] = fn()
            except Exception as e:  # a probe error is data (fail closed)
                results[name] = e
        return results
    with ThreadPoolExecutor(max_workers=min(8, len(tasks)), thread_name_prefix="probe") as pool:
        futures = {name: pool.submit(fn) for name, fn in tasks.items()}
        for name, fut in futures.items():
            try:
                results[name] = fut.result()
            except Exception as e:
                results[name] = e
    return results


def gather_probes(probes: Iterable[Probe], node: str, kube: KubeAPI | None, nodes: NodeAutomation | None,
                  *, clock: Clock = time.time, host_max_age: float = 0.0,
                  host_results: Future[Mapping[str, HostFacts | Exception]] | None = None) -> Facts:
    """Facts for one node: exactly the given probes, run in parallel (see ``gather_probes_many``)."""
    return gather_probes_many(probes, [node], kube, nodes, clock=clock, host_max_age=host_max_age,
                              host_results=host_results)[node]


def gather_probes_many(probes: Iterable[Probe], node_names: Sequence[str], kube: KubeAPI | None,
                       nodes: NodeAutomation | None, *, clock: Clock = time.time,
                       host_max_age: float = 0.0,
                       host_results: Future[Mapping[str, HostFacts | Exception]] | None = None) -> dict[str, Facts]:
    """Facts for many nodes: node reads and object lists in parallel, one host-facts run for all.

    ``host_max_age`` > 0: host facts the connector received at most that many seconds ago (the
    closing facts of the playbook that just ran) are used instead of a new facts run, for the nodes
    that have them. Node and object reads always go to the API. The default (0) always gathers anew.
    ``host_results``: a facts run already started for these nodes (``gather_host_facts`` with the
    same files), waited for instead of starting one.
    """
    wanted = set(probes)
    if any(isinstance(p, HostFile) for p in wanted):
        wanted.add(HOST)
    tasks: dict[str, Callable[[], Any]] = {}
    if NODE in wanted and kube is not None:
        for n in node_names:
            tasks[f"node:{n}"] = (lambda n=n: _read_node(kube, n))  # type: ignore[misc]
    queries = sorted((p for p in wanted if isinstance(p, ObjectsQuery)), key=lambda q: q.key)
    if kube is not None:
        for q in queries:
            tasks[f"objects:{q.key}"] = (lambda q=q: _list(kube, q))  # type: ignore[misc]
    reused: Mapping[str, tuple[HostFacts, float]] = {}
    if HOST in wanted and nodes is not None:
        files = _host_files(wanted)
        reused = recent_host_facts(nodes, node_names, host_max_age, files)
        missing = [n for n in node_names if n not in reused]
        if missing and host_results is not None:
            tasks["hosts"] = host_results.result
        elif missing:
            tasks["hosts"] = lambda: gather_host_facts(nodes, missing, files)
    results = _run_parallel(tasks)
    now = clock()

    shared_errors: list[ProbeError] = []
    objects: dict[str, tuple[Mapping[str, Any], ...]] = {}
    for q in queries:
        if kube is None:
            shared_errors.append(ProbeError(f"objects:{q.key}", "no Kubernetes connection"))
            continue
        r = results[f"objects:{q.key}"]
        if isinstance(r, BaseException):
            shared_errors.append(_error(f"objects:{q.key}", r))
        else:
            objects[q.key] = r
    hosts = results.get("hosts")

    out: dict[str, Facts] = {}
    for n in node_names:
        errors = list(shared_errors)
        node_facts: NodeFacts | None = None
        if NODE in wanted:
            if kube is None:
                errors.append(ProbeError(NODE, "no Kubernetes connection"))
            else:
                r = results[f"node:{n}"]
                if isinstance(r, BaseException):
                    errors.append(_error(NODE, r))
                else:
                    node_facts = r
        host_facts: HostFacts | None = None
        host_age: float | None = None
        if HOST in wanted:
            if nodes is None:
                errors.append(ProbeError(HOST, "no inventory: host facts need --inventory"))
            elif n in reused:
                host_facts, host_age = reused[n]
            elif isinstance(hosts, BaseException):
                errors.append(_error(HOST, hosts))
            elif hosts is not None:
                h = hosts.get(n)
                if isinstance(h, HostFacts):
                    host_facts = h
                elif isinstance(h, BaseException):
                    errors.append(_error(HOST, h))
                else:
                    errors.append(ProbeError(HOST, f"no facts returned for {n}"))
        out[n] = Facts(node_name=n, node=node_facts, host=host_facts, objects=dict(objects),
                       errors=tuple(errors), gathered_at=now, host_age=host_age)
    return out


def gather(runbook: Runbook, params: Mapping[str, Any], node: str, kube: KubeAPI | None,
           nodes: NodeAutomation | None, *, clock: Clock = time.time) -> Facts:
    """Everything a plan of ``runbook`` on ``node`` needs, gathered in parallel (read-only)."""
    return gather_probes(runbook_probes(runbook, params), node, kube, nodes, clock=clock)


def gather_many(runbook: Runbook, params_by_node: Mapping[str, Mapping[str, Any]], kube: KubeAPI | None,
                nodes: NodeAutomation | None, *, clock: Clock = time.time) -> dict[str, Facts]:
    """Facts for a fleet: one ``nodes.gather_facts`` call covers every host."""
    probes: set[Probe] = set()
    for params in params_by_node.values():
        probes |= runbook_probes(runbook, params)
    return gather_probes_many(probes, list(params_by_node), kube, nodes, clock=clock)
