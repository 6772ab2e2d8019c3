"""Alertmanager matcher syntax: parsing, anchoring, missing labels."""

from __future__ import annotations

import pytest

from engine.serve.matchers import MatcherError, all_match, parse_all, parse_matchers

LABELS = {"alertname": "KubeNodeNotReady", "node": "omen2", "cluster": "home"}


@pytest.mark.parametrize(("text", "expected"), [
    ('{alertname="KubeNodeNotReady", node=~"omen.*"}', True),
    ('alertname="KubeNodeNotReady",node=~"omen.*"', True),
    ("node=omen2", True),
    ('node!="omen1"', True),
    ('node!~"omen[13]"', True),
    ('node=~"omen"', False),  # anchored: "omen" does not match "omen2"
    ('node=~"men2"', False),
    ('node=~"omen2|omen3"', True),
    ('missing=""', True),  # a missing label reads as ""
    ('missing!=""', False),
    ('missing=~".*"', True),
    ('{ alertname = "KubeNodeNotReady" , cluster="home" }', True),
    ('"node"="omen2"', True),
])
def test_matchers_follow_alertmanager_semantics(text: str, expected: bool) -> None:
    assert all_match(parse_matchers(text), LABELS) is expected


def test_quoted_values_keep_commas_braces_and_escapes() -> None:
    (m,) = parse_matchers(r'{summary="a, b} \"c\" \\ d"}')
    assert m.value == 'a, b} "c" \\ d'
    assert all_match([m], {"summary": 'a, b} "c" \\ d'})


def test_a_list_of_strings_and_a_label_map_are_anded() -> None:
    assert all_match(parse_all(['alertname="KubeNodeNotReady"', 'node=~"omen.*"']), LABELS)
    assert not all_match(parse_all(['alertname="KubeNodeNotReady"', 'node="omen1"']), LABELS)
    assert all_match(parse_all({"node": "omen2"}), LABELS)


@pytest.mark.parametrize("text", [
    "", "{}", "node", 'node=~"("', '{node="omen2"', 'node="unterminated', 'node="a" x', "=value",
    'node="\\q"',
])
def test_malformed_matchers_are_refused_with_a_message(text: str) -> None:
    with pytest.raises(MatcherError):
        parse_matchers(text)


def test_str_round_trips() -> None:
    (m,) = parse_matchers('node=~"omen\\"x.*"')
    (again,) = parse_matchers(str(m))
    assert (again.name, again.op, again.value) == (m.name, m.op, m.value)
