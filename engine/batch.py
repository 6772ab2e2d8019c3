"""One ``ansible-playbook`` process per batch of a fleet: the batch's playbook runs, shared.

In a fleet's rolling batch every node has its own executor (its own plan, journal, Lease and
verification), each in its own thread. ``SharedPlaybooks`` stands between those executors and the
Ansible connector: when a node's executor runs a playbook, the call waits until every other node
of the batch still running has reached a playbook run too (or ended); then the calls that ask for
the same playbook with the same variables, privilege and timeout become **one** run with
``--limit host1,host2,...``, and each caller gets back the part of the result that is its own:
its host's changes, failure, diffs, closing facts and task lines. A host that fails in the shared
run fails only its own node's step; what the executor does next (verify, roll back, stop) stays per
node. Calls that differ (another playbook, a rendered variable that differs) run as separate
processes of the same round.

Host-facts runs (a step's ``skip_if`` and guards, verification polls, the closing report) are
shared too, without a barrier: the first node of the batch that asks for facts waits at most
``gather_window`` seconds (or until every node of the batch has asked) for the others asking for
the same files, then one facts run covers them all.

Check-mode runs and calls for nodes outside the batch pass straight through. This
module decides nothing about a run and never imports ``ansible_runner``: it wraps the
``NodeAutomation`` protocol.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.connectors.base import NodeAutomation, PlaybookResult, TaskEvent
from engine.facts import HostFacts


@dataclass
class _Call:
    node: str
    host: str
    playbook: Path
    extravars: dict[str, Any]
    become: bool
    timeout: float
    on_event: Callable[[TaskEvent], None] | None
    result: PlaybookResult | None = None
    error: BaseException | None = None
    done: bool = False

    @property
    def key(self) -> tuple[str, str, bool, float]:
        return (str(self.playbook), json.dumps(self.extravars, sort_keys=True, default=str), self.become,
                self.timeout)


@dataclass
class _Gather:
    files: tuple[str, ...]
    nodes: list[str] = field(default_factory=list)
    started: bool = False
    done: bool = False
    result: Mapping[str, HostFacts | Exception] | None = None
    error: BaseException | None = None


@dataclass
class SharedPlaybooks:
    """A ``NodeAutomation`` for the executors of one batch (see the module docstring).

    ``members``: the batch's nodes. Each member's caller must call ``leave(node)`` when its run
    ends (whatever the outcome), so that the others stop waiting for it.
    """

    inner: NodeAutomation
    members: Sequence[str]
    processes: list[list[str]] = field(default_factory=list)  # nodes of each shared run started
    gather_window: float = 0.3  # seconds a facts request waits for the batch's others

    def __post_init__(self) -> None:
        self._cv = threading.Condition()
        self._active = set(self.members)
        self._waiting: dict[str, _Call] = {}
        self._hosts: dict[str, str] = {}
        self._gathers: dict[tuple[str, ...], _Gather] = {}

    # -- NodeAutomation ---------------------------------------------------------------------

    @property
    def facts_become(self) -> bool | None:
        return self.inner.facts_become

    def recent_facts(self, nodes: Sequence[str], *, max_age: float,
                     files: Sequence[str] = ()) -> Mapping[str, tuple[HostFacts, float]]:
        return self.inner.recent_facts(nodes, max_age=max_age, files=files)

    def cancel(self) -> None:
        self.inner.cancel()

    def inventory_host(self, node: str) -> str:
        return self.inner.inventory_host(node)

    def gather_facts(self, nodes: Sequence[str], files: Sequence[str] = ()) -> Mapping[str, HostFacts | Exception]:
        with self._cv:
            shared = len(nodes) == 1 and nodes[0] in self._active and len(self._active) > 1
        if not shared:
            return self.inner.gather_facts(nodes, files)
        node, key = nodes[0], tuple(sorted(files))
        with self._cv:
            group = self._gathers.get(key)
            leader = group is None or group.started
            if leader:
                group = self._gathers[key] = _Gather(key)
            assert group is not None
            group.nodes.append(node)
            self._cv.notify_all()
            if leader:
                deadline = time.monotonic() + self.gather_window
                while len(set(group.nodes)) < len(self._active) and (left := deadline - time.monotonic()) > 0:
                    self._cv.wait(left)
                group.started = True
                if self._gathers.get(key) is group:
                    del self._gathers[key]
        if leader:
            try:
                result: Mapping[str, HostFacts | Exception] | None = self.inner.gather_facts(
                    sorted(set(group.nodes)), list(key))
                error: BaseException | None = None
            except BaseException as e:
                result, error = None, e
            with self._cv:
                group.result, group.error, group.done = result, error, True
                self._cv.notify_all()
        else:
            with self._cv:
                while not group.done:
                    self._cv.wait()
        if group.error is not None:
            raise group.error
        assert group.result is not None
        return {node: group.result[node]} if node in group.result else {}

    def close(self) -> None:
        """The batch does not own the connector: closing it is the caller's business."""

    def run_playbook(self, playbook: Path, nodes: Sequence[str], *, extravars: Mapping[str, Any] | None = None,
                     become: bool = True, timeout: float = 300, check: bool = False,
                     on_event: Callable[[TaskEvent], None] | None = None) -> PlaybookResult:
        with self._cv:
            shared = not check and len(nodes) == 1 and nodes[0] in self._active and nodes[0] not in self._waiting
        if not shared:
            return self.inner.run_playbook(playbook, nodes, extravars=extravars, become=become, timeout=timeout,
                                           check=check, on_event=on_event)
        node = nodes[0]
        call = _Call(node, self._host(node), Path(playbook), dict(extravars or {}), become, timeout, on_event)
        with self._cv:
            self._waiting[node] = call
            self._launch_when_all_wait()
            while not call.done:
                self._cv.wait()
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    # -- the batch ----------------------------------------------------------------------------

    def leave(self, node: str) -> None:
        """``node``'s run ended: the others no longer wait for it."""
        with self._cv:
            self._active.discard(node)
            self._launch_when_all_wait()

    def _host(self, node: str) -> str:
        if node not in self._hosts:
            try:
                self._hosts[node] = self.inner.inventory_host(node)
            except Exception:
                self._hosts[node] = node
        return self._hosts[node]

    def _launch_when_all_wait(self) -> None:
        """Under the lock: when every active member waits on a playbook call, start the round."""
        if not self._waiting or any(n not in self._waiting for n in self._active):
            return
        groups: dict[tuple[str, str, bool, float], list[_Call]] = {}
        order = {n: i for i, n in enumerate(self.members)}
        for call in sorted(self._waiting.values(), key=lambda c: order.get(c.node, len(order))):
            groups.setdefault(call.key, []).append(call)
        self._waiting = {}
        for calls in groups.values():
            self.processes.append([c.node for c in calls])
            threading.Thread(target=self._run_group, args=(calls,), name="shared-playbook", daemon=True).start()

    def _run_group(self, calls: list[_Call]) -> None:
        first = calls[0]
        by_host = {c.host: c for c in calls}
        by_node = {c.node: c for c in calls}

        def route(ev: TaskEvent) -> None:
            host = str(ev.get("host", ""))
            target = by_host.get(host) or by_node.get(host)
            targets = [target] if target is not None else ([] if host else calls)
            for c in targets:
                if c.on_event is not None:
                    c.on_event(ev)

        try:
            result: PlaybookResult | None = self.inner.run_playbook(
                first.playbook, [c.node for c in calls], extravars=first.extravars, become=first.become,
                timeout=first.timeout, on_event=route)
            error: BaseException | None = None
        except BaseException as e:  # every caller sees the connector's error, as if it ran alone
            result, error = None, e
        with self._cv:
            for c in calls:
                c.result = split_result(result, c.node, c.host) if result is not None else None
                c.error = error
                c.done = True
            self._cv.notify_all()


