"""Resolve ``-p key=value`` strings and defaults into typed, validated param values.

Param values are data. They are validated here, before anything runs, and are never rendered
as templates themselves: a value ``{{7*7}}`` stays those seven characters (and a string param
without its own ``pattern`` refuses template and shell metacharacters outright).
Node params must be RFC 1123 subdomain names, which keeps ``omen2; rm -rf /`` out of Ansible
limits and API paths.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import UsageError
from engine.model import Param, ParamValue, Runbook

if TYPE_CHECKING:
    from engine.loader import LoadedRunbook

# Why fullmatch everywhere: ``$`` also matches before a trailing newline, so ``re.match(r"^...$")``
# let ``omen2\n`` through as a node name.
_NODE_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# Printable text without shell, quoting or template metacharacters; a param that needs more
# declares its own `pattern`.
_SAFE_STRING = re.compile(r"[A-Za-z0-9 _.,:/@+=%#-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_MAX_STRING = 1024
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def is_node_name(value: str) -> bool:
    """An RFC 1123 subdomain: lowercase, <= 253 characters, dot-separated labels of <= 63."""
    if not value or len(value) > 253:
        return False
    return all(len(part) <= 63 and _NODE_LABEL.fullmatch(part) for part in value.split("."))


def control_character(value: str) -> str | None:
    """Where ``value`` holds a control character (or a lone surrogate): ``"U+000A at position 5"``."""
    m = _CONTROL.search(value)
    return None if m is None else f"U+{ord(m.group()):04X} at position {m.start()}"


def validate_node_name(value: str) -> str:
    """``value`` if it is a valid node name, else UsageError (before any probe or playbook sees it)."""
    if not is_node_name(value):
        raise UsageError(f"{value!r} is not a valid node name (RFC 1123: lowercase letters, digits, "
                         "'-' and '.', at most 253 characters)")
    return value


def coerce_value(name: str, param: Param, value: Any) -> ParamValue:
    """One value (a CLI string or a typed value from YAML/JSON) -> the param's type, or ValueError."""
    kind = param.type
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"param {name}: expected true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool):
            raise ValueError(f"param {name}: expected an integer, got {value!r}")
        if isinstance(value, int):
            n = value
        elif isinstance(value, str) and re.fullmatch(r"[-+]?\d{1,18}", value.strip()):
            n = int(value.strip())
        else:
            raise ValueError(f"param {name}: expected an integer, got {value!r}")
        if param.min is not None and n < param.min:
            raise ValueError(f"param {name}: {n} is less than the minimum {param.min}")
        if param.max is not None and n > param.max:
            raise ValueError(f"param {name}: {n} is more than the maximum {param.max}")
        return n
    if not isinstance(value, str):
        raise ValueError(f"param {name}: expected a string, got {value!r}")
    bad = control_character(value)
    if bad is not None:  # Why: a newline or escape in a param reaches logs, Ansible limits and API paths
        raise ValueError(f"param {name}: {value[:80]!r} contains a control character ({bad})")
    if kind == "enum":
        assert param.values is not None
        if value not in param.values:
            raise ValueError(f"param {name}: {value!r} is not one of {', '.join(param.values)}")
        return value
    if kind == "node":
        if not is_node_name(value):
            raise ValueError(f"param {name}: {value!r} is not a valid node name "
                             "(RFC 1123: lowercase letters, digits, '-' and '.', at most 253 characters)")
    elif len(value) > _MAX_STRING:
        raise ValueError(f"param {name}: longer than {_MAX_STRING} characters")
    if param.pattern is not None:
        if not re.fullmatch(param.pattern, value):
            raise ValueError(f"param {name}: {value!r} does not match {param.pattern}")
    elif kind == "string" and not _SAFE_STRING.fullmatch(value):
        raise ValueError(f"param {name}: {value!r} contains characters a string param without a "
                         "'pattern' does not accept (quotes, shell or template metacharacters)")
    return value


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
