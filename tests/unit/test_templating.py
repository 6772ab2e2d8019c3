"""Templates render in a sandbox over params and facts only; hostile templates raise, never execute."""

from __future__ import annotations

import pytest

from engine.facts import Facts
from engine.templating import (
    TemplateError,
    context,
    evaluate_expression,
    facts_context,
    render,
    template_problems,
)
from tests.fakes import make_host, make_node

FACTS = Facts(node_name="omen2", node=make_node("omen2", labels={"nvidia.com/gpu.workload.config": "vm-passthrough"}),
              host=make_host("omen2", swap=True, kubelet="activating", journal="running with swap on is not supported"))
CTX = context({"node": "omen2", "ready_timeout": 180}, FACTS)

HOSTILE = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ self.__init__.__globals__ }}",
    "{{ params.__class__ }}",
    "{{ facts.node.labels.__class__.__base__ }}",
    "{{ (params|attr('__class__')) }}",
    "{{ request.application.__globals__ }}",
    "{{ config.items() }}",
    "{{ range.__self__ }}",
    "{{ 'x' * 100000000 }}",
    "{{ 2 ** 100000 }}",
    "{{ 10 ** 999 ** 999 }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{{ ''.format.__globals__ }}",
    "{{ {}.update(a=1) }}",
    "{{ facts.node.labels.update({'a': 'b'}) }}",
]


@pytest.mark.parametrize("payload", HOSTILE)
def test_hostile_templates_raise_instead_of_executing(payload: str) -> None:
    with pytest.raises(TemplateError):
        render(payload, CTX)


@pytest.mark.parametrize("payload", [p.removeprefix("{{ ").removesuffix(" }}") for p in HOSTILE if p.startswith("{{")])
def test_hostile_expressions_raise_instead_of_executing(payload: str) -> None:
    with pytest.raises(TemplateError):
        value = evaluate_expression(payload, CTX)
        str(value)


@pytest.mark.parametrize("payload", ["{{ ''.__class__ }}", "{{ cycler.__init__.__globals__ }}",
                                     "{{ lipsum.__globals__ }}", "{{ self._TemplateReference__context }}"])
def test_hostile_templates_are_refused_when_a_runbook_is_loaded(payload: str) -> None:
    assert template_problems(payload, params={"node": None})


def test_a_param_value_is_data_and_never_rendered_again() -> None:
    ctx = context({"node": "{{ 7*7 }}"}, None)
    assert render("node={{ params.node }}", ctx) == "node={{ 7*7 }}"


def test_facts_render_as_plain_data() -> None:
    out = render("{{ facts.node.labels['nvidia.com/gpu.workload.config'] }} "
                 "{{ facts.host.services.kubelet.state }} {{ facts.host.swap_active }}", CTX)
    assert out == "vm-passthrough activating True"


def test_facts_context_is_read_only() -> None:
    ctx = facts_context(FACTS)
    with pytest.raises(TypeError):
        ctx["node"]["labels"]["x"] = "y"


def test_undefined_names_raise_with_strict_undefined() -> None:
    with pytest.raises(TemplateError, match="undefined"):
        render("{{ params.missing }}", CTX)
    with pytest.raises(TemplateError):
        render("{{ facts.host.services.nginx.state }}", CTX)


def test_missing_host_facts_make_a_template_fail_not_print_none() -> None:
    ctx = context({"node": "omen2"}, Facts(node_name="omen2"))
    with pytest.raises(TemplateError):
        render("{{ facts.host.services.kubelet.state }}", ctx)


def test_expressions_evaluate_over_facts() -> None:
    assert evaluate_expression("facts.host.swap_active and params.ready_timeout > 60", CTX) is True
    assert evaluate_expression("facts.host.gpu_driver == 'vfio-pci'", CTX) is False


def test_static_checks_allow_declared_params_known_facts_and_local_names() -> None:
    params = {"node": None, "workload": None}
    assert template_problems("{{ params.node }}/{{ params['workload'] }}", params=params) == []
    assert template_problems("{% for k, v in facts.node.labels.items() %}{{ k }}{% endfor %}", params=params) == []
    assert template_problems("{% set x = 3 %}{{ x + 1 }}", params=params) == []
    assert template_problems("{{ params.nod }}", params=params) == ["template refers to undeclared param 'nod'"]
    assert "unknown fact 'hosts'" in template_problems("{{ facts.hosts }}", params=params)[0]
    assert template_problems("{{ env }}", params=params) == [
        "template refers to undefined name 'env' (only params and facts)"]
    assert "syntax error" in template_problems("{{ params.node ", params=params)[0]
