"""Node-condition triggers (engine.serve.node_conditions): a selected node whose condition has had one
of the statuses for ``for`` pages once per episode through the dispatcher's door, as an alert would."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.errors import UsageError
from engine.facts import Condition, NodeFacts
from engine.model import Trigger
from engine.serve.node_conditions import NodeConditionWatcher, candidate, firing
from engine.serve.starter import TriggerSpec
from engine.serve.triggers import Candidate, TriggerIndex
from tests.fakes import FakeKube, FakeLeadership, make_node

T0 = 1_800_000_000.0


def spec(**trigger: Any) -> TriggerSpec:
    t = Trigger.model_validate({"node_conditions": [{"type": "Ready", "status": ["False", "Unknown"], "for": "5m"}],
                                "mode": "auto", "require_diagnosis": True, **trigger})
    return TriggerSpec("gpu-node-recovery", t, "node")


def down(name: str, since: float, status: str = "Unknown", **labels: str) -> NodeFacts:
    node = make_node(name, labels=labels)
    ready = Condition("Ready", status, "NodeStatusUnknown", "Kubelet stopped posting", since)
    return replace(node, conditions=(ready,))


class Door:
    def __init__(self) -> None:
        self.seen: list[Candidate] = []
        self.transient = False

    def handle_candidates(self, candidates: Any, label: str, requested_by: str) -> list[Any]:
        self.seen += list(candidates)
        return [type("D", (), {"transient": self.transient, "outcome": "started"})()]


def watcher(nodes: list[NodeFacts], s: TriggerSpec, *, now: float,
            leading: bool = True) -> tuple[NodeConditionWatcher, Door]:
    door = Door()
    kube = FakeKube(nodes)
    return NodeConditionWatcher(lambda: kube, door, [s], FakeLeadership(leading), clock=lambda: now), door


def test_a_condition_fires_only_after_its_for() -> None:
    s = spec()
    match = s.trigger.node_conditions[0]
    assert firing(down("omen2", T0 - 299), match, T0) is None
    assert firing(down("omen2", T0 - 300), match, T0) is not None
    assert firing(down("omen2", T0 - 900, status="True"), match, T0) is None
    assert firing(down("omen2", 0.0), match, T0) is None  # no transition time: how long is unknown


def test_a_node_not_ready_for_its_for_pages_once_per_episode_with_the_runbooks_node_param() -> None:
    w, door = watcher([down("omen2", T0 - 600), make_node("omen1")], spec(), now=T0)
    w.check()
    (c,) = door.seen
    assert (c.runbook, c.node, c.params["node"], c.source, c.mode, c.require_diagnosis) == (
        "gpu-node-recovery", "omen2", "omen2", "node-condition", "auto", True)
    assert c.reason.startswith("node-condition: omen2 Ready=Unknown since ")
    w.check()
    assert len(door.seen) == 1  # the same episode does not page again
    assert candidate(spec(), down("omen2", T0 - 60), down("omen2", T0 - 60).conditions[0]).dedup_key != c.dedup_key


def test_the_node_selector_limits_the_watched_nodes_and_a_follower_reads_nothing() -> None:
    w, door = watcher([down("omen2", T0 - 600), down("omen3", T0 - 600, pool="gpu")],
                      spec(node_selector={"pool": "gpu"}), now=T0)
    w.check()
    assert [c.node for c in door.seen] == ["omen3"]
    follower, door2 = watcher([down("omen2", T0 - 600)], spec(), now=T0, leading=False)
    assert follower.check() == [] and door2.seen == []


def test_a_page_blocked_for_a_passing_reason_pages_again() -> None:
    w, door = watcher([down("omen2", T0 - 600)], spec(), now=T0)
    door.transient = True
    w.check()
    w.check()
    assert len(door.seen) == 2


def test_params_render_over_the_node_and_the_condition() -> None:
    s = spec(params={"why": "{{ condition.reason }} on {{ node.name }}"})
    node = down("omen2", T0 - 600)
    c = candidate(s, node, node.conditions[0])
    assert c.params == {"why": "NodeStatusUnknown on omen2", "node": "omen2"}


def test_the_trigger_index_takes_node_condition_triggers_and_refuses_a_trigger_matching_everything() -> None:
    index = TriggerIndex([spec()])
    assert len(index) == 1 and index.condition_triggers()[0].runbook == "gpu-node-recovery"
    assert index.describe()[0]["source"] == "node-condition"
    with pytest.raises(UsageError, match="node_conditions"):
        TriggerIndex([TriggerSpec("x", Trigger.model_validate({"mode": "auto"}), "node")])


def test_a_bad_status_is_a_load_error() -> None:
    with pytest.raises(ValueError, match="status"):
        Trigger.model_validate({"node_conditions": [{"type": "Ready", "status": ["Down"], "for": "5m"}]})
