"""Params are typed and validated before anything runs; hostile values are refused."""

from __future__ import annotations

from typing import Any

import pytest

from engine.errors import UsageError
from engine.loader import parse_runbook
from engine.model import Runbook
from engine.params import is_node_name, resolve_params, validate_node_name

RUNBOOK = parse_runbook(b"""apiVersion: runbook/v1
name: params-demo
version: "1"
params:
  node: {type: node, required: true}
  workload: {type: enum, values: [container, vm-passthrough], default: container}
  ready_timeout: {type: int, default: 180, min: 10, max: 3600}
  force: {type: bool, default: false}
  note: {type: string, default: "ok"}
  ticket: {type: string, pattern: "^[A-Z]+-[0-9]+$"}
steps:
  - id: wait
    action: {check: {}}
    verify: [{check: {node_ready: true}}]
""", "params-demo.yaml")


def resolve(*raw: str, node: str | None = None, runbook: Runbook = RUNBOOK) -> dict[str, Any]:
    return resolve_params(runbook, list(raw), node=node)


def test_defaults_fill_in_and_types_are_converted() -> None:
    assert resolve("node=omen2", "ready_timeout=60", "force=yes") == {
        "node": "omen2", "workload": "container", "ready_timeout": 60, "force": True, "note": "ok"}


def test_node_option_is_shorthand_for_the_node_param() -> None:
    assert resolve(node="omen2")["node"] == "omen2"
    with pytest.raises(UsageError, match="conflicts"):
        resolve("node=omen1", node="omen2")


def test_a_mapping_of_typed_values_is_accepted_like_cli_strings() -> None:
    values = resolve_params(RUNBOOK, {"node": "omen2", "ready_timeout": 30, "force": False})
    assert values["ready_timeout"] == 30 and values["force"] is False


@pytest.mark.parametrize(("raw", "message"), [
    (["node=omen2", "nodes=omen3"], "unknown param 'nodes'"),
    ([], "missing required param node (use --node)"),
    (["node=omen2", "workload=vfio"], "'vfio' is not one of container, vm-passthrough"),
    (["node=omen2", "ready_timeout=5"], "5 is less than the minimum 10"),
    (["node=omen2", "ready_timeout=99999"], "more than the maximum 3600"),
    (["node=omen2", "ready_timeout=ten"], "expected an integer"),
    (["node=omen2", "force=perhaps"], "expected true or false"),
    (["node=omen2", "ticket=abc"], "does not match"),
    (["node=omen2", "note"], "-p expects key=value"),
    (["node=omen2", "node=omen3"], "given twice"),
])
def test_invalid_params_are_usage_errors_that_name_the_problem(raw: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(*raw)


@pytest.mark.parametrize("value", [
    "omen2; rm -rf /", "omen2 && reboot", "$(id)", "`id`", "{{7*7}}", "{% raw %}", "OMEN2", "-omen2",
    "omen2-", "a" * 64, "omen2/../x", "omen2\nomen3", "", "omen_2", "ömen2", "a." * 127 + "a",
])
def test_hostile_or_invalid_node_names_are_rejected(value: str) -> None:
    assert not is_node_name(value)
    with pytest.raises(UsageError):
        resolve(node=value)
    with pytest.raises(UsageError):
        validate_node_name(value)


@pytest.mark.parametrize("value", ["omen2", "gpu-node-1", "node.example.com", "a", "a" * 63])
def test_valid_node_names_are_accepted(value: str) -> None:
    assert is_node_name(value)
    assert resolve(node=value)["node"] == value


@pytest.mark.parametrize("value", ["{{ 7*7 }}", "x; rm -rf /", "$(id)", "a`b`", "it's", 'say "hi"', "a|b",
                                   "x\ny", "<script>"])
def test_string_params_without_a_pattern_refuse_shell_and_template_characters(value: str) -> None:
    with pytest.raises(UsageError, match="param note"):
        resolve("node=omen2", f"note={value}")


def test_string_params_accept_ordinary_text() -> None:
    assert resolve("node=omen2", "note=swap turned on by ops, 2026-01-02 12:00")["note"].startswith("swap")
