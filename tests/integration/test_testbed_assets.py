"""The control-plane binaries are found, reused from the cache, and never rebuilt when present."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from engine.lab.assets import BINARIES, assets_complete, build_script, ensure_assets, find_assets


@pytest.fixture
def assets() -> Path:
    found = find_assets()
    if found is None:
        pytest.fail("no control-plane binaries (scripts/build-control-plane.sh builds them)")
    return found


def run_build_script(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(build_script())], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_the_build_script_ships_inside_the_package_and_the_repository_script_wraps_it() -> None:
    wrapper = Path(__file__).parents[2] / "scripts" / "build-control-plane.sh"
    assert build_script().is_file()
    assert "engine/data/build-control-plane.sh" in wrapper.read_text()


def test_a_complete_cache_is_reused_without_building(assets: Path) -> None:
    result = run_build_script(RUNBOOK_ASSETS=str(assets), KUBEBUILDER_ASSETS="")

    assert result.returncode == 0, result.stderr
    assert "nothing to build" in result.stdout
    assert ensure_assets(progress=pytest.fail) == assets  # found: no progress, no build


def test_kubebuilder_assets_with_all_four_binaries_skips_the_build_entirely(assets: Path, tmp_path: Path) -> None:
    result = run_build_script(KUBEBUILDER_ASSETS=str(assets), RUNBOOK_ASSETS=str(tmp_path / "never"))

    assert result.returncode == 0, result.stderr
    assert "KUBEBUILDER_ASSETS" in result.stdout and "nothing to build" in result.stdout
    assert not (tmp_path / "never").exists()


def test_an_envtest_folder_without_controller_manager_and_scheduler_is_not_enough(
        assets: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    envtest = tmp_path / "envtest"
    envtest.mkdir()
    for name in ("etcd", "kube-apiserver"):
        (envtest / name).symlink_to(assets / name)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(envtest))

    assert not assets_complete(envtest)
    assert find_assets() == assets  # falls back on the cache
    assert set(BINARIES) - {p.name for p in envtest.iterdir()} == {"kube-controller-manager", "kube-scheduler"}
