"""YAML -> ``Runbook``, with every problem located as ``PATH:LINE[:COL]: where: message``.

The one boundary where runbook text becomes typed objects. We compose the YAML node tree with
PyYAML's safe composer and build plain Python values ourselves, so that we can

* record the line of every key and value (to locate pydantic's errors),
* refuse duplicate keys, merge keys, more than one document, and any tag outside the YAML core
  schema (``!!python/object``, custom ``!tags``),
* bound alias expansion and nesting (a small file must not expand into a huge structure).

Then pydantic validates the structure, and ``_semantic_problems`` checks what a schema cannot:
unique step ids, ``requires`` naming earlier steps only, a verify on every mutating step, templates
that parse and use only declared params / known facts, playbooks that exist, ``name`` = file stem.
All problems are collected and raised together as one ``LoadError``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from engine import checks as chk
from engine import (
    kube_verbs,  # noqa: F401  (importing it registers the kube verbs the format validates against)
    playbook_previews,
)
from engine.errors import LoadError, Location
from engine.model import ACTION_KEYS, DiagnosisSpec, Fleet, Plan, Runbook, kube_verb_keys

MAX_BYTES = 1 << 20  # 1 MiB: a runbook is a page or two
MAX_NODES = 20_000  # values built, counting every alias expansion
MAX_DEPTH = 40
RUNBOOK_SUFFIXES = (".yaml", ".yml")

_TAG = "tag:yaml.org,2002:"
_ALLOWED_TAGS = {_TAG + t for t in ("str", "int", "float", "bool", "null", "seq", "map", "timestamp")}

Path_ = tuple[str | int, ...]
Mark = tuple[int, int]  # 1-based line, 1-based column


# --------------------------------------------------------------------------------------------
# Where runbooks and playbooks live
# --------------------------------------------------------------------------------------------


def packaged_data_dir() -> Path:
    """``engine/data``: the runbooks and playbooks installed with the package."""
    return Path(__file__).resolve().parent / "data"


def default_runbooks_dir() -> Path:
    """``./runbooks`` when present, else the runbooks installed with the package."""
    local = Path("runbooks")
    if local.is_dir():
        return local
    return packaged_data_dir() / "runbooks"


def _is_shipped_playbook(path: Path, name: str) -> bool:
    """``path`` is the packaged playbook ``name`` or a byte-for-byte copy of it (a missing ``path`` is
    reported by the playbook check, not here)."""
    shipped = packaged_data_dir() / "playbooks" / name
    if not path.is_file():
        return True
    try:
        return path.resolve() == shipped.resolve() or path.read_bytes() == shipped.read_bytes()
    except OSError:
        return False  # the shipped copy cannot be read: nothing says the file is it (fail closed)


def playbooks_dir_for(runbooks_dir: Path) -> Path:
    """The playbooks folder that goes with a runbooks folder: its sibling ``playbooks/``, else the
    packaged playbooks (so a user's own runbook can use the standard playbooks)."""
    sibling = Path(runbooks_dir).resolve().parent / "playbooks"
    if sibling.is_dir():
        return sibling
    packaged = packaged_data_dir() / "playbooks"
    return packaged if packaged.is_dir() else sibling


def find_runbooks(directory: Path) -> list[Path]:
    """The runbook files (``*.yaml``, ``*.yml``) directly in ``directory``, sorted."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.suffix in RUNBOOK_SUFFIXES and p.is_file()
                  and not p.name.startswith("."))


def resolve_runbook_path(name_or_path: str, runbooks_dir: Path | None = None) -> Path:
    """A path as given, or ``NAME`` looked up as ``<runbooks_dir>/NAME.yaml|.yml``."""
    p = Path(name_or_path)
    if p.suffix in RUNBOOK_SUFFIXES or os.sep in name_or_path or "/" in name_or_path:
        if p.is_file():
            return p
        raise _error([(Location(str(p)), "no such runbook file")])
    d = runbooks_dir if runbooks_dir is not None else default_runbooks_dir()
    for suffix in RUNBOOK_SUFFIXES:
        candidate = Path(d) / f"{name_or_path}{suffix}"
        if candidate.is_file():
            return candidate
    known = [f.stem for f in find_runbooks(Path(d))]
    near = difflib.get_close_matches(name_or_path, known, n=1)
    hint = f" (did you mean {near[0]}?)" if near else (f" (known: {', '.join(known)})" if known else "")
    raise _error([(Location(str(Path(d) / f"{name_or_path}.yaml")), f"no runbook named {name_or_path!r} in "
                      f"{d}{hint}")])


# --------------------------------------------------------------------------------------------
# Safe YAML
# --------------------------------------------------------------------------------------------


class _SafeComposer(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The safe loader, used only up to the node tree (we construct values ourselves). libyaml's
    when PyYAML has it: ~15x faster to compose, with the same marks."""


_CONSTRUCTOR = yaml.constructor.SafeConstructor()


class _Problems:
    def __init__(self, path: str) -> None:
        self.path = path
        self.items: list[tuple[Location, str]] = []

    def add(self, line: int, message: str, *, column: int | None = None, where: str = "") -> None:
        self.items.append((Location(self.path, max(1, line), column, where), message))


class _Builder:
    """Node tree -> plain values, recording marks; refuses what a runbook must not contain."""

    def __init__(self, problems: _Problems) -> None:
        self.problems = problems
        self.marks: dict[Path_, Mark] = {}
        self.key_marks: dict[Path_, Mark] = {}
        self.count = 0
        self.too_big = False

    def build(self, node: yaml.Node, path: Path_ = (), depth: int = 0) -> Any:
        if self.too_big:
            return None
        self.count += 1
        if self.count > MAX_NODES or depth > MAX_DEPTH:
            self.too_big = True
            what = "nested too deeply" if depth > MAX_DEPTH else \
                f"expands to more than {MAX_NODES} values (alias bomb?)"
            self.problems.add(node.start_mark.line + 1, f"document {what}", where=_where(path))
            return None
        mark = (node.start_mark.line + 1, node.start_mark.column + 1)
        self.marks.setdefault(path, mark)
        if node.tag not in _ALLOWED_TAGS:
            self.problems.add(mark[0], f"tag {node.tag.replace(_TAG, '!!')} is not allowed "
                              "(only plain YAML: no language-specific or custom tags)", where=_where(path))
            return None
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(child, (*path, i), depth + 1) for i, child in enumerate(node.value)]
        assert isinstance(node, yaml.ScalarNode)
        return self._scalar(node)

    def _mapping(self, node: yaml.MappingNode, path: Path_, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if key_node.tag == _TAG + "merge":
                self.problems.add(line, "merge keys (<<) are not supported", where=_where(path))
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self.problems.add(line, "a mapping key must be a plain scalar", where=_where(path))
                continue
            if key_node.tag not in _ALLOWED_TAGS:
                self.problems.add(line, f"tag {key_node.tag.replace(_TAG, '!!')} is not allowed",
                                  where=_where(path))
                continue
            key = str(key_node.value)  # keys are names: `on:` stays "on", not True
            if key in out:
                first = self.key_marks.get((*path, key), (0, 0))[0]
                self.problems.add(line, f"duplicate key {key!r} (first at line {first})", where=_where(path))
                continue
            self.key_marks[(*path, key)] = (line, key_node.start_mark.column + 1)
            out[key] = self.build(value_node, (*path, key), depth + 1)
        return out

    def _scalar(self, node: yaml.ScalarNode) -> Any:
        if node.tag == _TAG + "str" or node.tag == _TAG + "timestamp":
            return str(node.value)  # timestamps stay text: no datetime objects in the model
        constructor = _CONSTRUCTOR
        if node.tag == _TAG + "int":
            return constructor.construct_yaml_int(node)
        if node.tag == _TAG + "float":
            return constructor.construct_yaml_float(node)
        if node.tag == _TAG + "bool":
            return constructor.construct_yaml_bool(node)
        return None  # null


def compose_yaml(data: bytes, path: str) -> tuple[Any, dict[Path_, Mark], dict[Path_, Mark]]:
    """Bytes -> (plain value, value marks, key marks), or LoadError with every problem found."""
    problems = _Problems(path)
    if not data.strip():
        raise _error([(Location(path), "empty file")])
    if len(data) > MAX_BYTES:
        raise _error([(Location(path), f"file too large ({len(data)} bytes; limit {MAX_BYTES})")])
    if b"\x00" in data:
        raise _error([(Location(path), "binary file (contains NUL bytes), expected YAML text")])
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise _error([(Location(path), f"not UTF-8 text (invalid byte at offset {e.start})")]) from None
    try:
        loader = _SafeComposer(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.composer.ComposerError as e:
        mark = e.problem_mark or e.context_mark
        msg = "more than one YAML document (a runbook file holds exactly one)" \
            if "single document" in str(e.context or "") else f"invalid YAML: {e.problem or e}"
        raise _error([(Location(path, (mark.line + 1) if mark else 1,
                                   (mark.column + 1) if mark else None), msg)]) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        msg = f"invalid YAML: {e.problem or e.context or 'syntax error'}"
        if e.context and e.problem:
            msg = f"invalid YAML: {e.problem} ({e.context})"
        raise _error([(Location(path, (mark.line + 1) if mark else 1,
                                   (mark.column + 1) if mark else None), msg)]) from None
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, max(0, e.position)) + 1
        raise _error([(Location(path, line), f"invalid YAML: {e.reason} "
                          f"(character {e.character!r} is not allowed)")]) from None
    except yaml.YAMLError as e:
        raise _error([(Location(path), f"invalid YAML: {e}")]) from None
    except RecursionError:
        raise _error([(Location(path), "invalid YAML: nested too deeply")]) from None
    if root is None:
        raise _error([(Location(path), "empty document")])
    builder = _Builder(problems)
    try:
        value = builder.build(root)
    except RecursionError:
        problems.add(1, "document nested too deeply")
        value = None
    if problems.items:
        raise _error(problems.items)
    return value, builder.marks, builder.key_marks


# --------------------------------------------------------------------------------------------
# Locating pydantic errors
# --------------------------------------------------------------------------------------------


def _where(path: Iterable[str | int]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out if len(out) <= 100 else out[:97] + "..."


def _data_path(data: Any, loc: Iterable[str | int]) -> Path_:
    """Map a pydantic loc onto the data, dropping union tags and class names that are not keys."""
    out: list[str | int] = []
    cur = data
    for part in loc:
        in_mapping = isinstance(cur, Mapping) and isinstance(part, str) and part in cur
        in_list = isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur)
        if in_mapping or in_list:
            cur = cur[part]
            out.append(part)
        # else: a discriminator tag or a union member's name: not in the data
    return tuple(out)


def _line_of(path: Path_, marks: Mapping[Path_, Mark], key_marks: Mapping[Path_, Mark]) -> Mark:
    p = path
    while True:
        if p in key_marks:
            return key_marks[p]
        if p in marks:
            return marks[p]
        if not p:
            return (1, 1)
        p = p[:-1]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _noun(expected: str, path: Path_) -> str:
    if "node_ready" in expected:
        return "check"
    if "'label'" in expected:
        return "kube action"
    if "'ansible'" in expected:
        return "action"
    names = [p for p in path if isinstance(p, str)]
    last = names[-1] if names else ""
    if last in ("action", "rollback"):
        return "action"
    if last == "kube":
        return "kube action"
    if last == "on_failure":
        return "on_failure"
    return "check"


def _noun_keys(noun: str) -> tuple[str, ...]:
    """The keys a noun may take: the registered check kinds, the actions, the registered kube verbs."""
    if noun == "check":
        return chk.check_keys()
    if noun == "kube action":
        return kube_verb_keys()
    return {"action": ACTION_KEYS}.get(noun, ())


def _message(err: Mapping[str, Any], path: Path_) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    inp = err.get("input")
    loc = err["loc"]
    if kind == "missing":
        return f"missing required field {loc[-1]!r}"
    if kind == "extra_forbidden":
        return f"unknown field {loc[-1]!r}"
    if kind == "union_tag_invalid":
        noun = _noun(str(ctx.get("expected_tags", "")), path)
        tag = str(ctx.get("tag"))
        near = difflib.get_close_matches(tag, _noun_keys(noun), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else \
            f" (one of: {', '.join(_noun_keys(noun))})"
        return f"unknown {noun} {tag!r}{hint}"
    if kind == "union_tag_not_found":
        noun = _noun("", path)
        if noun == "on_failure":
            return "on_failure is 'stop' or {rollback: [actions]}"
        if isinstance(inp, Mapping):
            if not inp:
                return f"empty {noun}: expected exactly one key like {{{(_noun_keys(noun) or ('...',))[0]}: ...}}"
            article = "an" if noun[0] in "aeiou" else "a"
            return f"{article} {noun} has exactly one key, found {len(inp)}: {', '.join(map(repr, inp))}"
        return f"expected a {noun} (a mapping with one key), got {_short(inp)}"
    if kind == "literal_error":
        return f"expected {ctx.get('expected')}, got {_short(inp)}"
    if kind == "string_pattern_mismatch":
        field = next((p for p in reversed(loc) if isinstance(p, str)), "")
        if field in ("name", "id"):
            return (f"{_short(inp)} is not a valid {field}: lowercase letters, digits and '-' "
                    "(RFC 1123), starting and ending with a letter or digit")
        return f"{_short(inp)} does not match {ctx.get('pattern')}"
    if kind == "value_error":
        msg = str(err.get("msg", ""))
        return msg.removeprefix("Value error, ")
    if kind == "assertion_error":
        return str(err.get("msg", "")).removeprefix("Assertion failed, ")
    msg = str(err.get("msg", "invalid value"))
    if msg.startswith("Input should be "):
        msg = "expected " + msg.removeprefix("Input should be ")
    elif msg:
        msg = msg[0].lower() + msg[1:]
    return f"{msg}, got {_short(inp)}"


def _pydantic_problems(e: ValidationError, data: Any, path: str, marks: Mapping[Path_, Mark],
                       key_marks: Mapping[Path_, Mark]) -> list[tuple[Location, str]]:
    grouped: dict[tuple[int, str], list[str]] = {}
    errors = e.errors()
    paths = [_data_path(data, tuple(err["loc"])) for err in errors]
    for err, dpath in zip(errors, paths, strict=True):
        kind = err["type"]
        if kind == "too_short" and any(len(p) > len(dpath) and p[:len(dpath)] == dpath for p in paths):
            continue  # "steps: at least 1 item" only because an item failed: the item's error says it
        where = _where(dpath[:-1] if kind == "extra_forbidden" else dpath)
        line, _ = _line_of(dpath, marks, key_marks)
        if kind == "union_tag_invalid":
            tag = (err.get("ctx") or {}).get("tag")
            if tag is not None and (*dpath, str(tag)) in key_marks:
                line = key_marks[(*dpath, str(tag))][0]
        msg = _message(err, dpath)
        bucket = grouped.setdefault((line, where), [])
        if msg not in bucket:
            bucket.append(msg)
    out: list[tuple[Location, str]] = []
    for (line, where), msgs in grouped.items():
        typed = [m for m in msgs if m.startswith("expected ")]
        if len(typed) > 1:  # one value failing every member of a union: say it once
            got = typed[0].rsplit(", got ", 1)[-1]
            alts = " or ".join(m.removeprefix("expected ").rsplit(", got ", 1)[0] for m in typed)
            msgs = [m for m in msgs if m not in typed] + [f"expected {alts}, got {got}"]
        for m in msgs:
            out.append((Location(path, line, None, where), m))
    return out


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127, 0x85)} | {10: "\\n", 13: "\\r", 9: "\\t",
                                                              0x2028: "\\u2028", 0x2029: "\\u2029"}


