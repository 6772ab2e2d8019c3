"""Trigger matching and param rendering through the engine's sandbox."""

from __future__ import annotations

import json

import pytest

from engine.errors import UsageError
from engine.serve.alertmanager import parse_webhook
from engine.serve.config import PagerDutyMapping
from engine.serve.pagerduty import Incident
from engine.serve.triggers import TriggerIndex
from tests.fakes import alert, trigger_spec, webhook


def _alert(node: str, **kw: str):  # type: ignore[no-untyped-def]
    return parse_webhook(json.dumps(webhook(alert(node, **kw))).encode()).alerts[0]


def test_a_notready_alert_for_a_gpu_node_yields_the_flagship_with_its_node() -> None:
    idx = TriggerIndex([trigger_spec(matchers=('node=~"omen.*"',))])
    m = idx.for_alert(_alert("omen2"))
    (c,) = m.candidates
    assert (c.runbook, dict(c.params), c.node, c.mode, c.source) == (
        "gpu-node-recovery", {"node": "omen2"}, "omen2", "approve", "alertmanager")
    assert "KubeNodeNotReady" in c.reason and c.dedup_key == "fp-KubeNodeNotReady-omen2"


def test_name_and_matchers_must_both_match() -> None:
    idx = TriggerIndex([trigger_spec(matchers=('node=~"omen.*"',))])
    assert not idx.for_alert(_alert("cpu1")).candidates
    assert not idx.for_alert(_alert("omen2", alertname="KubeletDown")).candidates
    assert idx.for_alert(_alert("omen2", alertname="KubeNodeUnreachable")).candidates


def test_resolved_alerts_never_match() -> None:
    idx = TriggerIndex([trigger_spec()])
    assert not idx.for_alert(_alert("omen2", status="resolved")).candidates


def test_label_values_are_data_never_rendered() -> None:
    idx = TriggerIndex([trigger_spec()])
    (r,) = idx.for_alert(_alert("{{ 7*7 }}")).refusals  # refused by node-name validation, unrendered
    assert "'{{ 7*7 }}' is not a valid node name" in r.reason
    (r,) = idx.for_alert(_alert("{{ cycler.__init__.__globals__.os.popen('id').read() }}")).refusals
    assert "cycler" in r.reason and "not a valid node name" in r.reason


def test_a_template_that_fails_is_a_refusal_not_a_crash() -> None:
    idx = TriggerIndex([trigger_spec(params={"node": "{{ labels.instance }}"})])
    m = idx.for_alert(_alert("omen2"))
    assert not m.candidates
    assert "instance" in m.refusals[0].reason


def test_a_repeated_alert_gets_the_same_answer_from_memory_and_a_changed_one_is_matched_afresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.serve import triggers

    idx = TriggerIndex([trigger_spec(params={"node": "{{ labels.node }}", "why": "{{ annotations.summary }}"})])
    renders: list[str] = []
    real = triggers._render
    monkeypatch.setattr(triggers, "_render", lambda t, ctx: renders.append("r") or real(t, ctx))
    first = idx.for_alert(_alert("omen2"))
    again = idx.for_alert(_alert("omen2"))
    assert len(renders) == 1 and again.candidates == first.candidates
    again.candidates.clear()  # the caller's own list: the remembered answer is untouched
    assert idx.for_alert(_alert("omen2")).candidates == first.candidates
    (other,) = idx.for_alert(_alert("omen3")).candidates
    assert other.node == "omen3" and len(renders) == 2
    body = alert("omen2")
    body["annotations"]["summary"] = "another summary"  # annotations are read too
    changed = idx.for_alert(parse_webhook(json.dumps(webhook(body)).encode()).alerts[0])
    assert dict(changed.candidates[0].params)["why"] == "another summary" and len(renders) == 3


def test_refusals_are_not_remembered_and_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.serve import triggers

    monkeypatch.setattr(triggers, "MATCH_CACHE_SIZE", 3)
    idx = TriggerIndex([trigger_spec(params={"node": "{{ labels.instance }}"})])
    idx.for_alert(_alert("omen2"))
    assert not idx._cache  # a refusal (the template failed): asked afresh next time
    idx = TriggerIndex([trigger_spec()])
    for n in range(10):
        idx.for_alert(_alert(f"omen{n}"))
    assert len(idx._cache) == 3


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"matchers": ('node=~"("',)}, "matchers"),
    ({"params": {"node": "{{ labels.node.__class__ }}"}}, "private attribute"),
    ({"params": {"node": "{{ labels.node "}}, "syntax"),
    ({"params": {"node": "{{ facts.node }}"}}, ""),  # names outside the context are refused at render
    ({"alert": "", "matchers": ()}, "would match everything"),
])
def test_bad_triggers_fail_at_server_start(kwargs: dict, needle: str) -> None:  # type: ignore[type-arg]
    if needle == "":
        idx = TriggerIndex([trigger_spec(**kwargs)])
        assert idx.for_alert(_alert("omen2")).refusals
        return
    with pytest.raises(UsageError) as e:
        TriggerIndex([trigger_spec(**kwargs)])
    assert needle in str(e.value)


def test_incidents_map_by_service_and_title_with_named_groups() -> None:
    mapping = PagerDutyMapping(service="GPU nodes", title_pattern=r"Node (?P<node>[a-z0-9.-]+) is NotReady",
                               runbook="gpu-node-recovery", params={"ready_timeout": 300})
    idx = TriggerIndex([trigger_spec()], [mapping])
    inc = Incident.model_validate({"id": "Q1", "title": "[FIRING] Node omen2 is NotReady",
                                   "service": {"id": "PSVC", "summary": "GPU nodes"}})
    (c,) = idx.for_incident(inc).candidates
    assert (dict(c.params), c.node, c.source, c.dedup_key) == (
        {"ready_timeout": 300, "node": "omen2"}, "omen2", "pagerduty", "pd-incident-Q1")
    by_id = inc.model_copy(update={"service": inc.service.model_copy(update={"summary": "other"})})
    assert not idx.for_incident(by_id).candidates
    assert not idx.for_incident(inc.model_copy(update={"title": "Disk full on omen2"})).candidates


def test_runbook_declared_pagerduty_triggers_render_params_from_groups() -> None:
    spec = trigger_spec(alert="", pagerduty={"service": "PSVC", "title_pattern": r"(?P<host>omen\d+) down"},
                        params={"node": "{{ labels.host }}"})
    idx = TriggerIndex([spec])
    inc = Incident.model_validate({"id": "Q2", "title": "omen2 down", "service": {"id": "PSVC"}})
    (c,) = idx.for_incident(inc).candidates
    assert c.params == {"host": "omen2", "node": "omen2"} and c.node == "omen2"
    assert not idx.for_alert(_alert("omen2")).candidates  # a pagerduty-only trigger
