"""Hostile input: located errors (never a traceback), templates that never execute, values that stay data.

* Malformed runbooks (``data/bad/`` and ``data/bad-extra/``) through the real CLI, ``runbook validate``:
  exit 2 and ``PATH:LINE:`` on every line. Property-based: random Jinja templates in a runbook.
* Template injection: params and alert labels carrying Jinja2 payloads (attribute walks, ``__class__``,
  ``cycler`` / ``lipsum`` / ``joiner``, ``self._TemplateReference__context``, ``request`` / ``config``)
  are inserted as text, never rendered; authored into a runbook they are refused at load, and the
  sandbox refuses them at render time too. Nothing reaches the environment.
* Command injection: hostile node names and params are refused by validation (exit 2) before any
  connection is made.
* Webhooks: random JSON and bytes never make either endpoint fail with a 5xx or start a run.

Every case asserts the exact outcome; there are no expected failures (under ``CI=true`` an xfail fails).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import probes, templating
from engine.cli import main
from engine.errors import LoadError
from engine.loader import parse_runbook
from engine.model import Runbook
from engine.planning import plan_run
from tests.fakes import FakeClock, FakeKube, FakeNodes, incident_host, incident_node

DATA = Path(__file__).parent / "data"
BAD = DATA / "bad"
EXTRA = DATA / "bad-extra"
REPO = Path(__file__).resolve().parents[2]
LOCATED = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+)(:\d+)?: (?P<rest>.+)$")
CANARY = "runbook-canary-7f3a9c"  # in the environment of every test here: it must never come out

# file -> (line of the first problem, a fragment of its text)
EXTRA_EXPECTED: dict[str, tuple[int, str]] = {
    "bad-param-pattern.yaml": (6, "params.note: pattern is not a valid regular expression"),
    "enum-default-not-a-value.yaml": (6, "param default: 'vm-passthrough' is not one of container"),
    "jinja-config.yaml": (9, "undefined name 'config'"),
    "jinja-cycler.yaml": (9, "undefined name 'cycler'"),
    "jinja-env-lookup.yaml": (9, "undefined name 'lookup'"),
    "jinja-joiner.yaml": (9, "undefined name 'joiner'"),
    "jinja-lipsum.yaml": (9, "undefined name 'lipsum'"),
    "jinja-mro.yaml": (9, "private attribute '__mro__'"),
    "jinja-params-class.yaml": (9, "private attribute '__globals__'"),
    "jinja-range-self.yaml": (9, "private attribute '__self__'"),
    "jinja-request.yaml": (9, "undefined name 'request'"),
    "jinja-self-context.yaml": (9, "private attribute '_TemplateReference__context'"),
    "negative-timeout.yaml": (11, "steps[0].verify[0].timeout: not a duration: '-5s'"),
    "null-step.yaml": (7, "steps[0]: expected a valid dictionary"),
    "requires-self.yaml": (8, "step 'relabel' requires itself"),
    "requires-three-cycle.yaml": (8, "step 'first' requires 'third', which runs after it"),
    "shell-in-step-id.yaml": (7, "steps[0].id: 'relabel;rm -rf /' is not a valid id"),
    "steps-not-a-list.yaml": (6, "steps: expected a valid tuple"),
    "tab-indentation.yaml": (5, "invalid YAML"),
    "undefined-param-in-check.yaml": (11, "check.node_label.equals: template refers to undeclared param 'wokload'"),
    "undefined-param-in-timeout.yaml": (11, "timeout: template refers to undeclared param 'ready_timeout'"),
    "unknown-key-in-check.yaml": (10, "check.node_label: unknown field 'equal'"),
    "unknown-param-type.yaml": (6, "params.ratio.type: expected 'string', 'int', 'bool', 'enum' or 'node'"),
    "unknown-top-level-key.yaml": (6, "unknown field 'stesp'"),
    "unknown-filter.yaml": (9, "No filter named"),
    "jinja-attr-filter.yaml": (9, "the 'attr' filter"),
    "jinja-format-string.yaml": (9, "template calls str.format"),
}


@pytest.fixture(autouse=True)
def _canary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBOOK_CANARY", CANARY)


def _cli(*args: str, env: dict[str, str] | None = None) -> Any:
    """The real ``runbook`` command, in-process (click's runner), with stderr apart."""
    return CliRunner().invoke(main, list(args), env={"KUBECONFIG": "/nonexistent/kubeconfig",
                                                     "RUNBOOK_INVENTORY": "", **(env or {})},
                              catch_exceptions=True)


def _assert_located(text: str, path: Path) -> list[re.Match[str]]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "an error always says something"
    matches = []
    for line in lines:
        m = LOCATED.match(line)
        assert m, f"not PATH:LINE: {line!r}"
        assert m["path"] == str(path)
        matches.append(m)
    return matches


# -- malformed runbooks, through the CLI ---------------------------------------------------------


def test_every_file_of_the_extra_corpus_has_an_expectation_or_a_known_gap() -> None:
    assert sorted(p.name for p in EXTRA.iterdir()) == sorted(EXTRA_EXPECTED)


def test_the_whole_bad_corpus_through_the_cli_process_is_exit_2_and_path_line_for_every_file(
        tmp_path: Path) -> None:
    files = sorted(p for d in (BAD, EXTRA) for p in d.iterdir())
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "RUNBOOK_JOURNAL": str(tmp_path / "j.sqlite")}
    done = subprocess.run([sys.executable, "-m", "engine", "validate", *map(str, files)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    named = set()
    for line in done.stderr.splitlines():
        m = LOCATED.match(line)
        assert m, f"not PATH:LINE: {line!r}"
        named.add(m["path"])
    assert named == {str(p) for p in files}


@pytest.mark.parametrize("name", sorted(EXTRA_EXPECTED))
def test_each_extra_bad_runbook_is_exit_2_with_its_line(name: str) -> None:
    path = EXTRA / name
    result = _cli("validate", str(path))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2
    matches = _assert_located(result.stderr, path)
    line, fragment = EXTRA_EXPECTED[name]
    assert int(matches[0]["line"]) == line, result.stderr
    assert any(fragment in m["rest"] for m in matches), result.stderr


SAFE_EXPRESSIONS = st.sampled_from([
    "params.node", "params.nod", "params.node.upper()", "facts.node.labels", "facts.host.swap_active",
    "facts.nodes", "facts.node.__class__", "params['node']", "params.node[0]", "1 + 2", "'x' * 3",
    "range(3) | list", "x", "loop.index", "facts.errors | length", "params.node ~ '-x'",
    "params.node | default('y')", "params.node | upper", "params.node | replace('a', 'b')",
])
TEMPLATES = st.lists(st.one_of(
    SAFE_EXPRESSIONS.map(lambda e: "{{ " + e + " }}"),
    st.sampled_from(["{% if params.node %}", "{% endif %}", "{% for x in range(2) %}", "{% endfor %}",
                     "{{", "}}", "{%", "%}", "{#", "#}", "{{ }}", "{% raw %}", "{% set y = 1 %}"]),
    st.text(alphabet="abc :'\"\\\n{}%#|.()[]", max_size=10)), max_size=6).map("".join)

RUNBOOK_WITH_MESSAGE = """apiVersion: runbook/v1
name: fuzz
version: "1"
params:
  node: {{type: node, required: true}}
preconditions:
  - id: exists
    check: {{node_exists: true}}
    message: {message}
steps:
  - id: wait
    action: {{check: {{}}}}
    verify: [{{check: {{node_ready: true}}}}]
"""


@settings(max_examples=int(os.environ.get("RUNBOOK_FUZZ_EXAMPLES", "100")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(TEMPLATES)
@example("{{ params.node | default('x') | upper }}")
def test_random_templates_in_a_runbook_load_or_are_located_errors(template: str) -> None:
    data = RUNBOOK_WITH_MESSAGE.format(message=json.dumps(template)).encode()
    try:
        rb = parse_runbook(data, "fuzz.yaml", stem=None, playbooks_dir=REPO / "playbooks")
    except LoadError as e:
        for line in str(e).splitlines():
            assert re.match(r"^fuzz\.yaml:\d+(:\d+)?: .+", line), line
        return
    assert isinstance(rb, Runbook)


# -- template injection --------------------------------------------------------------------------


PAYLOADS = [
    "{{ 7*7 }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ lipsum.__globals__['os'].environ['RUNBOOK_CANARY'] }}",
    "{{ joiner.__init__.__globals__.os.environ }}",
    "{{ self._TemplateReference__context }}",
    "{{ request.application.__globals__.__builtins__ }}",
    "{{ config.items() }}",
    "{% for c in [].__class__.__base__.__subclasses__() %}{{ c }}{% endfor %}",
    "{{ params|attr('__class__') }}",
    "{{ '{0.__class__}'.format(params) }}",
    "{{ range.__self__ }}",
]

PERMISSIVE = parse_runbook(b"""apiVersion: runbook/v1
name: permissive
version: "1"
params:
  node: {type: node, required: true}
  note: {type: string, pattern: "^.*$", default: x}
preconditions:
  - id: says-the-note
    check: {expr: "params.note != 'forbidden'"}
    message: "note is {{ params.note }}"
  - id: always-false
    check: {expr: "params.note == 'never'"}
    message: "the note was {{ params.note }}; upper {{ params.note | upper }}"
steps:
  - id: label
    action: {kube: {annotate: {runbook/note: "{{ params.note }}"}}}
    verify: [{check: {node_ready: true}}]
""", "permissive.yaml", playbooks_dir=REPO / "playbooks")


@pytest.mark.parametrize("payload", PAYLOADS)
def test_a_param_carrying_a_jinja_payload_is_inserted_as_text_never_rendered(payload: str) -> None:
    clock = FakeClock()
    kube, nodes = FakeKube([incident_node()], clock=clock), FakeNodes({"omen2": incident_host()}, clock=clock)
    params = {"node": "omen2", "note": payload}
    facts = probes.gather(PERMISSIVE, params, "omen2", kube, nodes, clock=clock.wall)
    from datetime import UTC, datetime

    plan = plan_run(PERMISSIVE, params, facts, runbook_digest="d" * 64, now=datetime(2026, 7, 10, tzinfo=UTC))
    messages = {p.id: p.message for p in plan.preconditions}
    assert messages["always-false"] == f"the note was {payload}; upper {payload.upper()}"
    dumped = plan.model_dump_json()
    assert CANARY not in dumped and "uid=" not in dumped
    assert "49" not in dumped.replace(plan.digest, "").replace(plan.runbook_digest, "") or "49" in payload
    step = plan.step("label")
    assert payload in json.dumps(step.model_dump(mode="json"))  # the annotation value: the text itself


@pytest.mark.parametrize("payload", PAYLOADS)
def test_the_sandbox_refuses_payloads_authored_into_a_template_and_never_reaches_the_environment(
        payload: str) -> None:
    ctx = templating.context({"node": "omen2", "note": "x"})
    try:
        out = templating.render(payload, ctx)
    except templating.TemplateError as e:
        assert CANARY not in str(e)
        return
    assert payload == "{{ 7*7 }}" and out == "49"  # plain arithmetic is allowed; nothing else renders


@pytest.mark.parametrize("payload", PAYLOADS)
def test_alert_labels_carrying_payloads_stay_data_and_are_refused_as_node_names(payload: str) -> None:
    from engine.serve.alertmanager import parse_webhook
    from engine.serve.triggers import TriggerIndex
    from tests.fakes import alert, served, trigger_spec, webhook

    parsed = parse_webhook(json.dumps(webhook(alert(payload, instance=payload))).encode()).alerts[0]
    idx = TriggerIndex([trigger_spec(params={"node": "{{ labels.node }}"})])
    (refusal,) = idx.for_alert(parsed).refusals  # refused as a node name at the trigger, never rendered
    assert repr(payload[:80]) in refusal.reason
    idx = TriggerIndex([trigger_spec(params={"node": "{{ labels.node | lower }}-{{ labels.instance }}"})])
    matches = idx.for_alert(parsed)
    assert matches.candidates == []  # the rendered value is no node name either: refused, never started
    (refusal,) = matches.refusals
    # the text itself, once, not rendered again (no "49", no second expansion)
    assert f"param node: {f'{payload.lower()}-{payload}'[:80]!r} is not a valid node name" in refusal.reason
    with served() as s:
        # "omen2" first, so the trigger's node=~"omen.*" matches and the node name check is what refuses
        r = s.post_alerts(alert("omen2" + payload))
        assert r.status_code == 200, r.text
        (decision,) = r.json()["decisions"]
        assert decision["outcome"] == "rejected", decision
        # the text itself in the reason, exactly (not rendered, not truncated below 80 characters)
        assert decision["reason"] == (f"params: param node: {('omen2' + payload)[:80]!r} "
                                      "is not a valid node name (RFC 1123)"), decision
        assert CANARY not in r.text and s.starter.requests == []


# -- command injection: refused by validation, before any connection ------------------------------


HOSTILE_NODES = ["omen2;rm -rf /", "$(id)", "`id`", "--limit=all", "omen2\nomen3", "omen2 omen3", "-e@/etc/passwd",
                 "../../etc/passwd", "omen2&&reboot", "{{ 7*7 }}", "OMEN2", "", "a" * 300, "omen2|id", "*"]


@pytest.mark.parametrize("value", HOSTILE_NODES)
@pytest.mark.parametrize("how", ["run --node", "plan -p"])
def test_hostile_node_names_are_refused_with_exit_2(value: str, how: str, tmp_path: Path) -> None:
    command, flag = how.split()
    args = ["--node", value] if flag == "--node" else ["-p", f"node={value}"]
    result = _cli(command, "gpu-node-recovery", *args, *(["--yes"] if command == "run" else []),
                  env={"RUNBOOK_RUNBOOKS_DIR": str(REPO / "runbooks"), "RUNBOOK_JOURNAL": str(tmp_path / "j.sqlite")})
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output
    # refused by validation: no kubeconfig was ever read, nothing was recorded as a run
    assert "node" in result.stderr and "kubeconfig" not in result.stderr.lower()
    assert not (tmp_path / "j.sqlite").exists() or "r-" not in _cli("runs", env={
        "RUNBOOK_JOURNAL": str(tmp_path / "j.sqlite")}).output


HOSTILE_STRINGS = ["$(id)", "a;b", "x\ny", "a'b", 'a"b', "{{ 7*7 }}", "`id`", "a|b", "a&b", "a>b", "\x00", "é\u202e"]


@pytest.mark.parametrize("value", HOSTILE_STRINGS)
def test_a_string_param_without_its_own_pattern_refuses_shell_and_template_metacharacters(
        value: str, tmp_path: Path) -> None:
    runbooks = tmp_path / "runbooks"
    runbooks.mkdir()
    (runbooks / "noted.yaml").write_text("""apiVersion: runbook/v1
name: noted
version: "1"
params:
  node: {type: node, required: true}
  note: {type: string, default: x}
steps:
  - id: wait
    action: {check: {}}
    verify: [{check: {node_ready: true}}]
""")
    result = _cli("plan", "noted", "--node", "omen2", "-p", f"note={value}",
                  env={"RUNBOOK_RUNBOOKS_DIR": str(runbooks), "RUNBOOK_JOURNAL": str(tmp_path / "j.sqlite")})
    assert result.exit_code == 2, (result.output, result.exception)
    assert "param note" in result.stderr


# -- webhooks: whatever arrives, never a 5xx and never a run from garbage ---------------------------


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                max_size=4), max_leaves=25)
ALERT_SHAPED = st.fixed_dictionaries({
    "status": st.sampled_from(["firing", "resolved", "x", 1]),
    "alerts": st.lists(st.fixed_dictionaries({
        "status": st.sampled_from(["firing", "resolved", None]),
        "labels": st.dictionaries(st.sampled_from(["alertname", "node", "x"]),
                                  st.one_of(st.text(max_size=30), st.sampled_from(PAYLOADS), st.integers()),
                                  max_size=3),
        "fingerprint": st.one_of(st.text(max_size=10), st.integers())}), max_size=3),
    "version": st.sampled_from(["4", 4, None])})


def test_random_alertmanager_deliveries_never_fail_the_server() -> None:
    from tests.fakes import AUTH, served

    with served() as s:
        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(st.one_of(JSON.map(lambda v: json.dumps(v).encode()), ALERT_SHAPED.map(lambda v: json.dumps(v).encode()),
                         st.binary(max_size=300)))
        def deliver(body: bytes) -> None:
            r = s.client.post("/hooks/alertmanager", content=body,
                              headers={**AUTH, "Content-Type": "application/json"})
            assert r.status_code in (200, 202, 400), (r.status_code, r.text)
            assert CANARY not in r.text

        deliver()
        for request in s.starter.requests:  # whatever started came from a valid, matching alert
            assert re.fullmatch(r"omen[0-9]", str(request.node)), request


def test_random_pagerduty_deliveries_never_fail_the_server_even_when_signed() -> None:
    from engine.serve.pagerduty import sign
    from tests.fakes import served

    secret = "pd-secret-0123456789"  # secrets under 16 bytes are refused at start
    mapping = {"service": "GPU nodes", "title_pattern": r"Node (?P<node>[a-z0-9.-]+) is NotReady",
               "runbook": "gpu-node-recovery", "mode": "approve"}
    with served(env={"RUNBOOK_PAGERDUTY_SECRET": secret}, pagerduty={"mappings": [mapping]}) as s:
        @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=200)),
               st.booleans(), st.text(alphabet="abc123", min_size=1, max_size=6))
        def deliver(body: bytes, signed: bool, webhook_id: str) -> None:
            headers = {"Content-Type": "application/json", "X-Webhook-Id": webhook_id}
            if signed:
                headers["X-PagerDuty-Signature"] = sign(body, secret)
            r = s.client.post("/hooks/pagerduty", content=body, headers=headers)
            assert r.status_code in (200, 202, 400, 403), (r.status_code, r.text)

        deliver()
        assert s.starter.requests == []
