"""The loader turns YAML into a Runbook, or into PATH:LINE errors: never into a traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from engine.checks import AllCheck, NodeLabelCheck
from engine.errors import LoadError
from engine.kube_verbs.labels import KubeLabel
from engine.loader import (
    default_runbooks_dir,
    find_runbooks,
    load_runbook,
    parse_runbook,
    playbooks_dir_for,
    resolve_runbook_path,
    runbook_json_schema,
    validate_paths,
)
from engine.model import AnsibleAction, KubeAction, Rollback

DATA = Path(__file__).parent / "data"
BAD = DATA / "bad"
PLAYBOOKS = DATA / "playbooks"
REPO = Path(__file__).resolve().parents[2]
LOCATED = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+)(:\d+)?: (?P<rest>.+)$")

# file -> (line of the first problem, a fragment of its text)
EXPECTED: dict[str, tuple[int, str]] = {
    "alias-bomb.yaml": (6, "alias bomb"),
    "bad-duration.yaml": (13, "steps[0].verify[0].timeout: not a duration: 'soon'"),
    "bad-name.yaml": (2, "name: 'Bad_Name' is not a valid name"),
    "bad-yaml.yaml": (9, "invalid YAML"),
    "binary.yaml": (1, "binary file"),
    "check-two-keys.yaml": (9, "steps[0].guards[0]: a check has exactly one key, found 2: 'node_ready', 'swap_active'"),
    "comment-only.yaml": (1, "empty document"),
    "custom-tag.yaml": (6, "tag !include is not allowed"),
    "deep-nesting.yaml": (6, "nested too deeply"),
    "duplicate-key.yaml": (9, "duplicate key 'why' (first at line 8)"),
    "duplicate-step-id.yaml": (13, "steps[1].id: duplicate step id 'relabel'"),
    "empty.yaml": (1, "empty file"),
    "merge-key.yaml": (13, "merge keys (<<) are not supported"),
    "missing-playbook.yaml": (9, "playbook 'does-not-exist.yml' not found"),
    "missing-steps.yaml": (1, "missing required field 'steps'"),
    "name-mismatch.yaml": (2, "must equal the file name 'name-mismatch'"),
    "no-node-param.yaml": (1, "declare a param of type node"),
    "no-verify.yaml": (7, "steps[0]: step 'relabel' changes something but has no verify"),
    "not-a-mapping.yaml": (1, "a runbook is a mapping"),
    "not-utf8.yaml": (1, "not UTF-8"),
    "param-default-invalid.yaml": (6, "params.timeout: param default: 3 is less than the minimum 10"),
    "playbook-escape.yaml": (9, "must be a path inside the playbooks dir"),
    "private-attribute.yaml": (8, "private attribute"),
    "python-tag.yaml": (6, "tag !!python/object/apply:os.system is not allowed"),
    "requires-cycle.yaml": (8, "step 'first' requires 'second', which runs after it"),
    "requires-order.yaml": (8, "step 'restart' requires 'relabel', which runs after it"),
    "requires-unknown.yaml": (8, "requires unknown step 'relable' (did you mean 'relabel'?)"),
    "scalar-root.yaml": (1, "a runbook is a mapping"),
    "template-syntax.yaml": (9, "preconditions[0].message: template syntax error"),
    "two-documents.yaml": (13, "more than one YAML document"),
    "undefined-global.yaml": (9, "undefined name 'cycler'"),
    "undefined-template-name.yaml": (9, "preconditions[0].message: template refers to undeclared param 'nod'"),
    "unknown-action.yaml": (9, "steps[0].action: unknown action 'kubectl' (did you mean 'kube'?)"),
    "unknown-check.yaml": (14, "steps[0].verify[1].check: unknown check 'node_redy' (did you mean 'node_ready'?)"),
    "unknown-fact.yaml": (8, "unknown fact 'hosts'"),
    "unknown-key.yaml": (8, "steps[0]: unknown field 'gaurds'"),
    "unknown-kube-verb.yaml": (10, "unknown kube action 'lable' (did you mean 'label'?)"),
    "whitespace-only.yaml": (1, "empty file"),
    "wrong-api-version.yaml": (1, "apiVersion: expected 'runbook/v1', got 'runbook/v2'"),
    "wrong-types.yaml": (6, "approval: expected a valid boolean"),
}


def _load_bad(name: str) -> LoadError:
    with pytest.raises(LoadError) as info:
        load_runbook(BAD / name, playbooks_dir=PLAYBOOKS)
    return info.value


def test_every_file_of_the_bad_corpus_has_an_expectation() -> None:
    assert sorted(p.name for p in BAD.iterdir()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_bad_runbook_is_rejected_with_path_and_line(name: str) -> None:
    error = _load_bad(name)
    line, fragment = EXPECTED[name]
    lines = str(error).splitlines()
    assert lines, "a LoadError always says something"
    for text in lines:
        m = LOCATED.match(text)
        assert m, f"not PATH:LINE: {text!r}"
        assert m["path"] == str(BAD / name)
    first = error.problems[0]
    assert first[0].line == line, str(error)
    assert any(fragment in text for text in lines), str(error)


def test_every_problem_of_a_file_is_reported_at_once() -> None:
    error = _load_bad("wrong-types.yaml")
    assert [loc.line for loc, _ in error.problems] == [6, 9, 15]


def test_an_unknown_check_points_at_the_line_of_its_key() -> None:
    error = _load_bad("unknown-check.yaml")
    assert str(error) == (f"{BAD / 'unknown-check.yaml'}:14: steps[0].verify[1].check: "
                          "unknown check 'node_redy' (did you mean 'node_ready'?)")


def test_an_alias_bomb_stops_before_expanding() -> None:
    error = _load_bad("alias-bomb.yaml")
    assert len(error.problems) == 1


def test_yaml_11_booleans_as_keys_stay_strings() -> None:
    text = (REPO / "runbooks" / "example-label-and-file.yaml").read_text()
    text = text.replace("label: {runbook.example/marker:", "label: {on:")
    rb = parse_runbook(text.encode(), "x.yaml", playbooks_dir=REPO / "playbooks")
    action = rb.steps[0].action
    assert isinstance(action, KubeAction) and isinstance(action.kube, KubeLabel)
    assert "on" in action.kube.label


@pytest.mark.parametrize("path", find_runbooks(REPO / "runbooks"), ids=lambda p: p.name)
def test_the_runbooks_in_the_repository_load(path: Path) -> None:
    rb = load_runbook(path)
    assert rb.name == path.stem


def test_the_example_runbook_reads_as_a_procedure() -> None:
    rb = load_runbook(REPO / "runbooks" / "example-label-and-file.yaml")
    label, touch = rb.steps
    assert isinstance(label.action, KubeAction)
    assert isinstance(label.on_failure, Rollback)
    assert isinstance(touch.action, AnsibleAction)
    assert touch.requires == ("label-node",)
    assert isinstance(touch.guards[0], NodeLabelCheck)
    assert rb.node_param == "node"


def test_combinators_and_aliased_keywords_parse() -> None:
    text = b"""apiVersion: runbook/v1
