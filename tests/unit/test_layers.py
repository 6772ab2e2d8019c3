"""The ``layers`` contract (pyproject.toml, checked by ``lint-imports``) names every module and
package of ``engine``: a new module must take its floor, or the picture could drift there."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layered() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layers = next(c["layers"] for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return {name.strip() for layer in layers for name in re.split(r"[:|]", layer)}


def test_every_module_and_package_of_engine_is_on_a_floor_of_the_layers_contract() -> None:
    engine = ROOT / "engine"
    modules = {f"engine.{p.stem}" for p in engine.glob("*.py") if p.stem != "__init__"}
    packages = {f"engine.{p.name}" for p in engine.iterdir() if (p / "__init__.py").is_file()}
    missing = sorted((modules | packages) - _layered())
    assert not missing, f"not in the layers contract of pyproject.toml: {', '.join(missing)}"