def _one_line(text: str) -> str:
    """Problems print one per line: user text inside a message must not break the line."""
    return text.translate(_CONTROL)


def _error(problems: list[tuple[Location, str]]) -> LoadError:
    return LoadError(_sorted(problems))


def _sorted(problems: list[tuple[Location, str]]) -> list[tuple[Location, str]]:
    clean = [(Location(loc.path, loc.line, loc.column, _one_line(loc.where)), _one_line(msg)) for loc, msg in problems]
    return sorted(clean, key=lambda p: (p[0].path, p[0].line, p[0].column or 0))


# --------------------------------------------------------------------------------------------
# Semantic validation
# --------------------------------------------------------------------------------------------

_NOT_TEMPLATED_TOP = {"apiVersion", "name", "version", "description", "params", "triggers"}


def _walk_strings(value: Any, path: Path_) -> Iterable[tuple[Path_, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if not path and k in _NOT_TEMPLATED_TOP:
                continue
            yield from _walk_strings(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk_strings(v, (*path, i))


def _semantic_problems(rb: Runbook, data: Mapping[str, Any], *, stem: str | None,
                       playbooks_dir: Path | None) -> list[tuple[Path_, str]]:
    from engine.model import AnsibleAction as _Ansible
    from engine.model import KubeAction
    from engine.templating import template_problems

    out: list[tuple[Path_, str]] = []
    if stem is not None and rb.name != stem:
        out.append((("name",), f"name {rb.name!r} must equal the file name {stem!r}"))

    ids: dict[str, int] = {}
    for i, pre in enumerate(rb.preconditions):
        if pre.id in ids:
            out.append((("preconditions", i, "id"), f"duplicate precondition id {pre.id!r}"))
        ids[pre.id] = i
    index: dict[str, int] = {}
    for i, step in enumerate(rb.steps):
        if step.id in index:
            out.append((("steps", i, "id"), f"duplicate step id {step.id!r} (first is steps[{index[step.id]}])"))
        else:
            index[step.id] = i
    for i, step in enumerate(rb.steps):
        for j, req in enumerate(step.requires):
            where: Path_ = ("steps", i, "requires", j)
            if req == step.id:
                out.append((where, f"step {step.id!r} requires itself"))
            elif req not in index:
                near = difflib.get_close_matches(req, list(index), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                out.append((where, f"step {step.id!r} requires unknown step {req!r}{hint}"))
            elif index[req] > i:
                out.append((where, f"step {step.id!r} requires {req!r}, which runs after it "
                                   "(steps run in order: a requirement must come earlier; cycle or order violation)"))
        # drain verifies itself: no evictable pod is left on the node (engine/kube_verbs/drain.py);
        # so do the bootstrap token verbs (engine/kube_verbs/node_bootstrap.py): SELF_VERIFYING
        if step.mutating and not step.verify and not (isinstance(step.action, KubeAction)
                                                      and step.action.kube.SELF_VERIFYING):
            out.append((("steps", i), f"step {step.id!r} changes something but has no verify "
                                      "(every kube/ansible step must say how success is checked)"))

    # Templates: syntax, only declared params and known facts, no private attributes.
    for spath, text in _walk_strings(data, ()):
        if spath and spath[-1] == "expr":
            for p in template_problems(text, params=rb.params, expression=True):
                out.append((spath, p))
        elif "{{" in text or "{%" in text:
            for p in template_problems(text, params=rb.params):
                out.append((spath, p))

    # Playbooks exist.
    if playbooks_dir is not None:
        for i, step in enumerate(rb.steps):
            actions: list[tuple[Path_, Any]] = [(("steps", i, "action", "ansible", "playbook"), step.action)]
            actions += [(("steps", i, "on_failure", "rollback", k, "ansible", "playbook"), a)
                        for k, a in enumerate(step.rollback_actions)]
            for apath, action in actions:
                if isinstance(action, _Ansible):
                    pb = playbooks_dir / action.ansible.playbook
                    if not pb.is_file():
                        out.append((apath, f"playbook {action.ansible.playbook!r} not found in {playbooks_dir}"))

    # `preview: facts` only where the engine has a model of the playbook, and only for the shipped
    # playbook itself: a model of swap-off.yml says nothing true of another file of that name.
    for i, step in enumerate(rb.steps):
        if not isinstance(step.action, _Ansible) or step.action.ansible.preview != "facts":
            continue
        where, playbook = ("steps", i, "action", "ansible", "preview"), step.action.ansible.playbook
        if playbook not in playbook_previews.MODELS:
            out.append((where, f"preview: facts needs the engine's model of the playbook, and {playbook!r} has "
                               f"none (models: {', '.join(sorted(playbook_previews.MODELS))}); use true (check "
                               f"mode) or false"))
        elif playbooks_dir is not None and not _is_shipped_playbook(playbooks_dir / playbook, playbook):
            out.append((where, f"preview: facts models the shipped {playbook}, and {playbooks_dir / playbook} differs "
                               f"from it; use true (check mode) for a playbook of your own"))

    # The diagnoses: unique evidence ids, at least one required piece, declared params only; one
    # cause id once per runbook.
    causes: dict[str, str] = {}
    declared: list[tuple[Path_, DiagnosisSpec]] = [(("diagnosis",), rb.diagnosis)] if rb.diagnosis else []
    declared += [(("diagnoses", n), d) for n, d in enumerate(rb.diagnoses)]
    for where, diag in declared:
        label = _where(where)
        if diag.cause.id in causes:
            out.append(((*where, "cause", "id"), f"cause {diag.cause.id!r} is declared twice (first in "
                                                 f"{causes[diag.cause.id]})"))
        causes.setdefault(diag.cause.id, label)
        seen: dict[str, str] = {}
        for section, items in (("evidence", diag.evidence), ("excludes", diag.excludes)):
            for i, ev in enumerate(items):
                if ev.id in seen:
                    out.append(((*where, section, i, "id"),
                                f"duplicate evidence id {ev.id!r} (first in {label}.{seen[ev.id]})"))
                else:
                    seen[ev.id] = section
        if not any(ev.weight == "required" for ev in diag.evidence):
            out.append(((*where, "evidence"), "a diagnosis needs at least one piece of required evidence "
                                              "(weight: required), or every sick node would match"))
        for i, ev in enumerate(diag.excludes):
            if ev.weight != "required":
                out.append(((*where, "excludes", i, "weight"),
                            "excludes rule the cause out when they hold: weight does not apply (leave it out)"))
        for key in diag.params:
            if key not in rb.params:
                out.append(((*where, "params", key), f"param {key!r} is not declared in params"))
            elif key == rb.node_param:
                out.append(((*where, "params", key),
                            f"param {key!r} is the node param: diagnose fills it with the diagnosed node"))
        if rb.node_param is None:
            out.append((where, "a diagnosis is about a node: declare a param of type node"))

    for i, trig in enumerate(rb.triggers):
        if trig.require_diagnosis and not rb.all_diagnoses:
            out.append((("triggers", i, "require_diagnosis"),
                        "require_diagnosis needs the runbook's diagnosis section (the cause it fixes)"))

    # Node-targeting work needs a node param.
    if rb.node_param is None:
        targets = any(isinstance(s.action, KubeAction | _Ansible) for s in rb.steps)
        all_checks = [c for s in rb.steps for c in (*s.guards, *s.skip_if, *(v.check for v in s.verify))]
        all_checks += [c for p in rb.preconditions for c in (p.check, *([p.when] if p.when else []))]
        needs = chk.required_probes(all_checks)
        if targets or chk.NODE in needs or chk.HOST in needs:
            out.append((("params",) if "params" in data else (),
                        "this runbook acts on a node: declare a param of type node (usually 'node')"))
    return out


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def parse_runbook(data: bytes, path: str, *, stem: str | None = None,
                  playbooks_dir: Path | None = None) -> Runbook:
    """Bytes of a runbook file -> Runbook, or LoadError listing every problem (``PATH:LINE: ...``)."""
    value, marks, key_marks = compose_yaml(data, path)
    if not isinstance(value, dict):
        raise _error([(Location(path), f"a runbook is a mapping (apiVersion, name, steps, ...), "
                                          f"got {type(value).__name__}")])
    try:
        runbook = Runbook.model_validate(value)
    except ValidationError as e:
        raise _error(_pydantic_problems(e, value, path, marks, key_marks)) from None
    except RecursionError:
        raise _error([(Location(path), "document nested too deeply")]) from None
    problems = _semantic_problems(runbook, value, stem=stem, playbooks_dir=playbooks_dir)
    if problems:
        located = [(Location(path, _line_of(p, marks, key_marks)[0], None, _where(p)), m) for p, m in problems]
        raise _error(located)
    return runbook


FLEET_FILE = Path("catalogue") / "fleet.yaml"


def fleet_path(runbooks_dir: Path) -> Path:
    """The fleet knowledge of a runbooks folder: its ``catalogue/fleet.yaml``, else the packaged one."""
    own = Path(runbooks_dir) / FLEET_FILE
    return own if own.is_file() else packaged_data_dir() / "runbooks" / FLEET_FILE


def load_fleet(path: Path) -> Fleet:
    """Read ``catalogue/fleet.yaml`` (model.Fleet); LoadError with every problem, located."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise _error([(Location(str(path)), f"cannot read: {e.strerror or e}")]) from None
    value, marks, key_marks = compose_yaml(data, str(path))
    if not isinstance(value, dict):
        raise _error([(Location(str(path)), f"the fleet file is a mapping (workload_label, gpu_labels, ...), "
                                             f"got {type(value).__name__}")])
    try:
        return Fleet.model_validate(value)
    except ValidationError as e:
        raise _error(_pydantic_problems(e, value, str(path), marks, key_marks)) from None


def file_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_runbook(path: Path, *, playbooks_dir: Path | None = None) -> tuple[Runbook, bytes]:
    """Read and parse one runbook file; returns the runbook and the exact bytes (for the digest)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise _error([(Location(str(p)), "is a directory, not a runbook file")]) from None
    except OSError as e:
        raise _error([(Location(str(p)), f"cannot read: {e.strerror or e}")]) from None
    pb = playbooks_dir if playbooks_dir is not None else playbooks_dir_for(p.parent)
    return parse_runbook(data, str(p), stem=p.stem, playbooks_dir=pb), data


def load_runbook(path: Path, *, playbooks_dir: Path | None = None) -> Runbook:
    """Load and validate one runbook file. ``LoadError`` lists every problem found."""
    return read_runbook(path, playbooks_dir=playbooks_dir)[0]


def validate_paths(paths: Iterable[Path]) -> tuple[list[Path], list[tuple[Location, str]]]:
    """Validate files and directories (each runbook in them). Returns (valid files, problems)."""
    ok: list[Path] = []
    problems: list[tuple[Location, str]] = []
    for p in paths:
        files = find_runbooks(Path(p)) if Path(p).is_dir() else [Path(p)]
        if Path(p).is_dir() and not files:
            problems.append((Location(str(p)), "no runbook files (*.yaml) in this directory"))
        for f in files:
            try:
                load_runbook(f)
                ok.append(f)
            except LoadError as e:
                problems.extend(e.problems)
    return ok, problems


def runbook_json_schema() -> dict[str, Any]:
    """JSON Schema of the runbook format (for yaml-language-server and other editors)."""
    schema = Runbook.model_json_schema(by_alias=True, mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": "runbook/v1",
        "description": "A guarded remediation runbook (apiVersion runbook/v1). See docs/design.md.",
    }


__all__ = [
    "compose_yaml",
    "default_runbooks_dir",
    "file_digest",
    "find_runbooks",
    "load_runbook",
    "packaged_data_dir",
    "parse_runbook",
    "playbooks_dir_for",
    "read_runbook",
    "resolve_runbook_path",
    "runbook_json_schema",
    "validate_paths",
]


# --------------------------------------------------------------------------------------------
# Loaded runbooks and plan files: what the run service reads from disk
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedRunbook:
    """A runbook as loaded from its file, with the digest plans record and its playbooks folder."""

    runbook: Runbook
    path: Path
    digest: str  # sha256 of the file's bytes
    playbooks_dir: Path

    @property
    def name(self) -> str:
        return self.runbook.name


def load(name_or_path: str | Path, runbooks_dir: Path | None = None, *,
         playbooks_dir: Path | None = None) -> LoadedRunbook:
    """A runbook by name (looked up in ``runbooks_dir``) or by path; LoadError lists every problem."""
    path = resolve_runbook_path(str(name_or_path), runbooks_dir)
    pb = playbooks_dir if playbooks_dir is not None else playbooks_dir_for(path.parent)
    runbook, data = read_runbook(path, playbooks_dir=pb)
    return LoadedRunbook(runbook=runbook, path=path, digest=file_digest(data), playbooks_dir=pb)


def list_runbooks(runbooks_dir: Path | None = None) -> tuple[list[LoadedRunbook], list[tuple[Location, str]]]:
    """Every runbook in the folder that loads, and the problems of those that do not."""
    d = runbooks_dir if runbooks_dir is not None else default_runbooks_dir()
    ok: list[LoadedRunbook] = []
    problems: list[tuple[Location, str]] = []
    for path in find_runbooks(d):
        try:
            ok.append(load(path))
        except LoadError as e:
            problems.extend(e.problems)
    return ok, problems


def save_plan(p: Plan, path: Path) -> None:
    """Write a plan file for ``runbook apply``."""
    Path(path).write_text(p.model_dump_json(indent=2) + "\n", encoding="utf-8")


def load_plan(path: Path) -> Plan:
    """A saved plan file -> Plan; LoadError when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return Plan.model_validate(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError([(Location(str(path)), f"not a plan file: {e}")]) from None
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise LoadError([(Location(str(path), 1, None, where), f"not a valid plan: {first['msg']}")]) from None
