"""The run store's contract (tests/store_contract.py) over every store, in-process: the SQLite
journal on a temporary file, and RemediationRuns on ``tests.fakes.FakeKube``'s object API (an API
server's semantics: resourceVersions, 409 on a stale one, a status subresource). The same suite
runs on the real API server in tests/integration/test_kube_store_real_api.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.journal import Journal
from engine.kube_store import KubeRunStore
from engine.store import RunStore
from tests.fakes import FakeKube
from tests.store_contract import *  # noqa: F403  (the contract's tests and the ``store`` fixture)
from tests.store_contract import StoreBed, set_owner_in

NS = "runbook-system"


@pytest.fixture(params=["sqlite", "kubernetes-fake"])
def bed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreBed]:
    opened: list[RunStore] = []

    def reopen() -> RunStore:
        s: RunStore = Journal(tmp_path / "j.sqlite") if request.param == "sqlite" else KubeRunStore(kube, NS)
        opened.append(s)
        return s

    kube = FakeKube()
    first = reopen()
    yield StoreBed(first, reopen, set_owner_in(first))
    for s in opened:
        s.close()
