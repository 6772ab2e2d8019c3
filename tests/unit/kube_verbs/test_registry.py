"""A kube verb is one module of engine/kube_verbs/: its spec class and its ``decide``, whose
``@decides(Spec)`` is the one registration (the spec becomes a verb of the format, the decide is
registered). The package imports every module of its own, so no line elsewhere names the verb: the
format's ``KubeVerb``, the loader's hints, ``runbook schema`` and planning all read the registries
(docs/design.md, "How to add a kube verb")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

import engine.kube_verbs as kv
from engine import model
from engine.errors import LoadError
from engine.facts import NodeFacts
from engine.kube_verbs import DECIDE, kube_effect
from engine.kube_verbs.cordon import KubeCordon
from engine.kube_verbs.effects import APPLY, PREVIEW, NoOp, decides
from engine.loader import parse_runbook, runbook_json_schema
from engine.model import KubeVerbSpec, kube_verb, kube_verb_keys
from tests.fakes import make_node

# The verbs of the first format, in its order (the schema's oneOf, the "one of:" hint).
BUILT_IN = ("label", "unlabel", "annotate", "cordon", "uncordon", "taint", "untaint", "patch", "evict",
            "delete_pods", "wait", "drain", "bootstrap_token", "approve_node_csr", "delete_bootstrap_tokens")


def test_every_kube_verb_of_the_format_has_exactly_one_registered_decide() -> None:
    specs = {v.KEY: v for v in model.kube_verbs()}
    assert tuple(specs) == kube_verb_keys() == BUILT_IN
    assert set(DECIDE) == set(specs.values())
    assert all(spec.__module__.startswith("engine.kube_verbs.") for spec in specs.values())


def test_every_module_of_the_package_is_imported_without_an_import_line_naming_it() -> None:
    on_disk = sorted(p.stem for p in Path(kv.__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    assert list(kv._MODULES) == on_disk
    assert set(kv.verb_modules()) <= set(on_disk)
    assert "cordon" in kv.verb_modules() and "effects" not in kv.verb_modules()


def test_every_effect_variant_has_its_apply_and_its_preview() -> None:
    variants = set(kv.KubeEffect.__args__)  # type: ignore[attr-defined]
    assert set(APPLY) == set(PREVIEW) == variants


def test_the_format_accepts_every_registered_verb_and_names_them_all_in_its_hint() -> None:
    action = model.KubeAction.model_validate({"kube": {"cordon": True}})
    assert isinstance(action.kube, KubeCordon)
    assert isinstance(kube_effect(action.kube, make_node("omen2", unschedulable=True)), NoOp)
    with pytest.raises(Exception, match="cordon"):
        model.KubeAction.model_validate({"kube": {"cordonn": True}})


def test_a_verb_key_or_a_decide_registered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):

        @kube_verb
        class Again(model._Model):  # type: ignore[name-defined]
            KEY: ClassVar[str] = "cordon"
            cordon: bool

    with pytest.raises(ValueError, match="already has a decide"):
        decides(KubeCordon)(lambda verb, node: NoOp("x", "", {}))


def test_a_spec_that_is_not_a_kube_verb_spec_or_lacks_its_field_is_refused() -> None:
    class Stray(model._Model):  # type: ignore[name-defined]
        KEY: ClassVar[str] = "stray"
        stray: bool

    class Fieldless(KubeVerbSpec):
        KEY: ClassVar[str] = "fieldless"
        other: bool

    with pytest.raises(ValueError, match="must derive from KubeVerbSpec"):
        kube_verb(Stray)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="needs a field named 'fieldless'"):
        kube_verb(Fieldless)
    assert "stray" not in kube_verb_keys() and "fieldless" not in kube_verb_keys()


class KubeNap(KubeVerbSpec):
    """A verb defined outside the package, as a new verb module would define it."""

    KEY: ClassVar[str] = "nap"
    MUTATING: ClassVar[bool] = False
    READS_NODE: ClassVar[bool] = False
    nap: bool


@pytest.fixture
def nap_registered() -> Iterator[None]:
    decides(KubeNap)(lambda verb, node: NoOp(f"napped on {node.name}", "true", {}))
    try:
        yield
    finally:
        model.unregister_kube_verb("nap")
        DECIDE.pop(KubeNap, None)


RUNBOOK = """apiVersion: runbook/v1
name: napper
version: "1"
params: {node: {type: node, required: true}}
steps:
  - id: rest
    action: {kube: {%s: true}}
"""


@pytest.mark.usefixtures("nap_registered")
def test_a_verb_registered_by_its_decide_alone_is_part_of_the_format_hints_and_schema() -> None:
    assert kube_verb_keys() == (*BUILT_IN, "nap")  # after the verbs of the first format
    rb = parse_runbook((RUNBOOK % "nap").encode(), "napper.yaml")
    verb = rb.steps[0].action.kube  # type: ignore[union-attr]
    assert isinstance(verb, KubeNap) and not rb.steps[0].mutating
    assert kube_effect(verb, NodeFacts("omen2")) == NoOp("napped on omen2", "true", {})
    refs = runbook_json_schema()["$defs"]["KubeAction"]["properties"]["kube"]["oneOf"]
    assert refs[-1] == {"$ref": "#/$defs/KubeNap"}
    with pytest.raises(LoadError) as e:
        parse_runbook((RUNBOOK % "zzz").encode(), "napper.yaml")
    assert "unknown kube action 'zzz' (one of: label, unlabel" in str(e.value)
    assert str(e.value).rstrip().endswith("delete_bootstrap_tokens, nap)")


def test_an_unregistered_verb_is_gone_from_the_format_again() -> None:
    assert "nap" not in kube_verb_keys()
    with pytest.raises(LoadError, match="unknown kube action 'nap'"):
        parse_runbook((RUNBOOK % "nap").encode(), "napper.yaml")
