"""Property: whatever bytes a runbook file holds, loading gives a Runbook or a located LoadError."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
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


def _lines_of(text: str, path: tuple[Any, ...]) -> tuple[int, int]:
    """(first, last) line of the YAML node at ``path`` in ``text``, the first being its key's line."""
    node = yaml.compose(text)
    assert node is not None
    first = 1
    for part in path:
        if isinstance(node, yaml.MappingNode):
            key, node = next((k, v) for k, v in node.value if k.value == part)
            first = key.start_mark.line + 1
        else:
            node = node.value[part]
            first = node.start_mark.line + 1
    return first, node.end_mark.line + 1


def test_wrong_values_anywhere_in_a_runbook_are_located_at_the_value_or_the_mapping_holding_it() -> None:
    tally = {"refused": 0, "loaded": 0}

    @FUZZ
    @given(st.data())
    def one(data: st.DataObject) -> None:
        doc = yaml.safe_load(data.draw(st.sampled_from(SEEDS)))
        path = data.draw(st.sampled_from(_paths(doc)[1:]))
        target = doc
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = data.draw(JSON_VALUES)
        text = yaml.safe_dump(doc, sort_keys=False)
        try:
            parse_runbook(text.encode(), "fuzz.yaml", stem=None, playbooks_dir=REPO / "playbooks")
        except LoadError as e:
            assert_loads_or_locates(text.encode())  # every line PATH:LINE:
            lines = [int(m.group(1)) for m in map(LOCATED.match, str(e).splitlines()) if m]
            first = _lines_of(text, path[:-1])[0] if len(path) > 1 else 1
            last = _lines_of(text, path)[1]
            assert any(first <= n <= last for n in lines), (path, first, last, str(e))
            tally["refused"] += 1
        else:
            tally["loaded"] += 1  # the drawn value happened to be valid there (a free-form field, a bool for a bool)

    one()
    # not vacuous: most drawn values are wrong, and those were refused (a loader accepting anything fails here)
    assert tally["refused"] >= 0.8 * (tally["refused"] + tally["loaded"]), tally


@pytest.mark.parametrize(("line", "wrong", "error"), [
    ("        timeout: 30s\n", "        timeout: banana\n", "steps[0].verify[0].timeout: not a duration: 'banana'"),
    ("        become: true\n", "        become: maybe please\n",
     "steps[1].action.ansible.become: expected a valid boolean"),
    ("    max: 3600\n", "    max: lots\n", "params.ready_timeout.max: expected a valid integer"),
    ("      - {swap_active: false}\n", "      - {swap_active: 7}\n",
     "steps[1].skip_if[0].swap_active: expected a valid boolean"),
], ids=["timeout", "become", "max", "swap_active"])
def test_a_wrong_value_in_the_flagship_is_reported_at_its_own_line(line: str, wrong: str, error: str) -> None:
    text = FLAGSHIP_PATH.read_text()
    at = text[:text.index(line)].count("\n") + 1
    with pytest.raises(LoadError) as refused:
        parse_runbook(text.replace(line, wrong, 1).encode(), "fuzz.yaml", stem=None, playbooks_dir=REPO / "playbooks")
    assert str(refused.value).startswith(f"fuzz.yaml:{at}: {error}"), str(refused.value)
