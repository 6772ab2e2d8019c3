"""Alertmanager label matchers: ``{alertname="KubeNodeNotReady", node=~"omen.*"}``.

Accepted forms (as in Alertmanager routes and amtool): a brace group of comma-separated matchers,
the same without braces, or a single matcher. Operators ``=``, ``!=``, ``=~``, ``!~``; values
quoted (``"..."`` with ``\\"``, ``\\\\``, ``\\n`` escapes) or bare. Regexes are anchored on both ends,
as Alertmanager does, so ``node=~"omen"`` does not match ``omen2``. A missing label reads as the
empty string (``foo=""`` matches when ``foo`` is absent). Parsing is pure; it never renders
templates and never looks at anything but the labels it is given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

Op = Literal["=", "!=", "=~", "!~"]
_BARE_NAME = re.compile(r"[^\s=!~,{}\"]+")
_BARE_VALUE = re.compile(r"[^,}\"]*")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}


class MatcherError(ValueError):
    """A matcher string that does not parse, or a regex that does not compile."""


@dataclass(frozen=True)
class Matcher:
    name: str
    op: Op
    value: str
    _regex: re.Pattern[str] | None = None

    def matches(self, labels: Mapping[str, str]) -> bool:
        actual = labels.get(self.name, "")
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        assert self._regex is not None
        hit = self._regex.fullmatch(actual) is not None
        return hit if self.op == "=~" else not hit

    def __str__(self) -> str:
        escaped = self.value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'{self.name}{self.op}"{escaped}"'


def make_matcher(name: str, op: Op, value: str) -> Matcher:
    if not name:
        raise MatcherError("a matcher needs a label name")
    regex = None
    if op in ("=~", "!~"):
        try:
            regex = re.compile(value)
        except re.error as e:
            raise MatcherError(f"{name}{op}{value!r}: invalid regular expression: {e}") from e
    return Matcher(name, op, value, regex)


def _quoted(text: str, pos: int) -> tuple[str, int]:
    """Read a double-quoted string starting at ``text[pos] == '"'``; return (value, next pos)."""
    out: list[str] = []
    i = pos + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            if i + 1 >= len(text):
                break
            nxt = text[i + 1]
            if nxt not in _ESCAPES:
                raise MatcherError(f"unknown escape \\{nxt} at column {i + 1}")
            out.append(_ESCAPES[nxt])
            i += 2
            continue
        if ch == '"':
            return "".join(out), i + 1
        out.append(ch)
        i += 1
    raise MatcherError(f"unterminated quoted string starting at column {pos + 1}")


def _skip_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def parse_matchers(text: str) -> list[Matcher]:
    """``'{a="1", b=~"x.*"}'`` / ``'a="1", b!=2'`` / ``'a=1'`` -> matchers (AND). MatcherError if bad."""
    s = text.strip()
    if s.startswith("{"):
        if not s.endswith("}"):
            raise MatcherError(f"{text!r}: missing closing brace")
        s = s[1:-1]
    out: list[Matcher] = []
    pos = _skip_spaces(s, 0)
    while pos < len(s):
        if s[pos] == '"':
            name, pos = _quoted(s, pos)
        else:
            m = _BARE_NAME.match(s, pos)
            if not m:
                raise MatcherError(f"{text!r}: expected a label name at column {pos + 1}")
            name, pos = m.group(0), m.end()
        pos = _skip_spaces(s, pos)
        op: Op
        for candidate in ("=~", "!~", "!=", "="):
            if s.startswith(candidate, pos):
                op = candidate
                pos += len(candidate)
                break
        else:
            raise MatcherError(f"{text!r}: expected one of = != =~ !~ after {name!r}")
        pos = _skip_spaces(s, pos)
        if pos < len(s) and s[pos] == '"':
            value, pos = _quoted(s, pos)
        else:
            m = _BARE_VALUE.match(s, pos)
            assert m is not None  # the pattern matches the empty string
            value, pos = m.group(0).strip(), m.end()
        out.append(make_matcher(name, op, value))
        pos = _skip_spaces(s, pos)
        if pos < len(s):
            if s[pos] != ",":
                raise MatcherError(f"{text!r}: expected ',' at column {pos + 1}")
            pos = _skip_spaces(s, pos + 1)
    if not out:
        raise MatcherError(f"{text!r}: no matcher")
    return out


def parse_all(items: Iterable[str] | Mapping[str, str]) -> list[Matcher]:
    """Matcher strings, or a ``{label: value}`` map (equality matchers) -> one AND-ed list."""
    if isinstance(items, Mapping):
        return [make_matcher(str(k), "=", str(v)) for k, v in items.items()]
    out: list[Matcher] = []
    for item in items:
        out.extend(parse_matchers(item))
    return out


def all_match(matchers: Iterable[Matcher], labels: Mapping[str, str]) -> bool:
    return all(m.matches(labels) for m in matchers)