def split_result(result: PlaybookResult, node: str, host: str) -> PlaybookResult:
    """The part of a multi-host run's result that is ``node``'s (its results are keyed by node;
    task lines by inventory host)."""

    def mine(mapping: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in mapping.items() if k in (node, host)}

    failed, unreachable = mine(result.failed_hosts), mine(result.unreachable_hosts)
    if failed or unreachable:
        status, rc = ("failed" if result.status == "successful" else result.status), (result.rc or 2)
    elif result.status == "timeout" and mine(result.host_facts):
        # Its host went through the whole play (every playbook ends by publishing the host's facts,
        # playbooks/README.md) without failing, at its own pace (ANSIBLE_STRATEGY free): another
        # host's slowness ran the shared process out of time, not this node's.
        status, rc = "successful", 0
    elif result.status in ("timeout", "canceled"):
        status, rc = result.status, result.rc
    else:
        status, rc = "successful", 0  # another host failed: not this node's failure
    tasks = tuple(t for t in result.tasks if str(t.get("host", "")) in (node, host, ""))
    return PlaybookResult(status=status, rc=rc, changed=mine(result.changed), failed_hosts=failed,
                          unreachable_hosts=unreachable, diffs=mine(result.diffs),
                          host_facts=mine(result.host_facts), tasks=tasks)


__all__ = ["SharedPlaybooks", "split_result"]