name: combos
version: "1"
params: {node: {type: node, required: true}}
preconditions:
  - id: p
    check:
      all:
        - any: [{swap_active: true}, {journal_contains: {unit: kubelet, text: swap}}]
        - not: {node_exists: false}
steps:
  - id: wait
    action: {check: {}}
    verify: [{check: {node_ready: true}, timeout: 2m}]
"""
    rb = parse_runbook(text, "combos.yaml", stem="combos")
    assert isinstance(rb.preconditions[0].check, AllCheck)
    assert rb.steps[0].verify[0].timeout == "2m"


def test_validate_reports_good_files_and_problems_together(tmp_path: Path) -> None:
    (tmp_path / "runbooks").mkdir()
    good = REPO / "runbooks" / "example-label-and-file.yaml"
    (tmp_path / "runbooks" / good.name).write_bytes(good.read_bytes())
    (tmp_path / "runbooks" / "empty.yaml").write_text("")
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "example-touch-file.yml").write_text("- hosts: all\n")
    ok, problems = validate_paths([tmp_path / "runbooks"])
    assert [p.name for p in ok] == [good.name]
    assert [(loc.line, msg) for loc, msg in problems] == [(1, "empty file")]


def test_runbooks_are_found_by_name_with_a_hint_for_typos() -> None:
    assert resolve_runbook_path("example-label-and-file", REPO / "runbooks").name == "example-label-and-file.yaml"
    with pytest.raises(LoadError, match="did you mean example-label-and-file"):
        resolve_runbook_path("example-label-and-fil", REPO / "runbooks")


def test_playbooks_dir_is_the_sibling_of_the_runbooks_dir() -> None:
    assert playbooks_dir_for(REPO / "runbooks") == (REPO / "playbooks").resolve()


def test_default_runbooks_dir_prefers_the_working_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_runbooks_dir().parts[-2:] == ("data", "runbooks")
    (tmp_path / "runbooks").mkdir()
    assert default_runbooks_dir() == Path("runbooks")


def test_the_json_schema_accepts_the_repository_runbooks() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = runbook_json_schema()
    json.dumps(schema)  # serialisable, for `runbook schema`
    assert schema["title"] == "runbook/v1"
    for path in find_runbooks(REPO / "runbooks"):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"apiVersion": "runbook/v1", "name": "x", "version": "1", "steps": [],
                             "bogus": 1}, schema)
