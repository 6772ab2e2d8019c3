"""Ansible YAML inventories, read for one purpose: which inventory host is a Kubernetes node.

A node maps to the host whose host variable ``k8s_node_name`` names it, else to the host of the
same name. Only the YAML inventory format is read (``all: {hosts, vars, children}``), the way
Ansible reads it: a host listed in several groups is one host. Values are never interpreted
beyond ``k8s_node_name`` and ``ansible_host`` (tagged values such as ``!vault`` are kept as
opaque text), so an inventory with vaulted secrets loads without the vault password.

What this module must not do: run Ansible, resolve templates, or read secrets.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from engine.errors import HostError, LoadError, Location

NODE_VAR = "k8s_node_name"
_GROUP_KEYS = frozenset({"hosts", "vars", "children"})


@dataclass(frozen=True)
class InventoryHost:
    name: str  # the inventory hostname Ansible uses (``--limit``)
    node: str  # the Kubernetes node it runs
    address: str = ""  # ``ansible_host`` when given
    groups: tuple[str, ...] = ()
    vars: Mapping[str, Any] = field(default_factory=dict)  # host-level variables as written


@dataclass(frozen=True)
class Inventory:
    path: Path
    hosts: Mapping[str, InventoryHost]  # by inventory hostname

    def host_for_node(self, node: str) -> str:
        """The inventory hostname of a Kubernetes node; ``HostError`` when none is known."""
        for host in self.hosts.values():
            if host.node == node:
                return host.name
        raise HostError(f"node {node} is not in the inventory {self.path} (no host named {node} "
                        f"and no host with {NODE_VAR}: {node})", host=node)

    def node_for_host(self, host: str) -> str:
        entry = self.hosts.get(host)
        return entry.node if entry else host

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted(h.node for h in self.hosts.values()))

    def group(self, name: str) -> tuple[str, ...]:
        """Inventory hostnames in a group (direct or through children)."""
        return tuple(sorted(h.name for h in self.hosts.values() if name in h.groups))


def load_inventory(path: Path) -> Inventory:
    """Read a YAML inventory file (or every ``*.yml``/``*.yaml`` of a directory, as Ansible does).

    Raises ``LoadError`` (``PATH:LINE: message``) for invalid YAML, a wrong structure, or two
    hosts claiming the same node.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".yml", ".yaml") and p.is_file())
        if not files:
            raise LoadError([(Location(str(path)), "no *.yml or *.yaml inventory file in this folder")])
    else:
        files = [path]
    builder = _Builder()
    for f in files:
        builder.read(f)
    return builder.finish(path)


class _Builder:
    def __init__(self) -> None:
        self.problems: list[tuple[Location, str]] = []
        self.vars: dict[str, dict[str, Any]] = {}
        self.groups: dict[str, set[str]] = {}
        self.lines: dict[str, Location] = {}

    def read(self, path: Path) -> None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            self.problems.append((Location(str(path)), f"cannot read inventory: {e}"))
            return
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = mark.line + 1 if mark is not None else 1
            self.problems.append((Location(str(path), line), f"invalid YAML: {getattr(e, 'problem', e)}"))
            return
        if root is None:
            self.problems.append((Location(str(path)), "empty inventory"))
            return
        if not isinstance(root, yaml.MappingNode):
            self.problems.append((_loc(path, root), "an inventory is a mapping of groups (e.g. all:)"))
            return
        for key, value in _pairs(root):
            self._group(path, key.value, value, ())

    def _group(self, path: Path, name: str, node: yaml.Node, parents: tuple[str, ...]) -> None:
        lineage = (*parents, name)
        if name in parents:
            self.problems.append((_loc(path, node), f"group {name} contains itself"))
            return
        self.groups.setdefault(name, set())
        if _is_null(node):
            return
        if not isinstance(node, yaml.MappingNode):
            self.problems.append((_loc(path, node), f"group {name}: expected a mapping with "
                                                    "hosts, vars or children"))
            return
        for key, value in _pairs(node):
            if key.value not in _GROUP_KEYS:
                self.problems.append((_loc(path, key), f"group {name}: unknown key {key.value!r} "
                                                       "(hosts, vars or children)"))
            elif key.value == "hosts":
                self._hosts(path, name, value, lineage)
            elif key.value == "children":
                if _is_null(value):
                    continue
                if not isinstance(value, yaml.MappingNode):
                    self.problems.append((_loc(path, value), f"group {name}: children must be a mapping"))
                    continue
                for child, child_node in _pairs(value):
                    self._group(path, child.value, child_node, lineage)
            elif not _is_null(value) and not isinstance(value, yaml.MappingNode):
                self.problems.append((_loc(path, value), f"group {name}: vars must be a mapping"))

    def _hosts(self, path: Path, group: str, node: yaml.Node, lineage: tuple[str, ...]) -> None:
        if _is_null(node):
            return
        if not isinstance(node, yaml.MappingNode):
            self.problems.append((_loc(path, node), f"group {group}: hosts must be a mapping of "
                                                    "hostnames (to their variables or nothing)"))
            return
        for key, value in _pairs(node):
            host = str(key.value)
            host_vars = self.vars.setdefault(host, {})
            self.lines.setdefault(host, _loc(path, key))
            if isinstance(value, yaml.MappingNode):
                for k, v in _pairs(value):
                    host_vars[str(k.value)] = _plain(v)
            elif not _is_null(value):
                self.problems.append((_loc(path, value), f"host {host}: variables must be a mapping"))
            for g in lineage:
                self.groups.setdefault(g, set()).add(host)

    def finish(self, path: Path) -> Inventory:
        hosts: dict[str, InventoryHost] = {}
        claimed: dict[str, str] = {}
        for name, host_vars in self.vars.items():
            node = host_vars.get(NODE_VAR, name)
            if not isinstance(node, str) or not node:
                self.problems.append((self.lines[name], f"host {name}: {NODE_VAR} must be a node name"))
                continue
            if node in claimed:
                self.problems.append((self.lines[name], f"hosts {claimed[node]} and {name} both "
                                                        f"claim node {node}"))
                continue
            claimed[node] = name
            address = host_vars.get("ansible_host")
            hosts[name] = InventoryHost(
                name=name, node=node, address=address if isinstance(address, str) else "",
                groups=tuple(sorted(g for g, members in self.groups.items() if name in members)),
                vars=MappingProxyType(dict(host_vars)))
        if self.problems:
            raise LoadError(self.problems)
        return Inventory(path=path, hosts=MappingProxyType(hosts))


def _pairs(node: yaml.MappingNode) -> Iterator[tuple[yaml.ScalarNode, yaml.Node]]:
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode):
            yield key, value


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null")


def _plain(node: yaml.Node) -> Any:
    """A host variable's value: scalars as text (ints/bools resolved), collections as given."""
    if isinstance(node, yaml.ScalarNode):
        if node.tag.startswith("tag:yaml.org,2002:"):
            try:
                return yaml.safe_load(yaml.serialize(node))
            except yaml.YAMLError:
                return node.value
        return node.value  # e.g. !vault: opaque
    if isinstance(node, yaml.SequenceNode):
        return [_plain(v) for v in node.value]
    if isinstance(node, yaml.MappingNode):
        return {str(k.value): _plain(v) for k, v in _pairs(node)}
    return None


def _loc(path: Path, node: yaml.Node) -> Location:
    return Location(str(path), node.start_mark.line + 1, node.start_mark.column + 1)
