"""The run store's contract (tests/store_contract.py) over every store, in-process: the SQLite
journal on a temporary file, and RemediationRuns on ``tests.fakes.FakeKube``'s object API (an API
server's semantics: resourceVersions, 409 on a stale one, a status subresource). The same suite
runs on the real API server in tests/integration/test_kube_store_real_api.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.journal import Journal
from engine.kube_store import KubeRunStore
from engine.settings import STORES
from engine.store import RunStore
from tests.fakes import FakeKube
from tests.store_contract import *  # noqa: F403  (the contract's tests and the ``store`` fixture)
from tests.store_contract import StoreBed, set_owner_in

NS = "runbook-system"


# The bed of each store a command can open (``engine.settings.STORES``): its name there -> (the
# test id, how a test opens it over a fresh backend). A new store adds its line here.
BEDS: dict[str, tuple[str, Callable[[Path, FakeKube], RunStore]]] = {
    "sqlite": ("sqlite", lambda tmp, kube: Journal(tmp / "j.sqlite")),
    "kubernetes": ("kubernetes-fake", lambda tmp, kube: KubeRunStore(kube, NS)),
}


@pytest.fixture(params=list(BEDS.values()), ids=[test_id for test_id, _ in BEDS.values()])
def bed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreBed]:
    opened: list[RunStore] = []
    _, open_store = request.param

    def reopen() -> RunStore:
        s = open_store(tmp_path, kube)
        opened.append(s)
        return s

    kube = FakeKube()
    first = reopen()
    yield StoreBed(first, reopen, set_owner_in(first))
    for s in opened:
        s.close()


def test_every_store_a_command_can_open_runs_the_contract() -> None:
    assert set(BEDS) == set(STORES)
