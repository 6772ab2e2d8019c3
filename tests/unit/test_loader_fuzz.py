"""Property: whatever bytes a runbook file holds, loading gives a Runbook or a located LoadError."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import LoadError
from engine.loader import parse_runbook
from engine.model import Runbook

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = (REPO / "runbooks" / "example-label-and-file.yaml").read_text()
FLAGSHIP_PATH = REPO / "runbooks" / "gpu-node-recovery.yaml"
SEEDS = [EXAMPLE] + ([FLAGSHIP_PATH.read_text()] if FLAGSHIP_PATH.exists() else [])
LOCATED = re.compile(r"^fuzz\.yaml:(\d+)(:\d+)?: .+")
# RUNBOOK_FUZZ_EXAMPLES=5000 for a long run; CI keeps the default.
FUZZ = settings(max_examples=int(os.environ.get("RUNBOOK_FUZZ_EXAMPLES", "250")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def assert_loads_or_locates(data: bytes) -> None:
    try:
        rb = parse_runbook(data, "fuzz.yaml", stem=None, playbooks_dir=REPO / "playbooks")
    except LoadError as e:
        text = str(e)
        assert text
        n_lines = data.count(b"\n") + 1
        for line in text.splitlines():
            m = LOCATED.match(line)
            assert m, f"not PATH:LINE: {line!r}"
            assert 1 <= int(m.group(1)) <= n_lines + 1
        return
    assert isinstance(rb, Runbook)


@FUZZ
@given(st.binary(max_size=3000))
def test_arbitrary_bytes_never_escape_as_another_exception(data: bytes) -> None:
    assert_loads_or_locates(data)


YAML_CHARS = list("abcdefghijklmnopqrstuvwxyz_0123456789 :-[]{},&*!|>'\"#%@`?<=\n\t.\\/")
YAMLISH = st.text(alphabet=st.sampled_from(YAML_CHARS), max_size=600)


@FUZZ
@given(YAMLISH)
def test_yaml_like_text_never_escapes_as_another_exception(text: str) -> None:
    assert_loads_or_locates(text.encode())


@st.composite
def mutated_runbook(draw: st.DrawFn) -> str:
    lines = draw(st.sampled_from(SEEDS)).splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 4))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "insert", "replace-char", "indent", "dedent"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "insert":
            lines.insert(i, draw(YAMLISH) + "\n")
        elif op == "replace-char" and lines[i]:
            j = draw(st.integers(0, len(lines[i]) - 1))
            lines[i] = lines[i][:j] + draw(st.sampled_from(list(":-[]{}&*!|'\"# x0"))) + lines[i][j + 1:]
        elif op == "indent":
            lines[i] = "  " + lines[i]
        elif op == "dedent":
            lines[i] = lines[i].lstrip()
    return "".join(lines)


@FUZZ
@given(mutated_runbook())
def test_mutated_runbooks_never_escape_as_another_exception(text: str) -> None:
    assert_loads_or_locates(text.encode())


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=25,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@FUZZ
@given(st.data())
def test_wrong_values_anywhere_in_a_runbook_are_located(data: st.DataObject) -> None:
    doc = yaml.safe_load(data.draw(st.sampled_from(SEEDS)))
    path = data.draw(st.sampled_from(_paths(doc)[1:]))
    target = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = data.draw(JSON_VALUES)
    assert_loads_or_locates(yaml.safe_dump(doc, sort_keys=False).encode())
