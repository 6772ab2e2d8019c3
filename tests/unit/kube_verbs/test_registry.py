"""A kube verb is one spec class (``@kube_verb`` in engine.model) and one module whose ``decide``
registers itself (``@decides``): the format's union, the loader's hints and planning all read the
registries, so nothing else names the verb (docs/design.md, "How to add a kube verb")."""

from __future__ import annotations

from typing import ClassVar

import pytest

from engine import model
from engine.kube_verbs import DECIDE, kube_effect
from engine.kube_verbs.effects import NoOp, decides
from engine.model import KUBE_VERBS, KubeCordon, kube_verb
from tests.fakes import make_node


def test_every_kube_verb_of_the_format_has_exactly_one_registered_decide() -> None:
    specs = {v.KEY: v for v in model._KUBE_VERBS}  # type: ignore[attr-defined]
    assert tuple(specs) == KUBE_VERBS
    assert set(DECIDE) == set(specs.values())


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
