"""A check kind is one class: defined and registered here, a runbook can use it at once, and
`runbook validate`, `runbook schema`, planning and evaluation all know it (docs/design.md, "How to
add a check")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner
from pydantic import Field

from engine import checks as chk
from engine.checkkind import CheckResult, Env, FormatModel, check_keys, register_check, result, unregister_check
from engine.checks import HostCheck
from engine.cli import main
from engine.facts import Facts, GpuDevice, HostFacts
from engine.loader import parse_runbook
from engine.model import PlanState
from engine.planning import plan_run
from tests.fakes import healthy_node, make_host


class GpusAtLeastSpec(FormatModel):
    count: int = Field(ge=1)


class GpusAtLeastCheck(HostCheck):
    """At least this many GPUs on the host (a kind defined by a test)."""

    KEY: ClassVar[str] = "gpus_at_least"
    gpus_at_least: GpusAtLeastSpec

    def describe(self) -> str:
        return f"at least {self.gpus_at_least.count} GPUs"

    def evaluate_host(self, host: HostFacts, env: Env) -> CheckResult:
        n = len(host.gpus)
        return result(n >= self.gpus_at_least.count, f"{n} GPUs", {"host.gpus": n})


RUNBOOK = """\
apiVersion: runbook/v1
name: gpus-seen
version: "1"
params:
  node: {type: node, required: true}
preconditions:
  - id: enough-gpus
    check: {gpus_at_least: {count: 2}}
    message: the host shows fewer than 2 GPUs
steps:
  - id: wait
    action: {check: {}}
    verify:
      - check: {all: [{node_ready: true}, {gpus_at_least: {count: 1}}]}
"""


@pytest.fixture
def registered() -> Iterator[None]:
    register_check(GpusAtLeastCheck)
    try:
        yield
    finally:
        unregister_check(GpusAtLeastCheck.KEY)


def write(tmp_path: Path, text: str = RUNBOOK) -> Path:
    path = tmp_path / "gpus-seen.yaml"
    path.write_text(text)
    return path


def host_with(n: int) -> HostFacts:
    gpus = tuple(GpuDevice(f"0{i}:00.0", "10de:2b85", "GPU", "nvidia") for i in range(n))
    return HostFacts(host="omen2", gpus=gpus, services=make_host().services)


def test_a_check_kind_registered_by_a_test_module_is_validated_by_runbook_validate(
        registered: None, tmp_path: Path) -> None:
    good = CliRunner().invoke(main, ["validate", str(write(tmp_path))])
    assert good.exit_code == 0, good.output
    bad = CliRunner().invoke(main, ["validate", str(write(tmp_path, RUNBOOK.replace("count: 2", "count: 0")))])
    assert bad.exit_code != 0
    assert "gpus-seen.yaml:8: preconditions[0].check.gpus_at_least.count: expected greater than or equal to 1" \
        in bad.output  # its own spec, located


def test_without_registration_the_same_runbook_is_an_unknown_check(tmp_path: Path) -> None:
    assert "gpus_at_least" not in check_keys()
    got = CliRunner().invoke(main, ["validate", str(write(tmp_path))])
    assert got.exit_code != 0 and "unknown check 'gpus_at_least'" in got.output


def test_runbook_schema_exports_a_registered_kind_wherever_a_check_may_appear(registered: None) -> None:
    got = CliRunner().invoke(main, ["schema"])
    assert got.exit_code == 0, got.output
    schema = json.loads(got.output)
    kind = schema["$defs"]["GpusAtLeastCheck"]
    assert kind["required"] == ["gpus_at_least"] and kind["additionalProperties"] is False
    assert kind["description"].startswith("At least this many GPUs")
    ref = {"$ref": "#/$defs/GpusAtLeastCheck"}
    assert ref in schema["$defs"]["Verify"]["properties"]["check"]["oneOf"]
    assert ref in schema["$defs"]["AllCheck"]["properties"]["all"]["items"]["oneOf"]  # nested checks too
    host_group = [r["$ref"] for r in schema["$defs"]["Verify"]["properties"]["check"]["oneOf"]]
    assert host_group.index("#/$defs/GpusAtLeastCheck") < host_group.index("#/$defs/ExprCheck")  # with its group


def test_a_registered_kind_plans_evaluates_and_names_its_probes(registered: None, tmp_path: Path) -> None:
    rb = parse_runbook(write(tmp_path).read_bytes(), "gpus-seen.yaml", stem="gpus-seen")
    check = rb.preconditions[0].check
    assert chk.describe(check) == "at least 2 GPUs"
    assert chk.required_probes([check]) == {chk.HOST}
    assert chk.evaluate(check, Facts("omen2", host=None)).holds is None  # no host facts: unknown
    now = datetime(2026, 12, 3, tzinfo=UTC)
    one = plan_run(rb, {"node": "omen2"}, Facts("omen2", node=healthy_node(), host=host_with(1)),
                   runbook_digest="0" * 64, now=now)
    assert one.state is PlanState.BLOCKED and "fewer than 2 GPUs" in " ".join(one.blocked_reasons)
    two = plan_run(rb, {"node": "omen2"}, Facts("omen2", node=healthy_node(), host=host_with(2)),
                   runbook_digest="0" * 64, now=now)
    assert two.state is not PlanState.BLOCKED
    assert two.depends_on.get("host.gpus") == 2
    assert two.steps[0].verify[0].check == "all(node is Ready; at least 1 GPUs)"


def test_a_key_is_registered_once_and_a_kind_needs_its_spec_field() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_check(type("Again", (HostCheck,), {"__annotations__": {"node_ready": "bool"},
                                                    "KEY": "node_ready"}))

    class NoField(HostCheck):
        KEY: ClassVar[str] = "no_field"
        other: int = 0

    with pytest.raises(ValueError, match="needs a field named 'no_field'"):
        register_check(NoField)
    assert "no_field" not in check_keys()
