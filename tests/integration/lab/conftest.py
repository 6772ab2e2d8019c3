"""The lab fixtures: one lab per test session (control plane, SSH node hosts, simulator) in a temp folder.

* ``lab`` (session): a running ``LabUnderTest``; ``lab.lab`` is the ``engine.lab.manager.Lab``.
* ``incident`` (module): the lab in the scenario's initial state (reset first if a test changed it).
* ``fresh_lab`` (per test): reset to the initial state before the test; the test may change anything.
* ``sh``: run a shell command with the lab's environment (``eval "$(runbook lab env)"`` done), its own
  HOME (kubectl cache, Ansible temp) and return the CompletedProcess.

A missing prerequisite skips (the root conftest turns skips into failures under CI=true).

How a lab test module shares the lab (CI's time budget, docs/reliability.md "CI time budget"):

* Starting a lab costs ~25 s, a reset ~13-15 s (the real node lifecycle controller must see the dead
  nodes' heartbeats stop), looking costs nothing. A test that only reads takes ``incident``; a test
  that changes the lab takes ``fresh_lab`` (or takes ``incident`` and sets ``incident.dirty = True``
  before changing anything, so the next user resets). Never reset by hand what a fixture resets.
* Something a whole module needs on top of the incident (monitoring, cluster mode, a server, RBAC
  objects) is a module-scoped fixture on ``lab`` that starts it once and stops it in its teardown,
  leaving the session's lab as it found it (test_monitoring_loop.py, test_cluster_mode_lab.py).
* A lab of its own only for another scenario (test_multi_gpu.py) or for what ``lab up``/``down`` do
  to a lab (test_lab_lifecycle.py); module-scoped, down in its teardown.
* ``scripts/test.sh`` runs the integration tests on two pytest-xdist workers, a whole module per
  worker (``--dist loadfile``): each worker has its own session lab, so two labs run at once. A module
  must not depend on another module having run before it on the same lab, must choose its ports and
  loopback addresses at run time (``engine.lab.ports``) and keep its files under its own tmp paths,
  and whatever it looks for machine-wide (processes in /proc, files in /tmp) must be found by a marker
  of its own (its lab's password, its tmp folder, a tag): the other worker's lab runs beside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import tests.integration.lab.flagship_cli
import tests.integration.lab.lab_helpers
import tests.integration.lab.serve_helpers
import tests.integration.lab.test_durability_helpers
from engine.lab.assets import find_assets
from engine.lab.manager import Lab
from engine.lab.nodehosts import node_host_prerequisite_problems

# This folder is a package (tests laid out like the code; basenames may repeat across tests/): its
# helpers are ``tests.integration.lab.<name>``. A test module written with the bare names (branches
# started while the folder was on sys.path) gets the very same module objects, never a second copy.
# Remove once nothing imports the bare names.
for _helper in (tests.integration.lab.flagship_cli, tests.integration.lab.lab_helpers,
                tests.integration.lab.serve_helpers, tests.integration.lab.test_durability_helpers):
    sys.modules.setdefault(_helper.__name__.rpartition(".")[2], _helper)


@dataclass
class LabUnderTest:
    lab: Lab
    home: Path
    dirty: bool = False

    def reset(self) -> None:
        self.lab.reset(timeout=120)
        self.dirty = False

    def env(self) -> dict[str, str]:
        return {**os.environ, **self.lab.env(), "HOME": str(self.home),
                "ANSIBLE_HOME": str(self.home / "ansible"), "ANSIBLE_LOCAL_TEMP": str(self.home / "ansible-tmp"),
                "ANSIBLE_NOCOLOR": "1"}


def _prerequisites() -> str | None:
    problems = node_host_prerequisite_problems()
    if find_assets() is None:
        problems.append("no control-plane binaries (bash scripts/build-control-plane.sh)")
    for tool in ("kubectl", "ansible"):
        if shutil.which(tool) is None:
            problems.append(f"no {tool} on PATH")
    return "; ".join(problems) or None


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabUnderTest]:
    problem = _prerequisites()
    if problem:
        pytest.skip(problem)
    under_test = LabUnderTest(Lab(tmp_path_factory.mktemp("lab")), tmp_path_factory.mktemp("lab-home"))
    under_test.lab.up(timeout=240)
    try:
        yield under_test
    finally:
        under_test.lab.down()


@pytest.fixture(scope="module")
def incident(lab: LabUnderTest) -> LabUnderTest:
    if lab.dirty:
        lab.reset()
    return lab


@pytest.fixture
def fresh_lab(lab: LabUnderTest) -> LabUnderTest:
    if lab.dirty:
        lab.reset()
    lab.dirty = True
    return lab


@pytest.fixture
def sh(lab: LabUnderTest) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(command: str, check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["bash", "-c", command], env=lab.env(), capture_output=True, text=True,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"{command!r} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    return run
