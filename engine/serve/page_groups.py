"""Which nodes an Alertmanager page (a group, by ``groupKey``) is about, and which have recovered.

Alertmanager groups alerts by the route's ``group_by``; with ``group_by: [alertname]`` one group -
one PagerDuty incident, when Alertmanager's ``pagerduty_configs`` pages - holds the alerts of every
node. A run fixes one node, so a run's success may resolve the page only when **every** node of
the group's alerts has recovered: by a run of its own that succeeded, or by its alert arriving
resolved. Each delivery of a group carries all its current alerts; ``observe`` records their nodes,
``recovered`` marks a node fixed and says which are still not. A group whose nodes all recovered
is forgotten; at most ``max_groups`` are kept (the oldest forgotten first: its page is then resolved
by the run as before this bookkeeping). Thread-safe; memory only (a restart forgets the groups).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class PageGroups:
    def __init__(self, max_groups: int = 10_000) -> None:
        self.max_groups = max_groups
        self._groups: OrderedDict[str, dict[str, bool]] = OrderedDict()  # group key -> node -> recovered
        self._warned: OrderedDict[str, None] = OrderedDict()  # groups already said to hold several nodes
        self._lock = threading.Lock()

    def first_mixed(self, group_key: str) -> bool:
        """True the first time ``group_key`` is found to hold several nodes (warn once per group)."""
        with self._lock:
            if group_key in self._warned:
                return False
            self._warned[group_key] = None
            while len(self._warned) > self.max_groups:
                self._warned.popitem(last=False)
            return True

    def observe(self, group_key: str, firing: Iterable[str], resolved: Iterable[str] = ()) -> None:
        """A delivery of ``group_key``: the nodes of its firing and of its resolved alerts. A node
        once recovered stays so (its alert fires until the next evaluation notices the recovery)."""
        if not group_key:
            return
        with self._lock:
            nodes = self._groups.get(group_key)
            if nodes is None:
                nodes = self._groups[group_key] = {}
                while len(self._groups) > self.max_groups:
                    self._groups.popitem(last=False)
            for node in firing:
                nodes.setdefault(node, False)
            for node in resolved:
                nodes[node] = True

    def recovered(self, group_key: str, node: str | None) -> list[str]:
        """``node``'s run succeeded: the group's nodes still not recovered (sorted; empty: the whole
        page is recovered, or the group is unknown)."""
        with self._lock:
            nodes = self._groups.get(group_key)
            if nodes is None:
                return []
            if node is not None:
                nodes[node] = True
            left = sorted(n for n, ok in nodes.items() if not ok)
            if not left:
                del self._groups[group_key]
            return left

    def nodes(self, group_key: str) -> dict[str, bool]:
        with self._lock:
            return dict(self._groups.get(group_key, {}))
