"""Resolve ``-p key=value`` strings and defaults into typed, validated param values.

Param values are data. They are validated here, before anything runs, and are never rendered
as templates themselves: a value ``{{7*7}}`` stays those seven characters (and a string param
without its own ``pattern`` refuses template and shell metacharacters outright).
Node params must be RFC 1123 subdomain names, which keeps ``omen2; rm -rf /`` out of Ansible
limits and API paths.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import UsageError
from engine.model import Param, ParamValue, Runbook, is_node_name

if TYPE_CHECKING:
    from engine.loader import LoadedRunbook

def validate_node_name(value: str) -> str:
    """``value`` if it is a valid node name, else UsageError (before any probe or playbook sees it)."""
    if not is_node_name(value):
        raise UsageError(f"{value!r} is not a valid node name (RFC 1123: lowercase letters, digits, "
                         "'-' and '.', at most 253 characters)")
    return value


def coerce_value(name: str, param: Param, value: Any) -> ParamValue:
    """One value (a CLI string or a typed value from YAML/JSON) -> the param's type, or ValueError."""
    return param.coerce(name, value)


def parse_assignments(raw: Iterable[str]) -> dict[str, str]:
    """``["node=omen2", "force=true"]`` -> dict; a malformed item is a UsageError."""
    out: dict[str, str] = {}
    for item in raw:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"-p expects key=value, got {item!r}")
        if key in out:
            raise UsageError(f"param {key} given twice")
        out[key] = value
    return out


def resolve_params(runbook: Runbook, raw: Mapping[str, Any] | Iterable[str] = (),
                   *, node: str | None = None) -> dict[str, ParamValue]:
    """Given values (``key=value`` strings or a mapping) + defaults -> typed values.

    ``node`` is the ``--node N`` shorthand for ``-p node=N``. Every problem is reported at once.
    """
    given: dict[str, Any] = dict(raw) if isinstance(raw, Mapping) else parse_assignments(raw)
    if node is not None:
        target = runbook.node_param or "node"
        if target in given and given[target] != node:
            raise UsageError(f"--node {node} conflicts with -p {target}={given[target]}")
        given[target] = node
    problems: list[str] = []
    for key in given:
        if key not in runbook.params:
            known = ", ".join(sorted(runbook.params)) or "none"
            problems.append(f"unknown param {key!r} for runbook {runbook.name} (params: {known})")
    values: dict[str, ParamValue] = {}
    for name, param in runbook.params.items():
        if name in given:
            try:
                values[name] = coerce_value(name, param, given[name])
            except ValueError as e:
                problems.append(str(e))
        elif param.default is not None:
            values[name] = coerce_value(name, param, param.default)
        elif param.required:
            hint = " (use --node)" if name == runbook.node_param else ""
            problems.append(f"missing required param {name}{hint}")
    if problems:
        raise UsageError("; ".join(problems))
    return values


@dataclass(frozen=True)
class PreparedRun:
    """A loaded runbook with resolved, validated params for one node: one target of a run."""

    loaded: LoadedRunbook
    params: dict[str, Any]
    node: str

    @property
    def runbook(self) -> Runbook:
        return self.loaded.runbook


def prepare_run(loaded: LoadedRunbook, raw_params: Mapping[str, Any] | Iterable[str] = (), *,
                node: str | None = None) -> PreparedRun:
    """Resolve ``-p key=value`` (or a mapping) + ``--node`` into typed params for one node."""
    params = resolve_params(loaded.runbook, raw_params, node=node)
    key = loaded.runbook.node_param
    if key is None or key not in params:
        raise UsageError(f"runbook {loaded.name} needs a node: give --node or -p {key or 'node'}=NAME")
    return PreparedRun(loaded=loaded, params=params, node=str(params[key]))


def prepare_fleet(loaded: LoadedRunbook, raw_params: Mapping[str, Any] | Iterable[str],
                  node_names: Sequence[str]) -> list[PreparedRun]:
    """One prepared run per node (the same params, the node param set to each node)."""
    given = dict(raw_params) if isinstance(raw_params, Mapping) else None
    items = list(raw_params) if given is None else []
    out = [prepare_run(loaded, given if given is not None else items, node=n) for n in node_names]
    if not out:
        raise UsageError("the selector matches no node")
    return out
